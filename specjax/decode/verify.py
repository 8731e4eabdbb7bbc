"""Draft verification: llama.cpp's four branches (synthetic, replay, rejection, match) as pure fns.

Layout of one row (one sequence), T = K + 1:

    verify batch   : id_last@pos0  d_0@pos0+1  d_1@pos0+2  ...  d_{K-1}@pos0+K
    logits_TV row i: the target's prediction for absolute position pos0+1+i
    draft_K/valid_K: the draft and its prefix validity mask (n_valid = sum(valid_K))

Every token chosen at row i lands at absolute position `pos0 + 1 + i`, and all randomness for it
comes from `make_key(seed, pos0 + 1 + i, ROLE_*)` (see `specjax.sampling`). The target's own draw
at row i is always `sample_token(logits_TV[i], params, make_key(seed, pos0+1+i, ROLE_SAMPLE))`, the
very draw plain decoding makes at that position.

Outputs (`VerifyResult`): `n_accepted` in 0..n_valid (accepted draft tokens), `next_token` (the
correction token, or the bonus token sampled at row n_valid when every valid draft token was
accepted), and `tokens [K+1]` = accepted draft tokens followed by `next_token`, padded with
`PAD_TOKEN`. Exactly `n_accepted + 1` tokens are emitted, as llama.cpp's `accepted` list.

Branches (llama.cpp §6, selected per row by `verify_rows` in this order):
* synthetic (benchmarks only; static switch): accept d_i iff u_i < c_i (u from ROLE_SYNTH) and
  d_i is not an end-of-generation token; on rejection emit the target's own draw at that row.
  Replay rows (below) are accepted unconditionally, as upstream's `is_replay` flag does.
* replay: accept every valid draft token without testing; next = the target's draw at row n_valid.
* rejection (temperature > 0 and the row's drafter supplied q): Leviathan et al. speculative
  sampling against the target's truncated, tempered (and grammar-renormalised) distribution p.
  Accept d_i iff q(d_i) > 0 and (p(d_i) >= q(d_i) or u < p(d_i)/q(d_i)), u from ROLE_ACCEPT; on
  rejection draw from max(0, p - q) / sum with ROLE_RESIDUAL, or take the target's own draw if
  the residual has no mass. The emitted token is then distributed exactly as p.
* match: accept while the target's own draw equals the draft token (greedy at temperature 0).

Acceptance is a prefix: n_accepted = sum(cumprod(accept_K & valid_K)). All arithmetic is float32
with explicit zero-mass guards (no epsilons). Per-row functions take scalar `SamplingParams`
fields; `verify_rows` is the batched entry point that computes every branch and selects with
`jnp.where`, so one compilation serves all rows and all outcomes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DraftOutput
from specjax.pytree import pytree_dataclass
from specjax.sampling import (
    ROLE_ACCEPT,
    ROLE_RESIDUAL,
    ROLE_SAMPLE,
    ROLE_SYNTH,
    SamplingParams,
    apply_penalties,
    make_key,
    mask_probs,
    penalty_windows,
    sample_probs,
    target_probs,
)
from specjax.types import Array

#: Filler for the unused tail of `VerifyResult.tokens`.
PAD_TOKEN = -1

#: Which branch decided a row (`VerifyResult.branch`).
BRANCH_MATCH = 0
BRANCH_REJECTION = 1
BRANCH_REPLAY = 2
BRANCH_SYNTHETIC = 3


@pytree_dataclass
class VerifyResult:
    """Outcome of verifying one row (scalars, `[K+1]`) or a batch (`[B]`, `[B, K+1]`)."""

    n_accepted: Array  # int32, accepted draft tokens (0..n_valid)
    next_token: Array  # int32, correction or bonus token (always emitted)
    tokens: Array  # int32 [K+1], accepted draft tokens then next_token, PAD_TOKEN after
    branch: Array  # int32, BRANCH_* that decided the row


# --------------------------------------------------------------------------------------------
# shared per-row pieces


@pytree_dataclass
class _RowTarget:
    """The target side of one row, computed once and shared by every branch."""

    probs_TV: Array  # float32, the target's (grammar-constrained) sampling distribution per row
    ratio_probs_TV: Array  # float32, p for rejection's ratio test (mask_probs: zeros if no mass)
    samples_T: Array  # int32, the target's own draw per row (ROLE_SAMPLE)
    positions_T: Array  # int32, absolute position of the token chosen at each row


def _row_target(
    logits_TV: Array, params: SamplingParams, pos0: Array, allowed_TV: Array | None
) -> _RowTarget:
    t = logits_TV.shape[0]
    positions_T = jnp.asarray(pos0).astype(jnp.int32) + 1 + jnp.arange(t, dtype=jnp.int32)
    keys_T = jax.vmap(make_key, in_axes=(None, 0, None))(params.seed, positions_T, ROLE_SAMPLE)
    raw_TV = jax.vmap(target_probs, in_axes=(0, None))(logits_TV, params)
    if allowed_TV is None:
        probs_TV = ratio_TV = raw_TV
    else:
        # same as sampling.masked_target_probs, sharing the unmasked chain with the ratio test
        ratio_TV = jax.vmap(mask_probs)(raw_TV, allowed_TV)
        neg_inf = jnp.float32(-jnp.inf)
        masked_logits_TV = jnp.where(allowed_TV, logits_TV.astype(jnp.float32), neg_inf)
        first_TV = jax.vmap(target_probs, in_axes=(0, None))(masked_logits_TV, params)
        has_mass_T = jnp.sum(ratio_TV, axis=-1) > 0
        probs_TV = jnp.where(has_mass_T[:, None], ratio_TV, first_TV)
    drawn_T = jax.vmap(sample_probs)(probs_TV, keys_T)
    greedy_T = jnp.argmax(probs_TV, axis=-1).astype(jnp.int32)
    samples_T = jnp.where(jnp.asarray(params.temperature) > 0, drawn_T, greedy_T)
    return _RowTarget(
        probs_TV=probs_TV, ratio_probs_TV=ratio_TV, samples_T=samples_T, positions_T=positions_T
    )


def _prefix_count(accept_K: Array, valid_K: Array) -> Array:
    ok_K = (accept_K & valid_K).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(ok_K)).astype(jnp.int32)


def _emit(draft_K: Array, n_accepted: Array, next_token: Array, branch: int) -> VerifyResult:
    k = draft_K.shape[0]
    idx_T = jnp.arange(k + 1, dtype=jnp.int32)
    padded_T = jnp.concatenate([draft_K.astype(jnp.int32), jnp.full((1,), PAD_TOKEN, jnp.int32)])
    tokens_T = jnp.where(idx_T < n_accepted, padded_T, jnp.int32(PAD_TOKEN))
    tokens_T = jnp.where(idx_T == n_accepted, next_token, tokens_T)
    return VerifyResult(
        n_accepted=n_accepted,
        next_token=next_token,
        tokens=tokens_T,
        branch=jnp.int32(branch),
    )


def _n_valid(valid_K: Array) -> Array:
    # validity is a prefix; cumprod makes it one even if the caller's mask is not
    return jnp.sum(jnp.cumprod(valid_K.astype(jnp.int32))).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# branch cores (target pieces precomputed)


def _match(target: _RowTarget, draft_K: Array, valid_K: Array) -> VerifyResult:
    k = draft_K.shape[0]
    n_acc = _prefix_count(target.samples_T[:k] == draft_K, valid_K)
    return _emit(draft_K, n_acc, target.samples_T[n_acc], BRANCH_MATCH)


def _replay(target: _RowTarget, draft_K: Array, valid_K: Array) -> VerifyResult:
    n_acc = _n_valid(valid_K)
    return _emit(draft_K, n_acc, target.samples_T[n_acc], BRANCH_REPLAY)


def _rejection(
    target: _RowTarget,
    draft_K: Array,
    valid_K: Array,
    q_KV: Array,
    seed: Array,
) -> VerifyResult:
    k = draft_K.shape[0]
    # p for the ratio test: grammar-renormalised, all zeros if the mask removed all of p's mass
    p_KV = target.ratio_probs_TV[:k]
    q_KV = q_KV.astype(jnp.float32)
    positions_K = target.positions_T[:k]
    keys_u = jax.vmap(make_key, in_axes=(None, 0, None))(seed, positions_K, ROLE_ACCEPT)
    keys_r = jax.vmap(make_key, in_axes=(None, 0, None))(seed, positions_K, ROLE_RESIDUAL)
    u_K = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys_u)

    tok_K = draft_K.astype(jnp.int32)
    p_x = jnp.take_along_axis(p_KV, tok_K[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q_KV, tok_K[:, None], axis=1)[:, 0]
    ratio_K = p_x / jnp.where(q_x > 0, q_x, 1.0)
    accept_K = (q_x > 0) & ((p_x >= q_x) | (u_K < ratio_K))
    n_acc = _prefix_count(accept_K, valid_K)

    residual_KV = jnp.maximum(p_KV - q_KV, 0.0)
    mass_K = jnp.sum(residual_KV, axis=1)
    resampled_K = jax.vmap(sample_probs)(residual_KV, keys_r)
    correction_K = jnp.where(mass_K > 0, resampled_K, target.samples_T[:k])
    correction_T = jnp.concatenate([correction_K, target.samples_T[k:]])
    n_valid = _n_valid(valid_K)
    next_token = jnp.where(n_acc < n_valid, correction_T[n_acc], target.samples_T[n_acc])
    return _emit(draft_K, n_acc, next_token, BRANCH_REJECTION)


def _synthetic(
    target: _RowTarget,
    draft_K: Array,
    valid_K: Array,
    seed: Array,
    rates_K: Array,
    eog_V: Array,
) -> VerifyResult:
    k = draft_K.shape[0]
    keys_K = jax.vmap(make_key, in_axes=(None, 0, None))(seed, target.positions_T[:k], ROLE_SYNTH)
    u_K = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys_K)
    tok_K = jnp.clip(draft_K.astype(jnp.int32), 0, eog_V.shape[0] - 1)
    accept_K = (u_K < rates_K.astype(jnp.float32)) & ~eog_V.astype(bool)[tok_K]
    n_acc = _prefix_count(accept_K, valid_K)
    return _emit(draft_K, n_acc, target.samples_T[n_acc], BRANCH_SYNTHETIC)


# --------------------------------------------------------------------------------------------
# public per-row verifiers


def _target_only_verifier(
    core: Callable[[_RowTarget, Array, Array], VerifyResult], name: str, doc: str
) -> Callable[..., VerifyResult]:
    """The public per-row verifier `name` of a branch `core` that reads nothing but the
    target and the draft: `(logits_TV, draft_K, valid_K, params, pos0, *, allowed_TV=None)`."""

    def verify(
        logits_TV: Array,
        draft_K: Array,
        valid_K: Array,
        params: SamplingParams,
        pos0: Array,
        *,
        allowed_TV: Array | None = None,
    ) -> VerifyResult:
        target = _row_target(logits_TV, params, pos0, allowed_TV)
        return core(target, draft_K, valid_K.astype(bool))

    verify.__name__ = verify.__qualname__ = name
    verify.__doc__ = doc
    return verify


verify_match = _target_only_verifier(
    _match,
    "verify_match",
    """llama.cpp's `common_sampler_sample_and_accept_n`: accept while target draw == draft.""",
)

verify_replay = _target_only_verifier(
    _replay,
    "verify_replay",
    """Checkpoint replay: accept all valid draft tokens untested, sample at row n_valid.""",
)


def verify_rejection(
    logits_TV: Array,
    draft_K: Array,
    valid_K: Array,
    q_KV: Array,
    params: SamplingParams,
    pos0: Array,
    *,
    allowed_TV: Array | None = None,
) -> VerifyResult:
    """Speculative sampling (Leviathan et al.; llama.cpp PR #27694) for one row.

    `q_KV` is the draft's distribution each draft token was drawn from (rows sum to 1 over their
    support; tokens outside it have q = 0). `allowed_TV` (bool) restricts p to grammar-allowed
    tokens, renormalised; when no allowed token has mass p stays the (all-zero) unrenormalised
    p_raw, so the row rejects and falls back to the target's own (grammar-first) draw.
    """
    valid_K = valid_K.astype(bool)
    target = _row_target(logits_TV, params, pos0, allowed_TV)
    return _rejection(target, draft_K, valid_K, q_KV, params.seed)


def verify_synthetic(
    logits_TV: Array,
    draft_K: Array,
    valid_K: Array,
    params: SamplingParams,
    pos0: Array,
    rates_K: Array,
    eog_V: Array,
    *,
    allowed_TV: Array | None = None,
) -> VerifyResult:
    """Synthetic acceptance (benchmark only; llama.cpp `server_sample_and_accept_synth`).

    `rates_K` are the conditional rates from `resolve_synthetic_rates`; `eog_V` is a `[V]` bool
    mask of end-of-generation tokens, which are never accepted as draft tokens.
    """
    target = _row_target(logits_TV, params, pos0, allowed_TV)
    return _synthetic(target, draft_K, valid_K.astype(bool), params.seed, rates_K, eog_V)


# --------------------------------------------------------------------------------------------
# batched entry point


def verify_rows(
    logits_BTV: Array,
    draft: DraftOutput,
    params: SamplingParams,
    pos0_B: Array,
    *,
    replay_B: Array | None = None,
    has_q_B: Array | None = None,
    allowed_BTV: Array | None = None,
    synth_rates_K: Array | None = None,
    eog_V: Array | None = None,
    recent_BW: Array | None = None,
    recent_valid_BW: Array | None = None,
) -> VerifyResult:
    """Verify a batch; the branch per row is synthetic -> replay -> rejection -> match.

    logits_BTV:      target logits of the verify batch (T = K + 1).
    draft:           `DraftOutput` (tokens/valid `[B, K]`; q `[B, K, V]` or None).
    params:          `SamplingParams` with `[B]` fields.
    pos0_B:          position of `id_last` per row.
    replay_B:        bool `[B]`, rows replaying a checkpointed `accepted` list (default: none).
    has_q_B:         bool `[B]`, rows whose drafter filled q (default: all rows when q exists).
    allowed_BTV:     bool grammar masks per verify row (default: everything allowed).
    synth_rates_K:   conditional synthetic rates; not None switches synthetic on (static).
    eog_V:           bool `[V]` end-of-generation mask, required with synthetic.
    recent_BW/recent_valid_BW: the sampler's recent accepted tokens (ending with `id_last`); when
                     given, the repeat penalty is applied to every verify row with the window it
                     would have in sequential decoding (`sampling.penalty_windows`).

    A row uses rejection iff temperature > 0 and it has q; replay rows are accepted untested
    (under synthetic too, like upstream's `is_replay`). Every branch is computed for every row
    and the result selected with `jnp.where`: one trace for any mix of rows and outcomes.
    """
    b, t, vocab = logits_BTV.shape
    k = t - 1
    if draft.tokens.shape != (b, k):
        raise ValueError(
            f"draft tokens {draft.tokens.shape} do not match logits {logits_BTV.shape}"
        )
    synthetic = synth_rates_K is not None
    if synthetic and eog_V is None:
        raise ValueError("synthetic verification needs the end-of-generation mask eog_V")
    if replay_B is None:
        replay_B = jnp.zeros((b,), bool)
    q_BKV = draft.q
    if q_BKV is not None and q_BKV.shape != (b, k, vocab):
        raise ValueError(f"draft q {q_BKV.shape} does not match logits {logits_BTV.shape}")
    if eog_V is not None and eog_V.shape != (vocab,):
        raise ValueError(f"eog_V {eog_V.shape} must be a [V] mask, V = {vocab}")
    if q_BKV is not None and has_q_B is None:
        has_q_B = jnp.ones((b,), bool)
    if (recent_BW is None) != (recent_valid_BW is None):
        raise ValueError("recent_BW and recent_valid_BW must be given together")

    def row(
        logits_TV: Array,
        draft_K: Array,
        valid_K: Array,
        params_row: SamplingParams,
        pos0: Array,
        replay: Array,
        q_KV: Array | None,
        has_q: Array | None,
        allowed_TV: Array | None,
        recent_W: Array | None,
        recent_valid_W: Array | None,
    ) -> VerifyResult:
        valid_K = valid_K.astype(bool)
        if recent_W is not None and recent_valid_W is not None:
            win_TW, win_valid_TW = penalty_windows(recent_W, recent_valid_W, draft_K, valid_K)
            logits_TV = jax.vmap(apply_penalties, in_axes=(0, 0, 0, None))(
                logits_TV.astype(jnp.float32), win_TW, win_valid_TW, params_row.repeat_penalty
            )
        target = _row_target(logits_TV, params_row, pos0, allowed_TV)
        out = _match(target, draft_K, valid_K)
        if q_KV is not None and has_q is not None:
            rej = _rejection(target, draft_K, valid_K, q_KV, params_row.seed)
            use_rej = has_q & (jnp.asarray(params_row.temperature) > 0)
            out = jax.tree.map(lambda a, c: jnp.where(use_rej, a, c), rej, out)
        rep = _replay(target, draft_K, valid_K)
        out = jax.tree.map(lambda a, c: jnp.where(replay, a, c), rep, out)
        if synth_rates_K is not None and eog_V is not None:
            syn = _synthetic(target, draft_K, valid_K, params_row.seed, synth_rates_K, eog_V)
            out = jax.tree.map(lambda a, c: jnp.where(replay, c, a), syn, out)
        return out

    return jax.vmap(row)(
        logits_BTV,
        draft.tokens,
        draft.valid,
        params,
        jnp.asarray(pos0_B).astype(jnp.int32),
        replay_B.astype(bool),
        q_BKV,
        has_q_B,
        allowed_BTV,
        recent_BW,
        recent_valid_BW,
    )


def first_argmax(x: Array, axis: int = -1) -> Array:
    """`jnp.argmax` (lowest index on ties) for finite inputs, as two plain reductions.

    XLA's CPU backend lowers `jnp.argmax` to a variadic (value, index) reduce that does not
    vectorise; a max followed by a min over the indices that reach it is 2-3x faster and
    returns the same index. Inputs must be finite (logits are; see specjax.models.llama).
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    top = jnp.max(x, axis=axis, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.minimum(jnp.min(jnp.where(x == top, iota, n), axis=axis), n - 1)


def verify_greedy(greedy_BT: Array, draft: DraftOutput) -> VerifyResult:
    """`verify_rows` for a batch in which every row is greedy (temperature <= 0, no penalty,
    no grammar, no synthetic, no replay): match against the target's argmax per verify row
    (`greedy_BT [B, K+1]`, lowest index on ties as `target_probs`: see `first_argmax`),
    without building sampling distributions. Bit-identical results; the engine selects it
    with `lax.cond` when the whole batch qualifies.
    """

    def row(argmax_T: Array, draft_K: Array, valid_K: Array) -> VerifyResult:
        k = draft_K.shape[0]
        n = _prefix_count(argmax_T[:k] == draft_K, valid_K.astype(bool))
        return _emit(draft_K, n, argmax_T[n], BRANCH_MATCH)

    return jax.vmap(row)(greedy_BT, draft.tokens, draft.valid)


# --------------------------------------------------------------------------------------------
# synthetic acceptance rates (host side)


def synthetic_acceptance_rates(
    k: int, length: float | None = None, rates: Sequence[float] | None = None
) -> np.ndarray | None:
    """llama.cpp's `common_speculative_synth_rates_resolve`: unconditional rates a_j, `[K]`.

    `length` None or -1.0 and `rates` None/empty mean "off" (returns None). Errors (ValueError)
    carry llama.cpp's messages. A length L solves p + p^2 + ... + p^K = L - 1 by 32 bisection
    steps on [0, 1] (L == K+1 -> p = 1, L == 1 -> p = 0) and gives a_j = p^(j+1).
    """
    has_length = length is not None and length != -1.0
    has_rates = rates is not None and len(rates) > 0
    if not has_length and not has_rates:
        return None
    if has_length and has_rates:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")
    if k <= 0:
        raise ValueError("synthetic acceptance requires at least one speculative token")

    if has_rates:
        assert rates is not None
        values = [float(r) for r in rates]
        if len(values) != k:
            raise ValueError(
                f"synthetic acceptance rates must contain {k} values, got {len(values)}"
            )
        for i, r in enumerate(values):
            if not math.isfinite(r) or r < 0.0 or r > 1.0:
                raise ValueError("synthetic acceptance rates must be finite and within [0, 1]")
            if i > 0 and r > values[i - 1]:
                raise ValueError("synthetic acceptance rates must be monotonically non-increasing")
        return np.asarray(values, np.float64)

    assert length is not None
    length = float(length)
    length_max = float(k) + 1.0
    if not math.isfinite(length) or length < 1.0 or length > length_max:
        raise ValueError(
            f"synthetic acceptance length must be finite and within [1, {length_max:.0f}]"
        )
    p = 0.0
    if length == length_max:
        p = 1.0
    elif length > 1.0:
        p_min, p_max = 0.0, 1.0
        for _ in range(32):
            p_mid = 0.5 * (p_min + p_max)
            total, term = 0.0, p_mid
            for _ in range(k):
                total += term
                term *= p_mid
            if total < length - 1.0:
                p_min = p_mid
            else:
                p_max = p_mid
        p = 0.5 * (p_min + p_max)
    out, rate = [], p
    for _ in range(k):
        out.append(rate)
        rate *= p
    return np.asarray(out, np.float64)


def resolve_synthetic_rates(
    k: int, length: float | None = None, rates: Sequence[float] | None = None
) -> np.ndarray | None:
    """Conditional acceptance probabilities `[K]` for `verify_synthetic` (None when off).

    c_0 = a_0, c_j = a_j / a_{j-1} (0 when a_{j-1} == 0), where a = `synthetic_acceptance_rates`.
    The expected accepted count is sum(a_j); mean acceptance length 1 + sum(a_j).
    """
    uncond = synthetic_acceptance_rates(k, length, rates)
    if uncond is None:
        return None
    cond, prev = [], 1.0
    for a in uncond:
        cond.append(a / prev if prev > 0.0 else 0.0)
        prev = float(a)
    return np.asarray(cond, np.float64)
