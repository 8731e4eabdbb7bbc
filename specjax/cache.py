"""Immutable KV cache with position masks.

Layout (design notes section 5):

    k[l], v[l]  [B, S, G, E]  per-layer tuple (never stacked: donated per layer to the jit)
    pos         [B, S] int32  position held by each cell, -1 = empty cell
    overflow    [B] bool      sticky flag: some write of this row found no free cell

Invariants:
* Row b is llama.cpp's sequence b. Cells are never shared between rows.
* Keys are stored already rotated (RoPE) at the position in `pos`; `seq_add`/`seq_div`
  re-rotate them by the position delta, as llama.cpp's K-shift does.
* A new token goes to the lowest free cell of its row (found with a cumulative count of free
  cells), so holes left by a mid-range `seq_rm` are reused. Cell order carries no meaning:
  attention visibility derives from positions alone (key visible iff pos_k >= 0 and
  pos_k <= pos_q, and pos_q - pos_k < window on sliding-window layers).
* A token whose row has no free cell is dropped and sets `overflow[row]`; the host checks
  the flag after the jitted call and raises (`check_overflow`). Nothing is overwritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import CacheOverflowError
from specjax.pytree import pytree_dataclass, static_field
from specjax.types import EMPTY_POS, Array


@pytree_dataclass
class KVCache:
    k: tuple[Array, ...]
    v: tuple[Array, ...]
    pos: Array
    overflow: Array
    #: RoPE inverse frequencies [E/2], needed to re-rotate keys when positions shift.
    inv_freq: tuple[float, ...] = static_field()

    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.pos.shape[1])

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @staticmethod
    def init(
        *,
        batch: int,
        capacity: int,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        inv_freq: tuple[float, ...],
        dtype: jnp.dtype | str = jnp.float32,
    ) -> KVCache:
        if batch <= 0 or capacity <= 0:
            raise ValueError(f"cache batch and capacity must be positive, got {batch}, {capacity}")
        shape = (batch, capacity, n_kv_heads, head_dim)
        return KVCache(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
            pos=jnp.full((batch, capacity), EMPTY_POS, jnp.int32),
            overflow=jnp.zeros((batch,), bool),
            inv_freq=tuple(float(f) for f in inv_freq),
        )


def assign_slots(pos_BS: Array, positions_BT: Array) -> tuple[Array, Array]:
    """Cells for new tokens: the k-th valid token of a row goes to the row's k-th free cell.

    Returns (slot [B, T] with S for "not written", overflow [B]).
    """
    S = pos_BS.shape[1]
    T = positions_BT.shape[1]
    valid_BT = positions_BT >= 0
    rank_BT = jnp.cumsum(valid_BT, axis=1) - 1
    free_idx_BT = jax.vmap(lambda free: jnp.nonzero(free, size=T, fill_value=S)[0])(pos_BS < 0)
    slot_BT = jnp.take_along_axis(free_idx_BT, jnp.clip(rank_BT, 0, T - 1), axis=1)
    slot_BT = jnp.where(valid_BT, slot_BT, S).astype(jnp.int32)
    overflow_B = jnp.any(valid_BT & (slot_BT >= S), axis=1)
    return slot_BT, overflow_B


def write_positions(cache: KVCache, positions_BT: Array) -> tuple[KVCache, Array]:
    """Claim cells for `positions_BT` (-1 = padding); returns the new cache and the slots."""
    slot_BT, overflow_B = assign_slots(cache.pos, positions_BT)
    rows_BT = jnp.arange(cache.batch, dtype=jnp.int32)[:, None] + jnp.zeros_like(slot_BT)
    pos = cache.pos.at[rows_BT, slot_BT].set(positions_BT.astype(jnp.int32), mode="drop")
    return (
        KVCache(
            k=cache.k,
            v=cache.v,
            pos=pos,
            overflow=cache.overflow | overflow_B,
            inv_freq=cache.inv_freq,
        ),
        slot_BT,
    )


def write_layer(buf_BSGE: Array, slot_BT: Array, new_BTGE: Array) -> Array:
    rows_BT = jnp.arange(buf_BSGE.shape[0], dtype=jnp.int32)[:, None] + jnp.zeros_like(slot_BT)
    return buf_BSGE.at[rows_BT, slot_BT].set(new_BTGE.astype(buf_BSGE.dtype), mode="drop")


def check_overflow(cache: KVCache) -> None:
    """Host-side: raise if any row ran out of cells (call after a jitted forward)."""
    overflow = np.asarray(jax.device_get(cache.overflow))
    if overflow.any():
        rows = np.nonzero(overflow)[0].tolist()
        raise CacheOverflowError(
            f"KV cache overflow: rows {rows} needed more than the capacity of {cache.capacity} cells"
        )


def keep_prefix(cache: KVCache, keep_B: Array) -> KVCache:
    """`seq_rm(row, keep[row], -1)` for every row at once: drop cells at positions >= keep."""
    pos = jnp.where(cache.pos >= keep_B[:, None], EMPTY_POS, cache.pos)
    return KVCache(k=cache.k, v=cache.v, pos=pos, overflow=cache.overflow, inv_freq=cache.inv_freq)
