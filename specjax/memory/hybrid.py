"""llama.h memory for a hybrid recurrent target (qwen35): recurrent state with `n_rs_seq`
snapshot planes, the attention KV cache beside it, and the NO / PART / FULL / RS probe.

Written from llama.cpp's `src/llama-memory-recurrent.cpp`, `llama-memory-hybrid.cpp`,
`models/delta-net-base.cpp` and `common_context_can_seq_rm` (spec sections 2 and 3.1).

`RecurrentMemory` (one cell per row; row b is llama.cpp's sequence b), written in place:
* `count [B]`: tokens the row consumed since it was empty (net of the rollbacks a forward
  took up); the state after c of them is what the planes below give at count c.
* `ssm[j]` [P, B, Hv, S, S] for the j-th delta-net layer, P = 1 + n_rs_seq planes in a ring:
  the SSM state after c tokens is at slot c mod P (zero at c = 0), so plane d, the state d
  tokens before the row's last consumed token, is slot (count - d) mod P (`in_order`).
* `conv[j]` [d_conv - 1 + n_rs_seq, B, C]: the conv inputs of the row's last tokens, token
  c (from 0) at slot c mod (d_conv - 1 + n_rs_seq); the conv window after c tokens is
  the inputs of tokens c - d_conv + 1 .. c - 1 (zero before the first), so a rollback of up
  to n_rs_seq tokens finds its window without a plane of its own.
* A forward over n valid tokens of a row starts from its state at count - rs_idx and writes
  the states after each of its last P tokens and the inputs of its last d_conv - 1 +
  n_rs_seq, in their slots; nothing else moves. Plane d is thus the state d tokens earlier
  whatever the batch sizes were. (Upstream's op leaves planes >= n_tokens stale; the two
  agree on every plane a bounded rollback after a verify batch reads, d < n_tokens.)
  A fresh or removed row reads as zeros (count 0): removal writes no state.
* `pos [B]`: the position of the row's tail (last consumed token), -1 = empty row.
* `rs_idx [B]`: a pending rollback (0 = none). The next forward that consumes tokens of the
  row reads its input state from plane rs_idx and resets it to 0 (llama.cpp's `s_copy`).
* `seq_rm(seq, p0, p1)` follows upstream exactly (p0 < 0 -> 0, p1 < 0 -> inf):
  - seq < 0: only "everything" or an empty range succeed (everything clears every row);
  - seq >= B: ok = False;
  - [0, inf): the row is cleared and rs_idx reset (other clears keep a pending rs_idx, as
    upstream; a cleared row reads zeros from every plane);
  - a partial tail removal `0 < p0 <= pos < p1` sets rs_idx = r = pos - p0 + 1 and pos =
    p0 - 1 iff no rollback is pending and 1 <= r <= n_rs_seq; otherwise ok = False and
    nothing changes;
  - a range holding the tail but starting at 0 clears the row; a range not holding the tail
    changes nothing and succeeds.
* `seq_cp` gives dst a copy of src's states, count, pos and pending rollback (upstream
  shares the cell; here the rows then evolve independently), whatever the range; `seq_keep`
  clears the other rows; `seq_add` / `seq_div` move the tail position only (as upstream).
* `checkpoint` / `load`: llama.cpp's PARTIAL_ONLY state of every row (its current state
  and tail) and its load into chosen rows, which writes that one state (upstream's load
  leaves the other planes as they were).

`HybridMemory` = attention `KVCache` (PART) + `RecurrentMemory`, as `llama_memory_hybrid`:
`seq_rm` tries the recurrent part first and touches the KV cache only where it succeeded;
`seq_pos_min` is the max of the parts' minima, `seq_pos_max` the min of their maxima;
`can_shift` is False (qwen35's partial RoPE keys are not re-rotated).

Every function is pure and jittable; sequence ids and positions may be traced scalars (or,
for `seq_rm_rows`, per-row [B] arrays).
"""

from __future__ import annotations

import enum
import functools
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import numpy as np

from specjax.memory import ops as kv_memory
from specjax.memory.kv import KVCache
from specjax.models import qwen35
from specjax.models.llama import forward_fn, new_cache
from specjax.pytree import pytree_dataclass, replace, static_field
from specjax.types import EMPTY_POS, Array, Params, alias, axis_size

_POS_INF = np.iinfo(np.int32).max
IntLike = int | Array


class SeqRmType(enum.IntEnum):
    """`common_context_seq_rm_type` (values as upstream)."""

    NO = 0
    PART = 1
    FULL = 2
    RS = 3


def _i32(x: IntLike) -> Array:
    return jnp.asarray(x, jnp.int32)


def _bounds(p0: IntLike, p1: IntLike) -> tuple[Array, Array]:
    p0 = _i32(p0)
    p1 = _i32(p1)
    return jnp.where(p0 < 0, 0, p0), jnp.where(p1 < 0, _POS_INF, p1)


def _rows(mask_B: Array, new: Array, old: Array, axis: int) -> Array:
    """Select along the row axis `axis` of `new` / `old`."""
    shape = [1] * new.ndim
    shape[axis] = mask_B.shape[0]
    return jnp.where(mask_B.reshape(shape), new, old)


# ----------------------------------------------------------------------------- recurrent part
class SavedState(NamedTuple):
    """One recurrent state per row (llama.cpp's PARTIAL_ONLY state of a hybrid memory): per
    delta-net layer the conv window [B, d_conv - 1, C] and the SSM state [B, Hv, S, S], and
    the tail position [B]."""

    conv: tuple[Array, ...]
    ssm: tuple[Array, ...]
    pos: Array


@pytree_dataclass
class RecurrentMemory:
    conv: tuple[Array, ...]  # per delta-net layer [d_conv - 1 + n_rs_seq, B, C] float32
    ssm: tuple[Array, ...]  # per delta-net layer [P, B, Hv, S, S] float32
    pos: Array  # [B] int32, tail position, -1 = empty
    rs_idx: Array  # [B] int32, pending rollback plane (0 = none)
    count: Array  # [B] int32, tokens consumed since the row was empty
    n_rs_seq: int = static_field()
    window: int = static_field()  # d_conv - 1

    batch = axis_size("pos", 0)

    @property
    def n_planes(self) -> int:
        return self.n_rs_seq + 1

    @property
    def n_inputs(self) -> int:
        """Conv inputs kept per row: a window, and the n_rs_seq before it."""
        return self.window + self.n_rs_seq

    @staticmethod
    def init(config: qwen35.Qwen35Config, batch: int, n_rs_seq: int = 0) -> RecurrentMemory:
        if n_rs_seq < 0:
            raise ValueError(f"n_rs_seq must be >= 0, got {n_rs_seq}")
        P, n_rec = n_rs_seq + 1, len(config.recurrent_layers)
        W, C = config.ssm_conv_kernel - 1, config.conv_dim
        return RecurrentMemory(
            conv=tuple(jnp.zeros((W + n_rs_seq, batch, C), jnp.float32) for _ in range(n_rec)),
            ssm=tuple(
                jnp.zeros((P, batch, config.Hv, config.S, config.S), jnp.float32)
                for _ in range(n_rec)
            ),
            pos=jnp.full((batch,), EMPTY_POS, jnp.int32),
            rs_idx=jnp.zeros((batch,), jnp.int32),
            count=jnp.zeros((batch,), jnp.int32),
            n_rs_seq=n_rs_seq,
            window=W,
        )

    # -- states at a token count
    def _windows(self, count_B: Array) -> tuple[Array, ...]:
        """Per layer [B, W, C]: the conv inputs of tokens count - W .. count - 1 (zeros
        before the row's first)."""
        # (gathered slot-major, as the ring: the forward's concatenation along the window
        # wants that layout too, so the transpose moves nothing)
        idx_WB = count_B[None] - self.window + jnp.arange(self.window)[:, None]
        rows = jnp.arange(self.batch)[None]
        return tuple(
            jnp.where((idx_WB >= 0)[..., None], c[idx_WB % self.n_inputs, rows], 0.0).transpose(
                1, 0, 2
            )
            for c in self.conv
        )

    def _states(self, count_B: Array) -> tuple[Array, ...]:
        """Per layer [B, Hv, S, S]: the SSM state after `count_B` tokens (zero at 0)."""
        slot, rows = count_B % self.n_planes, jnp.arange(self.batch)
        empty = (count_B <= 0).reshape((-1, 1, 1, 1))
        return tuple(jnp.where(empty, 0.0, s[slot, rows]) for s in self.ssm)

    def _input_count(self) -> Array:
        """[B]: the tokens behind the next forward's input state (a row cleared with a
        rollback pending has none)."""
        return jnp.maximum(self.count - self.rs_idx, 0)

    def current(self) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
        """(conv window, ssm) per layer [B, ...]: each row's state rs_idx tokens before its
        last consumed one (its input state)."""
        count = self._input_count()
        return self._windows(count), self._states(count)

    def in_order(self) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
        """(conv windows, ssm) per layer [P, B, ...]: at index d the state d tokens before
        the row's last consumed token (a gather: for readers of the history)."""
        windows = [self._windows(self.count - d) for d in range(self.n_planes)]
        states = [self._states(self.count - d) for d in range(self.n_planes)]
        return tuple(map(jnp.stack, zip(*windows))), tuple(map(jnp.stack, zip(*states)))

    def checkpoint(self) -> SavedState:
        """Every row's current state and tail (llama.cpp's PARTIAL_ONLY `state_seq_get`)."""
        conv, ssm = self.current()
        return SavedState(conv=conv, ssm=ssm, pos=self.pos)

    def load(self, rows_B: Array, saved: SavedState) -> Self:
        """The rows `rows_B` take `saved`'s state as their current one and its position as
        their tail, no rollback pending (llama.cpp's `state_seq_set`, which resets rs_idx).
        As upstream's, which writes the current plane only, their earlier states are not
        restored: a rollback right after a load reads what the planes held. Writes one
        state per row, in place."""
        W = self.window
        # (a count of pos + 1, at least a window: no part of the state reads as "before
        # the row's first token")
        count = jnp.where(rows_B, jnp.maximum(saved.pos + 1, W), self.count).astype(jnp.int32)
        rows = jnp.arange(self.batch)
        idx_BW = count[:, None] - W + jnp.arange(W)[None]
        past_W = self.n_inputs + jnp.arange(W)[None]  # past the ring: dropped
        slot_BW = jnp.where(rows_B[:, None], idx_BW % self.n_inputs, past_W)
        slot_B = jnp.where(rows_B, count % self.n_planes, self.n_planes)

        def put_window(ring: Array, window: Array) -> Array:
            return ring.at[slot_BW, rows[:, None]].set(window, mode="drop", unique_indices=True)

        def put_state(planes: Array, state: Array) -> Array:  # (as `advance` writes them)
            return planes.at[slot_B[None], rows[None]].set(
                state[None], mode="drop", unique_indices=True
            )

        return replace(
            self,
            conv=tuple(put_window(r, w) for r, w in zip(self.conv, saved.conv)),
            ssm=tuple(put_state(p, s) for p, s in zip(self.ssm, saved.ssm)),
            pos=jnp.where(rows_B, saved.pos, self.pos).astype(jnp.int32),
            rs_idx=jnp.where(rows_B, 0, self.rs_idx).astype(jnp.int32),
            count=count,
        )

    def row_state_shapes(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """(conv, ssm): per layer the shape of one row's state, a `SavedState` row: the conv
        window (W, C) and the SSM state (Hv, S, S)."""
        conv = tuple((self.window, c.shape[2]) for c in self.conv)  # (rows on axis 1)
        return conv, tuple(tuple(s.shape[2:]) for s in self.ssm)

    def take_row(self, row: Array) -> Self:
        """Row `row` as a one-row memory."""

        def take(x: Array, axis: int) -> Array:
            return jax.lax.dynamic_slice_in_dim(x, row, 1, axis)

        return replace(
            self,
            conv=tuple(take(c, 1) for c in self.conv),
            ssm=tuple(take(s, 1) for s in self.ssm),
            pos=take(self.pos, 0),
            rs_idx=take(self.rs_idx, 0),
            count=take(self.count, 0),
        )

    def put_row(self, row: Array, new: RecurrentMemory) -> Self:
        """The memory with row `row` replaced by the one-row memory `new`."""

        def put(x: Array, y: Array, axis: int) -> Array:
            return jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), row, axis)

        return replace(
            self,
            conv=tuple(put(c, n, 1) for c, n in zip(self.conv, new.conv)),
            ssm=tuple(put(s, n, 1) for s, n in zip(self.ssm, new.ssm)),
            pos=put(self.pos, new.pos, 0),
            rs_idx=put(self.rs_idx, new.rs_idx, 0),
            count=put(self.count, new.count, 0),
        )

    def _clear_rows(self, clear_B: Array, reset_B: Array | None = None) -> Self:
        """Empty the rows `clear_B` (no tail, no tokens: they read zero states, and nothing
        is written); reset rs_idx where `reset_B` (upstream resets it only for a
        whole-sequence removal and `clear`)."""
        reset_B = clear_B if reset_B is None else reset_B
        return replace(
            self,
            pos=jnp.where(clear_B, EMPTY_POS, self.pos),
            rs_idx=jnp.where(reset_B, 0, self.rs_idx),
            count=jnp.where(clear_B, 0, self.count),
        )

    # -- llama.h API
    def seq_rm_rows(self, rows_B: Array, p0: IntLike, p1: IntLike) -> tuple[Self, Array]:
        """`seq_rm(b, p0, p1)` for every row b with rows_B[b] (p0 / p1 scalars or [B]).

        Returns (memory, ok [B]); rows not selected report True and are untouched."""
        lo, hi = _bounds(p0, p1)
        rm_all = (lo == 0) & (hi == _POS_INF)
        has_tail = self.pos >= 0
        partial = has_tail & (lo > 0) & (lo <= self.pos) & (hi > self.pos)
        r = self.pos - (lo - 1)
        rs_ok = partial & (self.rs_idx == 0) & (r >= 1) & (r <= self.n_rs_seq)
        clear = rows_B & ~partial & (rm_all | (has_tail & (lo <= self.pos) & (self.pos < hi)))
        out = self._clear_rows(clear, rows_B & rm_all)
        roll = rows_B & rs_ok
        out = replace(
            out,
            rs_idx=jnp.where(roll, r, out.rs_idx).astype(jnp.int32),
            pos=jnp.where(roll, lo - 1, out.pos).astype(jnp.int32),
        )
        ok_B = ~rows_B | ~partial | rs_ok
        return out, ok_B

    def seq_rm(self, seq: IntLike, p0: IntLike, p1: IntLike) -> tuple[Self, Array]:
        _check_seq(self.batch, seq, allow_all=True)
        B = self.batch
        seq_a = _i32(seq)
        lo, hi = _bounds(p0, p1)
        # seq < 0: the range must be everything (clears all rows) or nothing
        all_ok = (lo == hi) | ((lo == 0) & (hi == _POS_INF))
        everything = (lo == 0) & (hi == _POS_INF)
        cleared = self._clear_rows(jnp.broadcast_to(everything, (B,)))
        one, ok_B = self.seq_rm_rows(jnp.arange(B) == seq_a, p0, p1)
        neg = seq_a < 0
        out = jax.tree.map(lambda a, b: jnp.where(neg, a, b), cleared, one)
        ok = jnp.where(neg, all_ok, (seq_a < B) & jnp.all(ok_B))
        return out, ok

    def seq_cp(self, src: IntLike, dst: IntLike, p0: IntLike, p1: IntLike) -> Self:
        del p0, p1  # upstream ignores the range for recurrent cells
        _check_seq(self.batch, src, "src")
        _check_seq(self.batch, dst, "dst")
        B = self.batch
        src_a, dst_a = _i32(src), _i32(dst)
        valid = (src_a >= 0) & (src_a < B) & (dst_a >= 0) & (dst_a < B) & (src_a != dst_a)
        to_B = (jnp.arange(B) == dst_a) & valid
        s = jnp.clip(src_a, 0, B - 1)

        def cp(x: Array, axis: int = 0) -> Array:
            src_row = jax.lax.dynamic_slice_in_dim(x, s, 1, axis)
            return _rows(to_B, jnp.broadcast_to(src_row, x.shape), x, axis)

        return replace(
            self,
            conv=tuple(cp(c, 1) for c in self.conv),
            ssm=tuple(cp(x, 1) for x in self.ssm),
            pos=cp(self.pos),
            rs_idx=cp(self.rs_idx),
            count=cp(self.count),
        )

    def seq_keep(self, seq: IntLike) -> Self:
        _check_seq(self.batch, seq)
        others = jnp.arange(self.batch) != _i32(seq)
        return self._clear_rows(others, jnp.zeros_like(others))

    def _move_tail(self, seq: IntLike, p0: IntLike, p1: IntLike, new_pos: Array) -> Self:
        lo, hi = _bounds(p0, p1)
        sel = (jnp.arange(self.batch) == _i32(seq)) & (self.pos >= lo) & (self.pos < hi)
        sel = sel & (self.pos >= 0) & (lo != hi)
        return replace(self, pos=jnp.where(sel, new_pos, self.pos).astype(jnp.int32))

    def seq_add(self, seq: IntLike, p0: IntLike, p1: IntLike, delta: IntLike) -> Self:
        _check_seq(self.batch, seq)
        return self._move_tail(seq, p0, p1, self.pos + _i32(delta))

    def seq_div(self, seq: IntLike, p0: IntLike, p1: IntLike, d: IntLike) -> Self:
        _check_seq(self.batch, seq)
        d_a = _i32(d)
        return self._move_tail(
            seq, p0, p1, jnp.where(d_a > 1, self.pos // jnp.maximum(d_a, 1), self.pos)
        )

    def seq_pos_min(self, seq: IntLike) -> Array:
        return self.seq_pos_max(seq)  # one cell per row: min == max == tail

    def seq_pos_max(self, seq: IntLike) -> Array:
        _check_seq(self.batch, seq)
        s = _i32(seq)
        inside = (s >= 0) & (s < self.batch)
        return jnp.where(inside, self.pos[jnp.clip(s, 0, self.batch - 1)], EMPTY_POS)

    def clear(self, data: bool = False) -> Self:
        del data  # a cleared row reads zeros either way (count 0: its next state starts at 0)
        return self._clear_rows(jnp.ones((self.batch,), bool))

    @property
    def can_shift(self) -> bool:
        return True

    def advance(
        self,
        conv_inputs: tuple[Array, ...],
        ssm_steps: tuple[Array, ...],
        final_ssm: tuple[Array, ...],
        positions_BT: Array,
        after: Array | None = None,
    ) -> Self:
        """The memory after a forward over `positions_BT` (valid tokens first per row).

        `conv_inputs` [B, T, C]: each token's conv input; `ssm_steps` [B, T, ...]: the SSM
        state after every token; `final_ssm` [B, ...]: the state after each row's last
        valid token. With n_rs_seq > 0 and no steps (an empty tuple), every SSM plane of a
        fed row gets the final state: for callers that never roll back into the batch (a
        draft model's prompt and catch-up forwards). `after`: an array computed from the
        forward's reads of this memory (the logits): the conv writes are ordered after it,
        so that they stay in place (`llama.commit_kv`'s)."""
        valid_BT = positions_BT >= 0
        n_B = jnp.sum(valid_BT, axis=1).astype(jnp.int32)
        fed_B = n_B > 0
        B, T = positions_BT.shape
        P, R = self.n_planes, self.n_inputs
        rows = jnp.arange(B)
        start = self._input_count()  # tokens before the batch's first
        count = jnp.where(fed_B, start + n_B, self.count).astype(jnp.int32)

        # conv: the inputs of a fed row's last (up to) R tokens, token t at slot
        # (start + t) mod R; R updates at every width (one shape: one layout of the ring)
        k_K = jnp.arange(R)
        t_BK = n_B[:, None] - R + k_K[None]
        keep_BK = t_BK >= 0
        if after is not None:  # (NaN drops every write; cannot be folded)
            probe = after.reshape(-1)[0]
            keep_BK = keep_BK & (probe == probe)
        slot_BK = jnp.where(keep_BK, (start[:, None] + t_BK) % R, R + k_K[None])  # or dropped
        t_BK = jnp.clip(t_BK, 0, T - 1)
        conv = tuple(
            c.at[slot_BK, rows[:, None]].set(
                x[rows[:, None], t_BK], mode="drop", unique_indices=True
            )
            for c, x in zip(self.conv, conv_inputs)
        )

        # ssm: logical plane d < n of a fed row is the state after its token n - 1 - d, at
        # slot (count - d) mod P; the others stay where they are
        def planes(old: Array, steps: Array | None, final: Array) -> Array:
            if P == 1 or steps is None:
                return _rows(fed_B, jnp.broadcast_to(final[None], old.shape), old, 1)
            d_P1 = jnp.arange(P)[:, None]
            t_PB = n_B[None] - 1 - d_P1
            slot_PB = jnp.where(t_PB >= 0, (count[None] - d_P1) % P, P + d_P1)  # or dropped
            new = steps[rows[None], jnp.clip(t_PB, 0, T - 1)]  # [P, B, ...]
            return old.at[slot_PB, rows[None]].set(new, mode="drop", unique_indices=True)

        steps_s = ssm_steps if ssm_steps else (None,) * len(self.ssm)
        ssm = tuple(planes(o, s, f) for o, s, f in zip(self.ssm, steps_s, final_ssm))
        last = jnp.max(jnp.where(valid_BT, positions_BT, EMPTY_POS), axis=1)
        return replace(
            self,
            conv=conv,
            ssm=ssm,
            pos=jnp.where(fed_B, last, self.pos).astype(jnp.int32),
            rs_idx=jnp.where(fed_B, 0, self.rs_idx).astype(jnp.int32),
            count=count,
        )


def select_recurrent(mask_B: Array, new: RecurrentMemory, old: RecurrentMemory) -> RecurrentMemory:
    """Per-row choice between two recurrent memories (their arrays carry rows on axis 1)."""
    return replace(
        new,
        conv=tuple(_rows(mask_B, n, o, 1) for n, o in zip(new.conv, old.conv)),
        ssm=tuple(_rows(mask_B, n, o, 1) for n, o in zip(new.ssm, old.ssm)),
        pos=jnp.where(mask_B, new.pos, old.pos),
        rs_idx=jnp.where(mask_B, new.rs_idx, old.rs_idx),
        count=jnp.where(mask_B, new.count, old.count),
    )


def _check_seq(batch: int, seq: IntLike, name: str = "seq", allow_all: bool = False) -> None:
    s = kv_memory._static_int(seq)
    if s is None:
        return
    if s >= batch or (s < 0 and not allow_all):
        hint = " (or < 0 for every row)" if allow_all else ""
        raise ValueError(
            f"{name} = {s} out of range for a memory of {batch} rows: need 0 <= {name} < "
            f"{batch}{hint}"
        )


# ----------------------------------------------------------------------------- hybrid memory
@pytree_dataclass
class HybridMemory:
    kv: KVCache  # the attention layers (PART)
    rec: RecurrentMemory

    batch = alias("rec.batch")
    n_rs_seq = alias("rec.n_rs_seq")

    @staticmethod
    def init(
        config: qwen35.Qwen35Config,
        batch: int,
        capacity: int,
        n_rs_seq: int = 0,
        kv_dtype: str | None = None,
    ) -> HybridMemory:
        kv = qwen35.new_state(config, batch, capacity, kv_dtype).kv
        return HybridMemory(kv=kv, rec=RecurrentMemory.init(config, batch, n_rs_seq))

    def seq_rm_rows(self, rows_B: Array, p0: IntLike, p1: IntLike) -> tuple[Self, Array]:
        """Per-row `seq_rm` (recurrent part first; the KV cache only where it succeeded)."""
        rec, ok_B = self.rec.seq_rm_rows(rows_B, p0, p1)
        lo, hi = _bounds(p0, p1)
        lo_B = jnp.broadcast_to(lo, (self.batch,))[:, None]
        hi_B = jnp.broadcast_to(hi, (self.batch,))[:, None]
        pos = self.kv.pos
        drop = (rows_B & ok_B)[:, None] & (pos >= 0) & (pos >= lo_B) & (pos < hi_B)
        kv = replace(self.kv, pos=jnp.where(drop, EMPTY_POS, pos))
        return replace(self, kv=kv, rec=rec), ok_B

    def seq_rm(self, seq: IntLike, p0: IntLike, p1: IntLike) -> tuple[Self, Array]:
        rec, ok = self.rec.seq_rm(seq, p0, p1)
        kv, _ = kv_memory.seq_rm(self.kv, seq, p0, p1)
        kv = jax.tree.map(lambda a, b: jnp.where(ok, a, b), kv, self.kv)
        return replace(self, kv=kv, rec=rec), ok

    def seq_cp(self, src: IntLike, dst: IntLike, p0: IntLike, p1: IntLike) -> Self:
        return replace(
            self,
            kv=kv_memory.seq_cp(self.kv, src, dst, p0, p1),
            rec=self.rec.seq_cp(src, dst, p0, p1),
        )

    def seq_keep(self, seq: IntLike) -> Self:
        return replace(self, kv=kv_memory.seq_keep(self.kv, seq), rec=self.rec.seq_keep(seq))

    def seq_add(self, seq: IntLike, p0: IntLike, p1: IntLike, delta: IntLike) -> Self:
        raise ValueError("seq_add is not supported on a qwen35 hybrid memory (can_shift is False)")

    def seq_div(self, seq: IntLike, p0: IntLike, p1: IntLike, d: IntLike) -> Self:
        raise ValueError("seq_div is not supported on a qwen35 hybrid memory (can_shift is False)")

    def seq_pos_min(self, seq: IntLike) -> Array:
        return jnp.maximum(kv_memory.seq_pos_min(self.kv, seq), self.rec.seq_pos_min(seq))

    def seq_pos_max(self, seq: IntLike) -> Array:
        return jnp.minimum(kv_memory.seq_pos_max(self.kv, seq), self.rec.seq_pos_max(seq))

    def clear(self, data: bool = False) -> Self:
        return replace(self, kv=kv_memory.clear(self.kv, data), rec=self.rec.clear(data))

    @property
    def can_shift(self) -> bool:
        return False


def forward_memory(
    config: qwen35.Qwen35Config,
    params: Params,
    tokens_BT: Array,
    positions_BT: Array,
    mem: HybridMemory,
    *,
    cache_empty: bool = False,
) -> tuple[Array, HybridMemory]:
    """qwen35 forward over a `HybridMemory`: logits [B, T, V] and the new memory.

    Each row reads its input recurrent state from plane rs_idx; with n_rs_seq > 0 the
    per-position states (token-by-token scan) fill the planes."""
    logits, mem, _ = forward_memory_hidden(
        config, params, tokens_BT, positions_BT, mem, cache_empty=cache_empty
    )
    return logits, mem


def forward_memory_hidden(
    config: qwen35.Qwen35Config,
    params: Params,
    tokens_BT: Array,
    positions_BT: Array,
    mem: HybridMemory,
    *,
    cache_empty: bool = False,
) -> tuple[Array, HybridMemory, Array]:
    """`forward_memory` that also returns h_nextn [B, T, D] (the LM head's input, which the
    MTP drafter reads; unused outputs cost nothing under jit)."""
    conv, ssm = mem.rec.current()
    state = qwen35.Qwen35State(kv=mem.kv, conv=conv, ssm=ssm)
    out = qwen35.forward(
        config,
        params,
        tokens_BT,
        positions_BT,
        state,
        per_position=mem.n_rs_seq > 0,
        cache_empty=cache_empty,
        return_hidden=True,
    )
    rec = mem.rec.advance(
        out.conv_inputs, out.ssm_steps, out.state.ssm, positions_BT, after=out.logits
    )
    assert out.hidden is not None
    return out.logits, HybridMemory(kv=out.state.kv, rec=rec), out.hidden


# ----------------------------------------------------------------------------- the probe
def _probe_attention(model: Any) -> SeqRmType:
    cache = new_cache(model.config, 1, 2)
    tokens = jnp.zeros((1, 2), jnp.int32)
    positions = jnp.arange(2, dtype=jnp.int32)[None]
    _, cache, _ = jax.jit(forward_fn, static_argnames=("config", "hidden_layers"))(
        model.config, model.params, tokens, positions, cache
    )
    _, ok = kv_memory.seq_rm(cache, 0, 1, -1)
    return SeqRmType.PART if bool(ok) else SeqRmType.FULL


@functools.partial(jax.jit, static_argnames=("config", "n_rs_seq"))
def _probe_hybrid_jit(config: qwen35.Qwen35Config, params: Params, n_rs_seq: int) -> Array:
    mem = HybridMemory.init(config, 1, 2, n_rs_seq)
    tokens = jnp.zeros((1, 2), jnp.int32)
    positions = jnp.arange(2, dtype=jnp.int32)[None]
    _, mem = forward_memory(config, params, tokens, positions, mem, cache_empty=True)
    _, ok = mem.seq_rm(0, 1, -1)
    return ok


def can_seq_rm(model: Any, n_rs_seq: int = 0) -> SeqRmType:
    """`common_context_can_seq_rm` on a fresh one-row memory of the model's kind.

    Upstream's rule: no memory or a failing 2-token decode (token 0 at positions 0, 1) ->
    NO; n_rs_seq > 0 (only archs that support recurrent rollback) -> RS; else seq_rm(0, 1,
    -1) failing -> FULL, succeeding -> PART. Unlike upstream (which clears the context it
    probes) the probe runs on its own memory: no caller state is read or changed."""
    config = getattr(model, "config", None)
    if config is None or getattr(model, "params", None) is None:
        return SeqRmType.NO
    try:
        if getattr(config, "arch", None) == "qwen35":
            ok = bool(_probe_hybrid_jit(config, model.params, n_rs_seq))
            if n_rs_seq > 0:
                return SeqRmType.RS
            return SeqRmType.PART if ok else SeqRmType.FULL
        return _probe_attention(model)
    except Exception:  # a decode error makes the target NO, as upstream
        return SeqRmType.NO
