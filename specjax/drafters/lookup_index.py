"""Which rows a chain of lookup drafters could draft for this round, for one hash and one read.

A lookup drafter (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod) declares
`lookup_size()` n and `lookup_gap()` g: it can draft only where the stream's last n tokens
occurred earlier in the stream, ending at a position <= L - 1 - g (L: the position of the
stream's last token; ngram-map-k, for one, scans only occurrences followed by m + 1
tokens). Asking it costs a round more than a plain one (the relay, and on XLA CPU the loop
structure around it: ~65 us against ~150 us for a whole plain round of the shipped target),
so over text that does not repeat the governor's probes were the whole cost of carrying
such a drafter. This index answers the question before anyone is asked: the engine keeps,
beside the token history, a bit table of the n-grams the stream has held, and the governor
asks a row only where the n-gram ending at its last token is in it.

Table: `[G, M]` bool, G = B (a row each) or 1 (`shared`: one table for all rows); M a power
of two, about 8 slots per cell the table covers. An n-gram `t[p-n+1 : p+1]` sets two slots
(a Bloom filter of two hashes): the top log2(M) bits of two 32-bit mixes of a polynomial hash
(`ngram_end_hashes`, mod 2^32) of its key, and it is in the table when both are set. Every
True that is not a repeat is an ask that finds nothing (~80 us at B = 1 on the shared 2-core
host, half a plain round). One slot at 4 per cell answered True for 8% of new n-grams over a
third-full table (ngram-mod was asked 13 times for nothing in 256 tokens of a benchmark
prompt in which no 24-gram repeats, and the governor backed off before ngram-map-k's real
repeats); two at 8 per cell answer 0.6% there, for twice the bytes.

The key is the n-gram itself when n <= KEY_TOKENS, else KEY_TOKENS of its tokens spread
evenly over it, its first and last among them (`key_offsets`): a round hashes at most
KEY_TOKENS tokens per position whatever n is (a 1,024-gram's hash was most of the index's
time), and equal n-grams still have equal keys. n is the shortest `lookup_size` of the chain
(a longer n-gram that occurred earlier ends with a shorter one that did) and g its smallest
`lookup_gap`.

Invariants:
* After prefill and after every round, for each row b and every position p with
  n - 1 <= p <= length_b - 1 - g (the n-grams a lookup may use), both slots of the n-gram
  ending at p are set in the row's table. So `query` is never False where the
  chain could draft: a False is exact, a True may come from colliding slots or, for
  n > KEY_TOKENS, from an n-gram that agrees with an earlier one on the key's tokens only
  (then the asked drafter finds nothing, as it did without the index).
* `shared`: a drafter of the chain keeps memory shared by all rows, which outlives a request
  (ngram-mod's pool: a leaf of its state has no batch axis). Its lookups may then hit
  n-grams of another row or of an earlier request, so the one table collects every row's
  n-grams and is never cleared (continuous batching keeps it across requests, as the pool
  is kept). It fills request after request, so it has 4 times the slots per cell
  (`SHARED_SLOTS_PER_CELL`): after 4 capacities' worth of n-grams it collides as often as
  a table of one request does when full. When such a state is carried into a call (a
  server slot's drafter memory), the n-grams it already holds are unknown: the table
  starts full and every row stays askable, unless the table of the call that left the
  state comes with it (a `Generator` keeps it beside its drafter states): the new prompts'
  n-grams are then added to it.
* The index decides only whether the governor asks a row (`engine.draft_budget`): with the
  cost model off (llama.cpp's behaviour, `adaptive=False`) every row is asked as before,
  and the tokens never depend on it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafter, per_row_leaves
from specjax.types import Array

#: Table slots per cell the table covers. With two slots set per n-gram (`_slots`), a lookup
#: over a table whose cells all hold n-grams comes back True by collision with probability
#: about (1 - e^(-2/8))^2 = 5%; over a third of them, 0.6% (one slot at 4 per cell: 22%, 8%).
SLOTS_PER_CELL = 8
#: The same for a shared table, which is never cleared: a `Generator` serving 16 requests
#: of 600 tokens at 2,048 cells put ~4.7 n-grams per cell into it, where two slots at 8 per
#: cell collide for about half of new n-grams (6% at 32 per cell).
SHARED_SLOTS_PER_CELL = 32
#: The smallest table (slots per row), and the largest shared one (16 MB).
MIN_SLOTS = 1024
MAX_SHARED_SLOTS = 1 << 24
#: `insert` hashes up to this many positions window by window (a round's K + 1 new tokens:
#: O(width * key tokens), no pass over S); more (a prompt), from shifted copies of the row.
ROUND_WIDTH = 128


#: Most tokens of an n-gram its hash reads (`key_offsets`).
KEY_TOKENS = 32

#: Odd multiplier of `ngram_end_hashes`.
_HASH_A = 0x9E3779B1
#: Odd multiplier of `_slots`' second mix.
_SECOND_MIX = 0x2C1B3C6D


def _powers(x: int, count: int) -> np.ndarray:
    """x^0 .. x^(count-1) mod 2^32 (uint32 products wrap)."""
    steps = np.full(max(count - 1, 0), x, np.uint32)
    return np.concatenate([np.ones(1, np.uint32), np.cumprod(steps, dtype=np.uint32)])


def key_offsets(n: int) -> np.ndarray:
    """Which tokens of an n-gram its hash reads, as offsets from its first token (ascending):
    all n when n <= KEY_TOKENS, else k (n - 1) // (KEY_TOKENS - 1) for k < KEY_TOKENS (the
    first and the last token and evenly spread between)."""
    if n <= KEY_TOKENS:
        return np.arange(n)
    return np.arange(KEY_TOKENS) * (n - 1) // (KEY_TOKENS - 1)


def ngram_end_hashes(tokens_BS: Array, n: int) -> Array:
    """[B, S] uint32: the hash of the n-gram `t[p-n+1 : p+1]` ending at each position p (equal
    n-grams hash equally wherever they are; garbage where p < n - 1).

    Polynomial `sum_k (t_{p-n+1+o_k} + 1) A^k mod 2^32` over the key's offsets o_k
    (`key_offsets`): one shifted copy of the row per key token, O(S * min(n, KEY_TOKENS))."""
    B, S = tokens_BS.shape
    terms = tokens_BS.astype(jnp.uint32) + jnp.uint32(1)
    hashes = jnp.zeros((B, S), jnp.uint32)
    offsets = key_offsets(n)
    for power, offset in zip(_powers(_HASH_A, len(offsets)), offsets):
        back = min(n - 1 - int(offset), S)  # (the key token sits `back` positions before p)
        shifted = jnp.pad(terms[:, : S - back], ((0, 0), (back, 0)))
        hashes = hashes + shifted * jnp.uint32(power)
    return hashes


def lookup_n(drafters: Sequence[Drafter]) -> int | None:
    """The chain's shortest `lookup_size`, or None: no drafters, or one without a lookup
    size (draft-simple, ngram-cache: they may draft without any repeat)."""
    sizes = [d.lookup_size() for d in drafters]
    known = [int(n) for n in sizes if n is not None]
    if not sizes or len(known) < len(sizes):
        return None
    return min(known)


def lookup_gap(drafters: Sequence[Drafter]) -> int:
    """The chain's smallest `lookup_gap` (`Drafter.lookup_gap`: 0 unless a drafter says)."""
    return min((int(d.lookup_gap()) for d in drafters), default=0)


def shares_memory(drafters: Sequence[Any], capacity: int) -> bool:
    """Whether some drafter's state has a leaf without the batch axis (memory shared by the
    rows and kept across requests, such as ngram-mod's pool)."""
    return _shares_memory(tuple(drafters), capacity)


@functools.lru_cache(maxsize=64)
def _shares_memory(drafters: tuple[Any, ...], capacity: int) -> bool:
    # (cached: two `eval_shape`s of each drafter's `init`, ~3 ms, for an answer fixed by
    # the configuration, asked by each `generate` call of a Generator)
    return not all(all(per_row_leaves(d, capacity)) for d in drafters)


def table_shape(batch: int, capacity: int, shared: bool) -> tuple[int, int]:
    """(G, M) of the table of `batch` rows of `capacity` cells."""
    wanted = SHARED_SLOTS_PER_CELL * capacity * batch if shared else SLOTS_PER_CELL * capacity
    slots = max(MIN_SLOTS, 1 << int(np.ceil(np.log2(wanted))))
    return (1, min(slots, MAX_SHARED_SLOTS)) if shared else (batch, slots)


def _slots(hashes: Array, slots: int) -> Array:
    """`[..., 2]` table slots of each hash: the top log2(slots) bits of its 32-bit
    finalizer mix (MurmurHash3's `fmix32`; the polynomial's own top bits barely depend on
    its oldest token, whose term is not multiplied), and those of that mix folded and
    multiplied once more (its top bits depend on all of the first mix's bits)."""
    x = hashes ^ (hashes >> jnp.uint32(16))
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> jnp.uint32(13))
    x = x * jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> jnp.uint32(16))
    # (a select over a broadcast last axis, not a stack: a concatenation is a kernel of its
    # own on XLA CPU, every round)
    x = x[..., None]
    second = jnp.arange(2) == 1
    y = jnp.where(second, (x ^ (x >> jnp.uint32(15))) * jnp.uint32(_SECOND_MIX), x)
    return (y >> jnp.uint32(32 - (slots.bit_length() - 1))).astype(jnp.int32)


def _group(table: Array, batch: int) -> Array:
    """[B] the table row of each batch row."""
    return jnp.arange(batch) if table.shape[0] == batch else jnp.zeros((batch,), jnp.int32)


def _key_hashes(keys_BEk: Array) -> Array:
    """Hash of each key `keys_BEk[..., :]` (an n-gram's key tokens, oldest first), as
    `ngram_end_hashes` computes it: sum_k (t_k + 1) A^k mod 2^32."""
    k = keys_BEk.shape[-1]
    pow_a = jnp.asarray(_powers(_HASH_A, k)).reshape((1,) * (keys_BEk.ndim - 1) + (k,))
    terms = (keys_BEk.astype(jnp.uint32) + jnp.uint32(1)) * pow_a
    return jnp.sum(terms, axis=-1, dtype=jnp.uint32)


def build(
    history_BS: Array,
    length_B: Array,
    n: int,
    shape: tuple[int, int],
    gap: int = 0,
    table: Array | None = None,
) -> Array:
    """A table holding the n-grams ending at positions n-1 .. length-1-gap of every row (and
    those `table`, of that shape, already holds)."""
    S = history_BS.shape[1]
    table = jnp.zeros(shape, bool) if table is None else table
    count = jnp.maximum(length_B - gap, 0)
    return insert(table, history_BS, jnp.zeros_like(length_B), count, n, S)


@jax.named_scope("lookup")
def insert(
    table: Array, history_BS: Array, first_B: Array, count_B: Array, n: int, width: int
) -> Array:
    """`table` with the n-grams ending at positions first .. first + count - 1 of each row
    (count <= width, static) set; positions < n - 1 hold no n-gram and are skipped."""
    if width <= ROUND_WIDTH:  # (a round's few positions: their keys, O(width * key tokens))
        beyond = first_B + width  # (a query position past every window; its answer unused)
        return advance(table, history_BS, first_B, count_B, beyond, first_B, n, width)[0]
    # (a prompt: every position's hash, O(S * key tokens))
    S = history_BS.shape[1]
    ends_BW = first_B[:, None] + jnp.arange(width)[None, :]
    hashes_BW = jnp.take_along_axis(
        ngram_end_hashes(history_BS, n), jnp.clip(ends_BW, 0, S - 1), axis=1
    )
    ok_BW = _insertable(ends_BW, count_B, n, S)
    return _mark(table, _flat_slots(table, hashes_BW), ok_BW)[0]


@jax.named_scope("lookup")
def advance(
    table: Array,
    history_BS: Array,
    first_B: Array,
    count_B: Array,
    length_B: Array,
    last_B: Array,
    n: int,
    width: int,
) -> tuple[Array, Array]:
    """`insert(table, history_BS, first_B, count_B, n, width)` and then `query` at
    (length_B, last_B), their windows hashed in one pass (a round's: width <= ROUND_WIDTH):
    what a round leaves for the next one to read."""
    B, S = history_BS.shape
    # window ends: the inserted positions, then the query's (a select, not a concatenate: a
    # kernel of its own on XLA CPU, every round)
    col_E = jnp.arange(width + 1)[None, :]
    ends_BE = jnp.where(col_E < width, first_B[:, None] + col_E, length_B[:, None])
    offsets = jnp.asarray(key_offsets(n))[None, None, :]
    idx = ends_BE[:, :, None] - n + 1 + offsets  # [B, width + 1, key tokens]
    past = jnp.take_along_axis(history_BS, jnp.clip(idx, 0, S - 1).reshape(B, -1), axis=1)
    keys = jnp.where(idx == length_B[:, None, None], last_B[:, None, None], past.reshape(idx.shape))
    flat_BE = _flat_slots(table, _key_hashes(keys))
    table, flat = _mark(table, flat_BE, _insertable(ends_BE, count_B, n, S))  # (query: never)
    return table, (length_B >= n - 1) & jnp.all(flat[flat_BE[:, width]], axis=-1)


def query(table: Array, history_BS: Array, length_B: Array, last_B: Array, n: int) -> Array:
    """[B] bool: the n-gram ending at the row's last token (position `length`, not in the
    history yet) is in its table: some lookup of the chain may find a draft."""
    none = jnp.zeros_like(length_B)
    return advance(table, history_BS, length_B, none, length_B, last_B, n, 0)[1]


def _insertable(ends_BE: Array, count_B: Array, n: int, S: int) -> Array:
    """Which window ends are inserted: the first `count` of each row that end an n-gram."""
    col_E = jnp.arange(ends_BE.shape[1])[None, :]
    return (col_E < count_B[:, None]) & (ends_BE >= n - 1) & (ends_BE < S)


def _flat_slots(table: Array, hashes_BE: Array) -> Array:
    """`[B, E, 2]`: flat indices (table row * M + slot) of each n-gram's slots: a 1-D
    scatter and gather, no index pairs (each pair a concatenation, a kernel of its own on
    XLA CPU)."""
    B, M = hashes_BE.shape[0], table.shape[1]
    return _group(table, B)[:, None, None] * M + _slots(hashes_BE, M)


def _mark(table: Array, flat_BEH: Array, ok_BE: Array) -> tuple[Array, Array]:
    """(table, its flat view) with the slots `flat_BEH` of the n-grams `ok_BE` set."""
    G, M = table.shape
    where = jnp.where(ok_BE[..., None], flat_BEH, G * M)
    flat = table.reshape(G * M).at[where].set(True, mode="drop")
    return flat.reshape(G, M), flat
