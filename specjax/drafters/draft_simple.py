"""draft-simple: a separate small draft model with its own KV cache (llama.cpp section 5.1).

Invariants:
* The draft cache holds the target's memory prefix positions 0..n_past[b]-1 of every row
  (`n_past <= length`). `process` evaluates the prompt; verify batches are not re-evaluated:
  like llama.cpp's draft-simple, `draft` first catches up from the token history (usually
  none or one token, the last accepted draft token, in a 1-wide forward; up to CATCH_UP
  tokens in CATCH_UP-wide ones; a row further behind, e.g. whose prompt continuous
  batching did not evaluate (`lazy_prompt`), alone in batch-1 chunks of CATCH_UP_ROW),
  then drafts.
* The k-step loop runs on device. On CPU and GPU it reads the draft cache without writing
  it: each step's K/V go to a small scratch ([B, G, K, E] per layer) that later steps attend
  to, and after the loop the scratch (id_last, d_1, ... as fed) is committed at its real
  positions. On a TPU (`control.draft_steps_in_cache`) each step writes its K/V into the
  loop-carried cache, as llama.cpp's draft context does. Either way `rollback` trims what
  verification rejected (llama.cpp's `seq_rm`), so accepted drafts are never evaluated twice
  and nothing of cache size is copied per round.
* Drafting samples from a softmax over the top-10 draft logits at temperature 1 and takes
  the argmax; a row stops when that top probability is < p_min (token not added) or its
  length reaches its budget; drafts shorter than n_min are cleared.
* Probabilistic mode (static flag, `--spec-draft-sampling probabilistic`; greedy drafting
  is the default, as upstream): at temperature > 0 the
  top-10 distribution is tempered with the target's temperature, the drafted token is
  sampled from it with a key from `seed ^ 0x85ebca6b` (llama.cpp's `spec_retune`), and q
  (that distribution over the full vocabulary) is returned for rejection sampling.

`DraftSimpleRecurrent`: draft-simple with a recurrent draft model (qwen35 hybrid), and the draft
context's rollback rule.

A qwen35 draft model's memory is a `HybridMemory`: attention KV cells (PART: a tail can be
dropped) beside delta-net states, which cannot drop a tail unless snapshot planes cover it.
llama.cpp's server applies the target's checkpoint rule to the draft context too (spec 3.3,
7.3): a FULL draft context is checkpointed before drafting and restored after it (`load_dft`,
then `seq_rm(ctx_dft, pos_max + 1, -1)`); an RS one is checkpointed only when the draft is
longer than its `n_rs_seq` (`use_ckpt_dft = dft == RS && |draft| > n_rs_seq(dft)`). Upstream
creates draft contexts with n_rs_seq = 0, so they are FULL; `n_rs_seq` here defaults to that.

Its invariants (on top of `DraftSimple`'s: the memory holds positions 0..n_past[b]-1, catch-up
from the token history, drafts never re-evaluated while kept):
* The draft loop runs on the loop-carried memory, one token per step (planes shift per step,
  so plane d is the state d tokens earlier).
* After the loop, a row that fed f tokens keeps them iff f <= n_rs_seq; otherwise its
  recurrent state is the pre-draft one (the checkpoint: the pre-loop pytree, PARTIAL_ONLY)
  and its drafted KV cells are dropped (counter `checkpoint`). Under FULL (n_rs_seq = 0)
  that is every drafting row: the accepted tokens reach the draft context through the next
  round's catch-up (the replay), and rejected ones never enter it. (Upstream re-mirrors the
  whole verify batch with `process`, and its trailing `seq_rm` of the rejected tail then
  fails on the FULL draft context.)
* `rollback(keep)`: a kept tail beyond keep is removed with `seq_rm(row, keep, -1)`, which
  restores plane r <= f <= n_rs_seq (counter `rs_plane`). A `seq_rm` that fails anyway
  clears the row, which catch-up re-feeds from the history: slower, never wrong (counter
  `rebuilt`; unreachable by the rule above).
* Prompt and catch-up forwards do not compute per-position states: every plane of a fed row
  gets the final state. Rollbacks never reach behind the draft loop's first token, and the
  loop's one-token steps shift real states into planes 0..f-1 with the pre-draft state at f.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.control import draft_steps_in_cache, run_once
from specjax.drafters import draft_tokens
from specjax.drafters.base import (
    Drafter,
    DraftInput,
    DraftOutput,
    TargetBatch,
    TokenHistory,
)
from specjax.drafters.draft_tokens import DRAFT_TOP_K
from specjax.errors import VocabMismatchError
from specjax.memory.hybrid import HybridMemory, forward_memory, select_recurrent
from specjax.memory.kv import KVCache, keep_prefix
from specjax.models import qwen35
from specjax.models.config import ModelConfig
from specjax.models.llama import ExtraKV, commit_kv, forward_compute, new_cache
from specjax.pytree import pytree_dataclass, replace
from specjax.types import EMPTY_POS, Array, Params

if TYPE_CHECKING:
    from specjax.config import SpecConfig

#: llama.cpp's constants in `common_speculative_are_compatible`.
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5
#: `spec_retune` mixes the target seed so draft and target RNG streams differ.
DRAFT_SEED_XOR = 0x85EBCA6B
#: Width of one catch-up forward over history tokens the draft cache does not hold yet.
CATCH_UP = 16
#: Width of one batch-1 catch-up forward of a row more than CATCH_UP tokens behind (a
#: deferred prompt, or tokens generated while the governor kept the row from drafting).
CATCH_UP_ROW = 64


@pytree_dataclass
class DraftSimpleState:
    cache: KVCache
    n_past: Array  # [B] int32: the draft cache holds positions 0..n_past-1


@dataclasses.dataclass(frozen=True)
class DraftSimple(Drafter):
    name: ClassVar[str] = "draft-simple"
    #: `process` of a prompt may be skipped (continuous batching defers it): `draft` catches
    #: up from the token history before it drafts, so only rows that draft pay for it.
    lazy_prompt: ClassVar[bool] = True
    #: A round in which no row drafts leaves the state as it is (`draft` skips, `process`
    #: ignores verify batches, `accept` is a no-op, `rollback` to length + 1 >= n_past keeps
    #: every cell), so a round the governor turns off may skip the calls (`engine.spec_step`).
    idle_noop: ClassVar[bool] = True
    #: a draft-model step per drafted token, and the catch-up of the rounds it was not asked in
    prices: ClassVar[frozenset[str]] = frozenset({"draft_step", "catch_up"})
    #: a draft model's parameters: the target's decode form (`weights.decode_params`)
    params_form: ClassVar[str] = "model"

    config: ModelConfig
    target_vocab: int
    probabilistic: bool = False
    top_k: int = DRAFT_TOP_K

    @classmethod
    def from_spec(cls, spec: SpecConfig, target: Any, draft: Any) -> tuple[Drafter, Any]:
        """The draft model's drafter, checked against the target's vocabulary: a
        `DraftSimpleRecurrent` for a qwen35 draft model."""
        if draft is None:
            raise ValueError("draft-simple needs a draft model (-md/--spec-draft-model)")
        tc, dc = target.config, draft.config
        if target.tokenizer is not None and draft.tokenizer is not None:
            check_vocab_compatible(target.tokenizer, draft.tokenizer, tc.V, dc.V)
        elif abs(tc.V - dc.V) > 128:
            raise VocabMismatchError(
                f"draft vocab size {dc.V} differs from the target's {tc.V} by more than 128"
            )
        # "greedy" (default, as upstream): argmax drafts verified by match, so output equals
        # plain sampling with the same seed. "probabilistic": rows at temperature > 0 sample
        # their drafts and are verified by rejection sampling; rows at temperature 0 still
        # draft the argmax, so one static drafter serves every temperature without recompiling.
        probabilistic = spec.draft_sampling == "probabilistic"
        if getattr(dc, "arch", None) == "qwen35":
            # a recurrent draft context: FULL (n_rs_seq 0, as upstream's draft contexts)
            recurrent = DraftSimpleRecurrent(
                config=dc, target_vocab=tc.V, probabilistic=probabilistic
            )
            return recurrent, draft.params
        drafter = DraftSimple(config=dc, target_vocab=tc.V, probabilistic=probabilistic)
        return drafter, draft.params

    def init(self, batch: int, capacity: int) -> DraftSimpleState:
        return DraftSimpleState(
            cache=new_cache(self.config, batch, capacity), n_past=jnp.zeros((batch,), jnp.int32)
        )

    # -- the draft model's memory: `DraftSimpleRecurrent` overrides these for a qwen35 draft
    def _row(self, cache: Any, r: Array) -> Any:
        """Row r of the draft memory as a one-row memory."""

        def row(x: Array) -> Array:
            return jax.lax.dynamic_slice_in_dim(x, r, 1, 0)

        return KVCache(
            k=tuple(row(x) for x in cache.k),
            v=tuple(row(x) for x in cache.v),
            pos=row(cache.pos),
            overflow=row(cache.overflow),
            inv_freq=cache.inv_freq,
        )

    def _put_row(self, cache: Any, row_cache: Any, r: Array) -> Any:
        """The draft memory with row r replaced by the one-row memory `row_cache`."""

        def put(x: Array, y: Array) -> Array:
            return jax.lax.dynamic_update_slice_in_dim(x, y, r, 0)

        return KVCache(
            k=tuple(put(x, y) for x, y in zip(cache.k, row_cache.k)),
            v=tuple(put(x, y) for x, y in zip(cache.v, row_cache.v)),
            pos=put(cache.pos, row_cache.pos),
            overflow=put(cache.overflow, row_cache.overflow),
            inv_freq=cache.inv_freq,
        )

    def _loop_start(self, state: Any, batch: int, k_max: int) -> Any:
        """The draft loop's model carry: a [B, G, K, E] scratch per layer for the K/V of the
        fed tokens (the cache itself is only read inside the loop), or on a TPU the cache,
        which each step writes (`control.draft_steps_in_cache`)."""
        if draft_steps_in_cache():
            return state.cache
        cfg = self.config
        shape = (batch, cfg.G, k_max, cfg.E)
        return ExtraKV(
            k=tuple(jnp.zeros(shape, c.dtype) for c in state.cache.k),
            v=tuple(jnp.zeros(shape, c.dtype) for c in state.cache.v),
            pos=jnp.full((batch, k_max), -1, jnp.int32),
        )

    def _loop_step(
        self, params: Params, state: Any, carry: Any, tok_B: Array, pos_B: Array, i: Array
    ) -> tuple[Array, Any]:
        """Feed one token per row (pos -1: none): (logits [B, V], carry)."""
        if isinstance(carry, KVCache):
            out = forward_compute(self.config, params, tok_B[:, None], pos_B[:, None], carry)
            assert out.logits is not None
            cache = commit_kv(carry, pos_B[:, None], out.k, out.v, after=out.logits)
            return out.logits[:, 0], cache
        out = forward_compute(
            self.config, params, tok_B[:, None], pos_B[:, None], state.cache, extra=carry
        )
        carry = ExtraKV(
            k=tuple(_put(s, i, x) for s, x in zip(carry.k, out.k)),
            v=tuple(_put(s, i, x) for s, x in zip(carry.v, out.v)),
            pos=jax.lax.dynamic_update_slice_in_dim(carry.pos, pos_B[:, None], i, 1),
        )
        assert out.logits is not None
        return out.logits[:, 0], carry

    def _loop_end(self, state: Any, carry: Any, reads: Array) -> Any:
        """The state after the loop: what was fed (id_last, d_1, ...) is kept, and `rollback`
        trims the part verification rejects."""
        if isinstance(carry, KVCache):  # the steps wrote the cache: count what they fed
            fed = jnp.sum(carry.pos >= state.n_past[:, None], axis=1).astype(jnp.int32)
            return replace(state, cache=carry, n_past=state.n_past + fed)
        cache = commit_kv(
            state.cache,
            carry.pos,
            tuple(x.transpose(0, 2, 1, 3) for x in carry.k),
            tuple(x.transpose(0, 2, 1, 3) for x in carry.v),
            after=reads,
        )
        fed = jnp.sum(carry.pos >= 0, axis=1).astype(jnp.int32)
        return replace(state, cache=cache, n_past=state.n_past + fed)

    def begin(self, state: DraftSimpleState, history: TokenHistory) -> DraftSimpleState:
        del history
        return state

    def _evaluate(self, params: Params, cache: Any, tokens_BT: Array, positions_BT: Array) -> Any:
        """Write the K/V of `tokens` into the draft cache (no LM head)."""
        out = forward_compute(
            self.config, params, tokens_BT, positions_BT, cache, (self.config.L,), logits=False
        )
        return commit_kv(cache, positions_BT, out.k, out.v, after=out.hidden[0])

    def process(
        self, params: Params, state: DraftSimpleState, batch: TargetBatch
    ) -> DraftSimpleState:
        if not batch.is_prompt:
            return state  # verify rows: `draft` catches up from the history when needed
        cache = self._evaluate(params, state.cache, batch.tokens, batch.positions)
        n_past = jnp.maximum(state.n_past, jnp.max(batch.positions, axis=1) + 1)
        return replace(state, cache=cache, n_past=n_past.astype(jnp.int32))

    def accept(
        self, state: DraftSimpleState, n_accepted: Array, is_other: Array, active: Array
    ) -> DraftSimpleState:
        del n_accepted, is_other, active
        return state

    def rollback(self, state: DraftSimpleState, keep: Array) -> DraftSimpleState:
        return DraftSimpleState(
            cache=keep_prefix(state.cache, keep), n_past=jnp.minimum(state.n_past, keep)
        )

    def _catch_up(
        self, params: Params, state: DraftSimpleState, history: TokenHistory, rows_B: Array
    ) -> DraftSimpleState:
        """Evaluate history[n_past:length] of `rows` so the draft cache holds the prefix.

        Rows more than CATCH_UP tokens behind first catch up alone, CATCH_UP_ROW tokens per
        batch-1 forward (furthest behind first); then every row's last <= CATCH_UP tokens
        go in one batched forward. A row far behind thus costs its own tokens, not
        B * CATCH_UP per step for all rows."""
        S = history.tokens.shape[1]
        target_B = jnp.where(rows_B, history.length, state.n_past)
        W = CATCH_UP_ROW

        def far_cond(st: Any) -> Array:
            return jnp.any(target_B - st.n_past > CATCH_UP)

        def far_body(st: Any) -> Any:
            r = jnp.argmax(target_B - st.n_past).astype(jnp.int32)
            start = st.n_past[r]
            idx_T = start + jnp.arange(W, dtype=jnp.int32)
            ok_T = idx_T < target_B[r]
            tokens_1T = history.tokens[r, jnp.clip(idx_T, 0, S - 1)][None, :]
            positions_1T = jnp.where(ok_T, idx_T, -1)[None, :]
            row_cache = self._evaluate(params, self._row(st.cache, r), tokens_1T, positions_1T)
            cache = self._put_row(st.cache, row_cache, r)
            n_past = st.n_past.at[r].add(jnp.sum(ok_T).astype(jnp.int32))
            return replace(st, cache=cache, n_past=n_past)

        state = jax.lax.while_loop(far_cond, far_body, state)

        def behind(st: Any) -> Array:
            return jnp.any(st.n_past < target_B)

        def one_behind(st: Any) -> Array:
            return behind(st) & jnp.all(target_B - st.n_past <= 1)

        def body(width: int, st: Any) -> Any:
            idx_BT = st.n_past[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
            ok_BT = idx_BT < target_B[:, None]
            tokens = jnp.take_along_axis(history.tokens, jnp.clip(idx_BT, 0, S - 1), axis=1)
            positions = jnp.where(ok_BT, idx_BT, -1)
            cache = self._evaluate(params, st.cache, tokens, positions)
            n_past = st.n_past + jnp.sum(ok_BT, axis=1).astype(jnp.int32)
            return replace(st, cache=cache, n_past=n_past)

        # The usual case, a round after all k drafts were accepted (d_k was never fed), is
        # one token behind: a 1-wide forward (runs 0 or 1 times) instead of a CATCH_UP-wide.
        state = jax.lax.while_loop(one_behind, functools.partial(body, 1), state)
        return jax.lax.while_loop(behind, functools.partial(body, CATCH_UP), state)

    def draft(
        self, params: Params, state: DraftSimpleState, inp: DraftInput, k_max: int
    ) -> tuple[DraftSimpleState, DraftOutput]:
        B = inp.last_token.shape[0]
        V = self.target_vocab
        n_shared = min(V, self.config.V)

        def run(state: Any) -> tuple[Any, DraftOutput]:
            seed = inp.seed if inp.seed is not None else jnp.zeros((B,), jnp.int32)
            draft_seed = jnp.bitwise_xor(seed.astype(jnp.uint32), jnp.uint32(DRAFT_SEED_XOR))
            limit = jnp.minimum(inp.n_max, k_max)
            if inp.draft_n_max is not None:
                limit = jnp.minimum(limit, inp.draft_n_max)
            drafting = inp.drafting & (limit > 0)
            state = self._catch_up(params, state, inp.history, drafting)
            temp = inp.temperature.astype(jnp.float32)
            carry0 = self._loop_start(state, B, k_max)

            def cond(carry):
                i, _, _, alive, _, _, _, _, _ = carry
                return (i < k_max) & jnp.any(alive)

            def body(carry):
                i, model, tok, alive, n, tokens, valid, q, reads = carry
                pos = jnp.where(alive, inp.history.length + i, -1)
                logits, model = self._loop_step(params, state, model, tok, pos, i)
                logits = logits[:, :n_shared]
                # upstream clamps its top-k sampler to the vocabulary (a draft may have < 10)
                if self.probabilistic:
                    keys = sampling.make_keys(
                        draft_seed, inp.history.length + i + 1, sampling.ROLE_DRAFT
                    )
                    pick = draft_tokens.pick_draft_token(logits, self.top_k, temp, keys, q_width=V)
                    q = draft_tokens.record_q(i, pick, alive, q)
                else:
                    pick = draft_tokens.pick_draft_token(logits, self.top_k)
                alive, n, tokens, valid = draft_tokens.keep_draft_token(
                    i, pick, alive, n, tokens, valid, inp.p_min, limit
                )
                reads = reads + pick.top_vals[0, 0]
                return i + 1, model, pick.token, alive, n, tokens, valid, q, reads

            q0 = draft_tokens.zero_q(B, k_max, V, self.probabilistic)
            init = (
                jnp.zeros((), jnp.int32),
                carry0,
                inp.last_token.astype(jnp.int32),
                drafting,
                jnp.zeros((B,), jnp.int32),
                jnp.zeros((B, k_max), jnp.int32),
                jnp.zeros((B, k_max), bool),
                q0,
                jnp.zeros((), jnp.float32),  # depends on every step's reads of the cache
            )
            _, model, _, _, n, tokens, valid, q, reads = jax.lax.while_loop(cond, body, init)
            state = self._loop_end(state, model, reads)
            valid = valid & (n >= jnp.maximum(inp.n_min, 1))[:, None]
            out = DraftOutput(tokens=tokens, valid=valid, q=q if self.probabilistic else None)
            return state, out

        def skip(state: Any) -> tuple[Any, DraftOutput]:
            out = draft_tokens.empty_draft_q(B, k_max, V, self.probabilistic)
            return state, out

        # a loop run 0 or 1 times, not lax.cond: a cond's branches copy the draft's cache
        return run_once(jnp.any(inp.drafting), lambda c: run(c[0]), skip(state))


def _put(scratch_BGKE: Array, i: Array, new_BTGE: Array) -> Array:
    """Write one token's [B, 1, G, E] K or V into scratch slot i."""
    return jax.lax.dynamic_update_slice_in_dim(
        scratch_BGKE, new_BTGE.transpose(0, 2, 1, 3).astype(scratch_BGKE.dtype), i, 2
    )


def check_vocab_compatible(
    target_tok: Any, draft_tok: Any, n_vocab_tgt: int, n_vocab_dft: int
) -> None:
    """llama.cpp's `common_speculative_are_compatible`; raises VocabMismatchError with the reason."""
    if getattr(target_tok, "vocab_type", None) != getattr(draft_tok, "vocab_type", None):
        raise VocabMismatchError(
            f"draft vocab type {getattr(draft_tok, 'vocab_type', None)!r} differs from the "
            f"target's {getattr(target_tok, 'vocab_type', None)!r}"
        )
    for special in ("bos", "eos"):
        add_t = bool(getattr(target_tok, f"add_{special}", False))
        add_d = bool(getattr(draft_tok, f"add_{special}", False))
        id_t = getattr(target_tok, f"{special}_id", None)
        id_d = getattr(draft_tok, f"{special}_id", None)
        if add_t != add_d or (add_t and id_t != id_d):
            raise VocabMismatchError(
                f"draft {special.upper()} settings (add={add_d}, id={id_d}) differ from the "
                f"target's (add={add_t}, id={id_t})"
            )
    if abs(n_vocab_tgt - n_vocab_dft) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        raise VocabMismatchError(
            f"draft vocab size {n_vocab_dft} differs from the target's {n_vocab_tgt} by more "
            f"than {SPEC_VOCAB_MAX_SIZE_DIFFERENCE}"
        )
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(n_vocab_tgt, n_vocab_dft)):
        t, d = target_tok.token_text(i), draft_tok.token_text(i)
        if t != d:
            raise VocabMismatchError(
                f"draft token {i} is {d!r} but the target's token {i} is {t!r}"
            )


# --------------------------------------------------------------------------------------------
# A recurrent (qwen35) draft model

#: Columns of `RecurrentDraftState.rollbacks`.
DRAFT_ROLLBACK_PATHS = ("rs_plane", "checkpoint", "rebuilt")


@pytree_dataclass
class RecurrentDraftState:
    cache: HybridMemory
    n_past: Array  # [B] int32: the draft memory holds positions 0..n_past-1
    rollbacks: Array  # [B, 3] int32: rounds per DRAFT_ROLLBACK_PATHS


@dataclasses.dataclass(frozen=True)
class DraftSimpleRecurrent(DraftSimple):
    """`DraftSimple` over a qwen35 draft model (same protocol, same drafting rule)."""

    name: ClassVar[str] = "draft-simple"

    config: qwen35.Qwen35Config  # type: ignore[assignment]
    #: snapshot planes of the draft context (0: FULL, upstream's draft contexts)
    n_rs_seq: int = 0

    def __post_init__(self) -> None:
        if self.n_rs_seq < 0:
            raise ValueError(f"draft context n_rs_seq must be >= 0, got {self.n_rs_seq}")

    def init(self, batch: int, capacity: int) -> RecurrentDraftState:  # type: ignore[override]
        return RecurrentDraftState(
            cache=HybridMemory.init(self.config, batch, capacity, self.n_rs_seq),
            n_past=jnp.zeros((batch,), jnp.int32),
            rollbacks=jnp.zeros((batch, len(DRAFT_ROLLBACK_PATHS)), jnp.int32),
        )

    # -- memory hooks
    def _evaluate(
        self, params: Params, cache: HybridMemory, tokens_BT: Array, positions_BT: Array
    ) -> HybridMemory:
        """Feed tokens (no LM head use, no per-position states: see the module docstring)."""
        conv, ssm = cache.rec.current()
        state = qwen35.Qwen35State(kv=cache.kv, conv=conv, ssm=ssm)
        out = qwen35.forward(self.config, params, tokens_BT, positions_BT, state)
        rec = cache.rec.advance(out.conv_inputs, (), out.state.ssm, positions_BT, after=out.logits)
        return HybridMemory(kv=out.state.kv, rec=rec)

    def _row(self, cache: HybridMemory, r: Array) -> HybridMemory:
        return HybridMemory(kv=super()._row(cache.kv, r), rec=cache.rec.take_row(r))

    def _put_row(self, cache: HybridMemory, row_cache: HybridMemory, r: Array) -> HybridMemory:
        return HybridMemory(
            kv=super()._put_row(cache.kv, row_cache.kv, r),
            rec=cache.rec.put_row(r, row_cache.rec),
        )

    def _loop_start(self, state: RecurrentDraftState, batch: int, k_max: int) -> HybridMemory:
        del batch, k_max
        return state.cache

    def _loop_step(
        self,
        params: Params,
        state: RecurrentDraftState,
        carry: HybridMemory,
        tok_B: Array,
        pos_B: Array,
        i: Array,
    ) -> tuple[Array, HybridMemory]:
        del state, i
        logits, carry = forward_memory(self.config, params, tok_B[:, None], pos_B[:, None], carry)
        return logits[:, 0], carry

    def _loop_end(
        self, state: RecurrentDraftState, carry: HybridMemory, reads: Array
    ) -> RecurrentDraftState:
        del reads  # the loop wrote its own carry: no read of the old memory to order after
        pre = state.cache
        fed = jnp.maximum(carry.rec.pos + 1 - state.n_past, 0).astype(jnp.int32)
        keep_fed = fed <= self.n_rs_seq
        rec = select_recurrent(keep_fed, carry.rec, pre.rec)
        drop = ~keep_fed[:, None] & (carry.kv.pos >= state.n_past[:, None])
        kv = replace(carry.kv, pos=jnp.where(drop, EMPTY_POS, carry.kv.pos))
        restored = ~keep_fed & (fed > 0)
        return replace(
            state,
            cache=HybridMemory(kv=kv, rec=rec),
            n_past=jnp.where(keep_fed, state.n_past + fed, state.n_past).astype(jnp.int32),
            rollbacks=state.rollbacks.at[:, 1].add(restored.astype(jnp.int32)),
        )

    def rollback(self, state: RecurrentDraftState, keep: Array) -> RecurrentDraftState:  # type: ignore[override]
        need = state.n_past > keep
        mem, ok = state.cache.seq_rm_rows(need, keep, -1)
        failed = need & ~ok
        mem, _ = mem.seq_rm_rows(failed, 0, -1)  # clear: catch-up re-feeds the row
        n_past = jnp.where(failed, 0, jnp.where(need, keep, state.n_past))
        counts = jnp.stack([need & ok, jnp.zeros_like(need), failed], axis=1)
        return replace(
            state,
            cache=mem,
            n_past=n_past.astype(jnp.int32),
            rollbacks=state.rollbacks + counts.astype(jnp.int32),
        )
