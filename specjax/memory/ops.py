"""llama.h's memory API (`llama_memory_*`) as pure, jittable functions over a memory pytree.

Every function takes the memory state and returns a new one; nothing is mutated. Sequence ids,
ranges, shifts and divisors may be traced int32 scalars, so one compiled function serves every
value. Row `b` of a `KVCache` is llama.cpp's sequence `b`.

Semantics (llama.h, checked against src/llama-kv-cache.cpp and src/llama-kv-cells.h):
* Ranges are half-open `[p0, p1)`; `p0 < 0` means 0 and `p1 < 0` means +infinity. An empty or
  inverted range touches nothing.
* `seq_rm(seq < 0)` removes from every row; the other functions need `seq >= 0`. A traced
  sequence id outside `[0, B)` selects no row (`seq_keep`: keeps no row, since no cell belongs
  to it), so nothing is ever read or written out of bounds.
* `seq_add` removes cells whose shifted position is negative (`llama_kv_cells::pos_add`).
  `seq_div` uses C integer division (positions are >= 0, so floor == truncation); a divisor
  `<= 1` is a no-op (llama.cpp returns early for 1; llama.h requires `d > 1`).
* Removal is a masking update of `pos` (set to -1); cells never move and the k/v data of a
  removed cell is left in place (it is invisible: attention derives visibility from `pos`).
* Keys are stored rotated at their position. `seq_add` / `seq_div` re-rotate each moved key by
  its own position delta (new - old), in float32, cast back to the buffer dtype: llama.cpp's
  K-shift. The re-rotation uses `cache.inv_freq` (rotate-half layout, llama3 scaling included).
* `overflow` is sticky: only `clear` resets it (and `seq_cp` may set it).

Difference from llama.cpp: rows never share cells. llama.cpp's `seq_cp` on a unified cache makes
the source cells *also belong* to `dst` (no data copy), so a later `seq_add`/`seq_div` on either
sequence moves the shared cell for both; with one stream per sequence it requires the full
range and replaces `dst` wholesale. Here `seq_cp` copies the k/v and positions of the source
cells in range into `dst`'s lowest free cells, adding to what `dst` already holds; afterwards
the two rows evolve independently. Per-row multisets of positions are therefore exactly what
llama.h promises for independent sequences.
"""

from __future__ import annotations

import operator
from typing import Protocol, Self, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.memory.kv import KVCache, assign_slots
from specjax.pytree import replace
from specjax.types import EMPTY_POS, Array

_POS_INF = np.iinfo(np.int32).max

M = TypeVar("M")
K = TypeVar("K", bound=KVCache)
IntLike = int | Array


@runtime_checkable
class Memory(Protocol):
    """The llama.h memory API that a non-KV memory (recurrent, hybrid) implements as methods.

    Each method is pure and jittable: it returns a new memory (and, for `seq_rm`, a bool
    array `ok`). The module-level functions of `specjax.memory.ops` dispatch to these methods for
    any memory that is not a `KVCache`.

    * `seq_rm` returns `ok == False` when a *partial* removal is impossible (recurrent state
      without snapshot planes); the returned memory is then unchanged. Removing a whole
      sequence (`p0 <= 0` and `p1 < 0`) never fails. A hybrid memory tries its recurrent
      part first and only then its attention part, so a failure mutates nothing.
    * `can_shift` is False when `seq_add` / `seq_div` are unsupported.
    """

    def seq_rm(self, seq: IntLike, p0: IntLike, p1: IntLike) -> tuple[Self, Array]: ...

    def seq_cp(self, src: IntLike, dst: IntLike, p0: IntLike, p1: IntLike) -> Self: ...

    def seq_keep(self, seq: IntLike) -> Self: ...

    def seq_add(self, seq: IntLike, p0: IntLike, p1: IntLike, delta: IntLike) -> Self: ...

    def seq_div(self, seq: IntLike, p0: IntLike, p1: IntLike, d: IntLike) -> Self: ...

    def seq_pos_min(self, seq: IntLike) -> Array: ...

    def seq_pos_max(self, seq: IntLike) -> Array: ...

    def clear(self, data: bool = False) -> Self: ...

    @property
    def can_shift(self) -> bool: ...


# ----------------------------------------------------------------------------- host checks


def _static_int(x: IntLike) -> int | None:
    """The value of a host integer (Python / NumPy int, or a concrete 0-d array), else None."""
    if isinstance(x, bool | np.bool_):
        raise TypeError(f"expected an integer, got the bool {x!r}")
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return operator.index(x)
    except TypeError:
        if isinstance(x, jax.Array | np.ndarray) and x.ndim == 0:
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"expected an integer scalar, got dtype {x.dtype}") from None
            return int(x)
        raise TypeError(f"expected an integer scalar, got {type(x).__name__}") from None


def _check_seq(cache: KVCache, seq: IntLike, name: str = "seq", allow_all: bool = False) -> None:
    s = _static_int(seq)
    if s is None:
        return
    if s >= cache.batch or (s < 0 and not allow_all):
        hint = " (or < 0 for every row)" if allow_all else ""
        raise ValueError(
            f"{name} = {s} out of range for a cache of {cache.batch} rows: "
            f"need 0 <= {name} < {cache.batch}{hint}"
        )


def _i32(x: IntLike) -> Array:
    return jnp.asarray(x, jnp.int32)


def _range_mask(pos_BS: Array, p0: IntLike, p1: IntLike) -> Array:
    """Non-empty cells whose position lies in [p0, p1) with llama.h's negative conventions."""
    p0 = _i32(p0)
    p1 = _i32(p1)
    lo = jnp.where(p0 < 0, 0, p0)
    hi = jnp.where(p1 < 0, _POS_INF, p1)
    return (pos_BS >= 0) & (pos_BS >= lo) & (pos_BS < hi)


def _row_mask(batch: int, seq: IntLike) -> Array:
    """[B] bool: the row `seq` (none when outside [0, B))."""
    return jnp.arange(batch, dtype=jnp.int32) == _i32(seq)


def _rotate(k_BGSE: Array, delta_BS: Array, inv_freq: tuple[float, ...]) -> Array:
    """Rotate stored keys by a per-cell position delta (rotate-half RoPE), float32 math."""
    half = k_BGSE.shape[-1] // 2
    if len(inv_freq) != half:
        raise ValueError(
            f"cache.inv_freq has {len(inv_freq)} entries for a head dimension of "
            f"{k_BGSE.shape[-1]} (need {half})"
        )
    freq = jnp.asarray(inv_freq, jnp.float32)[None, None, :]
    angle = delta_BS.astype(jnp.float32)[:, :, None] * freq  # [B, S, E/2]
    c = jnp.cos(angle)[:, None, :, :]
    s = jnp.sin(angle)[:, None, :, :]
    x = k_BGSE.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(k_BGSE.dtype)
    return jnp.where((delta_BS != 0)[:, None, :, None], out, k_BGSE)


def _move(cache: K, new_pos_BS: Array) -> K:
    """Set new positions (-1 = removed) and re-rotate the keys of cells that moved."""
    kept = (cache.pos >= 0) & (new_pos_BS >= 0)
    delta_BS = jnp.where(kept, new_pos_BS - cache.pos, 0)
    k = tuple(_rotate(k_l, delta_BS, cache.inv_freq) for k_l in cache.k)
    return replace(cache, k=k, pos=new_pos_BS.astype(jnp.int32))


# ----------------------------------------------------------------------------- public API


def seq_rm(cache: M, seq: IntLike, p0: IntLike, p1: IntLike) -> tuple[M, Array]:
    """`llama_memory_seq_rm`: drop cells of row `seq` (every row if `seq < 0`) in [p0, p1).

    Returns `(cache, ok)`; `ok` is a 0-d bool array, always True for a KV cache.
    """
    if not isinstance(cache, KVCache):
        return cache.seq_rm(seq, p0, p1)  # type: ignore[attr-defined]
    _check_seq(cache, seq, allow_all=True)
    seq_a = _i32(seq)
    rows_B = (seq_a < 0) | _row_mask(cache.batch, seq_a)
    remove_BS = rows_B[:, None] & _range_mask(cache.pos, p0, p1)
    pos = jnp.where(remove_BS, EMPTY_POS, cache.pos)
    return replace(cache, pos=pos), jnp.asarray(True)


def seq_cp(cache: M, src: IntLike, dst: IntLike, p0: IntLike, p1: IntLike) -> M:
    """`llama_memory_seq_cp`: copy the cells of row `src` in [p0, p1) into row `dst`.

    k/v of every layer and the positions are copied into `dst`'s lowest free cells (in the
    source's cell order); cells that do not fit are dropped and set `overflow[dst]`. Copying a
    row onto itself is a no-op. Unlike llama.cpp, the rows do not share the cells afterwards.
    """
    if not isinstance(cache, KVCache):
        return cache.seq_cp(src, dst, p0, p1)  # type: ignore[attr-defined]
    _check_seq(cache, src, "src")
    _check_seq(cache, dst, "dst")
    B = cache.batch
    src_a, dst_a = _i32(src), _i32(dst)
    valid = (src_a >= 0) & (src_a < B) & (dst_a >= 0) & (dst_a < B) & (src_a != dst_a)
    src_c = jnp.clip(src_a, 0, B - 1)
    dst_c = jnp.clip(dst_a, 0, B - 1)
    src_pos_S = cache.pos[src_c]
    take_S = _range_mask(src_pos_S[None, :], p0, p1)[0] & valid
    copy_pos_S = jnp.where(take_S, src_pos_S, EMPTY_POS)
    slot_1S, overflow_1 = assign_slots(cache.pos[dst_c][None, :], copy_pos_S[None, :])
    slot_S = slot_1S[0]  # S = not copied
    pos = cache.pos.at[dst_c, slot_S].set(copy_pos_S, mode="drop")
    k = tuple(_copy_cells(buf, src_c, dst_c, slot_S) for buf in cache.k)
    v = tuple(_copy_cells(buf, src_c, dst_c, slot_S) for buf in cache.v)
    overflow = cache.overflow | (_row_mask(B, dst_c) & overflow_1[0])
    return replace(cache, k=k, v=v, pos=pos, overflow=overflow)


def _copy_cells(buf_BGSE: Array, src: Array, dst: Array, slot_S: Array) -> Array:
    """Copy every cell of row `src` to cell `slot_S[cell]` of row `dst` (S = not copied)."""
    cells_SGE = jnp.swapaxes(buf_BGSE[src], 0, 1)  # advanced indices first: [S, G, E]
    return buf_BGSE.at[dst, :, slot_S].set(cells_SGE, mode="drop")


def seq_keep(cache: M, seq: IntLike) -> M:
    """`llama_memory_seq_keep`: empty every row except `seq`."""
    if not isinstance(cache, KVCache):
        return cache.seq_keep(seq)  # type: ignore[attr-defined]
    _check_seq(cache, seq)
    keep_B = _row_mask(cache.batch, seq)
    pos = jnp.where(keep_B[:, None], cache.pos, EMPTY_POS)
    return replace(cache, pos=pos)


def seq_add(cache: M, seq: IntLike, p0: IntLike, p1: IntLike, delta: IntLike) -> M:
    """`llama_memory_seq_add`: add `delta` to row `seq`'s positions in [p0, p1).

    Cells whose new position is negative are removed; the keys of the others are re-rotated
    so they attend as if encoded at their new position.
    """
    if not isinstance(cache, KVCache):
        return cache.seq_add(seq, p0, p1, delta)  # type: ignore[attr-defined]
    _check_seq(cache, seq)
    sel_BS = _row_mask(cache.batch, seq)[:, None] & _range_mask(cache.pos, p0, p1)
    shifted = cache.pos + _i32(delta)
    new_pos = jnp.where(sel_BS, jnp.where(shifted < 0, EMPTY_POS, shifted), cache.pos)
    return _move(cache, new_pos)


def seq_div(cache: M, seq: IntLike, p0: IntLike, p1: IntLike, d: IntLike) -> M:
    """`llama_memory_seq_div`: integer-divide row `seq`'s positions in [p0, p1) by `d > 1`.

    `d <= 1` is a no-op when traced; a host `d <= 0` raises ValueError.
    """
    if not isinstance(cache, KVCache):
        return cache.seq_div(seq, p0, p1, d)  # type: ignore[attr-defined]
    _check_seq(cache, seq)
    d_host = _static_int(d)
    if d_host is not None and d_host <= 0:
        raise ValueError(f"seq_div needs a divisor d > 1 (llama.h), got d = {d_host}")
    d_a = _i32(d)
    sel_BS = _row_mask(cache.batch, seq)[:, None] & _range_mask(cache.pos, p0, p1) & (d_a > 1)
    divided = cache.pos // jnp.maximum(d_a, 1)
    new_pos = jnp.where(sel_BS, divided, cache.pos)
    return _move(cache, new_pos)


def seq_pos_min(cache: KVCache | Memory, seq: IntLike) -> Array:
    """`llama_memory_seq_pos_min`: smallest position in row `seq` (int32), -1 if empty."""
    if not isinstance(cache, KVCache):
        return cache.seq_pos_min(seq)
    _check_seq(cache, seq)
    row_S = jnp.where(_row_mask(cache.batch, seq)[:, None], cache.pos, EMPTY_POS)
    low = jnp.min(jnp.where(row_S >= 0, row_S, _POS_INF))
    return jnp.where(low == _POS_INF, EMPTY_POS, low).astype(jnp.int32)


def seq_pos_max(cache: KVCache | Memory, seq: IntLike) -> Array:
    """`llama_memory_seq_pos_max`: largest position in row `seq` (int32), -1 if empty."""
    if not isinstance(cache, KVCache):
        return cache.seq_pos_max(seq)
    _check_seq(cache, seq)
    row_S = jnp.where(_row_mask(cache.batch, seq)[:, None], cache.pos, EMPTY_POS)
    return jnp.max(row_S).astype(jnp.int32)


def clear(cache: M, data: bool = False) -> M:
    """`llama_memory_clear`: every cell empty and overflow reset; zero k/v too if `data`."""
    if not isinstance(cache, KVCache):
        return cache.clear(data)  # type: ignore[attr-defined]
    pos = jnp.full_like(cache.pos, EMPTY_POS)
    overflow = jnp.zeros_like(cache.overflow)
    if not data:
        return replace(cache, pos=pos, overflow=overflow)
    k = tuple(jnp.zeros_like(buf) for buf in cache.k)
    v = tuple(jnp.zeros_like(buf) for buf in cache.v)
    return replace(cache, k=k, v=v, pos=pos, overflow=overflow)


def can_shift(memory: KVCache | Memory) -> bool:
    """`llama_memory_can_shift`: whether `seq_add` / `seq_div` are supported (static)."""
    if isinstance(memory, KVCache):
        return True
    return bool(memory.can_shift)
