"""draft-simple with a recurrent draft model (qwen35 hybrid): the draft context's rollback rule.

A qwen35 draft model's memory is a `HybridMemory`: attention KV cells (PART: a tail can be
dropped) beside delta-net states, which cannot drop a tail unless snapshot planes cover it.
llama.cpp's server applies the target's checkpoint rule to the draft context too (spec 3.3,
7.3): a FULL draft context is checkpointed before drafting and restored after it (`load_dft`,
then `seq_rm(ctx_dft, pos_max + 1, -1)`); an RS one is checkpointed only when the draft is
longer than its `n_rs_seq` (`use_ckpt_dft = dft == RS && |draft| > n_rs_seq(dft)`). Upstream
creates draft contexts with n_rs_seq = 0, so they are FULL; `n_rs_seq` here defaults to that.

Invariants (on top of `DraftSimple`'s: the memory holds positions 0..n_past[b]-1, catch-up
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
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.drafters.draft_simple import DraftSimple
from specjax.hybrid_memory import HybridMemory, forward_memory, select_recurrent
from specjax.models import qwen35
from specjax.pytree import pytree_dataclass, replace
from specjax.types import EMPTY_POS, Array, Params

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
        rec = cache.rec.advance((), (), out.state.conv, out.state.ssm, positions_BT)
        return HybridMemory(kv=out.state.kv, rec=rec)

    def _row(self, cache: HybridMemory, r: Array) -> HybridMemory:
        def rows(x: Array, axis: int) -> Array:
            return jax.lax.dynamic_slice_in_dim(x, r, 1, axis)

        rec = cache.rec
        return HybridMemory(
            kv=super()._row(cache.kv, r),
            rec=replace(
                rec,
                conv=tuple(rows(c, 1) for c in rec.conv),
                ssm=tuple(rows(s, 1) for s in rec.ssm),
                pos=rows(rec.pos, 0),
                rs_idx=rows(rec.rs_idx, 0),
            ),
        )

    def _put_row(self, cache: HybridMemory, row_cache: HybridMemory, r: Array) -> HybridMemory:
        def put(x: Array, y: Array, axis: int) -> Array:
            return jax.lax.dynamic_update_slice_in_dim(x, y, r, axis)

        rec, new = cache.rec, row_cache.rec
        return HybridMemory(
            kv=super()._put_row(cache.kv, row_cache.kv, r),
            rec=replace(
                rec,
                conv=tuple(put(c, n, 1) for c, n in zip(rec.conv, new.conv)),
                ssm=tuple(put(s, n, 1) for s, n in zip(rec.ssm, new.ssm)),
                pos=put(rec.pos, new.pos, 0),
                rs_idx=put(rec.rs_idx, new.rs_idx, 0),
            ),
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
