"""Differentiable acceptance: acceptance rates, expected acceptance lengths and draft losses.

The quantities that decide a speculative speed-up, as pure JAX functions of the target's and
the draft's logits (jit / vmap / grad safe), and the training losses built on them
(`specjax.train.draft` uses them; `benchmarks/acceptance.py` checks the predictions against
what the engine measures).

Distributions (`truncated_probs`):
* The target's p is `specjax.sampling.target_probs`'s distribution: top_k -> top_p (on the
  temperature-1 softmax of the top-k survivors) -> min_p (relative to the top logit) ->
  softmax(logits / temperature) over the survivors. The kept set is computed by the same rules
  (same stable ranking: lower token id first on equal logits); a test checks the two agree.
* draft-simple's probabilistic q is the same chain with top_k = 10, no top_p / min_p, and the
  target's temperature (`draft_params`); its greedy draft token is the draft's argmax.
* temperature <= 0 is greedy: the one-hot argmax (lowest id on ties).

Where truncation breaks differentiability, and what the gradient is there:
* The kept set is a piecewise-constant function of the logits: it changes only where two
  logits tie in rank (top_k), where a cumulative mass crosses top_p, or where a logit crosses
  max + log(min_p). It is computed under `stop_gradient`, so the gradient is the derivative
  of the softmax over the *current* kept set: exact wherever the set is locally constant
  (almost everywhere) and the one-sided derivative of the current set at the boundaries, where
  the function itself jumps (a token entering or leaving the support).
* temperature <= 0 (greedy) and the argmax of a greedy draft are piecewise constant: their
  gradient with respect to the logits is 0 (the value is exact, e.g. `greedy_acceptance_rate`
  is p(argmax q), differentiable in the target's logits and temperature but constant in q).
* min(p, q) at a tie p(x) == q(x) takes the gradient of p (`jnp.where(q < p, q, p)`): the
  gradient with respect to the draft is 0 there, the one-sided derivative for raising q(x).
  |p - q| at a tie has subgradient 0. log alpha uses alpha clamped below at 1e-30 (disjoint
  supports give alpha = 0 and a zero gradient, never NaN).
* KL terms use 0 * log 0 = 0; KL(p || q) is +inf where q(x) = 0 < p(x) (truncate only the
  distributions whose support you mean to compare; the training losses use untruncated ones
  for KL/CE).

Expected acceptance length of a chain of K drafted tokens with conditional acceptance
probabilities alpha_1..alpha_K: E[L] = 1 + sum_k prod_{i<=k} alpha_i (the emitted tokens per
verification: accepted drafts plus the target's own token). The same formula serves block
drafters (all K positions drafted at once from one context): alpha_k is then position k's
acceptance probability given positions < k were accepted. `path_acceptance_length` predicts
the engine's measured mean acceptance length along a generated path, draft budgets included.

Array arguments take any leading batch dims (`[..., V]` logits, `[..., K]` rates);
`SamplingParams` fields are scalars applying to every row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.pytree import pytree_dataclass
from specjax.sampling import SamplingParams, truncation_mask
from specjax.types import Array

#: draft-simple's top-k (`specjax.drafters.draft_simple.DRAFT_TOP_K`).
DRAFT_TOP_K = 10
#: Lower clamp of alpha inside logarithms (disjoint supports -> finite loss, zero gradient).
LOG_FLOOR = 1e-30

OBJECTIVES = ("ce", "tv", "nla", "kl", "lk")


def sampling_params(
    temperature: float | Array = 1.0,
    top_k: int | Array = 0,
    top_p: float | Array = 1.0,
    min_p: float | Array = 0.0,
) -> SamplingParams:
    """Scalar `SamplingParams` with truncation off by default (temperature 1)."""
    return SamplingParams.create(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def draft_params(temperature: float | Array, top_k: int = DRAFT_TOP_K) -> SamplingParams:
    """draft-simple's probabilistic q: top-10 of the draft logits at the target's temperature."""
    return sampling_params(temperature=temperature, top_k=top_k)


# ---------------------------------------------------------------------------------------------
# distributions


def _keep_mask(logits_V: Array, params: SamplingParams) -> Array:
    """The verifier's kept set (bool [V]): `sampling.truncation_mask`, outside the gradient."""
    return truncation_mask(jax.lax.stop_gradient(logits_V.astype(jnp.float32)), params)


def _row_log_probs(logits_V: Array, params: SamplingParams) -> Array:
    logits_V = logits_V.astype(jnp.float32)
    keep_V = _keep_mask(logits_V, params)
    temp = jnp.asarray(params.temperature).astype(jnp.float32)
    sampled = temp > 0
    safe_temp = jnp.where(sampled, temp, 1.0)
    logp_V = jax.nn.log_softmax(jnp.where(keep_V, logits_V / safe_temp, -jnp.inf))
    greedy_V = jnp.arange(logits_V.shape[-1]) == jnp.argmax(jax.lax.stop_gradient(logits_V))
    return jnp.where(sampled, logp_V, jnp.where(greedy_V, 0.0, -jnp.inf))


def _over_rows(fn: Callable[[Array, SamplingParams], Array]) -> Callable[..., Array]:
    def apply(logits: Array, params: SamplingParams) -> Array:
        lead, vocab = logits.shape[:-1], logits.shape[-1]
        flat = logits.reshape((-1, vocab))
        out = jax.vmap(fn, in_axes=(0, None))(flat, params)
        return out.reshape((*lead, vocab))

    return apply


def truncated_log_probs(logits: Array, params: SamplingParams) -> Array:
    """log of the verifier's distribution `[..., V]` (-inf outside the kept set)."""
    return _over_rows(_row_log_probs)(logits, params)


def truncated_probs(logits: Array, params: SamplingParams) -> Array:
    """The verifier's distribution `[..., V]` (equals `sampling.target_probs` per row)."""
    return jnp.exp(truncated_log_probs(logits, params))


# ---------------------------------------------------------------------------------------------
# acceptance rates and lengths


def acceptance_rate_probs(p: Array, q: Array) -> Array:
    """sum_x min(p(x), q(x)) over the last axis: the probability that rejection sampling
    accepts a token drawn from q when the target samples from p (= 1 - TV(p, q))."""
    p = p.astype(jnp.float32)
    q = q.astype(jnp.float32)
    return jnp.sum(jnp.where(q < p, q, p), axis=-1)


def acceptance_rate(
    target_logits: Array,
    draft_logits: Array,
    target: SamplingParams,
    draft: SamplingParams | None = None,
) -> Array:
    """alpha `[...]` for a probabilistic draft: sum_x min(p(x), q(x)) with p = the target's
    truncated, tempered distribution and q = the draft's (default: draft-simple's top-10 q at
    the target's temperature)."""
    if draft is None:
        draft = draft_params(target.temperature)
    p = truncated_probs(target_logits, target)
    q = truncated_probs(draft_logits, draft)
    return acceptance_rate_probs(p, q)


def greedy_acceptance_rate(
    target_logits: Array, draft_logits: Array, target: SamplingParams
) -> Array:
    """The probability that a greedy draft token (the draft's argmax, verified by match) is
    accepted: p(argmax q). At temperature 0 it is argmax agreement (0 or 1). Constant in the
    draft's logits (gradient 0); differentiable in the target's logits and temperature."""
    logp = truncated_log_probs(target_logits, target)
    tok = jnp.argmax(jax.lax.stop_gradient(draft_logits), axis=-1)
    return jnp.exp(jnp.take_along_axis(logp, tok[..., None], axis=-1)[..., 0])


def argmax_agreement(target_logits: Array, draft_logits: Array) -> Array:
    """1.0 where argmax(target) == argmax(draft) (lowest id on ties), else 0.0: the temperature-0
    acceptance of a greedy draft token."""
    same = jnp.argmax(target_logits, axis=-1) == jnp.argmax(draft_logits, axis=-1)
    return same.astype(jnp.float32)


def expected_acceptance_length(alpha: Array, valid: Array | None = None) -> Array:
    """E[L] = 1 + sum_k prod_{i<=k} alpha_i over the last axis `[..., K]` (`valid`: a prefix
    mask of drafted positions; later positions count as rejected)."""
    alpha = alpha.astype(jnp.float32)
    if valid is not None:
        alpha = jnp.where(valid, alpha, 0.0)
    return 1.0 + jnp.sum(jnp.cumprod(alpha, axis=-1), axis=-1)


def position_acceptance_rates(alpha: Array) -> Array:
    """Unconditional acceptance rate of each draft position `[..., K]` (prod_{i<=k} alpha_i):
    llama.cpp's per-position acceptance statistics."""
    return jnp.cumprod(alpha.astype(jnp.float32), axis=-1)


def block_acceptance_length(alpha: Array, valid: Array | None = None) -> Array:
    """Expected acceptance length of a block drafter (DFlash-style: K positions drafted in one
    pass): alpha_k is position k's acceptance given positions < k were accepted; the accepted
    count is still a prefix, so this is `expected_acceptance_length`."""
    return expected_acceptance_length(alpha, valid)


def greedy_acceptance_length(target_logits: Array, draft_logits: Array) -> Array:
    """Temperature-0 acceptance length of one chain `[..., K, V]` (both models' logits at the
    K drafted positions): 1 + the length of the prefix where the argmaxes agree."""
    return expected_acceptance_length(argmax_agreement(target_logits, draft_logits))


def path_acceptance_length(
    alphas: Sequence[np.ndarray], k: int, total: bool = False
) -> float | tuple[float, float]:
    """Predicted mean acceptance length of draft-simple along generated paths (host, NumPy).

    `alphas[r][j]` is the acceptance probability of generated token j of row r (the first
    generated token, j = 0, comes from prefill and is never drafted). A round starts with e
    tokens emitted, drafts min(k, n - e - 1) tokens (the engine's budget for `n` new tokens),
    accepts a prefix (P(a >= i) = alpha_e ... alpha_{e+i-1}) and emits a + 1 tokens; rounds
    without a drafted token are not counted (as the engine's statistics). Returns
    1 + E[accepted] / E[rounds] over all rows (with `total`: (E[accepted], E[rounds])), the
    quantity the engine reports as `mean_acceptance_length`, computed by a backward recursion.
    """
    acc_total, rounds_total = 0.0, 0.0
    for row in alphas:
        a = np.asarray(row, np.float64)
        n = a.size
        acc = np.zeros(n + 2)
        rounds = np.zeros(n + 2)
        for e in range(n - 1, 0, -1):
            budget = min(k, n - e - 1)
            if budget <= 0:
                acc[e], rounds[e] = acc[e + 1], rounds[e + 1]
                continue
            reach = np.concatenate([[1.0], np.cumprod(a[e : e + budget]), [0.0]])
            prob = reach[:-1] - reach[1:]  # P(a = i), i = 0..budget
            nxt = np.minimum(e + np.arange(budget + 1) + 1, n)
            acc[e] = float(np.sum(prob * (np.arange(budget + 1) + acc[nxt])))
            rounds[e] = 1.0 + float(np.sum(prob * rounds[nxt]))
        if n >= 1:
            acc_total += acc[1]
            rounds_total += rounds[1]
    if total:
        return acc_total, rounds_total
    return 1.0 + acc_total / rounds_total if rounds_total > 0 else 1.0


# ---------------------------------------------------------------------------------------------
# divergences and losses (per position; average them yourself)


def _xlogy_diff(logp: Array, logq: Array) -> Array:
    """sum_x p(x) (log p(x) - log q(x)) with 0 * anything = 0 where p(x) = 0."""
    p = jnp.exp(logp)
    diff = jnp.where(p > 0, logp - jnp.where(p > 0, logq, 0.0), 0.0)
    return jnp.sum(jnp.where(p > 0, p * diff, 0.0), axis=-1)


def total_variation(p: Array, q: Array) -> Array:
    """TV(p, q) = 1/2 sum_x |p(x) - q(x)| = 1 - sum_x min(p, q) (subgradient 0 at ties)."""
    return 1.0 - acceptance_rate_probs(p, q)


def kl_divergence(logp: Array, logq: Array) -> Array:
    """KL(p || q) from log-probabilities `[..., V]` (0 log 0 = 0; +inf where q = 0 < p)."""
    return _xlogy_diff(logp, logq)


def cross_entropy(logp: Array, logq: Array) -> Array:
    """H(p, q) = -sum_x p(x) log q(x) (soft labels; 0 log 0 = 0)."""
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, logq, 0.0), 0.0), axis=-1)


def token_cross_entropy(logq: Array, tokens: Array) -> Array:
    """-log q(token) `[...]`: the data cross-entropy (hard labels)."""
    return -jnp.take_along_axis(logq, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def neg_log_acceptance(p: Array, q: Array) -> Array:
    """-log alpha (alpha clamped below at LOG_FLOOR): the acceptance-length-shaped loss."""
    return -jnp.log(jnp.maximum(acceptance_rate_probs(p, q), LOG_FLOOR))


def hybrid_loss(p: Array, q: Array, logp: Array, logq: Array, kl_weight: float = 1.0) -> Array:
    """-log alpha(p_T, q_T) + kl_weight * (1 - alpha) * KL(p || q): the hybrid used for block
    heads (DSpark) and `--objective lk` (differentiated as written, weight included).

    After LK losses (Samarin et al. 2026, arXiv 2602.23881): the acceptance term is what the
    verifier rewards; the KL term (on the untempered, untruncated distributions) keeps the
    draft's full distribution close to the target's where alpha is low, and fades as alpha
    reaches 1. This is specjax's formulation, not a transcription of the paper's.
    """
    alpha = acceptance_rate_probs(p, q)
    weight = kl_weight * (1.0 - alpha)
    return -jnp.log(jnp.maximum(alpha, LOG_FLOOR)) + weight * kl_divergence(logp, logq)


@pytree_dataclass
class ObjectiveTerms:
    """Per-position terms of `objective_terms` (each `[...]`)."""

    loss: Array
    alpha: Array  # acceptance rate of a probabilistic draft at the verification temperature
    greedy_alpha: Array  # p(argmax q): acceptance of a greedy draft at that temperature
    kl: Array  # KL(p || q) at temperature 1, untruncated
    reverse_kl: Array  # KL(q || p) at temperature 1, untruncated


def objective_terms(
    name: str,
    target_logits: Array,
    draft_logits: Array,
    tokens: Array,
    target: SamplingParams,
    draft: SamplingParams | None = None,
    *,
    kl_weight: float = 1.0,
) -> ObjectiveTerms:
    """The training objective `name` (one of OBJECTIVES) per position, plus diagnostics.

    ce:  data cross-entropy -log q(token) (no teacher);
    kl:  KL(p || q) at temperature 1, untruncated (the shipped code-draft's main term);
    tv:  TV(p_T, q_T) = 1 - alpha, the verifier's distributions at `target` / `draft`;
    nla: -log alpha(p_T, q_T);
    lk:  `hybrid_loss`.
    `draft` defaults to draft-simple's q at the target's temperature (top-10).
    """
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; expected one of {', '.join(OBJECTIVES)}")
    if draft is None:
        draft = draft_params(target.temperature)
    target_logits = jax.lax.stop_gradient(target_logits)
    logp1 = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    logq1 = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_t = truncated_probs(target_logits, target)
    q_t = truncated_probs(draft_logits, draft)
    alpha = acceptance_rate_probs(p_t, q_t)
    kl = kl_divergence(logp1, logq1)
    losses = {
        "ce": lambda: token_cross_entropy(logq1, tokens),
        "kl": lambda: kl,
        "tv": lambda: 1.0 - alpha,
        "nla": lambda: -jnp.log(jnp.maximum(alpha, LOG_FLOOR)),
        "lk": lambda: hybrid_loss(p_t, q_t, logp1, logq1, kl_weight),
    }
    return ObjectiveTerms(
        loss=losses[name](),
        alpha=alpha,
        greedy_alpha=greedy_acceptance_rate(target_logits, draft_logits, target),
        kl=kl,
        reverse_kl=kl_divergence(logq1, logp1),
    )
