"""The target's memory behind one interface: what the engine's round asks of it.

The engine (`specjax.decode.engine`) runs one prefill, one round and one loop for every target; what
differs between targets is their memory, and only through this interface:

    init(batch, capacity)                      -> memory     a fresh, empty memory pytree
    forward(params, tokens, positions, memory, hidden_layers, fresh, logit_index)
                                               -> TargetForward(logits, memory, hidden)
                                                  the tokens' forward with their cells written
    checkpoint(memory, k_max)                  -> (saved | None, memory)
                                                  the PARTIAL_ONLY state a verify of up to
                                                  k_max drafts may have to restore, and the
                                                  memory to verify on
    settle(saved, after, length, n_drafted, n_accepted, active, replaying)
                                               -> (memory, checkpoint [B] | None, paths)
                                                  llama.cpp's rollback of the rejected tail
    drop_from(memory, start)                   -> memory     seq_rm(row, start[row], -1), all rows
    take_row(memory, slot) / put_row(memory, slot, row)      one row as a batch of one
                                                             (continuous batching's slots)

Three memories (all frozen, hashable: a field of the engine, static under jit):

* `KVTargetMemory`: an attention-only model (`specjax.models.llama`) over a `KVCache`. Its
  rollback level is PART: `seq_rm(row, keep, -1)` drops the rejected cells (`keep_prefix`),
  so a rejected draft never needs a checkpoint (`checkpoints` False; `settle` returns None).
  A model with sliding-window layers over it keeps every cell (llama.cpp's `--swa-full`).
* `SWATargetMemory`: an attention-only model with sliding-window layers (gemma3) over a
  `SWACache` (`specjax.memory.swa`: those layers' cells in a ring of W - 1 + k_max + 1, the
  others' in S cells), llama.cpp's iSWA cache without `--swa-full`. PART as the KV memory:
  the rollback keeps id_last, so it removes at most the verify batch, which the ring still
  holds with everything a later token sees; the probe's seq_rm succeeds, as llama.cpp's.
* `HybridTargetMemory`: a qwen35 hybrid recurrent model over a `HybridMemory` (KV cache of
  the attention layers + recurrent state with `n_rs_seq` snapshot planes). Its level is RS
  when n_rs_seq > 0, else FULL. A rejected tail of at most n_rs_seq tokens rolls back by a
  plane (`rs_plane`); a longer draft (decided on its length before verifying, as upstream's
  `use_ckpt`) restores the pre-round recurrent state, the PARTIAL_ONLY checkpoint, and trims
  the KV cells from the round's start: nothing is committed and the accepted tokens are the
  row's replay draft for the next round (`checkpoints` True). The checkpoint is one plane
  taken before the verify, and only where a draft may outgrow the planes (k_max > n_rs_seq):
  the verify then writes its planes in place, since nothing reads the old ring after it.

Invariants: `forward` never reads cells at positions >= a row's write positions (the cells a
round wrote are either kept or dropped by `settle` before the next round); `hidden` holds one
array [B, T, D] per requested id in `hidden_layers` order (layer ids of a llama target;
`H_NEXTN` of a qwen35 target, the LM head's input that draft-mtp reads). `paths` is an int32
[len(ROLLBACK_PATHS)] vector of row-rounds per rollback path (`rollback_counts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from specjax.memory.hybrid import HybridMemory, SavedState, forward_memory_hidden
from specjax.memory.kv import KVCache, keep_prefix, row_high_water
from specjax.memory.swa import SWACache, keep_prefix_swa, ring_cells
from specjax.models import qwen35
from specjax.models.config import ModelConfig, layer_rope_frequencies, rope_frequencies
from specjax.models.llama import commit_kv, forward_compute, new_cache
from specjax.pytree import replace
from specjax.types import Array, Params

#: How verified rounds left the target's memory (one schema for every target; counts are
#: row-rounds): `full_accept` (every drafted token accepted, nothing to remove), `seq_rm`
#: (PART: the rejected KV cells dropped by `seq_rm`, attention-only targets), `rs_plane`
#: (RS: a recurrent state rolled back by a snapshot plane), `checkpoint` (FULL, or RS beyond
#: n_rs_seq: the pre-round checkpoint restored), `replay` (the rounds replaying a
#: checkpointed round's accepted tokens), `seq_rm_failed` (a bounded rollback that failed;
#: always 0 in a correct run).
ROLLBACK_PATHS = ("full_accept", "seq_rm", "rs_plane", "checkpoint", "replay", "seq_rm_failed")

#: The hidden-state id under which a qwen35 target hands its h_nextn (the LM head's input,
#: which draft-mtp reads) in `TargetBatch.hidden`.
H_NEXTN = -1


class TargetForward(NamedTuple):
    logits: Array  # [B, T, V], or [B, 1, V] with logit_index
    memory: Any  # the memory with the tokens' cells written
    hidden: tuple[Array, ...]  # one [B, T, D] per requested hidden id


class TargetMemory(Protocol):
    """What the engine's round asks of a target's memory (see the module docstring)."""

    @property
    def config(self) -> Any: ...

    @property
    def checkpoints(self) -> bool:
        """Whether a rejected draft may need the pre-round checkpoint (then replayed)."""
        ...

    @property
    def seq_rm_type(self) -> str:
        """The rollback level llama.cpp's probe reports for it: PART, FULL or RS."""
        ...

    def init(self, batch: int, capacity: int) -> Any: ...

    def forward(
        self,
        params: Params,
        tokens_BT: Array,
        positions_BT: Array,
        memory: Any,
        hidden_layers: tuple[int, ...] = (),
        *,
        fresh: bool = False,
        logit_index: Array | None = None,
    ) -> TargetForward: ...

    def checkpoint(self, memory: Any, k_max: int) -> tuple[Any, Any]:
        """(saved, memory): the state `settle` restores for a row whose rejected draft its
        memory cannot roll back (llama.cpp's `update_tgt` with PARTIAL_ONLY), taken before
        the verify of drafts of up to `k_max` tokens (None where no such draft can need
        one), and the memory the verify is to write, ordered after the save (so that the
        verify writes it in place instead of XLA keeping a copy for a save it moved later)."""
        ...

    def settle(
        self,
        saved: Any,
        after: Any,
        length_B: Array,
        n_drafted_B: Array,
        n_accepted_B: Array,
        active_B: Array,
        replaying_B: Array | None,
    ) -> tuple[Any, Array | None, Array]:
        """After a verify of `n_drafted_B` draft tokens at `length_B` (`after`: the memory the
        verify wrote, `saved`: the `checkpoint` taken before it), keep id_last and the
        `n_accepted_B` accepted tokens of the `active_B` rows and drop the rest. Returns the
        memory, the rows that restored the checkpoint instead (they commit nothing and
        replay; None: this memory never does) and the round's row counts per rollback path."""
        ...

    def drop_from(self, memory: Any, start_B: Array) -> Any:
        """`seq_rm(row, start[row], -1)` for every row (start 0 empties the row)."""
        ...

    def take_row(self, memory: Any, slot: Array) -> Any: ...

    def put_row(self, memory: Any, slot: Array, row: Any) -> Any: ...

    def kv(self, memory: Any) -> KVCache:
        """The attention cache inside the memory (overflow checks, sizes)."""
        ...


def _take(x: Array, slot: Array) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, slot, 1, 0)


def _put(x: Array, slot: Array, value: Array) -> Array:
    return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), slot, 0)


def _kv_row(cache: KVCache, slot: Array) -> KVCache:
    return KVCache(
        k=tuple(_take(x, slot) for x in cache.k),
        v=tuple(_take(x, slot) for x in cache.v),
        pos=_take(cache.pos, slot),
        overflow=_take(cache.overflow, slot),
        inv_freq=cache.inv_freq,
    )


def _kv_put_row(cache: KVCache, slot: Array, row: KVCache) -> KVCache:
    return KVCache(
        k=tuple(_put(x, slot, y) for x, y in zip(cache.k, row.k)),
        v=tuple(_put(x, slot, y) for x, y in zip(cache.v, row.v)),
        pos=_put(cache.pos, slot, row.pos),
        overflow=_put(cache.overflow, slot, row.overflow),
        inv_freq=cache.inv_freq,
    )


def rollback_counts(**counts: Array) -> Array:
    """[len(ROLLBACK_PATHS)] int32 with the named paths' counts, 0 elsewhere."""
    return jnp.stack(
        [counts[name] if name in counts else jnp.zeros((), jnp.int32) for name in ROLLBACK_PATHS]
    ).astype(jnp.int32)


def part_rollback_counts(verified_B: Array, n_rollback_B: Array) -> Array:
    """PART's counts for one round: rows that verified a draft (`verified_B`) count in
    `seq_rm` when they dropped rejected cells (`n_rollback_B` > 0), else in `full_accept`."""
    verified = verified_B.astype(bool)
    rejected = n_rollback_B > 0
    return rollback_counts(
        full_accept=jnp.sum(verified & ~rejected), seq_rm=jnp.sum(verified & rejected)
    )


class _PartAttentionMemory:
    """What `KVTargetMemory` and `SWATargetMemory` share: an attention-only model's forward
    through `forward_compute`, the commit of the new K/V by `commit_kv` (either cache) and
    the PART rollback `seq_rm(row, keep, -1)`, which drops the rejected cells of every row at
    once. A memory gives its high-water mark and its `keep_prefix`."""

    config: ModelConfig

    checkpoints = False
    seq_rm_type = "PART"

    #: the memory's `seq_rm(row, keep, -1)` (`keep_prefix`'s arguments)
    _keep_prefix: Callable[[Any, Array], Any]

    def _high_water(self, memory: Any) -> Array:
        raise NotImplementedError

    def forward(
        self,
        params: Params,
        tokens_BT: Array,
        positions_BT: Array,
        memory: Any,
        hidden_layers: tuple[int, ...] = (),
        *,
        fresh: bool = False,
        logit_index: Array | None = None,
    ) -> TargetForward:
        # `fresh`: the cache holds nothing yet (prefill), so nothing is read. Otherwise the
        # read and the write share one pass over the cells (the high-water mark), and the
        # write is ordered after the reads (`after`) so that it stays in place.
        high_water = None if fresh else self._high_water(memory)
        out = forward_compute(
            self.config,
            params,
            tokens_BT,
            positions_BT,
            memory,
            hidden_layers,
            cache_empty=fresh,
            logit_index=logit_index,
            high_water_B=high_water,
        )
        assert out.logits is not None
        after = None if fresh else out.logits
        memory = commit_kv(memory, positions_BT, out.k, out.v, after=after, high_water_B=high_water)
        return TargetForward(out.logits, memory, tuple(out.hidden))

    def checkpoint(self, memory: Any, k_max: int) -> tuple[None, Any]:
        """PART never restores one."""
        return None, memory

    def settle(
        self,
        saved: Any,
        after: Any,
        length_B: Array,
        n_drafted_B: Array,
        n_accepted_B: Array,
        active_B: Array,
        replaying_B: Array | None,
    ) -> tuple[Any, None, Array]:
        """PART: `seq_rm(row, keep, -1)` drops the rejected cells of every row at once."""
        paths = part_rollback_counts(active_B & (n_drafted_B > 0), n_drafted_B - n_accepted_B)
        keep = jnp.where(active_B, length_B + n_accepted_B + 1, length_B)
        return self._keep_prefix(after, keep), None, paths


@dataclasses.dataclass(frozen=True)
class KVTargetMemory(_PartAttentionMemory):
    """An attention-only target over a `KVCache` (rollback level PART)."""

    config: ModelConfig
    #: KV cache dtypes (llama.cpp's `-ctk` / `-ctv`); None = the model's dtype.
    cache_type_k: str | None = None
    cache_type_v: str | None = None

    def init(self, batch: int, capacity: int) -> KVCache:
        return new_cache(self.config, batch, capacity, self.cache_type_k, self.cache_type_v)

    def _high_water(self, memory: KVCache) -> Array:
        return row_high_water(memory.pos)

    _keep_prefix = staticmethod(keep_prefix)

    def drop_from(self, memory: KVCache, start_B: Array) -> KVCache:
        memory = keep_prefix(memory, start_B)
        return replace(memory, overflow=memory.overflow & (start_B > 0))

    def take_row(self, memory: KVCache, slot: Array) -> KVCache:
        return _kv_row(memory, slot)

    def put_row(self, memory: KVCache, slot: Array, row: KVCache) -> KVCache:
        return _kv_put_row(memory, slot, row)

    def kv(self, memory: KVCache) -> KVCache:
        return memory


#: Architectures llama.cpp gives an iSWA cache (its `swa_type` set): their sliding-window
#: layers keep a ring (`SWATargetMemory`) unless `--swa-full`. (llama.cpp's qwen2 / qwen3 /
#: llama ignore a sliding window; specjax applies theirs as a mask over a full cache.)
SWA_CACHE_ARCHS = ("gemma3",)


def uses_swa_cache(config: Any) -> bool:
    """Whether a target of `config` keeps its sliding-window layers in a ring by default."""
    return getattr(config, "arch", None) in SWA_CACHE_ARCHS and any(
        config.layer_window(i) for i in range(config.L)
    )


@dataclasses.dataclass(frozen=True)
class SWATargetMemory(_PartAttentionMemory):
    """An attention-only target with sliding-window layers over a `SWACache` (rollback level
    PART): `batch_width` is the widest batch that may be rolled back (k_max + 1)."""

    config: ModelConfig
    batch_width: int
    cache_type_k: str | None = None
    cache_type_v: str | None = None

    def __post_init__(self) -> None:
        if not any(self.config.layer_window(i) for i in range(self.config.L)):
            raise ValueError(f"{self.config.arch} target has no sliding-window layer")
        if self.batch_width < 1:
            raise ValueError(f"batch_width must be >= 1, got {self.batch_width}")

    def init(self, batch: int, capacity: int) -> SWACache:
        c = self.config
        swa = tuple(c.layer_window(i) > 0 for i in range(c.L))
        k_dtype = self.cache_type_k or c.dtype
        return SWACache.init(
            batch=batch,
            capacity=capacity,
            ring_cells=ring_cells(c.sliding_window, self.batch_width, capacity),
            swa=swa,
            window=c.sliding_window,
            n_kv_heads=c.G,
            head_dim=c.E,
            inv_freq=tuple(rope_frequencies(c)),
            inv_freq_swa=tuple(layer_rope_frequencies(c, swa.index(True))),
            dtype=k_dtype,
            v_dtype=self.cache_type_v or k_dtype,
        )

    def _high_water(self, memory: SWACache) -> Array:
        return row_high_water(memory.full.pos)  # the full part's

    #: keep >= length + 1, so the ring still holds everything the next token sees
    #: (`specjax.memory.swa`)
    _keep_prefix = staticmethod(keep_prefix_swa)

    def drop_from(self, memory: SWACache, start_B: Array) -> SWACache:
        memory = keep_prefix_swa(memory, start_B)
        full = memory.full
        return replace(memory, full=replace(full, overflow=full.overflow & (start_B > 0)))

    def take_row(self, memory: SWACache, slot: Array) -> SWACache:
        return replace(memory, full=_kv_row(memory.full, slot), ring=_kv_row(memory.ring, slot))

    def put_row(self, memory: SWACache, slot: Array, row: SWACache) -> SWACache:
        return replace(
            memory,
            full=_kv_put_row(memory.full, slot, row.full),
            ring=_kv_put_row(memory.ring, slot, row.ring),
        )

    def kv(self, memory: SWACache) -> KVCache:
        """The memory as one `KVCache` for the host's checks: every layer's K/V in model
        order (ring layers with R cells), the full part's positions and overflow flags
        (its `nbytes` leaves out only the ring's [B, R] positions)."""
        layers = [memory.part(i) for i in range(self.config.L)]
        return KVCache(
            k=tuple(part.k[j] for part, j in layers),
            v=tuple(part.v[j] for part, j in layers),
            pos=memory.full.pos,
            overflow=memory.full.overflow,
            inv_freq=memory.full.inv_freq,
        )


@dataclasses.dataclass(frozen=True)
class HybridTargetMemory:
    """A qwen35 hybrid recurrent target over a `HybridMemory` (RS with n_rs_seq > 0, else
    FULL)."""

    config: qwen35.Qwen35Config
    n_rs_seq: int = 0
    kv_dtype: str | None = None

    checkpoints = True

    @property
    def seq_rm_type(self) -> str:
        return "RS" if self.n_rs_seq > 0 else "FULL"

    def init(self, batch: int, capacity: int) -> HybridMemory:
        return HybridMemory.init(self.config, batch, capacity, self.n_rs_seq, self.kv_dtype)

    def forward(
        self,
        params: Params,
        tokens_BT: Array,
        positions_BT: Array,
        memory: HybridMemory,
        hidden_layers: tuple[int, ...] = (),
        *,
        fresh: bool = False,
        logit_index: Array | None = None,
    ) -> TargetForward:
        if any(layer != H_NEXTN for layer in hidden_layers):
            raise ValueError(
                f"a {self.config.arch} target hands its drafters only h_nextn, not layers "
                f"{[x for x in hidden_layers if x != H_NEXTN]}"
            )
        logits, memory, h_nextn = forward_memory_hidden(
            self.config, params, tokens_BT, positions_BT, memory, cache_empty=fresh
        )
        if logit_index is not None:
            logits = jnp.take_along_axis(logits, logit_index[:, None, None], axis=1)
        return TargetForward(logits, memory, tuple(h_nextn for _ in hidden_layers))

    def checkpoint(
        self, memory: HybridMemory, k_max: int
    ) -> tuple[SavedState | None, HybridMemory]:
        """The recurrent state (one per row) where a draft of k_max may outgrow the planes."""
        if k_max <= self.n_rs_seq:
            return None, memory
        return jax.lax.optimization_barrier((memory.rec.checkpoint(), memory))

    def settle(
        self,
        saved: SavedState | None,
        after: HybridMemory,
        length_B: Array,
        n_drafted_B: Array,
        n_accepted_B: Array,
        active_B: Array,
        replaying_B: Array | None,
    ) -> tuple[HybridMemory, Array, Array]:
        """RS: a rejected tail within the planes rolls back by `seq_rm(row, keep, -1)`.
        Checkpoint (FULL, or RS with a draft longer than the planes: decided on the draft's
        length, as upstream decides before verifying): the pre-round recurrent state comes
        back (PARTIAL_ONLY) and the KV cells from the round's start are dropped; the row
        commits nothing. Replayed tokens are accepted, so a replay round never rolls back."""
        replaying = jnp.zeros_like(active_B) if replaying_B is None else replaying_B
        rejected = active_B & (n_drafted_B - n_accepted_B > 0)
        if saved is None:  # k_max <= n_rs_seq: static, so the checkpoint's work is compiled out
            use_checkpoint = jnp.zeros_like(active_B)
        else:
            use_checkpoint = ~replaying & (n_drafted_B > self.n_rs_seq)
        checkpoint = rejected & use_checkpoint
        by_plane = rejected & ~use_checkpoint
        memory, ok = after.seq_rm_rows(by_plane, length_B + n_accepted_B + 1, -1)
        if saved is not None:
            memory = replace(memory, rec=memory.rec.load(checkpoint, saved))
            memory, _ = memory.seq_rm_rows(checkpoint, length_B, -1)
        verified = active_B & (n_drafted_B > 0) & ~checkpoint
        paths = rollback_counts(
            full_accept=jnp.sum(verified & ~replaying & ~rejected),
            rs_plane=jnp.sum(by_plane),
            checkpoint=jnp.sum(checkpoint),
            replay=jnp.sum(active_B & replaying),
            seq_rm_failed=jnp.sum(by_plane & ~ok),
        )
        return memory, checkpoint, paths

    def drop_from(self, memory: HybridMemory, start_B: Array) -> HybridMemory:
        everywhere = jnp.ones(start_B.shape, bool)
        memory, _ = memory.seq_rm_rows(everywhere, start_B, -1)
        return replace(memory, kv=replace(memory.kv, overflow=memory.kv.overflow & (start_B > 0)))

    def take_row(self, memory: HybridMemory, slot: Array) -> HybridMemory:
        return HybridMemory(kv=_kv_row(memory.kv, slot), rec=memory.rec.take_row(slot))

    def put_row(self, memory: HybridMemory, slot: Array, row: HybridMemory) -> HybridMemory:
        return HybridMemory(
            kv=_kv_put_row(memory.kv, slot, row.kv), rec=memory.rec.put_row(slot, row.rec)
        )

    def kv(self, memory: HybridMemory) -> KVCache:
        return memory.kv
