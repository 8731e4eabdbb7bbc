"""Immutable KV cache with position masks.

Layout (design notes section 5):

    k[l], v[l]  [B, G, S, E]  per-layer tuple (never stacked: donated per layer to the jit);
                              the layout attention contracts over, so no step re-lays it out
    pos         [B, S] int32  position held by each cell, -1 = empty cell
    overflow    [B] bool      sticky flag: some write of this row found no free cell

K and V have their own dtypes (llama.cpp's `-ctk` / `-ctv`; F16 by default in `generate`).

Invariants:
* Row b is llama.cpp's sequence b. Cells are never shared between rows.
* Keys are stored already rotated (RoPE) at the position in `pos`; `seq_add`/`seq_div`
  re-rotate them by the position delta, as llama.cpp's K-shift does.
* A new token goes to the lowest free cell of its row, so holes left by a mid-range `seq_rm`
  are reused. When every row's occupied cells form a prefix (generation only removes
  tails), the free cells are those from the high-water mark on; otherwise they are searched.
  Cell order carries no meaning: attention visibility derives from positions alone (key
  visible iff pos_k >= 0 and pos_k <= pos_q, and pos_q - pos_k < window on sliding-window
  layers).
* Because new tokens take the lowest free cells, every occupied cell lies below the
  high-water mark `used_cells(cache.pos)`; attention reads only the chunks of cells below it,
  so per-token cost follows the used context, not the capacity.
* A token whose row has no free cell is dropped and sets `overflow[row]`; the host checks
  the flag after the jitted call and raises (`check_overflow`). Nothing is overwritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import CacheOverflowError
from specjax.pytree import pytree_dataclass, static_field
from specjax.types import EMPTY_POS, Array, axis_size

#: Cache types accepted by `-ctk` / `-ctv` (llama.cpp's names) and their JAX dtypes.
CACHE_TYPES: dict[str, str] = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def cache_dtype(name: str) -> str:
    """`f16` / `float16` -> "float16"; a clear ValueError for anything else."""
    if name in CACHE_TYPES:
        return CACHE_TYPES[name]
    if name in CACHE_TYPES.values():
        return name
    raise ValueError(f"unsupported KV cache type {name!r}; supported: {', '.join(CACHE_TYPES)}")


@pytree_dataclass
class KVCache:
    k: tuple[Array, ...]
    v: tuple[Array, ...]
    pos: Array
    overflow: Array
    #: RoPE inverse frequencies [E/2], needed to re-rotate keys when positions shift.
    inv_freq: tuple[float, ...] = static_field()

    batch = axis_size("pos", 0)
    capacity = axis_size("pos", 1)

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's arrays (K, V, positions, flags)."""
        leaves = jax.tree.leaves(self)
        return int(sum(x.size * x.dtype.itemsize for x in leaves))

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
        v_dtype: jnp.dtype | str | None = None,
    ) -> KVCache:
        if batch <= 0 or capacity <= 0:
            raise ValueError(f"cache batch and capacity must be positive, got {batch}, {capacity}")
        shape = (batch, n_kv_heads, capacity, head_dim)
        v_dtype = dtype if v_dtype is None else v_dtype
        return KVCache(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
            v=tuple(jnp.zeros(shape, v_dtype) for _ in range(n_layers)),
            pos=jnp.full((batch, capacity), EMPTY_POS, jnp.int32),
            overflow=jnp.zeros((batch,), bool),
            inv_freq=tuple(float(f) for f in inv_freq),
        )


def row_high_water(pos_BS: Array) -> Array:
    """Per row [B]: 1 + the highest occupied cell index (0 when the row is empty)."""
    S = pos_BS.shape[1]
    idx = jnp.arange(1, S + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(pos_BS >= 0, idx[None, :], 0), axis=1)


def used_cells(pos_BS: Array) -> Array:
    """High-water mark: 1 + the highest occupied cell index over all rows (0 when empty)."""
    return jnp.max(row_high_water(pos_BS))


def assign_slots(
    pos_BS: Array, positions_BT: Array, high_water_B: Array | None = None
) -> tuple[Array, Array]:
    """Cells for new tokens: the k-th valid token of a row goes to the row's k-th free cell.

    `high_water_B`: `row_high_water(pos_BS)` when the caller has it (one pass over the cells
    fewer). Returns (slot [B, T] with S for "not written", overflow [B]).
    """
    S = pos_BS.shape[1]
    T = positions_BT.shape[1]
    valid_BT = positions_BT >= 0
    rank_BT = jnp.cumsum(valid_BT, axis=1) - 1
    occupied_BS = pos_BS >= 0
    if high_water_B is None:
        high_water_B = row_high_water(pos_BS)
    # Only tails are removed during generation, so the occupied cells of each row usually
    # form a prefix: then the free cells are simply those from the high-water mark on, found
    # with two reductions instead of a search over all S cells (O(S) scans dominated decode
    # at large capacities). Rows with holes take the general search.
    compact = jnp.all(jnp.sum(occupied_BS, axis=1) == high_water_B)

    def after_high_water(_: Array) -> Array:
        idx_BT = high_water_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        return jnp.where(idx_BT < S, idx_BT, S).astype(jnp.int32)

    def lowest_free(pos_BS: Array) -> Array:
        search = jax.vmap(lambda free: jnp.nonzero(free, size=T, fill_value=S)[0])
        return search(pos_BS < 0).astype(jnp.int32)

    # (the branch gets `pos`, not the occupancy: an operand is computed whichever branch
    # runs, and the compact one, taken every decode step, needs no [B, S] array)
    free_idx_BT = jax.lax.cond(compact, after_high_water, lowest_free, pos_BS)
    slot_BT = jnp.take_along_axis(free_idx_BT, jnp.clip(rank_BT, 0, T - 1), axis=1)
    slot_BT = jnp.where(valid_BT, slot_BT, S).astype(jnp.int32)
    overflow_B = jnp.any(valid_BT & (slot_BT >= S), axis=1)
    return slot_BT, overflow_B


def write_positions(
    cache: KVCache, positions_BT: Array, high_water_B: Array | None = None
) -> tuple[KVCache, Array]:
    """Claim cells for `positions_BT` (-1 = padding); returns the new cache and the slots.
    `high_water_B`: as `assign_slots`'s."""
    slot_BT, overflow_B = assign_slots(cache.pos, positions_BT, high_water_B)
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


def write_layer(buf_BGSE: Array, slot_BT: Array, new_BTGE: Array) -> Array:
    """Scatter new tokens' [B, T, G, E] rows into cells `slot_BT` (S = not written)."""
    B, G = buf_BGSE.shape[0], buf_BGSE.shape[1]
    T = slot_BT.shape[1]
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None, None], (B, T, G))
    heads = jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32)[None, None, :], (B, T, G))
    slots = jnp.broadcast_to(slot_BT[:, :, None], (B, T, G))
    return buf_BGSE.at[rows, heads, slots].set(new_BTGE.astype(buf_BGSE.dtype), mode="drop")


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
