"""Greedy speculative decoding on a hybrid recurrent target (qwen35), on device.

The server flow of llama.cpp (spec section 7) on a `HybridMemory`, for every row at once:

    1 budget   min(S - length - 2, remaining - 1), clipped to [0, K]; rows holding a replay
               do not draft (7.2)
    2 relay    the drafters in llama.cpp's priority; the first with a draft wins the row
    3 verify   forward over [id_last, d_1..d_k] at length..length+k; with n_rs_seq > 0 it
               fills the n_rs_seq planes from the per-position states (hybrid_memory)
    4 accept   greedy match (replay rows: every replayed token untested, as later upstream's
               `server_accept_replay`; never loops: upstream bug #25819)
    5 rollback n_rollback = k - n_acc rows to discard; `use_ckpt = FULL or (RS and
               k > n_rs_seq)` (7.3/7.5, decided on the draft length before verifying):
               * no rollback needed: commit (counter `full_accept`);
               * RS, n_rollback <= n_rs_seq: `seq_rm(row, length + n_acc + 1, -1)` on the
                 hybrid memory rolls the recurrent state back by the plane n_rollback and
                 drops the KV cells (counter `rs_plane`);
               * checkpoint: the checkpoint is the pre-round pytree (PARTIAL_ONLY: only its
                 recurrent part is restored), then `seq_rm(row, length, -1)` trims the KV;
                 nothing is emitted, the accepted list [d_1..d_nacc, c] becomes the row's
                 replay draft for the next round (counter `checkpoint`; the replay round
                 counts in `replay`, and in the statistics with one accepted token less,
                 as upstream's PR #26320). The drafters are restored with it: their
                 own memory (the draft context, PART) is trimmed to the round's start
                 by `rollback`, and their per-row checkpoint data (`data_spec`,
                 `take_spec_state` / `load_spec_state`: EAGLE-3's boundary) is set back
                 to its pre-round value; `accept` is not called (upstream 7.5).
    6 feedback drafter.process(verify batch), accept, rollback (as specjax.engine)

Greedy decoding (the default): the output is plain greedy decoding token for token, up to the
float32 difference between the verify batch and one-token steps. With `sampling_params`
(temperature > 0, top-k/p, min-p; no repeat penalty) step 4 is `specjax.verify.verify_rows`:
the token at position p is drawn with the key (seed, p, ROLE_SAMPLE), drafts are accepted
while they match the target's own draws, replay rows are accepted untested and the
continuation drawn with its position's key. The sampler has no other state, so restoring a
checkpoint restores it: the output is plain sampling with the same seed token for token.
Everything runs in one jitted `lax.while_loop`; the host only reads the final state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling, verify
from specjax.drafters.base import (
    DraftInput,
    DraftOutput,
    TargetBatch,
    TokenHistory,
    chain_width,
    load_spec_state,
    take_spec_state,
)
from specjax.hybrid_memory import (
    HybridMemory,
    forward_memory_hidden,
    select_recurrent,
)
from specjax.models import qwen35
from specjax.pytree import pytree_dataclass, replace
from specjax.sampling import SamplingParams
from specjax.stats import ROLLBACK_PATHS, format_rollback_line
from specjax.types import Array, Params

FINISH_NONE, FINISH_EOG, FINISH_LENGTH, FINISH_CONTEXT = 0, 1, 2, 3
#: Names of the per-path round counters (`HybridGenState.paths`, summed over rows), a subset of
#: `specjax.stats.ROLLBACK_PATHS` (the report fills the others with 0).
PATHS = ("full_accept", "rs_plane", "checkpoint", "replay", "seq_rm_failed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridEngine:
    """Static facts of a run (a jit static argument)."""

    target: qwen35.Qwen35Config
    drafters: tuple[Any, ...] = ()
    k_max: int = 1
    n_rs_seq: int = 0  # 0: the target is FULL (checkpoints), else RS
    capacity: int
    out_capacity: int
    eog_ids: tuple[int, ...] = ()


@pytree_dataclass
class HybridGenState:
    mem: HybridMemory
    history: Array  # [B, S] tokens in memory (positions 0..length-1)
    length: Array  # [B] position of last_token (not yet in memory)
    last_token: Array  # [B]
    out_tokens: Array  # [B, O]
    out_len: Array  # [B]
    done: Array  # [B] bool
    finish: Array  # [B] int32
    drafter_states: tuple[Any, ...]
    replay_tokens: Array  # [B, K] accepted list of a checkpointed round
    replay_len: Array  # [B] 0 = no replay pending
    replay_winner: Array  # [B] drafter that produced the replayed draft
    paths: Array  # [len(PATHS)] int32 row-rounds per path
    n_draft_tokens: Array  # [] drafted tokens (llama.cpp's n_draft_tokens)
    n_accepted: Array  # [] accepted draft tokens (replay rounds: one less, as upstream)
    n_verif_steps: Array  # [] verification steps with a draft (not the checkpointed ones)
    n_rounds: Array  # []
    #: target sampling (temperature > 0 possible) or None: greedy (argmax, the fast path)
    sampling: SamplingParams | None = None


def _is_eog(engine: HybridEngine, tokens: Array) -> Array:
    if not engine.eog_ids:
        return jnp.zeros(tokens.shape, bool)
    ids = jnp.asarray(engine.eog_ids, jnp.int32).reshape((1,) * tokens.ndim + (-1,))
    return jnp.any(tokens[..., None] == ids, axis=-1)


def prefill(
    engine: HybridEngine,
    params: Params,
    drafter_params: tuple[Any, ...],
    tokens_BT: Array,
    lengths_B: Array,
    max_new_B: Array,
    start: tuple[HybridMemory, Array] | None = None,
    sampling_params: SamplingParams | None = None,
) -> HybridGenState:
    """`start`: (memory, n_cached [B]) of restored slots (`specjax.slots`): only the prompt
    after each row's cached prefix is evaluated. `sampling_params` ([B] fields): sample the
    tokens (key from seed, the token's position and ROLE_SAMPLE); None = greedy."""
    B, T = tokens_BT.shape
    S, K = engine.capacity, engine.k_max
    positions_BT = jnp.where(jnp.arange(T)[None] < lengths_B[:, None], jnp.arange(T)[None], -1)
    if start is None:
        mem = HybridMemory.init(engine.target, B, S, engine.n_rs_seq)
        logits, mem, hidden = forward_memory_hidden(
            engine.target, params, tokens_BT, positions_BT, mem, cache_empty=True
        )
        last_idx = lengths_B - 1
    else:
        from specjax.slots import suffix

        if any(getattr(d, "reads_nextn", False) for d in engine.drafters):
            raise ValueError("a restored slot holds no target hidden states for draft-mtp")
        mem, n_cached = start
        s_tokens, s_pos, last_idx = suffix(tokens_BT, lengths_B, n_cached)
        logits, mem, hidden = forward_memory_hidden(engine.target, params, s_tokens, s_pos, mem)
    last = jnp.take_along_axis(logits, last_idx[:, None, None], axis=1)[:, 0]
    if sampling_params is None:
        first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    else:
        keys = sampling.make_keys(sampling_params.seed, lengths_B, sampling.ROLE_SAMPLE)
        first = sampling.sample(last, sampling_params, keys).astype(jnp.int32)
    states = tuple(d.init(B, S) for d in engine.drafters)
    batch = TargetBatch(
        tokens=tokens_BT, positions=positions_BT, hidden=_nextn(engine, hidden), is_prompt=True
    )
    states = tuple(
        d.process(p, s, batch) for d, p, s in zip(engine.drafters, drafter_params, states)
    )
    history = jnp.zeros((B, S), jnp.int32).at[:, :T].set(jnp.where(positions_BT >= 0, tokens_BT, 0))
    hist = TokenHistory(tokens=history, length=lengths_B)
    states = tuple(d.begin(s, hist) for d, s in zip(engine.drafters, states))
    eog = _is_eog(engine, first)
    full = lengths_B >= S - 1
    finish = jnp.where(
        eog,
        FINISH_EOG,
        jnp.where(max_new_B <= 1, FINISH_LENGTH, jnp.where(full, FINISH_CONTEXT, FINISH_NONE)),
    )
    zero = jnp.zeros((), jnp.int32)
    return HybridGenState(
        mem=mem,
        history=history,
        length=lengths_B.astype(jnp.int32),
        last_token=first,
        out_tokens=jnp.zeros((B, engine.out_capacity), jnp.int32).at[:, 0].set(first),
        out_len=jnp.ones((B,), jnp.int32),
        done=finish != FINISH_NONE,
        finish=finish.astype(jnp.int32),
        drafter_states=states,
        replay_tokens=jnp.zeros((B, K), jnp.int32),
        replay_len=jnp.zeros((B,), jnp.int32),
        replay_winner=jnp.full((B,), -1, jnp.int32),
        paths=jnp.zeros((len(PATHS),), jnp.int32),
        n_draft_tokens=zero,
        n_accepted=zero,
        n_verif_steps=zero,
        n_rounds=zero,
        sampling=sampling_params,
    )


def _relay(
    engine: HybridEngine, drafter_params: tuple[Any, ...], st: HybridGenState, budget_B: Array
) -> tuple[Array, Array, Array, tuple[Any, ...]]:
    """llama.cpp's relay: (tokens [B, K], valid [B, K], winner [B], drafter states)."""
    B, K = st.length.shape[0], engine.k_max
    hist = TokenHistory(tokens=st.history, length=st.length)
    tokens = jnp.zeros((B, K), jnp.int32)
    valid = jnp.zeros((B, K), bool)
    winner = jnp.full((B,), -1, jnp.int32)
    remaining = budget_B > 0
    new_states = []
    for i, (d, p, s) in enumerate(zip(engine.drafters, drafter_params, st.drafter_states)):
        inp = DraftInput(
            history=hist,
            last_token=st.last_token,
            n_max=budget_B,
            drafting=remaining,
            n_min=jnp.zeros((), jnp.int32),
            p_min=jnp.zeros((), jnp.float32),
            temperature=jnp.zeros((B,), jnp.float32)
            if st.sampling is None
            else st.sampling.temperature,
            seed=None if st.sampling is None else st.sampling.seed,
        )
        s, out = d.draft(p, s, inp, K)
        won = remaining & out.valid[:, 0]
        cut = out.valid & (jnp.arange(K)[None, :] < budget_B[:, None])
        tokens = jnp.where(won[:, None], out.tokens, tokens)
        valid = jnp.where(won[:, None], cut, valid)
        winner = jnp.where(won, i, winner)
        remaining = remaining & ~won
        new_states.append(s)
    return tokens, valid, winner, tuple(new_states)


def _nextn(engine: HybridEngine, hidden: Array) -> dict[int, Array]:
    """`TargetBatch.hidden` for the chain: h_nextn under H_NEXTN when a drafter reads it."""
    from specjax.drafters.draft_mtp import H_NEXTN

    if any(getattr(d, "reads_nextn", False) for d in engine.drafters):
        return {H_NEXTN: hidden}
    return {}


def _verify(
    engine: HybridEngine, params: Params, mem: HybridMemory, v_tokens: Array, v_pos: Array
) -> tuple[Array, HybridMemory, Array]:
    """Target forward at width 1 when no row has a draft, else K + 1: (argmax [B, K+1], mem,
    h_nextn [B, K+1, D])."""
    K = engine.k_max

    def branch(width: int) -> Any:
        def run(ops: tuple[HybridMemory, Array, Array]) -> tuple[Array, HybridMemory, Array]:
            m, tok, pos = ops
            logits, m, h = forward_memory_hidden(
                engine.target, params, tok[:, :width], pos[:, :width], m
            )
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            pad = ((0, 0), (0, K + 1 - width))
            return jnp.pad(greedy, pad), m, jnp.pad(h, pad + ((0, 0),))

        return run

    wide = jnp.any(v_pos[:, 1:] >= 0).astype(jnp.int32)
    return jax.lax.switch(wide, [branch(1), branch(K + 1)], (mem, v_tokens, v_pos))


def _verify_logits(
    engine: HybridEngine, params: Params, mem: HybridMemory, v_tokens: Array, v_pos: Array
) -> tuple[Array, HybridMemory, Array]:
    """`_verify` returning the logits [B, K+1, V] (padded rows zero) for sampling."""
    K = engine.k_max

    def branch(width: int) -> Any:
        def run(ops: tuple[HybridMemory, Array, Array]) -> tuple[Array, HybridMemory, Array]:
            m, tok, pos = ops
            logits, m, h = forward_memory_hidden(
                engine.target, params, tok[:, :width], pos[:, :width], m
            )
            pad = ((0, 0), (0, K + 1 - width))
            return jnp.pad(logits, pad + ((0, 0),)), m, jnp.pad(h, pad + ((0, 0),))

        return run

    wide = jnp.any(v_pos[:, 1:] >= 0).astype(jnp.int32)
    return jax.lax.switch(wide, [branch(1), branch(K + 1)], (mem, v_tokens, v_pos))


def spec_step(
    engine: HybridEngine, params: Params, drafter_params: tuple[Any, ...], st: HybridGenState,
    max_new_B: Array,
) -> HybridGenState:  # fmt: skip
    B, K, S, n_out = st.length.shape[0], engine.k_max, engine.capacity, engine.out_capacity
    ar_K = jnp.arange(K)[None, :]
    ar_T = jnp.arange(K + 1)[None, :]
    active = ~st.done
    replaying = active & (st.replay_len > 0)
    remaining = max_new_B - st.out_len
    budget = jnp.clip(jnp.minimum(S - st.length - 2, remaining - 1), 0, K)
    budget = jnp.where(active & ~replaying, budget, 0)
    if engine.drafters:
        d_tokens, d_valid, winner, dstates = _relay(engine, drafter_params, st, budget)
    else:
        d_tokens, d_valid = jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K), bool)
        winner, dstates = jnp.full((B,), -1, jnp.int32), st.drafter_states
    drafted = jnp.sum(d_valid, axis=1).astype(jnp.int32)
    draft_tokens = jnp.where(replaying[:, None], st.replay_tokens, d_tokens)
    draft_len = jnp.where(replaying, st.replay_len, drafted)
    draft_len = jnp.where(active, draft_len, 0)
    winner = jnp.where(replaying, st.replay_winner, winner)
    valid_K = ar_K < draft_len[:, None]

    v_tokens = jnp.concatenate([st.last_token[:, None], draft_tokens], axis=1)
    v_valid = active[:, None] & (ar_T <= draft_len[:, None])
    v_pos = jnp.where(v_valid, st.length[:, None] + ar_T, -1)
    # upstream decides on the draft length (7.3): FULL always, RS beyond n_rs_seq planes
    use_ckpt = ~replaying & (draft_len > engine.n_rs_seq)
    if st.sampling is None:
        greedy, mem, hidden = _verify(engine, params, st.mem, v_tokens, v_pos)
        match_K = (greedy[:, :K] == draft_tokens) & valid_K
        n_acc = jnp.sum(jnp.cumprod(match_K.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        n_acc = jnp.where(replaying, draft_len, n_acc)  # replayed tokens are accepted untested
        n_acc = jnp.where(active, n_acc, 0)
        next_token = jnp.take_along_axis(greedy, n_acc[:, None], axis=1)[:, 0]
    else:  # specjax.verify: sample-and-match, replay rows accepted untested (keys by position)
        logits, mem, hidden = _verify_logits(engine, params, st.mem, v_tokens, v_pos)
        draft = DraftOutput(tokens=draft_tokens, valid=valid_K)
        result = verify.verify_rows(logits, draft, st.sampling, st.length, replay_B=replaying)
        n_acc = jnp.where(active, result.n_accepted, 0).astype(jnp.int32)
        next_token = result.next_token.astype(jnp.int32)
    n_rollback = draft_len - n_acc
    ckpt = active & (n_rollback > 0) & use_ckpt
    rs = active & (n_rollback > 0) & ~use_ckpt

    # RS: seq_rm of the rejected tail restores plane n_rollback (and drops the KV cells)
    mem, ok_B = mem.seq_rm_rows(rs, st.length + n_acc + 1, -1)
    # checkpoint: restore the pre-round recurrent state (PARTIAL_ONLY), trim the KV from length
    mem = replace(mem, rec=select_recurrent(ckpt, st.mem.rec, mem.rec))
    mem, _ = mem.seq_rm_rows(ckpt, st.length, -1)
    commit = active & ~ckpt

    keep = st.length + n_acc + 1
    new_length = jnp.where(commit, keep, st.length)
    rows_BT = jnp.arange(B)[:, None] + jnp.zeros((1, K + 1), jnp.int32)
    write = commit[:, None] & (ar_T <= n_acc[:, None])
    hist_idx = jnp.where(write, st.length[:, None] + ar_T, S)
    history = st.history.at[rows_BT, hist_idx].set(v_tokens, mode="drop")

    emitted = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
    emitted = jnp.where(ar_T == n_acc[:, None], next_token[:, None], emitted)
    n_emit = jnp.where(commit, n_acc + 1, 0)
    eog = _is_eog(engine, emitted) & (ar_T < n_emit[:, None])
    first_eog = jnp.argmax(eog, axis=1)
    hit_eog = jnp.any(eog, axis=1)
    n_emit = jnp.minimum(jnp.where(hit_eog, first_eog + 1, n_emit), remaining)
    out_idx = jnp.where(ar_T < n_emit[:, None], st.out_len[:, None] + ar_T, n_out)
    out_tokens = st.out_tokens.at[rows_BT, out_idx].set(emitted, mode="drop")
    out_len = st.out_len + n_emit
    eog_stop = hit_eog & (first_eog < n_emit)
    len_stop = out_len >= max_new_B
    ctx_stop = new_length >= S - 1
    newly = commit & (eog_stop | len_stop | ctx_stop)
    finish = jnp.where(
        newly,
        jnp.where(eog_stop, FINISH_EOG, jnp.where(len_stop, FINISH_LENGTH, FINISH_CONTEXT)),
        st.finish,
    )

    # the accepted list [d_1..d_nacc, c] of a checkpointed row is its next round's draft
    replay_tokens = jnp.where(ckpt[:, None], emitted[:, :K], st.replay_tokens)
    replay_len = jnp.where(ckpt, n_acc + 1, jnp.where(replaying, 0, st.replay_len))
    replay_winner = jnp.where(ckpt, winner, st.replay_winner)

    had_draft = active & (draft_len > 0)
    if engine.drafters:
        batch = TargetBatch(tokens=v_tokens, positions=v_pos, hidden=_nextn(engine, hidden))
        new_states = []
        for i, (d, p, s) in enumerate(zip(engine.drafters, drafter_params, dstates)):
            s = d.process(p, s, batch)
            s = d.accept(s, n_acc, winner != i, had_draft & ~ckpt)
            s = d.rollback(s, new_length)
            # checkpointed rows: the drafter's data_spec back to its pre-round value
            s = load_spec_state(d, s, take_spec_state(d, st.drafter_states[i]), ckpt)
            new_states.append(s)
        dstates = tuple(new_states)

    verified = had_draft & ~ckpt
    counted = jnp.where(replaying, jnp.maximum(n_acc - 1, 0), n_acc)
    paths = st.paths + jnp.stack(
        [
            jnp.sum(verified & ~replaying & (n_rollback == 0)),
            jnp.sum(rs),
            jnp.sum(ckpt),
            jnp.sum(replaying),
            jnp.sum(rs & ~ok_B),
        ]
    ).astype(jnp.int32)
    return HybridGenState(
        mem=mem,
        history=history,
        length=new_length,
        last_token=jnp.where(commit, next_token, st.last_token),
        out_tokens=out_tokens,
        out_len=out_len,
        done=st.done | newly,
        finish=finish.astype(jnp.int32),
        drafter_states=dstates,
        replay_tokens=replay_tokens,
        replay_len=replay_len.astype(jnp.int32),
        replay_winner=replay_winner,
        paths=paths,
        n_draft_tokens=st.n_draft_tokens + jnp.sum(jnp.where(replaying, 0, drafted)),
        n_accepted=st.n_accepted + jnp.sum(jnp.where(verified, counted, 0)),
        n_verif_steps=st.n_verif_steps + jnp.sum(verified),
        n_rounds=st.n_rounds + 1,
        sampling=st.sampling,
    )


@functools.partial(jax.jit, static_argnames=("engine",))
def run(
    engine: HybridEngine,
    params: Params,
    drafter_params: tuple[Any, ...],
    tokens_BT: Array,
    lengths_B: Array,
    max_new_B: Array,
    start: tuple[HybridMemory, Array] | None = None,
    sampling_params: SamplingParams | None = None,
) -> HybridGenState:
    """Prefill (from restored slots with `start`) + the speculative loop until every row is
    done (sampled with `sampling_params`, else greedy)."""
    st = prefill(
        engine, params, drafter_params, tokens_BT, lengths_B, max_new_B, start, sampling_params
    )

    def cond(s: HybridGenState) -> Array:
        return jnp.any(~s.done) & (s.n_rounds < 2 * engine.out_capacity)

    def body(s: HybridGenState) -> HybridGenState:
        return spec_step(engine, params, drafter_params, s, max_new_B)

    return jax.lax.while_loop(cond, body, st)


# ----------------------------------------------------------------------------- host side
#: Drafter types whose target needs n_rs_seq planes upstream (`need_n_rs_seq`).
_MODEL_DRAFTERS = ("draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark")


def need_n_rs_seq(spec: Any) -> int:
    """`common_params_speculative::need_n_rs_seq`: draft n_max when a drafter that runs on the
    target's hidden states is enabled, else 0."""
    return int(spec.draft_n_max) if any(t in spec.types for t in _MODEL_DRAFTERS) else 0


@dataclasses.dataclass(frozen=True)
class HybridSpecReport:
    """Host-side statistics of a hybrid speculative run."""

    seq_rm_type: str  # the probe's answer for the target: FULL or RS
    n_rs_seq: int
    paths: dict[str, int]  # row-rounds per rollback path (PATHS)
    n_draft_tokens: int
    n_accepted: int
    n_verif_steps: int
    names: tuple[str, ...]
    n_rounds: int = 0  # target forwards of the loop (one per round, all rows at once)
    #: a recurrent draft context's row-rounds per path (DRAFT_ROLLBACK_PATHS), else None
    draft_context: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        steps = self.n_verif_steps
        extra = {} if self.draft_context is None else {"draft_context": self.draft_context}
        return {
            "num_drafts": steps,
            "num_draft_tokens": self.n_draft_tokens,
            "num_accepted_tokens": self.n_accepted,
            "mean_acceptance_length": 1.0 + self.n_accepted / steps if steps else 1.0,
            "acceptance_rate": self.n_accepted / self.n_draft_tokens
            if self.n_draft_tokens
            else 0.0,
            "seq_rm_type": self.seq_rm_type,
            "n_rs_seq": self.n_rs_seq,
            "rollback": {name: self.paths.get(name, 0) for name in ROLLBACK_PATHS},
            "target_forwards": self.n_rounds,
            "drafters": list(self.names),
            **extra,
        }

    def lines(self) -> list[str]:
        out = [
            f"target memory: {self.seq_rm_type} (n_rs_seq = {self.n_rs_seq})",
            f"draft acceptance rate = {self.to_dict()['acceptance_rate']:.5f} "
            f"({self.n_accepted} accepted / {self.n_draft_tokens} generated)",
            format_rollback_line(self.paths),
        ]
        if self.draft_context is not None:
            c = self.draft_context
            out.append(
                f"draft context: {c['rs_plane']} rounds rolled back by RS plane, "
                f"{c['checkpoint']} by checkpoint"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _draft_context_counts(states: tuple[Any, ...]) -> dict[str, int] | None:
    """Row-rounds per rollback path of the recurrent draft contexts (None: there is none)."""
    from specjax.drafters.draft_simple_recurrent import DRAFT_ROLLBACK_PATHS, RecurrentDraftState

    counts = [
        np.asarray(s.rollbacks).sum(axis=0) for s in states if isinstance(s, RecurrentDraftState)
    ]
    if not counts:
        return None
    total = np.sum(counts, axis=0)
    return {name: int(x) for name, x in zip(DRAFT_ROLLBACK_PATHS, total)}


def generate_speculative(
    model: Any,
    prompt_ids: list[list[int]],
    max_new: Any,
    *,
    spec: Any,
    draft: Any,
    n_ctx: int,
    n_rs_seq: int | None,
    slots: Any = None,
    sampling_params: SamplingParams | None = None,
) -> tuple[Any, Any, Any, HybridSpecReport | None, float]:
    """Host side of a speculative run on a qwen35 target (called by `generate_hybrid`).

    Returns (out tokens [B, O], out_len [B], finish [B], report or None, seconds); None when
    the probe says NO (speculation disabled with a warning, plain decoding instead).
    `slots`: per-row `specjax.slots.SlotState` or None to start from; with `spec=None` (or a
    NO target) the loop runs without drafters (plain decoding) and the report is None.
    `sampling_params` ([B] fields): sample at temperature > 0 (None: greedy)."""
    import time
    import warnings

    import numpy as np

    from specjax.drafters.registry import build_drafters
    from specjax.hybrid_memory import SeqRmType, can_seq_rm

    config = model.config
    from_slots = slots is not None and any(s is not None for s in slots)
    if spec is None and not from_slots and sampling_params is None:
        return None, None, None, None, 0.0
    if spec is None:
        spec, kind, n_rs = None, SeqRmType.FULL, 0
    else:
        n_rs = need_n_rs_seq(spec) if n_rs_seq is None else int(n_rs_seq)
        if n_rs < 0:
            raise ValueError(f"n_rs_seq must be >= 0, got {n_rs}")
        kind = can_seq_rm(model, n_rs)
    if kind == SeqRmType.NO:
        warnings.warn(
            f"the target ({config.arch}) failed the rollback probe (seq_rm type NO): "
            "speculative decoding is disabled, decoding without drafts",
            stacklevel=3,
        )
        if not from_slots and sampling_params is None:
            return None, None, None, None, 0.0
        spec, n_rs = None, 0
    drafters, dparams = build_drafters(spec, model, draft) if spec is not None else ((), ())
    for d in drafters:
        if d.hidden_layers and not getattr(d, "reads_nextn", False):
            raise ValueError(
                f"{d.name} reads target hidden states, which the {config.arch} target does not "
                "export yet; use n-gram drafters or draft-simple"
            )
    # draft-mtp drafts at most its own (clamped) n_max
    K = chain_width(drafters, spec.resolved_k_max()) if spec is not None else 1
    B = len(prompt_ids)
    lengths = np.asarray([len(p) for p in prompt_ids], np.int32)
    T = min(max(8, 1 << (int(lengths.max()) - 1).bit_length()), n_ctx)  # history holds n_ctx
    n_out = max(8, 1 << (int(max_new.max()) + K).bit_length())
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompt_ids):
        tokens[b, : len(p)] = p
    engine = HybridEngine(
        target=config,
        drafters=drafters,
        k_max=K,
        n_rs_seq=n_rs,
        capacity=n_ctx,
        out_capacity=n_out,
        eog_ids=tuple(model.eog_ids),
    )
    start = None
    if from_slots:
        from specjax.slots import hybrid_start

        start = hybrid_start(model, list(slots), n_ctx, n_rs)
    t0 = time.perf_counter()
    st = jax.device_get(
        run(
            engine,
            model.params,
            dparams,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jnp.asarray(max_new),
            start,
            sampling_params,
        )
    )
    seconds = time.perf_counter() - t0
    if spec is None:
        return st.out_tokens, st.out_len, st.finish, None, seconds
    report = HybridSpecReport(
        seq_rm_type=kind.name,
        n_rs_seq=n_rs,
        paths={name: int(v) for name, v in zip(PATHS, st.paths)},
        n_draft_tokens=int(st.n_draft_tokens),
        n_accepted=int(st.n_accepted),
        n_verif_steps=int(st.n_verif_steps),
        names=tuple(d.name for d in drafters),
        n_rounds=int(st.n_rounds),
        draft_context=_draft_context_counts(st.drafter_states),
    )
    if report.paths["seq_rm_failed"]:
        raise RuntimeError(f"a bounded rollback failed in {report.paths['seq_rm_failed']} rounds")
    return st.out_tokens, st.out_len, st.finish, report, seconds
