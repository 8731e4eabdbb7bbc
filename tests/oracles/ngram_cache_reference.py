"""Plain-Python reference of llama.cpp's ngram-cache (lookup decoding, spec 5.8).

This is the executable statement of upstream's behaviour that the JAX drafter
(`specjax.drafters.ngram_cache`) and the host tools (`specjax.lookup`) are checked against.

Data model (invariants):
* A cache is `dict[ngram, part]` with `ngram` a 4-tuple of int32 tokens (unused slots -1 =
  `LLAMA_TOKEN_NULL`) and `part` a `dict[token, count]`, counts > 0, parts non-empty.
* Python dict order = the **insertion sequence** of the C++ `std::unordered_map`. Upstream
  breaks ties ("first maximum wins") in the map's *iteration* order, which for libstdc++ is a
  deterministic function of the insertion sequence and the bucket growth policy;
  `stl_iteration_order` reproduces it (bucket counts 13, 29, 59, 127, 257, ..., buckets =
  hash % count, a new key goes to the front of its bucket's group or, for an empty bucket, to the
  front of the list; a rehash re-inserts the nodes in list order). Copies keep both the order
  and the bucket count, so "a copied part" is modelled by copying its dict.
* A cache loaded from a file has the file's record order as its insertion sequence, and a save
  writes the iteration order (`to_file_order`).
* Arithmetic follows upstream's int32 (`count * 100 * static_count` wraps like the C++ code).

The speculative impl (`NgramCacheImplRef`) reproduces `common_speculative_impl_ngram_cache`:
the context cache is updated at each draft call with the tokens that arrived since the last
call, *as a separate sequence* (n-grams crossing the old/new boundary are never counted), and
`begin` keeps the per-sequence cache unless `reset_on_begin=True` (upstream bug #27852).
Upstream reads out of bounds when a primary n-gram would start before position 0 (|inp| < 4);
here such an n-gram simply never matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

NGRAM_MIN = 1
NGRAM_MAX = 4
NGRAM_STATIC = 2
TOKEN_NULL = -1
N_DRAFT = 8

#: Thresholds, index = n-gram size - 1 (context cache: lax, dynamic cache: strict).
MIN_SAMPLE_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLE_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)

#: libstdc++ `_Prime_rehash_policy` bucket counts of a map grown one insertion at a time
#: (max_load_factor 1): 13 buckets for elements 0..12, 29 from the 14th, ... (measured with
#: GCC 12; each is the first listed prime >= 2 * previous).
BUCKET_CHAIN = (
    13,
    29,
    59,
    127,
    257,
    541,
    1109,
    2357,
    5087,
    10273,
    20753,
    42043,
    85229,
    172933,
    351061,
    712697,
    1447153,
    2938679,
    5967347,
    12117689,
    24607243,
    49969847,
    101473717,
    206062531,
)

_FIB = 11400714819323198485
_M64 = (1 << 64) - 1

Ngram = tuple[int, int, int, int]
Part = dict[int, int]
Cache = dict[Ngram, Part]


def i32(x: int) -> int:
    """Wrap a Python int to int32 (two's complement), as upstream's int arithmetic does."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x & 0x80000000 else x


def token_hash(token: int) -> int:
    """`std::hash<int32_t>`: the value as size_t (sign-extended)."""
    return token & _M64


def ngram_hash(ngram: Sequence[int]) -> int:
    """`common_ngram_hash_function`: XOR over the 4 slots of `token * 11400714819323198485`."""
    h = 0
    for t in ngram:
        h ^= ((t & _M64) * _FIB) & _M64
    return h


def make_ngram(tokens: Sequence[int]) -> Ngram:
    """A 4-slot n-gram from up to 4 tokens (the rest `TOKEN_NULL`)."""
    t = list(tokens) + [TOKEN_NULL] * (NGRAM_MAX - len(tokens))
    return (int(t[0]), int(t[1]), int(t[2]), int(t[3]))


def stl_iteration_order(hashes: Sequence[int]) -> list[int]:
    """Iteration order (indices into `hashes`) of a libstdc++ unordered map built by inserting
    distinct keys with these hash codes, in this order, into a default-constructed map."""
    n = len(hashes)
    if n == 0:
        return []
    h = np.asarray([int(x) for x in hashes], dtype=np.uint64)
    order = np.zeros((0,), np.int64)  # the list, as indices into h
    start = 0
    for m in BUCKET_CHAIN:
        end = min(n, m)
        # the list of the previous phase is re-inserted (rehash), then the new elements
        seq = np.concatenate([order, np.arange(start, end, dtype=np.int64)])
        groups = h[seq] % np.uint64(m)
        _, first = np.unique(groups, return_index=True)
        head = np.empty(m if m <= 4 * len(seq) + 64 else 0, np.int64)
        if head.size:
            head[groups[first].astype(np.int64)] = first
            gs = head[groups.astype(np.int64)]
        else:
            lookup = dict(zip(groups[first].tolist(), first.tolist(), strict=True))
            gs = np.asarray([lookup[g] for g in groups.tolist()], np.int64)
        pos = np.arange(len(seq), dtype=np.int64)
        order = seq[np.lexsort((-pos, -gs))]
        start = end
        if end == n:
            return order.tolist()
    raise ValueError(f"unordered_map with {n} elements is beyond the modelled bucket chain")


def part_items(part: Part) -> list[tuple[int, int]]:
    """(token, count) pairs of a part in libstdc++ iteration order."""
    items = list(part.items())
    if len(items) <= 1:
        return items
    return [items[i] for i in stl_iteration_order([token_hash(t) for t, _ in items])]


def cache_keys(cache: Cache) -> list[Ngram]:
    """The n-grams of a cache in libstdc++ iteration order."""
    keys = list(cache.keys())
    if len(keys) <= 1:
        return keys
    return [keys[i] for i in stl_iteration_order([ngram_hash(k) for k in keys])]


def to_file_order(cache: Cache) -> Cache:
    """What `common_ngram_cache_save` writes, as a dict in file order (outer and inner)."""
    return {ng: dict(part_items(cache[ng])) for ng in cache_keys(cache)}


# ---------------------------------------------------------------------------------------------
# common/ngram-cache.cpp
# ---------------------------------------------------------------------------------------------


def ngram_cache_update(
    cache: Cache, ngram_min: int, ngram_max: int, inp: Sequence[int], nnew: int
) -> None:
    """`common_ngram_cache_update`: count `inp[i]` after `inp[i-s:i]` for the last `nnew` i."""
    n = len(inp)
    for size in range(ngram_min, ngram_max + 1):
        for i in range(max(n - nnew, size), n):
            ng = make_ngram(inp[i - size : i])
            tok = int(inp[i])
            part = cache.get(ng)
            if part is None:
                cache[ng] = {tok: 1}
            else:
                part[tok] = part.get(tok, 0) + 1


def _try_draft_static(nc_static: Cache, ngram_static: Ngram) -> int:
    part = nc_static.get(ngram_static)
    if part is None:
        return TOKEN_NULL
    max_count = 0
    total = 0
    best = TOKEN_NULL
    for tok, count in part_items(part):
        if count > max_count:
            best, max_count = tok, count
        total = i32(total + count)
    if total < MIN_SAMPLE_LAX[NGRAM_STATIC - 1]:
        return TOKEN_NULL
    if i32(100 * max_count) < i32(MIN_PERCENT_LAX[NGRAM_STATIC - 1] * total):
        return TOKEN_NULL
    return best


def _try_draft_primary(
    nc_primary: Cache,
    ngrams: Sequence[Ngram | None],
    part_static: Part,
    min_sample: Sequence[int],
    min_percent: Sequence[int],
) -> int:
    for i in range(len(ngrams) - 1, -1, -1):
        ng = ngrams[i]
        if ng is None:
            continue
        part = nc_primary.get(ng)
        if part is None:
            continue
        max_p = max_s = total = 0
        best = TOKEN_NULL
        items = list(part.items())
        # only ties need the libstdc++ order; find the best product first
        prods = []
        for tok, count in items:
            sc = part_static.get(tok)
            cs = i32(100 * sc) if sc is not None else 1
            prods.append((i32(count * cs), count, cs, tok))
            total = i32(total + count)
        top = max(p[0] for p in prods)
        if sum(1 for p in prods if p[0] == top) > 1:
            ordered = [items.index(it) for it in part_items(part)]
            prods = [prods[j] for j in ordered]
        for prod, count, cs, tok in prods:
            if prod > i32(max_p * max_s):
                best, max_p, max_s = tok, count, cs
        if total < min_sample[i]:
            continue
        if i32(100 * max_p) < i32(min_percent[i] * total):
            continue
        return best
    return TOKEN_NULL


def ngram_cache_draft(
    inp: Sequence[int],
    draft: list[int],
    n_draft: int,
    ngram_min: int,
    ngram_max: int,
    nc_context: Cache,
    nc_dynamic: Cache,
    nc_static: Cache,
) -> None:
    """`common_ngram_cache_draft`: extend `draft` (which starts as `[id_last]`) in place."""
    assert len(draft) == 1
    inp_size = len(inp)
    if inp_size < NGRAM_STATIC:
        return

    def tok_at(j: int) -> int:
        return int(inp[j]) if j < inp_size else draft[1 + j - inp_size]

    while len(draft) - 1 < n_draft:
        end = inp_size + len(draft) - 1
        ngram_static = make_ngram([tok_at(j) for j in range(end - NGRAM_STATIC, end)])
        part_static = nc_static.get(ngram_static, {})
        ngrams: list[Ngram | None] = []
        for size in range(ngram_min, ngram_max + 1):
            start = end - size
            ok = start >= 0
            ngrams.append(make_ngram([tok_at(j) for j in range(start, end)]) if ok else None)
        tok = _try_draft_primary(nc_context, ngrams, part_static, MIN_SAMPLE_LAX, MIN_PERCENT_LAX)
        if tok == TOKEN_NULL:
            tok = _try_draft_primary(
                nc_dynamic, ngrams, part_static, MIN_SAMPLE_STRICT, MIN_PERCENT_STRICT
            )
        if tok == TOKEN_NULL:
            tok = _try_draft_static(nc_static, ngram_static)
        if tok == TOKEN_NULL:
            break
        draft.append(tok)


def ngram_cache_merge(target: Cache, add: Cache) -> None:
    """`common_ngram_cache_merge`: add the counts of `add` into `target` (in place)."""
    for ng in cache_keys(add):
        part = add[ng]
        tpart = target.get(ng)
        if tpart is None:
            target[ng] = dict(part)  # a copy keeps the source's order
            continue
        for tok, count in part_items(part):
            tpart[tok] = tpart.get(tok, 0) + count


def copy_cache(cache: Cache) -> Cache:
    return {ng: dict(part) for ng, part in cache.items()}


# ---------------------------------------------------------------------------------------------
# common/speculative.cpp: common_speculative_impl_ngram_cache
# ---------------------------------------------------------------------------------------------


class NgramCacheImplRef:
    """One `common_speculative_impl_ngram_cache` (all sequences), with the relay's impl API
    `begin(seq, prompt)`, `draft_one(seq, prompt, id_last) -> draft`, `accept(...)`."""

    def __init__(
        self,
        n_seq: int = 1,
        *,
        n_draft: int = N_DRAFT,
        static: Cache | None = None,
        dynamic: Cache | None = None,
        reset_on_begin: bool = False,
    ) -> None:
        self.n_draft = n_draft
        self.reset_on_begin = reset_on_begin
        self.cache_size = [0] * n_seq
        self.context: list[Cache] = [{} for _ in range(n_seq)]
        self.dynamic: list[Cache] = [copy_cache(dynamic or {}) for _ in range(n_seq)]
        self.static: list[Cache] = [copy_cache(static or {}) for _ in range(n_seq)]

    def begin(self, seq: int, prompt: Sequence[int]) -> None:
        del prompt
        if self.reset_on_begin:
            self.cache_size[seq] = 0
            self.context[seq] = {}

    def draft_one(self, seq: int, prompt: Sequence[int], id_last: int) -> list[int]:
        n = len(prompt)
        if self.cache_size[seq] < n + 1:
            new = [int(t) for t in prompt[self.cache_size[seq] :]] + [int(id_last)]
            ngram_cache_update(self.context[seq], NGRAM_MIN, NGRAM_MAX, new, len(new))
            self.cache_size[seq] = n + 1
        inp = [int(t) for t in prompt] + [int(id_last)]
        draft = [int(id_last)]
        ngram_cache_draft(
            inp,
            draft,
            self.n_draft,
            NGRAM_MIN,
            NGRAM_MAX,
            self.context[seq],
            self.dynamic[seq],
            self.static[seq],
        )
        return draft[1:]

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        del seq, n_accepted, is_other


def build_cache(
    tokens: Iterable[int], ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX
) -> Cache:
    """A cache holding every n-gram of `tokens` (one `ngram_cache_update` over all of them)."""
    toks = [int(t) for t in tokens]
    cache: Cache = {}
    ngram_cache_update(cache, ngram_min, ngram_max, toks, len(toks))
    return cache
