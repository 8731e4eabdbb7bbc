"""What the feature-head drafters (draft-eagle3 `specjax.drafters.eagle3`, draft-dflash /
draft-dspark `specjax.drafters.dflash`) share: `FeatureHeadDrafter`, their base.

A feature-head drafter reads the target's hidden rows at its head's `target_layers` in
`process` (`reads_target_hidden`), keeps them in its own KV cache, and in a round in which no
row drafts logs the one row per batch `record` sees (`LOG_ROWS` per row) for a later batched
`flush` (`idle_record`). Its parameters are `{"head", "shared"}`: the head's own and the
target weights it borrows (`head_params`; on CPU the head in `head_kernel_params`' form).

`PendingBoundary` is the boundary of a drafter that pairs the next token with a pending
target row (draft-eagle3's `pending_g`, draft-mtp's `pending_h`): its update from a verify
batch, `accept`, and its checkpoint form (upstream's blob).

Invariants: the state of a `FeatureHeadDrafter` has `cache` (the head's KV), `log_pos`
[B, LOG_ROWS] (-1 = empty slot) and `log_n` [B]; `flush_log` empties the log after writing it,
`rollback` drops cache cells and logged rows at positions >= keep. The state of a
`PendingBoundary` drafter has `pending_pos`, `verify_pos_first`, `verify_rows` and the two
vector fields its class names (`PENDING`, `VERIFY`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.control import run_once
from specjax.drafters.base import (
    Drafter,
    TargetBatch,
    TokenHistory,
    boundary_blob,
    read_boundary_blob,
)
from specjax.drafters.draft_tokens import DRAFT_TOP_K
from specjax.memory.kv import KVCache, keep_prefix
from specjax.pytree import replace
from specjax.types import Array

#: Rows `record` keeps per row before `flush` writes them (one batched pass per LOG_ROWS
#: idle rounds).
LOG_ROWS = 32

S = TypeVar("S")


class FirstRow(NamedTuple):
    """The first evaluated row of each batch row (what `record` logs)."""

    has: Array  # [B] bool, the row evaluated a token
    beg: Array  # [B, 1] int32, its column
    pos: Array  # [B] int32, its position
    hidden: dict[int, Array]  # {layer: [B, 1, Dt]} the target's features at it


@dataclasses.dataclass(frozen=True)
class FeatureHeadDrafter(Drafter):
    """Base of the drafters of a feature head: the head's config, the target layers it
    reads, the draft width and the top-k, the checks against the target, the parameters,
    and the log `record` keeps (see the module docstring)."""

    reads_target_hidden: ClassVar[bool] = True
    params_form: ClassVar[str] = "head"
    #: `process` must see every verify batch; in a round no row may draft, `record` keeps it
    idle_record: ClassVar[bool] = True
    #: the head's model module (`shared_weights`, `kernel_params`) and its name in errors
    head_module: ClassVar[Any]
    KIND: ClassVar[str] = "head"

    config: Any
    #: target layer ids whose inputs `process` reads (the head's target_layers)
    hidden_layers: tuple[int, ...] = dataclasses.field()
    #: the longest draft this drafter produces (static: part of the chain's draft width)
    max_draft_len: int = dataclasses.field()
    top_k: int = DRAFT_TOP_K

    @classmethod
    def head_config(cls, draft: Any, target: Any, config_type: type, arch: str) -> Any:
        """The draft model's head config (a `config_type`, of architecture `arch` as the
        error names it), checked against the target (`check_target`)."""
        if draft is None:
            article = "an" if cls.KIND[0] in "AEIOU" else "a"
            raise ValueError(f"{cls.name} needs {article} {cls.KIND} head (-md/--spec-draft-model)")
        cfg = draft.config
        if not isinstance(cfg, config_type):
            raise ValueError(
                f"{cls.name} needs a draft model of architecture {arch}, got "
                f"{getattr(cfg, 'arch', type(cfg).__name__)!r}"
            )
        cls.check_target(cfg, target.config)
        return cfg

    @classmethod
    def check_target(cls, cfg: Any, target_config: Any) -> None:
        """ValueError when the head cannot read this target: feature width, layer ids or
        vocabulary differ."""
        tc = target_config
        if cfg.target_hidden != tc.D:
            raise ValueError(
                f"{cls.KIND} head expects target hidden size {cfg.target_hidden}, the target "
                f"has {tc.D}"
            )
        for layer in cfg.target_layers:
            if layer > tc.L:
                raise ValueError(
                    f"{cls.KIND}: target layer id {layer} exceeds target n_layer {tc.L}"
                )
        if cfg.V != tc.V:
            raise ValueError(f"{cls.KIND} head vocabulary {cfg.V} differs from the target's {tc.V}")

    @classmethod
    def head_params(cls, cfg: Any, draft: Any, target: Any) -> dict[str, Any]:
        """`{"head": the head's parameters, "shared": the target weights it borrows}`."""
        shared = cls.head_module.shared_weights(cfg, target.params, target.config.tie_embeddings)
        return {"head": draft.params, "shared": shared}

    @classmethod
    def head_kernel_params(cls, head: Any) -> Any:
        """The head's products as `KernelWeight`s (the head module's `kernel_params`)."""
        return cls.head_module.kernel_params(head)

    def begin(self, state: S, history: TokenHistory) -> S:
        del history  # upstream only warns when process() missed a prefill chunk
        return state

    @staticmethod
    def flush_log(state: S, write: Callable[[S], KVCache]) -> S:
        """`write(state)` (the logged rows into the cache) when a row has logged any, then
        the log emptied (a loop run 0 or 1 times: nothing when the log is empty)."""

        def apply(state: Any) -> Any:
            return replace(
                state,
                cache=write(state),
                log_pos=jnp.full_like(state.log_pos, -1),
                log_n=jnp.zeros_like(state.log_n),
            )

        return run_once(jnp.any(state.log_n > 0), apply, state)  # type: ignore[attr-defined]

    def flush_if_full(self, params: Any, state: S) -> S:
        """`flush` when some row's log is full (before `record` logs another row)."""
        full = jnp.any(state.log_n >= LOG_ROWS)  # type: ignore[attr-defined]
        return run_once(full, lambda s: self.flush(params, s), state)  # type: ignore[attr-defined]

    @staticmethod
    def first_row(batch: TargetBatch) -> FirstRow:
        """Each row's first evaluated token of `batch`: whether it has one, its column and
        position, and the target's features there."""
        pos = batch.positions.astype(jnp.int32)
        valid = pos >= 0
        beg = jnp.argmax(valid, axis=1).astype(jnp.int32)[:, None]
        hidden = {
            i: jnp.take_along_axis(h, beg[..., None], axis=1) for i, h in batch.hidden.items()
        }
        pos_beg = jnp.take_along_axis(pos, beg, axis=1)[:, 0]
        return FirstRow(jnp.any(valid, axis=1), beg, pos_beg, hidden)

    def rollback(self, state: S, keep: Array) -> S:
        log_pos = state.log_pos  # type: ignore[attr-defined]
        log_pos = jnp.where(log_pos >= keep[:, None], -1, log_pos)
        cache = keep_prefix(state.cache, keep)  # type: ignore[attr-defined]
        return replace(state, cache=cache, log_pos=log_pos)


class BatchSpan(NamedTuple):
    """Each row's evaluated columns of a target batch (valid positions are contiguous)."""

    has: Array  # [B] bool, the row evaluated a token
    beg: Array  # [B] int32, first evaluated column
    end: Array  # [B] int32, last evaluated column
    pos_beg: Array  # [B] its position
    pos_end: Array  # [B]


def batch_span(batch: TargetBatch) -> BatchSpan:
    """`BatchSpan` of `batch` (rows without a valid position: has False, columns 0 / T-1)."""
    pos = batch.positions
    T = pos.shape[1]
    valid = pos >= 0
    beg = jnp.argmax(valid, axis=1).astype(jnp.int32)
    end = (T - 1 - jnp.argmax(valid[:, ::-1], axis=1)).astype(jnp.int32)
    pos_beg = jnp.take_along_axis(pos, beg[:, None], axis=1)[:, 0]
    pos_end = jnp.take_along_axis(pos, end[:, None], axis=1)[:, 0]
    return BatchSpan(jnp.any(valid, axis=1), beg, end, pos_beg, pos_end)


class PendingBoundary:
    """The boundary a drafter pairs its next row with (draft-eagle3: `pending_g`, the
    encoded target features; draft-mtp: `pending_h`, the target's h_nextn): per row
    `pending_pos` [B] int32 (-1 = none yet) and the vector field named `PENDING` [B, D]
    float32, plus the snapshot of the last verify batch's vectors, `VERIFY` [B, S, D] with
    `verify_pos_first` and `verify_rows`, from which `accept` moves the boundary to the last
    accepted row.

    Its checkpoint form (`get_state` / `set_state` / `spec_state` / `set_spec_state`) is
    upstream's blob: little-endian int32 position then D float32 (`base.boundary_blob`);
    `get_state` gives None without a boundary, `set_state` ignores a blob of the wrong
    size."""

    PENDING: ClassVar[str]
    VERIFY: ClassVar[str]
    config: Any

    def snapshot(self, state: S, span: BatchSpan, vec_BTD: Array, **changes: Any) -> S:
        """`state` after a verify batch whose rows' vectors are `vec_BTD` [B, T, D]: the
        boundary at each row's last evaluated column, the snapshot from its first (rows
        without a token keep theirs); `changes`: other fields to replace."""
        has, beg, end = span.has, span.beg, span.end
        T = vec_BTD.shape[1]
        old = getattr(state, self.VERIFY)
        idx = jnp.clip(beg[:, None] + jnp.arange(T)[None, :], 0, T - 1)
        rows = jnp.take_along_axis(vec_BTD, idx[..., None], axis=1)[:, : old.shape[1]]
        new = jax.lax.dynamic_update_slice_in_dim(old, rows, 0, axis=1)
        last = jnp.take_along_axis(vec_BTD, end[:, None, None], axis=1)[:, 0]
        st: Any = state
        return replace(
            state,
            pending_pos=jnp.where(has, span.pos_end, st.pending_pos).astype(jnp.int32),
            verify_pos_first=jnp.where(has, span.pos_beg, st.verify_pos_first).astype(jnp.int32),
            verify_rows=jnp.where(has, end - beg + 1, st.verify_rows).astype(jnp.int32),
            **{
                self.PENDING: jnp.where(has[:, None], last, getattr(state, self.PENDING)),
                self.VERIFY: jnp.where(has[:, None, None], new, old),
            },
            **changes,
        )

    def accept(self, state: S, n_accepted: Array, is_other: Array, active: Array) -> S:
        """The boundary moved to each active row's last accepted snapshot row."""
        del is_other  # upstream moves the boundary whoever drafted
        st: Any = state
        rows = active & (st.verify_rows > 0)
        i = jnp.maximum(jnp.minimum(n_accepted, st.verify_rows - 1), 0).astype(jnp.int32)
        vec_i = jnp.take_along_axis(getattr(state, self.VERIFY), i[:, None, None], axis=1)[:, 0]
        return replace(
            state,
            pending_pos=jnp.where(rows, st.verify_pos_first + i, st.pending_pos),
            **{self.PENDING: jnp.where(rows[:, None], vec_i, getattr(state, self.PENDING))},
        )

    def get_state(self, state: Any, row: int) -> bytes | None:
        vector = np.asarray(getattr(state, self.PENDING))[row]
        return boundary_blob(int(np.asarray(state.pending_pos)[row]), vector)

    def spec_state(self, state: Any) -> dict[str, Array]:
        """Every row's boundary (the traced form of `get_state`: a checkpoint's data_spec)."""
        return {"pending_pos": state.pending_pos, self.PENDING: getattr(state, self.PENDING)}

    def set_spec_state(self, state: S, saved: dict[str, Array], rows_B: Array) -> S:
        """Restore the boundary of the rows `rows_B` from `spec_state`'s data."""
        old_pos = state.pending_pos  # type: ignore[attr-defined]
        old = getattr(state, self.PENDING)
        return replace(
            state,
            pending_pos=jnp.where(rows_B, saved["pending_pos"], old_pos),
            **{self.PENDING: jnp.where(rows_B[:, None], saved[self.PENDING], old)},
        )

    def set_state(self, state: S, row: int, blob: bytes) -> S:
        """Restore one row's boundary from `get_state`'s blob; a wrong-sized blob is ignored."""
        read = read_boundary_blob(blob, self.config.D)
        if read is None:
            return state
        pos, vector = read
        return replace(
            state,
            pending_pos=state.pending_pos.at[row].set(pos),  # type: ignore[attr-defined]
            **{self.PENDING: getattr(state, self.PENDING).at[row].set(vector)},
        )
