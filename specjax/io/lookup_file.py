"""llama.cpp lookup-cache files and the ngram-cache drafter's tables read from them.

The file format (`common_ngram_cache_save/load`): no header, native byte order, a sequence of
records `[4 x int32 n-gram][int32 n] n x ([int32 token][int32 count])` with `n > 0` and every
count > 0. An empty file is an empty cache. `load_cache` / `save_cache` read and write it
(dict form and its invariants: `specjax.io.lookup`'s docstring); `load_tables` / `make_tables`
build the drafter's read-only device tables (`LookupTable`, parts in libstdc++'s iteration
order, so the first maximum of a window is upstream's choice).

This module sits below both its users: `specjax.drafters.ngram_cache` (whose `from_spec` loads
the files named by the SpecConfig, and which drafts from the tables) and `specjax.io.lookup` (the
host algorithms, lookup-create/-merge/-stats).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from specjax.errors import ModelFileError
from specjax.pytree import pytree_dataclass, static_field
from specjax.types import Array

_I32 = np.dtype("=i4")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# ---------------------------------------------------------------------------------------------
# hashing (`specjax.drafters.ngram_cache.hash_words` is the device twin)
# ---------------------------------------------------------------------------------------------

HASH_SEED = 0x811C9DC5
HASH_MULT = 0x9E3779B1

# ---------------------------------------------------------------------------------------------
# libstdc++ iteration order
# ---------------------------------------------------------------------------------------------

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


CacheDict = Cache


# ---------------------------------------------------------------------------------------------
# device tables for the ngram-cache drafter
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


def hash_words_np(words: np.ndarray) -> np.ndarray:
    """uint32 hash of int32 rows `[..., W]` (host twin of `ngram_cache.hash_words`)."""
    w = np.ascontiguousarray(words, dtype=np.int32).view(np.uint32)
    h = np.full(w.shape[:-1], HASH_SEED, np.uint32)
    with np.errstate(over="ignore"):
        for k in range(w.shape[-1]):
            h = (h ^ w[..., k]) * np.uint32(HASH_MULT)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def _next_pow2(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


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
    """Device table of a cache dict (`specjax.io.lookup` form: insertion order = file order).

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


def make_tables(
    static: CacheDict | None,
    dynamic: CacheDict | None,
    min_shape: tuple[int, int, int, int] | None = None,
) -> NgramCacheTables | None:
    """The ngram-cache drafter's params from cache dicts (None when both are empty/absent);
    `min_shape` as in `build_lookup_table`."""
    st = build_lookup_table(static or {}, min_shape) if static or min_shape else None
    dy = build_lookup_table(dynamic or {}, min_shape) if dynamic or min_shape else None
    if st is None and dy is None:
        return None
    return NgramCacheTables(static=st, dynamic=dy)


def load_tables(
    static_path: str | os.PathLike[str] | None = None,
    dynamic_path: str | os.PathLike[str] | None = None,
) -> NgramCacheTables | None:
    """The drafter's params from llama.cpp cache files (None when neither is given).

    A dynamic cache that does not exist yet is empty (it is created at the end of the run, as
    llama.cpp's lookup example does); a missing static cache is an error."""
    static = load_cache(static_path) if static_path else None
    has_dynamic = bool(dynamic_path) and os.path.exists(os.fspath(dynamic_path or ""))
    dynamic = load_cache(dynamic_path) if has_dynamic and dynamic_path else None
    return make_tables(static, dynamic)


# ---------------------------------------------------------------------------------------------
# file format
# ---------------------------------------------------------------------------------------------


def decode_cache(data: bytes, name: str = "<bytes>") -> CacheDict:
    """Parse the bytes of a lookup cache file (see module docstring)."""
    nbytes = len(data)
    words = np.frombuffer(data, dtype=_I32, count=nbytes // 4).tolist()
    nw = len(words)
    cache: CacheDict = {}
    w = 0
    while 4 * w < nbytes:
        off = 4 * w
        if w + 5 > nw:
            raise ModelFileError(
                f"{name}: truncated record at byte offset {off}: needs 20 bytes for the n-gram "
                f"and its token count, {nbytes - off} left"
            )
        ngram = (words[w], words[w + 1], words[w + 2], words[w + 3])
        n = words[w + 4]
        if n <= 0:
            raise ModelFileError(
                f"{name}: corrupted record at byte offset {off}: token count {n} at byte "
                f"offset {off + 16} must be > 0"
            )
        end = w + 5 + 2 * n
        if end > nw:
            raise ModelFileError(
                f"{name}: truncated record at byte offset {off}: {n} tokens need "
                f"{20 + 8 * n} bytes, {nbytes - off} left"
            )
        part: dict[int, int] = {}
        for j in range(w + 5, end, 2):
            tok, count = words[j], words[j + 1]
            if count <= 0:
                raise ModelFileError(
                    f"{name}: corrupted record at byte offset {off}: count {count} of token "
                    f"{tok} at byte offset {4 * (j + 1)} must be > 0"
                )
            part.setdefault(tok, count)
        cache.setdefault(ngram, part)
        w = end
    return cache


def load_cache(path: str | os.PathLike[str]) -> CacheDict:
    """Read a llama.cpp lookup cache file (records in file order)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read lookup cache ({e.strerror or e})") from e
    return decode_cache(data, path)


def _check_int32(value: int, what: str) -> int:
    if not isinstance(value, int | np.integer) or not _INT32_MIN <= int(value) <= _INT32_MAX:
        raise ValueError(f"lookup cache: {what} {value!r} is not an int32")
    return int(value)


def encode_cache(cache: CacheDict) -> bytes:
    """The file bytes of a cache, records in dict order (validates everything first)."""
    words: list[int] = []
    for ngram, part in cache.items():
        if len(ngram) != 4:
            raise ValueError(f"lookup cache: n-gram {ngram!r} must have 4 slots (-1 = unused)")
        if not part:
            raise ValueError(f"lookup cache: n-gram {ngram!r} has no tokens")
        words.extend(_check_int32(t, "n-gram token") for t in ngram)
        words.append(len(part))
        for tok, count in part.items():
            words.append(_check_int32(tok, "token"))
            if _check_int32(count, "count") <= 0:
                raise ValueError(f"lookup cache: count {count} of token {tok} after {ngram} <= 0")
            words.append(int(count))
    return np.asarray(words, dtype=_I32).tobytes()


def save_cache(path: str | os.PathLike[str], cache: CacheDict) -> None:
    """Write a cache file atomically (temp file + rename; an old file survives a failure)."""
    path = os.fspath(path)
    data = encode_cache(cache)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".lookup-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o666 & ~umask
        os.chmod(tmp, mode)  # mkstemp makes 0600; keep the usual (or the old file's) mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
