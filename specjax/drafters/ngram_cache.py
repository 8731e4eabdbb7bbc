"""ngram-cache (llama.cpp lookup decoding, spec 5.8) on device.

Three caches map an n-gram (up to 4 tokens, -1 padded) to counts of the tokens that followed it:

* **context** (per row, `NgramCacheState`): four open-addressing tables (linear probing), one
  per n-gram size, of `(n-gram, token)` pairs with `table_size` slots each (a power of two;
  default `next_pow2((capacity + 1) / max_load)`: room for every pair of a full history). Each
  slot holds the n-gram, the token, its count and the stream position at which the pair was
  first seen (its insertion stamp). Drafting scans a size's table with one vectorised compare,
  so a step costs O(4 * table_size) per row.
* **dynamic** and **static** (shared by all rows, read-only while generating): `LookupTable`s
  built on the host from llama.cpp cache files (`specjax.lookup`), passed as the drafter's
  `params` (`NgramCacheTables`, or None when no file is used). Their parts are stored
  contiguously in libstdc++ iteration order, with per-n-gram sums and the count-only best token
  precomputed. The dynamic cache is updated on the host after a run (see
  `specjax.lookup.update_dynamic_cache` / `specjax.lookup.cache_from_state`), as llama.cpp's
  lookup example does; the server (and this drafter) never writes files.

Invariants (`draft`, per drafting row, exactly upstream's `common_speculative_impl_ngram_cache`):
* The stream is `history[0:length] + [last_token]`. Positions `[cache_size, length+1)` not yet
  ingested are counted into the context cache as ONE new sequence (`context_update=
  "speculative"`, upstream's quirk: an n-gram starting before `cache_size` is never counted);
  `context_update="lookup"` counts every n-gram ending in the new positions (the lookup
  examples' per-token update). Then `cache_size = length + 1`. Only drafting rows change.
* Up to `min(n_draft, k_max)` tokens are drafted one at a time from the last tokens of stream +
  draft so far: the context cache with lax thresholds for sizes 4..1, then the dynamic cache with
  strict thresholds, then the static cache alone (2-gram); candidates of the context/dynamic
  caches are weighted `count * (100 * static count)` (weight 1 when absent from the static part
  of the last 2 tokens), int32 arithmetic like upstream. No draft when `length + 1 < 2`.
  The relay truncates to `n_max`; this drafter also does.
* Ties between equally weighted candidates go to the first in the C++ map's iteration order.
  Exact for the dynamic/static caches (precomputed on the host) and for context parts with at
  most 13 distinct tokens (libstdc++'s first 13-bucket phase: latest bucket group first, latest
  insertion first within a group). A context part with more distinct tokens is ordered the
  same way, ignoring the reordering of earlier rehashes: ties there can differ from upstream.
  Without a static cache no tie in such a part can pass the thresholds, so the deviation needs
  a static cache.
* `begin` resets the row's context cache and `cache_size` when `reset_on_begin` (default).
  Upstream's `begin` is a no-op (bug #27852: the stale cache of the previous request is kept and
  the new prompt is only ingested beyond the old `cache_size`; acceptance fell from 86% to 11%);
  `reset_on_begin=False` reproduces it. `process/accept/rollback` are no-ops as upstream.

Capacity and full policy: a new pair is inserted only while its size's table holds fewer than
`max_load * table_size` pairs and a free slot is found within `max_probe` linear probes;
otherwise it is dropped (counted in `n_dropped`; a later occurrence may insert it with a partial
count if a probe limit was the cause) while pairs already present keep counting. Results equal
upstream's exactly while `n_dropped == 0`. Read-only tables hold everything they are built from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.drafters.base import DraftInput, DraftOutput, ModelFreeDrafter, TokenHistory
from specjax.drafters.ngram_cache_reference import (
    MIN_PERCENT_LAX,
    MIN_PERCENT_STRICT,
    MIN_SAMPLE_LAX,
    MIN_SAMPLE_STRICT,
    N_DRAFT,
    NGRAM_MAX,
    NGRAM_STATIC,
    i32,
    part_items,
)
from specjax.pytree import pytree_dataclass, replace, static_field
from specjax.types import Array

if TYPE_CHECKING:
    from specjax.config import SpecConfig

#: Buckets of a libstdc++ unordered_map holding 1..13 elements (first growth phase).
_PHASE0_BUCKETS = 13
_INT_MIN = np.iinfo(np.int32).min
_INT_MAX = np.iinfo(np.int32).max

# ---------------------------------------------------------------------------------------------
# hashing (identical on host and device)
# ---------------------------------------------------------------------------------------------

_H0 = 0x811C9DC5
_HM = 0x9E3779B1


def hash_words_np(words: np.ndarray) -> np.ndarray:
    """uint32 hash of int32 rows `[..., W]` (host twin of `hash_words`)."""
    w = np.ascontiguousarray(words, dtype=np.int32).view(np.uint32)
    h = np.full(w.shape[:-1], _H0, np.uint32)
    with np.errstate(over="ignore"):
        for k in range(w.shape[-1]):
            h = (h ^ w[..., k]) * np.uint32(_HM)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def hash_words(words: Array) -> Array:
    """uint32 hash of int32 rows `[..., W]` (murmur3-finalised multiply-xor)."""
    w = lax.bitcast_convert_type(words.astype(jnp.int32), jnp.uint32)
    h = jnp.full(w.shape[:-1], _H0, jnp.uint32)
    for k in range(w.shape[-1]):
        h = (h ^ w[..., k]) * jnp.uint32(_HM)
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


@pytree_dataclass
class LookupTable:
    """A read-only n-gram cache on device (built by `build_lookup_table`).

    N-gram `g` owns entries `[off[g], off[g] + len[g])` in libstdc++ iteration order.
    `ng_slots` / `pair_slots` are linear-probing hash tables (-1 = empty) over the n-gram keys
    and over `(g, token)`; a key is always found within `ng_probe` / `pair_probe` probes.
    """

    ng_keys: Array  # [G, 4] int32
    ng_off: Array  # [G] int32
    ng_len: Array  # [G] int32
    ng_sum: Array  # [G] int32, sum of counts (int32 wrap, as upstream)
    ng_best_tok: Array  # [G] int32, first max count in iteration order
    ng_best_count: Array  # [G] int32
    ng_slots: Array  # [Hg] int32 -> n-gram index
    ent_ng: Array  # [E] int32
    ent_tok: Array  # [E] int32
    ent_count: Array  # [E] int32
    pair_slots: Array  # [Hp] int32 -> entry index
    ng_probe: int = static_field(default=1)
    pair_probe: int = static_field(default=1)
    max_len: int = static_field(default=1)

    @property
    def n_ngrams(self) -> int:
        return int(self.ng_keys.shape[0])


@pytree_dataclass
class NgramCacheTables:
    """The drafter's params: shared read-only caches (None = no such file)."""

    static: LookupTable | None = None
    dynamic: LookupTable | None = None


def _np_hash_table(h: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """Linear-probing table of `len(h)` keys with hashes `h`: (slots -> key index, max probes)."""
    slots = np.full((size,), -1, np.int32)
    n = h.shape[0]
    if n == 0:
        return slots, 1
    home = (h & np.uint32(size - 1)).astype(np.int64)
    probe = np.zeros((n,), np.int64)
    pending = np.arange(n)
    while pending.size:
        pos = (home[pending] + probe[pending]) & (size - 1)
        free = slots[pos] == -1
        cand, cpos = pending[free], pos[free]
        upos, first = np.unique(cpos, return_index=True)
        slots[upos] = cand[first]
        won = np.zeros((n,), bool)
        won[cand[first]] = True
        pending = pending[~won[pending]]
        probe[pending] += 1
    return slots, int(probe.max()) + 1


def build_lookup_table(
    cache: dict[tuple[int, int, int, int], dict[int, int]],
    min_shape: tuple[int, int, int, int] | None = None,
) -> LookupTable | None:
    """Device table of a cache dict (`specjax.lookup` form: insertion order = file order).

    None for an empty cache. Parts are laid out in libstdc++ iteration order so the first
    maximum of a window is upstream's choice. `min_shape = (n-grams, entries, longest part,
    probes)` pads the arrays (and static sizes) to at least these, so caches of different sizes
    share one compiled program (an empty cache then gives a table that never matches).
    """
    if not cache and min_shape is None:
        return None
    pad_g, pad_e, pad_len, pad_probe = min_shape or (0, 0, 0, 0)
    G = max(len(cache), pad_g)
    ng_keys = np.zeros((G, 4), np.int32)
    ng_off = np.zeros((G,), np.int32)
    ng_len = np.zeros((G,), np.int32)
    ng_sum = np.zeros((G,), np.int32)
    best_tok = np.zeros((G,), np.int32)
    best_cnt = np.zeros((G,), np.int32)
    ent_tok: list[int] = []
    ent_count: list[int] = []
    ent_ng: list[int] = []
    for g, (ng, part) in enumerate(cache.items()):
        if len(ng) != 4:
            raise ValueError(f"n-gram {ng!r} does not have 4 slots")
        items = part_items(part)
        ng_keys[g] = ng
        ng_off[g] = len(ent_tok)
        ng_len[g] = len(items)
        total, bt, bc = 0, -1, 0
        for tok, count in items:
            if count > bc:
                bt, bc = tok, count
            total = i32(total + count)
            ent_tok.append(tok)
            ent_count.append(count)
            ent_ng.append(g)
        ng_sum[g], best_tok[g], best_cnt[g] = total, bt, bc
    n_real, e_real = len(cache), len(ent_tok)
    E = max(e_real, pad_e)
    ent_ng_a = np.full((E,), -1, np.int32)
    ent_ng_a[:e_real] = ent_ng
    ent_tok_a = np.full((E,), -1, np.int32)
    ent_tok_a[:e_real] = ent_tok
    ent_count_a = np.zeros((E,), np.int32)
    ent_count_a[:e_real] = ent_count
    ng_keys[n_real:] = -2  # padding n-grams: never hashed, never matched
    ng_slots, ng_probe = _np_hash_table(hash_words_np(ng_keys[:n_real]), _next_pow2(2 * G))
    pair_slots, pair_probe = _np_hash_table(
        hash_words_np(np.stack([ent_ng_a[:e_real], ent_tok_a[:e_real]], axis=-1)),
        _next_pow2(2 * E),
    )
    return LookupTable(
        ng_keys=jnp.asarray(ng_keys),
        ng_off=jnp.asarray(ng_off),
        ng_len=jnp.asarray(ng_len),
        ng_sum=jnp.asarray(ng_sum),
        ng_best_tok=jnp.asarray(best_tok),
        ng_best_count=jnp.asarray(best_cnt),
        ng_slots=jnp.asarray(ng_slots),
        ent_ng=jnp.asarray(ent_ng_a),
        ent_tok=jnp.asarray(ent_tok_a),
        ent_count=jnp.asarray(ent_count_a),
        pair_slots=jnp.asarray(pair_slots),
        ng_probe=max(ng_probe, pad_probe),
        pair_probe=max(pair_probe, pad_probe),
        max_len=max(int(ng_len.max(initial=0)), pad_len, 1),
    )


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


# ---------------------------------------------------------------------------------------------
# drafter state and config
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class NgramCacheState:
    """Per-row context cache, one sub-table per n-gram size (leaves have leading dimension B).

    Sub-table `s-1` holds the `(n-gram of size s, token)` pairs; its n-grams use columns
    `0..s-1` of `keys` (the rest -1). A slot is empty iff its count is 0.
    """

    keys: Array  # [B, 4, N, 4] int32
    tok: Array  # [B, 4, N] int32 following token
    count: Array  # [B, 4, N] int32, 0 = empty slot
    stamp: Array  # [B, 4, N] int32 stream position of the pair's first occurrence
    n_used: Array  # [B, 4] int32 occupied slots per sub-table
    n_dropped: Array  # [B] int32 new pairs dropped because a sub-table was full
    cache_size: Array  # [B] int32 stream tokens ingested (upstream `cache_size`)


_THRESH_LAX = (np.asarray(MIN_SAMPLE_LAX, np.int32), np.asarray(MIN_PERCENT_LAX, np.int32))
_THRESH_STRICT = (
    np.asarray(MIN_SAMPLE_STRICT, np.int32),
    np.asarray(MIN_PERCENT_STRICT, np.int32),
)


@dataclass(frozen=True)
class NgramCache(ModelFreeDrafter):
    """llama.cpp `ngram-cache` (see the module docstring for invariants and capacity).

    `table_size`: slots of each of the 4 per-size sub-tables of a row (a power of two); 0 =
    `next_pow2((capacity + 1) / max_load)`, room for every pair of a full history.
    `block`: stream positions ingested per loop iteration.
    """

    name: ClassVar[str] = "ngram-cache"
    n_draft: int = N_DRAFT
    table_size: int = 0
    max_load: float = 0.75
    max_probe: int = 64
    block: int = 32
    reset_on_begin: bool = True
    context_update: str = "speculative"

    def __post_init__(self) -> None:
        if self.n_draft < 0:
            raise ValueError(f"ngram-cache: n_draft must be >= 0, got {self.n_draft}")
        if self.table_size < 0 or (self.table_size & (self.table_size - 1)):
            raise ValueError(
                f"ngram-cache: table_size must be 0 or a power of two, got {self.table_size}"
            )
        if not 0.0 < self.max_load <= 1.0:
            raise ValueError(f"ngram-cache: max_load must be in (0, 1], got {self.max_load}")
        if self.max_probe < 1 or self.block < 1:
            raise ValueError("ngram-cache: max_probe and block must be >= 1")
        if self.context_update not in ("speculative", "lookup"):
            raise ValueError(
                f"ngram-cache: context_update must be 'speculative' or 'lookup', "
                f"got {self.context_update!r}"
            )

    # ------------------------------------------------------------------ state
    def slots_for(self, capacity: int) -> int:
        """Slots per sub-table for a history capacity."""
        if self.table_size:
            return self.table_size
        return _next_pow2(math.ceil((capacity + 1) / self.max_load))

    def init(self, batch: int, capacity: int) -> NgramCacheState:
        n = self.slots_for(capacity)
        return NgramCacheState(
            keys=jnp.full((batch, NGRAM_MAX, n, 4), -1, jnp.int32),
            tok=jnp.zeros((batch, NGRAM_MAX, n), jnp.int32),
            count=jnp.zeros((batch, NGRAM_MAX, n), jnp.int32),
            stamp=jnp.zeros((batch, NGRAM_MAX, n), jnp.int32),
            n_used=jnp.zeros((batch, NGRAM_MAX), jnp.int32),
            n_dropped=jnp.zeros((batch,), jnp.int32),
            cache_size=jnp.zeros((batch,), jnp.int32),
        )

    def begin(self, state: NgramCacheState, history: TokenHistory) -> NgramCacheState:
        del history
        if not self.reset_on_begin:
            return state  # upstream: no-op (bug #27852)
        return replace(
            state,
            count=jnp.zeros_like(state.count),
            n_used=jnp.zeros_like(state.n_used),
            n_dropped=jnp.zeros_like(state.n_dropped),
            cache_size=jnp.zeros_like(state.cache_size),
        )

    # ------------------------------------------------------------------ params
    def load_params(
        self, static_path: str | None = None, dynamic_path: str | None = None
    ) -> NgramCacheTables | None:
        """Device tables from llama.cpp cache files (None when neither is given).

        A dynamic cache that does not exist yet is empty (it is created at the end of the
        run, as llama.cpp's lookup example does); a missing static cache is an error.
        """
        import os

        from specjax.lookup import load_cache

        static = load_cache(static_path) if static_path else None
        has_dynamic = bool(dynamic_path) and os.path.exists(str(dynamic_path))
        dynamic = load_cache(str(dynamic_path)) if has_dynamic else None
        return make_tables(static, dynamic)

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

        def row(keys, tok, count, stamp, tokens_S, length, last, active):
            return _draft_row(
                tables, keys, tok, count, stamp, tokens_S, length, last, active, n_steps
            )

        toks, n = jax.vmap(row)(
            state.keys,
            state.tok,
            state.count,
            state.stamp,
            inp.history.tokens,
            length,
            last,
            drafting & (length + 1 >= NGRAM_STATIC),
        )
        idx = jnp.arange(k_max, dtype=jnp.int32)[None, :]
        valid = (idx < n[:, None]) & ((inp.n_max[:, None] <= 0) | (idx < inp.n_max[:, None]))
        valid = valid & drafting[:, None]
        tokens = jnp.zeros((B, k_max), jnp.int32).at[:, :n_steps].set(toks)
        return state, DraftOutput(tokens=jnp.where(valid, tokens, 0), valid=valid)

    # ------------------------------------------------------------------ ingestion
    def ingest(
        self, state: NgramCacheState, tokens_BS: Array, length: Array, last: Array, grow: Array
    ) -> NgramCacheState:
        """Count stream positions `[cache_size, length+1)` of the rows in `grow` into their
        context caches (see `context_update`) and set their `cache_size = length + 1`."""
        n_slots = state.count.shape[2]
        cap = int(self.max_load * n_slots)
        lookup_mode = self.context_update == "lookup"
        blk, max_probe = self.block, self.max_probe
        sizes = jnp.arange(1, NGRAM_MAX + 1, dtype=jnp.int32)
        col = jnp.arange(NGRAM_MAX, dtype=jnp.int32)

        def row(keys, tok, count, stamp, n_used, n_dropped, c0, tokens_S, length, last, grow):
            target = jnp.where(grow, length + 1, c0)
            S = tokens_S.shape[0]

            def stream_at(i: Array) -> Array:
                return jnp.where(i == length, last, tokens_S[jnp.clip(i, 0, S - 1)])

            def body(carry):
                p, keys, tok, count, stamp, n_used, n_dropped = carry
                i = p + jnp.arange(blk, dtype=jnp.int32)  # follower positions [W]
                lo = jnp.maximum(c0, sizes) if lookup_mode else c0 + sizes  # [4]
                valid = (i[None, :] >= lo[:, None]) & (i[None, :] < target)  # [4, W]
                src = i[None, :, None] - sizes[:, None, None] + col[None, None, :]  # [4, W, 4]
                ng = jnp.where(col[None, None, :] < sizes[:, None, None], stream_at(src), -1)
                nxt = jnp.broadcast_to(stream_at(i)[None, :, None], (NGRAM_MAX, blk, 1))
                k5 = jnp.concatenate([ng, nxt], axis=-1)  # [4, W, 5]
                eq = jnp.all(k5[:, :, None, :] == k5[:, None, :, :], axis=-1)  # [4, W, W]
                eq = eq & valid[:, :, None] & valid[:, None, :]
                w = jnp.arange(blk, dtype=jnp.int32)
                rep = valid & (jnp.argmax(eq, axis=2).astype(jnp.int32) == w[None, :])
                add = jnp.sum(eq, axis=2).astype(jnp.int32)
                stamp_new = jnp.broadcast_to(i[None, :], (NGRAM_MAX, blk))
                ins = jax.vmap(_insert, in_axes=(0, 0, 0, 0, 0, 0, 0, 0, 0, None, None))
                keys, tok, count, stamp, n_used, dropped = ins(
                    keys, tok, count, stamp, n_used, k5, add, stamp_new, rep, cap, max_probe
                )
                return p + blk, keys, tok, count, stamp, n_used, n_dropped + jnp.sum(dropped)

            carry = (c0, keys, tok, count, stamp, n_used, n_dropped)
            carry = lax.while_loop(lambda c: c[0] < target, body, carry)
            _, keys, tok, count, stamp, n_used, n_dropped = carry
            return keys, tok, count, stamp, n_used, n_dropped, target

        keys, tok, count, stamp, n_used, n_dropped, cache_size = jax.vmap(row)(
            state.keys,
            state.tok,
            state.count,
            state.stamp,
            state.n_used,
            state.n_dropped,
            state.cache_size,
            tokens_BS,
            length,
            last,
            grow,
        )
        return NgramCacheState(
            keys=keys,
            tok=tok,
            count=count,
            stamp=stamp,
            n_used=n_used,
            n_dropped=n_dropped.astype(jnp.int32),
            cache_size=cache_size,
        )


def _insert(keys, tok, count, stamp, n_used, k5_O, add_O, stamp_O, rep_O, cap, max_probe):
    """Add `add` to the count of each unique pair `k5` (where `rep`) in one sub-table,
    inserting new pairs while there is room. Returns the table and the number dropped."""
    n = count.shape[0]
    home = _home(hash_words(k5_O), n)
    o = jnp.arange(k5_O.shape[0], dtype=jnp.int32)
    ng_O, tk_O = k5_O[:, :4], k5_O[:, 4]

    def body(carry):
        probe, pending, keys, tok, count, stamp, n_used, n_dropped = carry
        pos = (home + probe) & (n - 1)
        occ = count[pos] > 0
        match = occ & jnp.all(keys[pos] == ng_O, axis=-1) & (tok[pos] == tk_O)
        found = pending & match
        empty = pending & ~occ
        earlier = (pos[:, None] == pos[None, :]) & empty[None, :] & (o[None, :] < o[:, None])
        winner = empty & ~jnp.any(earlier, axis=1)
        rank = jnp.cumsum(winner.astype(jnp.int32)) - 1
        allowed = winner & (n_used + rank < cap)
        refused = winner & ~allowed
        w_idx = jnp.where(allowed, pos, n)
        keys = keys.at[w_idx].set(ng_O, mode="drop")
        tok = tok.at[w_idx].set(tk_O, mode="drop")
        stamp = stamp.at[w_idx].set(stamp_O, mode="drop")
        count = count.at[w_idx].set(add_O, mode="drop")
        count = count.at[jnp.where(found, pos, n)].add(add_O, mode="drop")
        advance = pending & occ & ~match
        probe = probe + advance.astype(jnp.int32)
        give_up = advance & (probe >= max_probe)
        dropped = refused | give_up
        n_used = n_used + jnp.sum(allowed).astype(jnp.int32)
        n_dropped = n_dropped + jnp.sum(dropped).astype(jnp.int32)
        pending = pending & ~found & ~allowed & ~dropped
        return probe, pending, keys, tok, count, stamp, n_used, n_dropped

    carry = (jnp.zeros_like(o), rep_O, keys, tok, count, stamp, n_used, jnp.int32(0))
    carry = lax.while_loop(lambda c: jnp.any(c[1]), body, carry)
    return carry[2:]


# ---------------------------------------------------------------------------------------------
# drafting (one row)
# ---------------------------------------------------------------------------------------------


def _pick_part(m, tok, count, stamp, w):
    """One part of the context cache (members `m` of a sub-table): upstream's `try_draft`
    choice (token, its count), the sum of counts, and whether a positive maximum exists."""
    prod = count * w  # int32 wrap as upstream
    top = jnp.max(jnp.where(m, prod, _INT_MIN))
    total = jnp.sum(jnp.where(m, count, 0)).astype(jnp.int32)
    tied = m & (prod == top)
    # libstdc++ iteration order of a <= 13 element map: latest bucket group first, then latest
    bucket = jnp.remainder(tok, _PHASE0_BUCKETS)
    heads = (
        jnp.full((_PHASE0_BUCKETS,), _INT_MAX, jnp.int32)
        .at[bucket]
        .min(jnp.where(m, stamp, _INT_MAX))
    )
    gs = heads[bucket]
    best_gs = jnp.max(jnp.where(tied, gs, -1))
    win = jnp.argmax(jnp.where(tied & (gs == best_gs), stamp, -1))
    return tok[win], count[win], total, jnp.any(m) & (top > 0)


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


def _first_ok(best_tok, best_cnt, total, ok, thresholds) -> tuple[Array, Array]:
    """Largest n-gram size passing the thresholds: (found, token)."""
    min_sample, min_percent = (jnp.asarray(t) for t in thresholds)
    ok = ok & (total >= min_sample) & (jnp.int32(100) * best_cnt >= min_percent * total)
    size_idx = jnp.arange(4, dtype=jnp.int32)
    pick = jnp.max(jnp.where(ok, size_idx, -1))
    return pick >= 0, best_tok[jnp.maximum(pick, 0)]


def _draft_row(
    tables: NgramCacheTables, keys, tok, count, stamp, tokens_S, length, last, active, n_steps: int
) -> tuple[Array, Array]:
    S = tokens_S.shape[0]
    inp_size = length + 1
    ipos = inp_size + jnp.arange(-NGRAM_MAX, 0, dtype=jnp.int32)  # positions L-4..L-1
    tail0 = jnp.where(ipos == length, last, tokens_S[jnp.clip(ipos, 0, S - 1)])
    static, dynamic = tables.static, tables.dynamic
    sizes = jnp.arange(1, NGRAM_MAX + 1, dtype=jnp.int32)
    slot = jnp.arange(NGRAM_MAX, dtype=jnp.int32)

    def body(carry):
        step, tail, out, active = carry
        L = inp_size + step
        # key_s = last s tokens of stream + draft, -1 padded; invalid if it starts before 0
        src = NGRAM_MAX - sizes[:, None] + slot[None, :]  # [4 sizes, 4 slots]
        keys_4x4 = jnp.where(slot[None, :] < sizes[:, None], tail[jnp.clip(src, 0, 3)], -1)
        key_ok = L - sizes >= 0
        key2 = keys_4x4[NGRAM_STATIC - 1]
        g2 = _find_ngram(static, key2) if static is not None else jnp.int32(-1)
        picks = []
        for s in range(1, NGRAM_MAX + 1):
            m = (count[s - 1] > 0) & key_ok[s - 1]
            for k in range(s):
                m = m & (keys[s - 1, :, k] == tail[NGRAM_MAX - s + k])
            w = _static_weights(static, g2, tok[s - 1])
            picks.append(_pick_part(m, tok[s - 1], count[s - 1], stamp[s - 1], w))
        found, token = _first_ok(*(jnp.stack(x) for x in zip(*picks, strict=True)), _THRESH_LAX)
        if dynamic is not None:
            f2, t2 = _first_ok(*_pick_table(dynamic, keys_4x4, key_ok, g2, static), _THRESH_STRICT)
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
        out = out.at[step].set(jnp.where(found, token, 0))
        tail = jnp.where(found, jnp.concatenate([tail[1:], token[None]]), tail)
        return step + 1, tail, out, found

    init = (jnp.int32(0), tail0, jnp.zeros((n_steps,), jnp.int32), active)
    step, _, out, active_end = lax.while_loop(lambda c: (c[0] < n_steps) & c[3], body, init)
    n = jnp.where(active_end, step, step - 1)
    return out, jnp.maximum(n, 0).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# host helpers
# ---------------------------------------------------------------------------------------------


def make_tables(
    static: dict[tuple[int, int, int, int], dict[int, int]] | None,
    dynamic: dict[tuple[int, int, int, int], dict[int, int]] | None,
    min_shape: tuple[int, int, int, int] | None = None,
) -> NgramCacheTables | None:
    """Drafter params from cache dicts (None when both are empty/absent); `min_shape` as in
    `build_lookup_table`."""
    st = build_lookup_table(static or {}, min_shape) if static or min_shape else None
    dy = build_lookup_table(dynamic or {}, min_shape) if dynamic or min_shape else None
    if st is None and dy is None:
        return None
    return NgramCacheTables(static=st, dynamic=dy)


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


def build_ngram_cache(spec: SpecConfig) -> tuple[NgramCache, NgramCacheTables | None]:
    """Registry entry: the drafter and its params (tables from `-lcs` / `-lcd` files)."""
    drafter = NgramCache(n_draft=spec.ngram_cache_n_draft)
    return drafter, drafter.load_params(spec.lookup_cache_static, spec.lookup_cache_dynamic)


__all__ = [
    "LookupTable",
    "NgramCache",
    "NgramCacheState",
    "NgramCacheTables",
    "build_lookup_table",
    "build_ngram_cache",
    "context_cache",
    "hash_words",
    "hash_words_np",
    "make_tables",
]
