"""ngram-cache (llama.cpp lookup decoding, spec 5.8) on device.

Three caches map an n-gram (up to 4 tokens, -1 padded) to counts of the tokens that followed it:

* **context** (per row, `NgramCacheState`), per n-gram size (4 sub-tables of `slots_for(capacity)`
  slots, a power of two, sized from the history capacity: see "Capacity" below), two
  open-addressing (linear probing) hash tables:
  - the *pair table*: `(n-gram, token)` -> count, the stream position at which the pair was first
    seen (its insertion stamp) and its libstdc++ bucket-group stamp `gs` (see ties below);
  - the *part table*: n-gram -> its part's summary: sum of counts, the best member (token, count,
    gs, stamp) and the first stamp of each of the 13 phase-0 buckets.
  Ingestion adds only the new stream positions (blocks of `block` positions, O(block) gathers
  and scatters per sub-table and probe; on CPU one position at a time on a native kernel,
  `cpu_kernels.ngram_cache_ingest`, in place: the same contents, slots possibly taken in
  another order); a draft step probes the part table once per size.
  Nothing in a round scales with `table_size`, except the context part of drafting WITH a static
  cache (weights depend on the query, so the part's members are scanned: O(table_size)).
* **dynamic** and **static** (shared by all rows, read-only while generating): `LookupTable`s
  built on the host from llama.cpp cache files (`specjax.io.lookup_file.make_tables`), passed as the
  drafter's `params` (`NgramCacheTables`, or None when no file is used). Their parts are stored
  contiguously in libstdc++ iteration order, with per-n-gram sums and the count-only best token
  precomputed. The dynamic cache is updated on the host after a run (see
  `specjax.io.lookup.update_dynamic_cache` / `context_cache`), as llama.cpp's lookup example does.
  Of the host side this module imports only `specjax.io.lookup_file` (the tables' types, and
  `from_spec` loads the files it names), never `specjax.io.lookup`.

Invariants (`draft`, per drafting row, exactly upstream's `common_speculative_impl_ngram_cache`):
* The stream is `history[0:length] + [last_token]`. Positions `[cache_size, length+1)` not yet
  ingested are counted into the context cache as ONE new sequence (`context_update=
  "speculative"`, upstream's quirk: an n-gram starting before `cache_size` is never counted);
  `context_update="lookup"` counts every n-gram ending in the new positions (the lookup
  examples' per-token update). Then `cache_size = length + 1`. Only drafting rows change.
  The first draft's sequence, `[0, length+1)` upstream, is counted in two parts: the prompt
  in `begin` (prefill), the rest at the first draft (`seq_start` keeps the sequence open, so
  the n-grams across the prompt's end count): the same cache, the prompt's work out of decode.
* Up to `min(n_draft, k_max)` tokens are drafted one at a time from the last tokens of stream +
  draft so far: the context cache with lax thresholds for sizes 4..1, then the dynamic cache with
  strict thresholds, then the static cache alone (2-gram); candidates of the context/dynamic
  caches are weighted `count * (100 * static count)` (weight 1 when absent from the static part
  of the last 2 tokens), int32 arithmetic like upstream. No draft when `length + 1 < 2`.
  The relay truncates to `n_max`; this drafter also does.
* Ties between equally weighted candidates go to the first in the C++ map's iteration order.
  Exact for the dynamic/static caches (precomputed on the host) and for context parts with at
  most 13 distinct tokens (libstdc++'s first 13-bucket phase: latest bucket group first, latest
  insertion first within a group, i.e. the largest `(gs, stamp)` where `gs` is the first stamp
  of the member's bucket `token mod 13` in its part). A context part with more distinct tokens
  is ordered the same way, ignoring the reordering of earlier rehashes: ties there can differ
  from upstream. Without a static cache no tie in such a part can pass the thresholds, so the
  deviation needs a static cache. Without a static cache every weight is 1, so a part's best
  member is the largest `(count, gs, stamp)`, kept up to date on every ingestion (counts only
  grow: the new best is the old best or one of the pairs just counted).
* `begin` resets the row's context cache and `cache_size` when `reset_on_begin` (default).
  Upstream's `begin` is a no-op (bug #27852: the stale cache of the previous request is kept and
  the new prompt is only ingested beyond the old `cache_size`; acceptance fell from 86% to 11%);
  `reset_on_begin=False` reproduces it. `process/accept/rollback` are no-ops as upstream.
* Loops over rows are batched by hand (no `vmap` of a `while_loop`, whose batching would select
  between old and new tables every iteration), and every table update is a scatter of the few
  new entries into the donated state, out-of-range indices dropped.

Capacity: the tables are SIZED FROM THE HISTORY CAPACITY and keep everything, as upstream's
`std::unordered_map`s do (no n-gram or pair is ever dropped or overwritten, at any history length).
Why it is enough: each ingested stream position adds at most one pair to each size's table, and a
row ingests each position of `[0, capacity]` at most once over its life (`cache_size` only grows,
and `begin` empties the tables when it resets it), so a sub-table never holds more than `capacity`
pairs (a size-s pair needs s tokens before its follower) and never more n-grams than pairs.
`slots_for(capacity) = next_pow2((capacity + 1) / max_load)` slots (`table_size`, when larger, is
used instead: it is a floor, never a limit) leave a free slot for every insertion; probing runs
until the pair's slot or a free one is found (no probe limit: a cluster longer than any fixed
limit, rare but real at load 0.75, must not lose a pair). Why sized, not grown or spilled: the
state's shapes are static under `jit` (growing would recompile or round-trip to the host on the
decode path), the capacity is static and bounds the pairs exactly, and drafting stays O(probes).
The price is memory proportional to the capacity: per slot, 30 int32 + 1 bool = 121 bytes (keys
4, tok, count, stamp, gs, ng_keys 4, ng_sum, ng_best 4, ng_heads 13, ng_occ), 4 sub-tables, per
row: capacity 32,768 (-c 32768) -> 65,536 slots -> 31.7 MB (30.3 MiB) a row; 131,072 ->
262,144 slots -> 127 MB (121 MiB) a row (at a power-of-two capacity the load stays under 0.5).
`n_used` counts the pairs held; `n_dropped` stays 0 (kept as a checked invariant: the insertion
paths still count a pair they could not place, which the sizing rules out). Read-only tables hold
everything they are built from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.drafters.base import Drafter, DraftInput, DraftOutput, ModelFreeDrafter, TokenHistory
from specjax.io.lookup_file import HASH_MULT, HASH_SEED, LookupTable, NgramCacheTables, load_tables
from specjax.kernels import cpu as cpu_kernels
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array

if TYPE_CHECKING:
    from specjax.config import SpecConfig

# llama.cpp's constants (common/ngram-cache.h, common/speculative.cpp)
NGRAM_MIN = 1
NGRAM_MAX = 4
NGRAM_STATIC = 2
N_DRAFT = 8
#: Thresholds, index = n-gram size - 1 (context cache: lax, dynamic cache: strict).
MIN_SAMPLE_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLE_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)

#: Buckets of a libstdc++ unordered_map holding 1..13 elements (first growth phase).
_PHASE0_BUCKETS = 13
_INT_MIN = np.iinfo(np.int32).min
_INT_MAX = np.iinfo(np.int32).max

# ---------------------------------------------------------------------------------------------
# hashing (`specjax.io.lookup_file.hash_words_np` is the host twin)
# ---------------------------------------------------------------------------------------------


def hash_words(words: Array) -> Array:
    """uint32 hash of int32 rows `[..., W]` (murmur3-finalised multiply-xor)."""
    w = lax.bitcast_convert_type(words.astype(jnp.int32), jnp.uint32)
    h = jnp.full(w.shape[:-1], HASH_SEED, jnp.uint32)
    for k in range(w.shape[-1]):
        h = (h ^ w[..., k]) * jnp.uint32(HASH_MULT)
    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> jnp.uint32(13))
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> jnp.uint32(16))


def _home(h: Array, size: int) -> Array:
    return (h & jnp.uint32(size - 1)).astype(jnp.int32)


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# ---------------------------------------------------------------------------------------------
# read-only tables (static / dynamic caches)
# ---------------------------------------------------------------------------------------------


def _find_ngram(table: LookupTable, key_4: Array) -> Array:
    """Index of n-gram `key` in `table`, -1 if absent (one key, `[4]`)."""
    size = table.ng_slots.shape[0]
    home = _home(hash_words(key_4), size)

    def probe(p: Array, found: Array) -> Array:
        g = table.ng_slots[(home + p) & (size - 1)]
        hit = (g >= 0) & jnp.all(table.ng_keys[jnp.maximum(g, 0)] == key_4)
        return jnp.where(hit, g, found)

    return lax.fori_loop(0, table.ng_probe, probe, jnp.int32(-1))


def _static_weights(table: LookupTable | None, g2: Array, toks: Array) -> Array:
    """Upstream's `count_static`: `100 * count` of each token in static part `g2`, else 1."""
    if table is None:
        return jnp.ones(toks.shape, jnp.int32)
    size = table.pair_slots.shape[0]
    home = _home(hash_words(jnp.stack([jnp.broadcast_to(g2, toks.shape), toks], axis=-1)), size)

    def probe(p: Array, count: Array) -> Array:
        e = table.pair_slots[(home + p) & (size - 1)]
        ec = jnp.maximum(e, 0)
        hit = (e >= 0) & (table.ent_ng[ec] == g2) & (table.ent_tok[ec] == toks)
        return jnp.where(hit, table.ent_count[ec], count)

    count = lax.fori_loop(0, table.pair_probe, probe, jnp.zeros(toks.shape, jnp.int32))
    return jnp.where((g2 >= 0) & (count > 0), jnp.int32(100) * count, jnp.int32(1))


def _pick_table(table: LookupTable, keys_4x4, key_ok, g2, static):
    """Best token per n-gram size of a read-only cache (first maximum in iteration order)."""
    g = jax.vmap(lambda k: _find_ngram(table, k))(keys_4x4)  # [4]
    g = jnp.where(key_ok, g, -1)
    gc = jnp.maximum(g, 0)
    j = jnp.arange(table.max_len, dtype=jnp.int32)
    inside = (g >= 0)[:, None] & (j[None, :] < table.ng_len[gc][:, None])
    idx = jnp.where(inside, table.ng_off[gc][:, None] + j[None, :], 0)
    toks = table.ent_tok[idx]
    cnts = table.ent_count[idx]
    w = _static_weights(static, g2, toks)
    pm = jnp.where(inside, cnts * w, _INT_MIN)
    win = jnp.argmax(pm, axis=1)
    top = jnp.take_along_axis(pm, win[:, None], axis=1)[:, 0]
    best_tok = jnp.take_along_axis(toks, win[:, None], axis=1)[:, 0]
    best_cnt = jnp.take_along_axis(cnts, win[:, None], axis=1)[:, 0]
    return best_tok, best_cnt, table.ng_sum[gc], (g >= 0) & (top > 0)


# ---------------------------------------------------------------------------------------------
# drafter state and config
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class NgramCacheState:
    """Per-row context cache, one sub-table per n-gram size (leaves have leading dimension B).

    Sub-table `s-1` holds the `(n-gram of size s, token)` pairs (pair table) and the n-grams of
    size s (part table); n-grams use columns `0..s-1` of their keys (the rest -1). A pair slot
    is empty iff its count is 0, a part slot iff `ng_occ` is False.
    """

    keys: Array  # [B, 4, N, 4] int32 pair table: n-gram
    tok: Array  # [B, 4, N] int32 following token
    count: Array  # [B, 4, N] int32, 0 = empty slot
    stamp: Array  # [B, 4, N] int32 stream position of the pair's first occurrence
    gs: Array  # [B, 4, N] int32 first stamp of the pair's bucket (token mod 13) in its part
    ng_keys: Array  # [B, 4, N, 4] int32 part table: n-gram
    ng_occ: Array  # [B, 4, N] bool occupied part slot
    ng_sum: Array  # [B, 4, N] int32 sum of the part's counts (int32 wrap, as upstream)
    ng_best: Array  # [B, 4, N, 4] int32 best member (count, gs, stamp, token)
    ng_heads: Array  # [B, 4, N, 13] int32 first stamp per bucket (INT_MAX = none yet)
    n_used: Array  # [B, 4] int32 occupied pair slots per sub-table
    n_dropped: Array  # [B] int32 new pairs dropped because a sub-table was full
    cache_size: Array  # [B] int32 stream tokens ingested (upstream `cache_size`)
    #: [B] int32 first stream position of the sequence the next ingestion continues: its
    #: n-grams may start there (`context_update="speculative"`; see `begin`)
    seq_start: Array


#: The state's fields in the order of `cpu_kernels.ngram_cache_ingest`'s tables.
_KERNEL_FIELDS = (
    "keys", "tok", "count", "stamp", "gs", "ng_keys", "ng_occ", "ng_sum", "ng_best", "ng_heads",
    "n_used", "n_dropped", "cache_size", "seq_start",
)  # fmt: skip

_THRESH_LAX = (np.asarray(MIN_SAMPLE_LAX, np.int32), np.asarray(MIN_PERCENT_LAX, np.int32))
_THRESH_STRICT = (
    np.asarray(MIN_SAMPLE_STRICT, np.int32),
    np.asarray(MIN_PERCENT_STRICT, np.int32),
)


@dataclass(frozen=True)
class NgramCache(ModelFreeDrafter):
    """llama.cpp `ngram-cache` (see the module docstring for invariants and capacity).

    `table_size`: at least this many slots in each of the 4 per-size sub-tables of a row (a
    power of two); 0 = `next_pow2((capacity + 1) / max_load)`, room for every pair of a full
    history, which is also used whenever it is larger (`slots_for`: the tables never drop).
    `max_load`: the most of a sub-table a full history fills (sizes the tables).
    `block`: stream positions ingested per loop iteration.
    """

    name: ClassVar[str] = "ngram-cache"
    #: A round in which no row drafts leaves the state as it is (only drafting rows ingest
    #: or look up; a row catches up from the history when it drafts again; the feedback
    #: methods are no-ops), so a round the governor turns off may skip the call
    #: (`engine.spec_step`).
    idle_noop: ClassVar[bool] = True
    #: (ingestion of the new positions, on the native kernel where it is built, then up to
    #: n_draft steps probing 4 part tables: benchmarks/results/ask-cost-native.json, 0.073;
    #: 0.377 before the kernel and the prompt's ingestion in `begin`, ask-cost.json)
    ask_steps: ClassVar[float] = 0.08
    n_draft: int = N_DRAFT
    table_size: int = 0
    max_load: float = 0.75
    block: int = 32
    reset_on_begin: bool = True
    context_update: str = "speculative"

    @classmethod
    def from_spec(cls, spec: SpecConfig, target: Any, draft: Any) -> tuple[Drafter, Any]:
        """`--spec-ngram-cache-n-draft`; its parameters are the lookup files' device tables
        (`lookup_file.load_tables` of the files the SpecConfig names)."""
        drafter = cls(n_draft=spec.ngram_cache_n_draft)
        return drafter, load_tables(spec.lookup_cache_static, spec.lookup_cache_dynamic)

    def __post_init__(self) -> None:
        if self.n_draft < 0:
            raise ValueError(f"ngram-cache: n_draft must be >= 0, got {self.n_draft}")
        if self.table_size < 0 or (self.table_size & (self.table_size - 1)):
            raise ValueError(
                f"ngram-cache: table_size must be 0 or a power of two, got {self.table_size}"
            )
        if not 0.0 < self.max_load <= 1.0:
            raise ValueError(f"ngram-cache: max_load must be in (0, 1], got {self.max_load}")
        if self.block < 1:
            raise ValueError(f"ngram-cache: block must be >= 1, got {self.block}")
        if self.context_update not in ("speculative", "lookup"):
            raise ValueError(
                f"ngram-cache: context_update must be 'speculative' or 'lookup', "
                f"got {self.context_update!r}"
            )

    # ------------------------------------------------------------------ state
    def slots_for(self, capacity: int) -> int:
        """Slots per sub-table for a history capacity: room for every pair of a full history
        (at most `capacity` per size) at a load of at most `max_load`, or `table_size` if larger."""
        return max(self.table_size, _next_pow2(math.ceil((capacity + 1) / self.max_load)))

    def init(self, batch: int, capacity: int) -> NgramCacheState:
        n = self.slots_for(capacity)

        # distinct buffers per field, so that the whole state can be donated
        def z(*shape: int, fill: int = 0) -> Array:
            return jnp.full((batch, *shape), fill, jnp.int32)

        return NgramCacheState(
            keys=z(NGRAM_MAX, n, 4, fill=-1),
            tok=z(NGRAM_MAX, n),
            count=z(NGRAM_MAX, n),
            stamp=z(NGRAM_MAX, n),
            gs=z(NGRAM_MAX, n),
            ng_keys=z(NGRAM_MAX, n, 4, fill=-1),
            ng_occ=jnp.zeros((batch, NGRAM_MAX, n), bool),
            ng_sum=z(NGRAM_MAX, n),
            ng_best=z(NGRAM_MAX, n, 4),
            ng_heads=z(NGRAM_MAX, n, _PHASE0_BUCKETS, fill=_INT_MAX),
            n_used=z(NGRAM_MAX),
            n_dropped=z(),
            cache_size=z(),
            seq_start=z(),
        )

    def begin(self, state: NgramCacheState, history: TokenHistory) -> NgramCacheState:
        """A new request: the row's context cache emptied, then the prompt counted into it.

        Upstream counts the prompt at the first draft, with the sampled token, as one
        sequence: stream `[0, length + 1)`. Here the prompt's part `[0, length)` is counted
        now (in prefill, with the prompt at hand) and the sequence left open (`seq_start` 0),
        so the first draft counts the rest of that same sequence: the n-grams crossing the
        prompt's end included, the cache equal to upstream's. A decode round that asks then
        only catches up on the tokens generated since."""
        if not self.reset_on_begin:
            return state  # upstream: no-op (bug #27852)
        zero = jnp.zeros_like(state.cache_size)
        # empty = count 0 / ng_occ False; the other fields are rewritten on insertion
        state = replace(
            state,
            count=jnp.zeros_like(state.count),
            ng_occ=jnp.zeros_like(state.ng_occ),
            n_used=jnp.zeros_like(state.n_used),
            n_dropped=zero,
            cache_size=zero,
            seq_start=zero,
        )
        length = history.length.astype(jnp.int32)
        return self.ingest(
            state, history.tokens, length, zero, length > 0, end=length, open_sequence=True
        )

    # ------------------------------------------------------------------ draft
    def draft(
        self, params: NgramCacheTables | None, state: NgramCacheState, inp: DraftInput, k_max: int
    ) -> tuple[NgramCacheState, DraftOutput]:
        tables = params if params is not None else NgramCacheTables()
        length = inp.history.length.astype(jnp.int32)
        last = inp.last_token.astype(jnp.int32)
        drafting = inp.drafting
        B = length.shape[0]
        grow = drafting & (state.cache_size < length + 1)
        state = self.ingest(state, inp.history.tokens, length, last, grow)
        n_steps = min(self.n_draft, k_max)
        if n_steps == 0:
            return state, DraftOutput(
                tokens=jnp.zeros((B, k_max), jnp.int32), valid=jnp.zeros((B, k_max), bool)
            )
        active = drafting & (length + 1 >= NGRAM_STATIC)
        toks, n = _draft_rows(tables, state, inp.history.tokens, length, last, active, n_steps)
        idx = jnp.arange(k_max, dtype=jnp.int32)[None, :]
        valid = (idx < n[:, None]) & ((inp.n_max[:, None] <= 0) | (idx < inp.n_max[:, None]))
        valid = valid & drafting[:, None]
        tokens = jnp.zeros((B, k_max), jnp.int32).at[:, :n_steps].set(toks)
        return state, DraftOutput(tokens=jnp.where(valid, tokens, 0), valid=valid)

    # ------------------------------------------------------------------ ingestion
    def ingest(
        self,
        state: NgramCacheState,
        tokens_BS: Array,
        length: Array,
        last: Array,
        grow: Array,
        end: Array | None = None,
        open_sequence: bool = False,
    ) -> NgramCacheState:
        """Count stream positions `[cache_size, end)` (`end` None: `length + 1`, the whole
        stream `history[0:length] + [last]`) of the rows in `grow` into their context caches
        (see `context_update`) and set their `cache_size = end`.

        `context_update="speculative"`: an n-gram may start at the row's `seq_start`, which
        then moves to `end` (the next ingestion is a new sequence, upstream's quirk) unless
        `open_sequence` (`begin`: the first draft continues the prompt's sequence).

        One loop iteration takes `block` positions of every row (rows batched by hand)."""
        B, S = tokens_BS.shape
        # no limit but the table itself: sized from the capacity (`slots_for`), it always has a
        # free slot for a new pair, found by probing as far as needed (module doc, "Capacity")
        n_slots = state.count.shape[2]
        cap = max_probe = n_slots
        lookup_mode = self.context_update == "lookup"
        c0 = state.cache_size
        target = jnp.where(grow, length + 1 if end is None else end, c0)
        if cpu_kernels.available():  # the native kernel: the same contents, in place
            out = cpu_kernels.ngram_cache_ingest(
                tuple(getattr(state, name) for name in _KERNEL_FIELDS),
                tokens_BS,
                length,
                last,
                target,
                cap=cap,
                max_probe=max_probe,
                lookup=lookup_mode,
                open_sequence=open_sequence,
            )
            return NgramCacheState(**dict(zip(_KERNEL_FIELDS, out, strict=True)))
        blk = self.block
        sizes = jnp.arange(1, NGRAM_MAX + 1, dtype=jnp.int32)
        col = jnp.arange(NGRAM_MAX, dtype=jnp.int32)
        lo = (
            jnp.maximum(c0[:, None], sizes[None, :])
            if lookup_mode
            else jnp.maximum(c0[:, None], state.seq_start[:, None] + sizes[None, :])
        )
        w = jnp.arange(blk, dtype=jnp.int32)

        def stream_at(i: Array) -> Array:  # i [B, ...] stream positions
            flat = i.reshape(B, -1)
            got = jnp.take_along_axis(tokens_BS, jnp.clip(flat, 0, S - 1), axis=1)
            got = jnp.where(flat == length[:, None], last[:, None], got)
            return got.reshape(i.shape)

        def body(carry: tuple[Array, NgramCacheState]) -> tuple[Array, NgramCacheState]:
            p, st = carry
            i = p[:, None] + w[None, :]  # [B, W] follower positions
            valid = (i[:, None, :] >= lo[:, :, None]) & (i[:, None, :] < target[:, None, None])
            src = i[:, None, :, None] - sizes[None, :, None, None] + col[None, None, None, :]
            ng = jnp.where(
                col[None, None, None, :] < sizes[None, :, None, None], stream_at(src), -1
            )
            nxt = jnp.broadcast_to(stream_at(i)[:, None, :, None], (B, NGRAM_MAX, blk, 1))
            k5 = jnp.concatenate([ng, nxt], axis=-1)  # [B, 4, W, 5]
            eq = jnp.all(k5[:, :, :, None, :] == k5[:, :, None, :, :], axis=-1)  # [B,4,W,W]
            eq = eq & valid[:, :, :, None] & valid[:, :, None, :]
            rep = valid & (jnp.argmax(eq, axis=-1).astype(jnp.int32) == w[None, None, :])
            add = jnp.sum(eq, axis=-1).astype(jnp.int32)
            stamp_new = jnp.broadcast_to(i[:, None, :], (B, NGRAM_MAX, blk))
            st = _count_pairs(st, k5, add, stamp_new, rep, cap, max_probe)
            return p + blk, st

        _, state = lax.while_loop(lambda c: jnp.any(c[0] < target), body, (c0, state))
        seq_start = state.seq_start if open_sequence else jnp.where(grow, target, state.seq_start)
        return replace(state, cache_size=target, seq_start=seq_start)


# ---------------------------------------------------------------------------------------------
# table updates (all rows and sizes at once; tables flattened to [B * 4 * N, ...])
# ---------------------------------------------------------------------------------------------


def _flat(a: Array) -> Array:
    """[B, 4, N, ...] -> [B * 4 * N, ...] (a bitcast of the donated buffer)."""
    return a.reshape((-1,) + a.shape[3:])


def _after(x: Array) -> Array:
    """Always True, but data-dependent on `x`: orders a scatter after the gathers behind `x`
    (otherwise XLA cannot prove the order and copies the scattered buffer)."""
    return jnp.sum(x.astype(jnp.int32)) >= 0


def _earlier_claim(loc: Array, empty: Array) -> Array:
    """[..., W] True where an earlier entry (lower index) claims the same empty slot."""
    o = jnp.arange(loc.shape[-1], dtype=jnp.int32)
    same = (loc[..., :, None] == loc[..., None, :]) & empty[..., None, :]
    lower = (o[None, :] < o[:, None]).reshape((1,) * (same.ndim - 2) + same.shape[-2:])
    return jnp.any(same & lower, axis=-1)


def _better(a: tuple[Array, ...], b: tuple[Array, ...]) -> Array:
    """Lexicographic `(count, gs, stamp) a > b` (upstream's first maximum, see docstring)."""
    (ca, ga, sa), (cb, gb, sb) = a, b
    return (ca > cb) | ((ca == cb) & ((ga > gb) | ((ga == gb) & (sa > sb))))


def _count_pairs(
    st: NgramCacheState,
    k5: Array,
    add: Array,
    stamp_new: Array,
    rep: Array,
    cap: int,
    max_probe: int,
) -> NgramCacheState:
    """Add `add` to the count of each unique pair `k5 [B, 4, W, 5]` (where `rep`), inserting
    new pairs while there is room, and update their parts' summaries."""
    B, G, W, _ = k5.shape
    n = st.count.shape[2]
    total = B * G * n
    base = ((jnp.arange(B)[:, None] * G + jnp.arange(G)[None, :]) * n)[:, :, None]  # [B, 4, 1]
    ng_O, tk_O = k5[..., :4], k5[..., 4]
    keys, tok, count, stamp = _flat(st.keys), _flat(st.tok), _flat(st.count), _flat(st.stamp)

    # ---- pair table: find or insert every representative
    home = _home(hash_words(k5), n)

    def pair_body(c):
        probe, pending, keys, tok, count, stamp, n_used, n_drop, at, new = c
        pos = base + ((home + probe) & (n - 1))
        occ = count[pos] > 0
        match = occ & jnp.all(keys[pos] == ng_O, axis=-1) & (tok[pos] == tk_O)
        found = pending & match
        empty = pending & ~occ
        winner = empty & ~_earlier_claim(pos, empty)
        rank = jnp.cumsum(winner.astype(jnp.int32), axis=-1) - 1
        allowed = winner & (n_used[..., None] + rank < cap)
        # `_after(match)`: the scatters must wait for the reads of keys/tok above, or XLA
        # copies the tables instead of updating them in place
        w_idx = jnp.where(allowed & _after(match), pos, total)
        keys = keys.at[w_idx].set(ng_O, mode="drop")
        tok = tok.at[w_idx].set(tk_O, mode="drop")
        stamp = stamp.at[w_idx].set(stamp_new, mode="drop")
        count = count.at[w_idx].set(add, mode="drop")
        count = count.at[jnp.where(found, pos, total)].add(add, mode="drop")
        advance = pending & occ & ~match
        probe = probe + advance.astype(jnp.int32)
        dropped = (winner & ~allowed) | (advance & (probe >= max_probe))
        n_used = n_used + jnp.sum(allowed, axis=-1).astype(jnp.int32)
        n_drop = n_drop + jnp.sum(dropped, axis=(1, 2)).astype(jnp.int32)
        at = jnp.where(found | allowed, pos, at)
        pending = pending & ~found & ~allowed & ~dropped
        return probe, pending, keys, tok, count, stamp, n_used, n_drop, at, new | allowed

    zero = jnp.zeros((B, G, W), jnp.int32)
    carry = (zero, rep, keys, tok, count, stamp, st.n_used, st.n_dropped, zero + total, rep & False)
    _, _, keys, tok, count, stamp, n_used, n_dropped, at, new = lax.while_loop(
        lambda c: jnp.any(c[1]), pair_body, carry
    )
    hit = at < total

    # ---- part table: find or create the part of every counted pair
    ng_keys, ng_occ, ng_heads = _flat(st.ng_keys), _flat(st.ng_occ), _flat(st.ng_heads)
    ng_sum, ng_best = _flat(st.ng_sum), _flat(st.ng_best)
    ng_home = _home(hash_words(ng_O), n)

    def part_body(c):
        probe, pending, ng_keys, ng_occ, ng_heads, ng_sum, ng_best, g = c
        pos = base + ((ng_home + probe) & (n - 1))
        occ = ng_occ[pos]
        match = occ & jnp.all(ng_keys[pos] == ng_O, axis=-1)
        found = pending & match
        empty = pending & ~occ
        winner = empty & ~_earlier_claim(pos, empty)
        w_idx = jnp.where(winner & _after(match), pos, total)
        ng_keys = ng_keys.at[w_idx].set(ng_O, mode="drop")
        ng_occ = ng_occ.at[w_idx].set(True, mode="drop")
        ng_heads = ng_heads.at[w_idx].set(_INT_MAX, mode="drop")
        ng_sum = ng_sum.at[w_idx].set(0, mode="drop")
        ng_best = ng_best.at[w_idx].set(0, mode="drop")
        advance = pending & occ & ~match
        probe = probe + advance.astype(jnp.int32)
        g = jnp.where(found | winner, pos, g)
        pending = pending & ~found & ~winner & (probe < n)
        return probe, pending, ng_keys, ng_occ, ng_heads, ng_sum, ng_best, g

    part_carry = (zero, hit, ng_keys, ng_occ, ng_heads, ng_sum, ng_best, zero + total)
    _, _, ng_keys, ng_occ, ng_heads, ng_sum, ng_best, g = lax.while_loop(
        lambda c: jnp.any(c[1]), part_body, part_carry
    )
    hit = hit & (g < total)

    # ---- bucket-group stamps of new pairs, part sums, best members
    gsafe = jnp.minimum(g, total - 1)
    bucket = jnp.remainder(tk_O, _PHASE0_BUCKETS)
    head_idx = jnp.where(new & hit, gsafe * _PHASE0_BUCKETS + bucket, total * _PHASE0_BUCKETS)
    heads_flat = ng_heads.reshape(-1).at[head_idx].min(stamp_new, mode="drop")
    gs = _flat(st.gs)
    at_safe = jnp.minimum(at, total - 1)
    gs_O = jnp.where(
        new, heads_flat[jnp.minimum(head_idx, total * _PHASE0_BUCKETS - 1)], gs[at_safe]
    )
    gs = gs.at[jnp.where(new & hit, at, total)].set(gs_O, mode="drop")
    ng_sum = ng_sum.at[jnp.where(hit, g, total)].add(add, mode="drop")
    key_O = (count[at_safe], gs_O, stamp[at_safe])
    # the block's best pair per part (pairs of one block are distinct: no equal keys)
    same = (g[..., :, None] == g[..., None, :]) & hit[..., None, :]
    beaten = jnp.any(
        same
        & _better(tuple(k[..., None, :] for k in key_O), tuple(k[..., :, None] for k in key_O)),
        axis=-1,
    )
    old = ng_best[gsafe]  # [B, 4, W, 4]
    win = hit & ~beaten & _better(key_O, (old[..., 0], old[..., 1], old[..., 2]))
    best_new = jnp.stack([*key_O, tk_O], axis=-1)
    ng_best = ng_best.at[jnp.where(win, g, total)].set(best_new, mode="drop")

    shape = st.count.shape
    return replace(
        st,
        keys=keys.reshape(st.keys.shape),
        tok=tok.reshape(shape),
        count=count.reshape(shape),
        stamp=stamp.reshape(shape),
        gs=gs.reshape(shape),
        ng_keys=ng_keys.reshape(st.ng_keys.shape),
        ng_occ=ng_occ.reshape(shape),
        ng_sum=ng_sum.reshape(shape),
        ng_best=ng_best.reshape(st.ng_best.shape),
        ng_heads=heads_flat.reshape(st.ng_heads.shape),
        n_used=n_used,
        n_dropped=n_dropped,
    )


# ---------------------------------------------------------------------------------------------
# drafting (all rows at once)
# ---------------------------------------------------------------------------------------------


def _find_parts(st: NgramCacheState, keys_B44: Array, ok_B4: Array) -> Array:
    """Flat part-table index of each row's n-gram of each size (`[B, 4]`), -1 if absent."""
    B = keys_B44.shape[0]
    n = st.count.shape[2]
    base = (jnp.arange(B)[:, None] * NGRAM_MAX + jnp.arange(NGRAM_MAX)[None, :]) * n
    home = _home(hash_words(keys_B44), n)
    ng_keys, ng_occ = _flat(st.ng_keys), _flat(st.ng_occ)

    def body(c):
        probe, pending, g = c
        pos = base + ((home + probe) & (n - 1))
        occ = ng_occ[pos]
        match = occ & jnp.all(ng_keys[pos] == keys_B44, axis=-1)
        g = jnp.where(pending & match, pos, g)
        probe = probe + 1
        return probe, pending & occ & ~match & (probe < n), g

    init = (jnp.zeros((B, NGRAM_MAX), jnp.int32), ok_B4, jnp.full((B, NGRAM_MAX), -1, jnp.int32))
    return lax.while_loop(lambda c: jnp.any(c[1]), body, init)[2]


def _pick_part(m, tok, count, stamp, gs, w):
    """One part of the context cache (members `m` of a sub-table), weights `w`: upstream's
    `try_draft` choice (token, its count), the sum of counts, and whether a positive maximum
    exists. Scans the sub-table (used only with a static cache)."""
    prod = count * w  # int32 wrap as upstream
    top = jnp.max(jnp.where(m, prod, _INT_MIN))
    total = jnp.sum(jnp.where(m, count, 0)).astype(jnp.int32)
    tied = m & (prod == top)
    best_gs = jnp.max(jnp.where(tied, gs, -1))
    win = jnp.argmax(jnp.where(tied & (gs == best_gs), stamp, -1))
    return tok[win], count[win], total, jnp.any(m) & (top > 0)


def _pick_context_scan(st_row: NgramCacheState, tail, key_ok, g2, static):
    """Context picks of one row by scanning its sub-tables (static weights differ per query)."""
    picks = []
    for s in range(1, NGRAM_MAX + 1):
        m = (st_row.count[s - 1] > 0) & key_ok[s - 1]
        for k in range(s):
            m = m & (st_row.keys[s - 1, :, k] == tail[NGRAM_MAX - s + k])
        w = _static_weights(static, g2, st_row.tok[s - 1])
        picks.append(
            _pick_part(
                m, st_row.tok[s - 1], st_row.count[s - 1], st_row.stamp[s - 1], st_row.gs[s - 1], w
            )
        )
    return tuple(jnp.stack(x) for x in zip(*picks, strict=True))


def _first_ok(best_tok, best_cnt, total, ok, thresholds) -> tuple[Array, Array]:
    """Largest n-gram size passing the thresholds (last axis = size): (found, token)."""
    lead = (1,) * (ok.ndim - 1)
    min_sample, min_percent = (jnp.asarray(t).reshape(lead + (-1,)) for t in thresholds)
    ok = ok & (total >= min_sample) & (jnp.int32(100) * best_cnt >= min_percent * total)
    size_idx = jnp.arange(NGRAM_MAX, dtype=jnp.int32).reshape(lead + (-1,))
    pick = jnp.max(jnp.where(ok, size_idx, -1), axis=-1)
    tok = jnp.take_along_axis(best_tok, jnp.maximum(pick, 0)[..., None], axis=-1)[..., 0]
    return pick >= 0, tok


def _draft_rows(
    tables: NgramCacheTables, st: NgramCacheState, tokens_BS, length, last, active, n_steps: int
) -> tuple[Array, Array]:
    """`[B, n_steps]` drafted tokens and `[B]` their number (rows in `active` only)."""
    B, S = tokens_BS.shape
    inp_size = length + 1
    ipos = inp_size[:, None] + jnp.arange(-NGRAM_MAX, 0, dtype=jnp.int32)[None, :]  # L-4..L-1
    tail0 = jnp.take_along_axis(tokens_BS, jnp.clip(ipos, 0, S - 1), axis=1)
    tail0 = jnp.where(ipos == length[:, None], last[:, None], tail0)
    static, dynamic = tables.static, tables.dynamic
    sizes = jnp.arange(1, NGRAM_MAX + 1, dtype=jnp.int32)
    slot = jnp.arange(NGRAM_MAX, dtype=jnp.int32)
    src = NGRAM_MAX - sizes[:, None] + slot[None, :]  # [4 sizes, 4 slots]
    best = _flat(st.ng_best)
    ng_sum = _flat(st.ng_sum)

    def body(carry):
        step, tail, out, n, active = carry
        L = inp_size + step
        # key_s = last s tokens of stream + draft, -1 padded; invalid if it starts before 0
        used = (slot[None, :] < sizes[:, None])[None]
        keys = jnp.where(used, tail[:, jnp.clip(src, 0, 3)], -1)  # [B,4,4]
        key_ok = L[:, None] - sizes[None, :] >= 0
        key2 = keys[:, NGRAM_STATIC - 1]
        if static is not None:
            g2 = jax.vmap(lambda k: _find_ngram(static, k))(key2)
            picks = jax.vmap(lambda s_row, t, ok, g: _pick_context_scan(s_row, t, ok, g, static))(
                st, tail, key_ok, g2
            )
        else:
            g2 = jnp.full((B,), -1, jnp.int32)
            g = _find_parts(st, keys, key_ok & active[:, None])
            b = best[jnp.maximum(g, 0)]
            picks = (b[..., 3], b[..., 0], ng_sum[jnp.maximum(g, 0)], g >= 0)
        found, token = _first_ok(*picks, _THRESH_LAX)
        if dynamic is not None:
            pt = jax.vmap(lambda k, ok, g: _pick_table(dynamic, k, ok, g, static))(keys, key_ok, g2)
            f2, t2 = _first_ok(*pt, _THRESH_STRICT)
            token = jnp.where(found, token, t2)
            found = found | f2
        if static is not None:
            gc = jnp.maximum(g2, 0)
            tot = static.ng_sum[gc]
            bc = static.ng_best_count[gc]
            f3 = (
                (g2 >= 0)
                & (tot >= MIN_SAMPLE_LAX[NGRAM_STATIC - 1])
                & (bc > 0)
                & (jnp.int32(100) * bc >= jnp.int32(MIN_PERCENT_LAX[NGRAM_STATIC - 1]) * tot)
            )
            token = jnp.where(found, token, static.ng_best_tok[gc])
            found = found | f3
        found = found & active
        out = out.at[:, step].set(jnp.where(found, token, 0))
        tail = jnp.where(found[:, None], jnp.concatenate([tail[:, 1:], token[:, None]], 1), tail)
        return step + 1, tail, out, n + found.astype(jnp.int32), found

    init = (
        jnp.int32(0),
        tail0,
        jnp.zeros((B, n_steps), jnp.int32),
        jnp.zeros((B,), jnp.int32),
        active,
    )
    _, _, out, n, _ = lax.while_loop(lambda c: (c[0] < n_steps) & jnp.any(c[4]), body, init)
    return out, n


# ---------------------------------------------------------------------------------------------
# host helper (no IO: `specjax.io.lookup_file` reads and writes files)
# ---------------------------------------------------------------------------------------------


def context_cache(
    state: NgramCacheState, row: int
) -> dict[tuple[int, int, int, int], dict[int, int]]:
    """Row `row`'s context cache as a cache dict: parts in insertion order (exact), n-grams
    ordered by (first stamp, size) (upstream's record order may differ; content is equal)."""
    count = np.asarray(state.count[row]).reshape(-1)
    idx = np.nonzero(count > 0)[0]
    keys = np.asarray(state.keys[row]).reshape(-1, 4)[idx]
    toks = np.asarray(state.tok[row]).reshape(-1)[idx]
    cnts = count[idx]
    stamps = np.asarray(state.stamp[row]).reshape(-1)[idx]
    sizes = np.sum(keys >= 0, axis=1)
    out: dict[tuple[int, int, int, int], dict[int, int]] = {}
    for j in np.lexsort((toks, sizes, stamps)):
        a, b, c, d = (int(x) for x in keys[j])
        out.setdefault((a, b, c, d), {})[int(toks[j])] = int(cnts[j])
    return out


__all__ = [
    "LookupTable",
    "NgramCache",
    "NgramCacheState",
    "NgramCacheTables",
    "context_cache",
    "hash_words",
]
