"""A KV cache whose sliding-window layers keep a ring of cells: llama.cpp's iSWA cache
(`llama_kv_cache_iswa`) without `--swa-full`, for targets with sliding-window layers (gemma3).

Layout (`SWACache`):

    full   KVCache   the layers without a window (`swa[l]` False): S cells per row, as a plain
                     `KVCache` (a new token takes the lowest free cell; `overflow` when none)
    ring   KVCache   the sliding-window layers (window W): R cells per row; position p lives
                     in cell p % R (its `overflow` is never set)
    swa    static    per model layer: True = its K/V are in `ring`
    window static    W (a query at q sees keys at q - W < p <= q)

R = min(S, W - 1 + T) where T is the widest batch that may be rolled back (a verify of
k_max + 1 tokens): the W - 1 cells a later token can see, plus the batch. llama.cpp sizes its
SWA cache n_swa + n_ubatch (padded to 256) for the same reason: `find_slot` only reuses a cell
that the token after the batch can no longer see (`is_masked_swa(pos, seq_pos_max + 1)`).

Invariants:
* A batch writes into the ring only each row's positions above (its largest position in the
  batch) - R: an earlier one would be overwritten within the batch. The batch itself attends
  to all its tokens anyway (the forward reads the cache, then commits).
* After a batch whose largest position is M (a row's positions consecutive, as the engine's
  are), the ring holds every written position in [M - R + 1, M]; a token at q sees
  [q - W + 1, q]. So `seq_rm(row, p0, -1)` keeps everything a later token can see whenever
  p0 > M - T (it removes at most the batch: the engine's rollback of a rejected draft always
  keeps id_last, so it removes at most k_max positions) or p0 <= 0 (the row emptied). An
  overwritten cell never held such a position: it held p - R < q - W + 1.
* Positions held by the ring stay contiguous (the oldest is overwritten first), as llama.cpp
  keeps them by purging [pos_min, overwritten] in `apply_ubatch`.

seq_rm (llama.h semantics, `specjax.memory.ops.seq_rm` dispatches here): removes the cells in
[p0, p1) of the row (every row when seq < 0) from both parts, and reports ok = True for every
call, as `llama_kv_cache_iswa::seq_rm` does (both of its caches return true). So llama.cpp's
rollback probe (`common_context_can_seq_rm`: decode two tokens, `seq_rm(0, 1, -1)`) reports
PART: a rejected draft is dropped by seq_rm, never by a checkpoint. A removal deeper than the
ring's reach (p0 <= M - T, p0 > 0) also returns True, as in llama.cpp, but leaves a later
token's window short: `seq_pos_min` (the ring's lowest position, as `llama_kv_cache_iswa`
reports its SWA cache's) tells, and llama.cpp's server compares it with pos - n_swa to decide
to re-process the prompt. The engine never makes such a call (`drop_from` keeps the current
length or empties a row). `seq_cp` / `seq_keep` / `seq_add` / `seq_div` are not supported
(NotImplementedError; `can_shift` False): no path of the engine uses them on a target.

Memory: `nbytes` counts both parts; a ring layer holds R cells per row instead of S.
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.memory import ops
from specjax.memory.kv import KVCache, write_layer
from specjax.pytree import pytree_dataclass, replace, static_field
from specjax.types import EMPTY_POS, Array, alias


@pytree_dataclass
class SWACache:
    full: KVCache
    ring: KVCache
    #: per model layer: True = a sliding-window layer (its cells in `ring`)
    swa: tuple[bool, ...] = static_field()
    window: int = static_field()

    batch = alias("full.batch")
    #: cells per row of the full layers: the context (S)
    capacity = alias("full.capacity")
    #: cells per row of a sliding-window layer (R)
    ring_cells = alias("ring.capacity")

    @property
    def overflow(self) -> Array:
        return self.full.overflow

    @property
    def nbytes(self) -> int:
        """Bytes held by both parts (K, V, positions, flags)."""
        return self.full.nbytes + self.ring.nbytes

    def part(self, layer: int) -> tuple[KVCache, int]:
        """(the part holding `layer`'s K/V, the layer's index in it)."""
        flag = self.swa[layer]
        return (self.ring if flag else self.full), sum(1 for f in self.swa[:layer] if f == flag)

    @staticmethod
    def init(
        *,
        batch: int,
        capacity: int,
        ring_cells: int,
        swa: tuple[bool, ...],
        window: int,
        n_kv_heads: int,
        head_dim: int,
        inv_freq: tuple[float, ...],
        inv_freq_swa: tuple[float, ...],
        dtype: jnp.dtype | str = jnp.float32,
        v_dtype: jnp.dtype | str | None = None,
    ) -> SWACache:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        if not 0 < ring_cells <= capacity:
            raise ValueError(f"ring_cells must be in 1..capacity ({capacity}), got {ring_cells}")
        common = dict(batch=batch, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype)
        return SWACache(
            full=KVCache.init(
                capacity=capacity,
                n_layers=sum(1 for f in swa if not f),
                inv_freq=inv_freq,
                v_dtype=v_dtype,
                **common,  # type: ignore[arg-type]
            ),
            ring=KVCache.init(
                capacity=ring_cells,
                n_layers=sum(1 for f in swa if f),
                inv_freq=inv_freq_swa,
                v_dtype=v_dtype,
                **common,  # type: ignore[arg-type]
            ),
            swa=tuple(bool(f) for f in swa),
            window=int(window),
        )

    # ------------------------------------------------------------------ llama.h's memory API
    def seq_rm(self, seq: Array | int, p0: Array | int, p1: Array | int) -> tuple[SWACache, Array]:
        """`llama_memory_seq_rm` on both parts; ok is always True (see the module docstring)."""
        full, _ = ops.seq_rm(self.full, seq, p0, p1)
        ring, _ = ops.seq_rm(self.ring, seq, p0, p1)
        return replace(self, full=full, ring=ring), jnp.asarray(True)

    def seq_pos_min(self, seq: Array | int) -> Array:
        """The lowest position the row's ring holds (-1: none), as llama.cpp's iSWA cache
        reports its SWA cache's."""
        pos = self.ring.pos[jnp.asarray(seq, jnp.int32)]
        lowest = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max))
        return jnp.where(jnp.any(pos >= 0), lowest, -1)

    def seq_pos_max(self, seq: Array | int) -> Array:
        return jnp.max(self.ring.pos[jnp.asarray(seq, jnp.int32)])

    @property
    def can_shift(self) -> bool:
        return False

    def _unsupported(self, name: str) -> NotImplementedError:
        return NotImplementedError(f"{name} is not supported on a sliding-window (SWA) cache")

    def seq_cp(self, *args: object) -> SWACache:
        raise self._unsupported("seq_cp")

    def seq_keep(self, *args: object) -> SWACache:
        raise self._unsupported("seq_keep")

    def seq_add(self, *args: object) -> SWACache:
        raise self._unsupported("seq_add")

    def seq_div(self, *args: object) -> SWACache:
        raise self._unsupported("seq_div")


def ring_cells(window: int, batch_width: int, capacity: int) -> int:
    """R = min(S, W - 1 + T): what a later token sees plus the widest batch rolled back."""
    return min(capacity, window - 1 + batch_width)


def write_ring(
    ring: KVCache, positions_BT: Array, k: tuple[Array, ...], v: tuple[Array, ...]
) -> KVCache:
    """Write new tokens' K/V ([B, T, G, E] per ring layer) at cells position % R: of each
    row, the tokens above its largest position in the batch - R (padding, -1, skipped)."""
    R = ring.capacity
    last_B = jnp.max(positions_BT, axis=1)
    written_BT = (positions_BT >= 0) & (positions_BT > last_B[:, None] - R)
    slot_BT = jnp.where(written_BT, positions_BT % R, R).astype(jnp.int32)
    rows_BT = jnp.arange(ring.batch, dtype=jnp.int32)[:, None] + jnp.zeros_like(slot_BT)
    pos = ring.pos.at[rows_BT, slot_BT].set(positions_BT.astype(jnp.int32), mode="drop")
    return replace(
        ring,
        k=tuple(write_layer(c, slot_BT, x) for c, x in zip(ring.k, k)),
        v=tuple(write_layer(c, slot_BT, x) for c, x in zip(ring.v, v)),
        pos=pos,
    )


def keep_prefix_swa(cache: SWACache, keep_B: Array) -> SWACache:
    """`seq_rm(row, keep[row], -1)` for every row at once, both parts."""

    def drop(part: KVCache) -> KVCache:
        return replace(part, pos=jnp.where(part.pos >= keep_B[:, None], EMPTY_POS, part.pos))

    return replace(cache, full=drop(cache.full), ring=drop(cache.ring))
