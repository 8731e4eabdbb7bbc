"""Plain-Python references of llama.cpp's model-free n-gram drafters (no JAX).

These follow upstream `common/ngram-map.cpp` (ngram-simple, ngram-map-k, ngram-map-k4v),
`common/ngram-mod.cpp` and the ngram-mod impl in `common/speculative.cpp` statement by statement,
using Python ints with explicit wraparound for the unsigned arithmetic. They are the oracle the
JAX drafters are tested against, and they replay the recorded conformance vectors.

Invariants / conventions (same as upstream):
* `tokens` / `inp` / `prompt` is the history in the target's memory, EXCLUDING `sampled`
  (`id_last`), which is the token at position `len(tokens)`.
* Every impl exposes the relay interface used by `oracles.relay_reference`:
  `begin(seq, prompt)`, `draft_one(seq, prompt, id_last) -> list[int]`,
  `accept(seq, n_accepted, is_other)`. Per-sequence state lives in the impl (ngram-map keeps
  one map per sequence; ngram-mod shares ONE pool across sequences).
* Draft lists are never truncated here: the relay truncates to the caller's `n_max`.

Deliberate, flag-selected deviations (default = upstream behaviour):
* `NgramMapRef(check_min_hits_key_only=True)`: ngram-map-k also applies `min_hits`
  (upstream never checks it in key-only mode).
* `NgramMapRef(k4v_copy_majority=True)`: ngram-map-k4v copies the continuation stored for the
  majority value (`values[slot_max].value_idx`) instead of the matched occurrence's continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF

#: ngram-map: 32-bit LCG factor (`LCG_FACTOR`), hash-map size, value slots, count saturation.
MAP_LCG = 2654435761
MAP_HASH_SIZE = 262144
MAP_MAX_VALUES = 4
MAP_MAX_VALUE_COUNT = 16380

#: ngram-mod: 64-bit LCG factor, pool size, empty marker, ingestion chunk, thresholds.
MOD_LCG = 6364136223846793005
MOD_POOL_SIZE = 4 * 1024 * 1024
MOD_EMPTY = -1
MOD_CHUNK = 32


# --------------------------------------------------------------------------------------------
# ngram-simple
# --------------------------------------------------------------------------------------------


def ngram_simple_draft(tokens: list[int], sampled: int, size_n: int, size_m: int) -> list[int]:
    """`common_ngram_simple_draft`: copy what followed the most recent earlier occurrence."""
    n, m = size_n, size_m
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = [*tokens[cur_len - n + 1 : cur_len], sampled]
    match_pos = 0
    for j in range(cur_len - n - 1, 0, -1):  # position 0 is never a match
        if tokens[j : j + n] == pattern:
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:  # upstream compares with n, not m
        return []
    return list(tokens[match_pos + n : match_pos + n + copy_max])


class NgramSimpleRef:
    """Relay impl for ngram-simple (stateless)."""

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48) -> None:
        self.size_n, self.size_m = size_n, size_m

    def begin(self, seq: int, prompt: list[int]) -> None:
        del seq, prompt

    def draft_one(self, seq: int, prompt: list[int], id_last: int) -> list[int]:
        del seq
        return ngram_simple_draft(prompt, id_last, self.size_n, self.size_m)

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        del seq, n_accepted, is_other


# --------------------------------------------------------------------------------------------
# ngram-map (k / k4v)
# --------------------------------------------------------------------------------------------


def map_hash(tokens: list[int], start: int, n: int) -> int:
    """`common_ngram_map_hash`: uint32 LCG over `tokens[start:start+n]`."""
    h = 0
    for i in range(n):
        h = (h * MAP_LCG + tokens[start + i]) & MASK32
    return h


@dataclass
class MapValue:
    value_idx: int = 0  # history index of the value m-gram (0 = unused slot)
    value_num: int = 0  # occurrences (saturating at MAP_MAX_VALUE_COUNT)
    n_accepted: int = -1  # accepted tokens at the last draft from this value


@dataclass
class MapKey:
    key_idx: int
    stat_idx: int = 0
    key_num: int = 0
    values: list[MapValue] = field(default_factory=lambda: [MapValue() for _ in range(4)])


def _find_desc(inp: list[int], key: list[int], hi: int, lo_excl: int) -> int:
    """Largest j with hi >= j > lo_excl and inp[j:j+n] == key, else 0 (a descending scan)."""
    n = len(key)
    j = hi
    while j > lo_excl:
        if inp[j : j + n] == key:
            return j
        j -= 1
    return 0


def _occurrences(inp: list[int], key: list[int], lo: int, hi: int) -> list[int]:
    """All i in [lo, hi] (ascending) with inp[i:i+n] == key."""
    n = len(key)
    out: list[int] = []
    first = key[0]
    i = lo
    while i <= hi:
        try:
            i = inp.index(first, i, hi + 1)
        except ValueError:
            break
        if inp[i : i + n] == key:
            out.append(i)
        i += 1
    return out


class NgramMapRef:
    """`common_ngram_map` for ONE sequence: begin / draft / accept exactly as upstream."""

    def __init__(
        self,
        size_n: int = 12,
        size_m: int = 48,
        key_only: bool = True,
        min_hits: int = 1,
        *,
        check_min_hits_key_only: bool = False,
        k4v_copy_majority: bool = False,
        hash_size: int = MAP_HASH_SIZE,
    ) -> None:
        self.n, self.m = size_n, size_m
        self.hash_size = hash_size
        self.key_only = key_only
        self.min_hits = min_hits
        self.check_min_hits_key_only = check_min_hits_key_only
        self.k4v_copy_majority = k4v_copy_majority
        self.keys: list[MapKey] = []
        self.key_map: dict[int, int] = {}  # slot -> history index (absent = 0)
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.last_draft_created = False
        self.last_draft_key_idx = 0
        self.last_draft_value_idx = 0

    # ---- begin
    def begin(self, tokens: list[int]) -> None:
        n, m = self.n, self.m
        size_begin = len(tokens)
        c = self.size_last_begin
        if c > size_begin:
            c = size_begin - n - m if size_begin > n + m else 0
        if size_begin < self.idx_last_check:
            self.key_map = {h: i for h, i in self.key_map.items() if not (i != 0 and i >= c)}
            self.key_map_last_idx = c - 1 if c > 0 else 0
        if size_begin < self.idx_last_check and self.keys:
            for i in range(len(self.keys) - 1, -1, -1):
                key = self.keys[i]
                if key.key_idx >= c:
                    del self.keys[i]
                    continue
                if self.key_only:
                    continue
                for j in range(MAP_MAX_VALUES - 1, -1, -1):
                    v = key.values[j]
                    if v.value_idx != 0 and v.value_idx >= c:
                        for k in range(j, MAP_MAX_VALUES - 1):
                            nxt = key.values[k + 1]
                            key.values[k] = MapValue(nxt.value_idx, nxt.value_num, nxt.n_accepted)
                        last = key.values[MAP_MAX_VALUES - 1]
                        key.values[MAP_MAX_VALUES - 1] = MapValue(0, 0, last.n_accepted)
                if key.values[0].value_idx == 0:
                    del self.keys[i]
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin

    # ---- draft
    def draft(self, inp: list[int], sampled: int) -> list[int]:
        self.last_draft_created = False
        self.last_draft_key_idx = 0
        self.last_draft_value_idx = 0
        n, m = self.n, self.m
        cur_len = len(inp)
        if cur_len < 2 * n + m:
            return []
        assert self.idx_last_check <= cur_len
        self.idx_last_check = cur_len
        key = [*inp[cur_len - n + 1 : cur_len], sampled]
        slb = self.size_last_begin
        assert slb <= cur_len
        top = cur_len - n - m - 1

        match_pos = 0
        idx_key = self.key_map.get(map_hash(key, 0, n) % self.hash_size, 0)
        if idx_key != 0 and idx_key < top and inp[idx_key : idx_key + n] == key:
            match_pos = idx_key
        if match_pos == 0 and slb > n + m + 1:
            match_pos = _find_desc(inp, key, slb - n - m - 1, self.key_map_last_idx)
        if match_pos == 0:
            match_pos = _find_desc(inp, key, top, max(slb, self.key_map_last_idx))

        # insert hashes of the newly scanned positions (same order; first writer wins)
        if slb > n + m + 1:
            for j in range(slb - n - m - 1, self.key_map_last_idx, -1):
                h = map_hash(inp, j, n) % self.hash_size
                if self.key_map.get(h, 0) == 0:
                    self.key_map[h] = j
        for j in range(top, max(slb, self.key_map_last_idx), -1):
            h = map_hash(inp, j, n) % self.hash_size
            if self.key_map.get(h, 0) == 0:
                self.key_map[h] = j
        self.key_map_last_idx = max(top & MASK32, self.key_map_last_idx)

        if match_pos == 0:
            return []

        key_offset = len(self.keys)
        for i, k in enumerate(self.keys):
            if inp[k.key_idx : k.key_idx + n] == key:
                key_offset = i
                break
        if key_offset == len(self.keys):
            new_key = MapKey(key_idx=match_pos)
            for new_val in new_key.values:
                new_val.value_num = 0
                new_val.n_accepted = m
            self.keys.append(new_key)
        cur = self.keys[key_offset]
        cur.key_num = min(cur.key_num + 1, MAP_MAX_VALUE_COUNT)

        if self.key_only:
            if self.check_min_hits_key_only and cur.key_num < self.min_hits:
                return []
            n_draft = min(m, cur.values[0].n_accepted)
            draft = [inp[match_pos + n + i] for i in range(max(n_draft, 0))]
            self.last_draft_created = True
            self.last_draft_key_idx = key_offset
            self.last_draft_value_idx = 0
            return draft

        if cur.key_num < self.min_hits:
            return []

        for i in _occurrences(inp, key, cur.stat_idx, match_pos):
            vbeg = i + n
            idx_value = -1
            for v in range(MAP_MAX_VALUES):
                val = cur.values[v]
                if val.value_idx == 0:
                    val.value_idx = vbeg
                    val.value_num = 0
                    val.n_accepted = m
                    idx_value = v
                    break
                if inp[vbeg : vbeg + m] == inp[val.value_idx : val.value_idx + m]:
                    idx_value = v
                    break
            if idx_value >= 0:
                val = cur.values[idx_value]
                val.value_num = min(val.value_num + 1, MAP_MAX_VALUE_COUNT)
        cur.stat_idx = match_pos

        max_occur, slot_max = 0, 0
        for v in range(MAP_MAX_VALUES):
            if cur.values[v].value_num > max_occur:
                max_occur, slot_max = cur.values[v].value_num, v
        sum_occur = sum(cur.values[v].value_num for v in range(MAP_MAX_VALUES) if v != slot_max)
        if sum_occur > 0 and max_occur < 2 * sum_occur:
            return []

        n_draft = min(m, cur.values[slot_max].n_accepted)
        start = match_pos + n
        if self.k4v_copy_majority and cur.values[slot_max].value_idx != 0:
            start = cur.values[slot_max].value_idx
        draft = [inp[start + i] for i in range(max(n_draft, 0))]
        self.last_draft_created = True
        self.last_draft_key_idx = key_offset
        self.last_draft_value_idx = slot_max
        return draft

    # ---- accept
    def accept(self, n_accepted: int) -> None:
        if not self.last_draft_created:
            return
        val = self.keys[self.last_draft_key_idx].values[self.last_draft_value_idx]
        val.n_accepted = n_accepted


class NgramMapImplRef:
    """Relay impl for ngram-map-k / ngram-map-k4v: one `NgramMapRef` per sequence."""

    def __init__(
        self,
        key_only: bool,
        size_n: int = 12,
        size_m: int = 48,
        min_hits: int = 1,
        n_seq: int = 1,
        **flags: Any,
    ) -> None:
        self.name = "ngram-map-k" if key_only else "ngram-map-k4v"
        self.maps = [NgramMapRef(size_n, size_m, key_only, min_hits, **flags) for _ in range(n_seq)]

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.maps[seq].begin(prompt)

    def draft_one(self, seq: int, prompt: list[int], id_last: int) -> list[int]:
        return self.maps[seq].draft(prompt, id_last)

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            return
        self.maps[seq].accept(n_accepted)


# --------------------------------------------------------------------------------------------
# ngram-mod
# --------------------------------------------------------------------------------------------


def mod_hash(tokens: list[int], start: int, n: int) -> int:
    """`common_ngram_mod::idx` before the modulo: uint64 LCG (int32 tokens sign-extended)."""
    h = 0
    for i in range(n):
        h = (h * MOD_LCG + tokens[start + i]) & MASK64
    return h


@dataclass
class ModSeqInfo:
    i_last: int = 0
    n_draft_last: int = 0
    n_low: int = 0


class NgramModRef:
    """Relay impl for ngram-mod: one shared pool (`common_ngram_mod`) + per-sequence info."""

    name = "ngram-mod"

    def __init__(
        self,
        n_match: int = 24,
        n_min: int = 48,
        n_max: int = 64,
        pool_size: int = MOD_POOL_SIZE,
        n_seq: int = 1,
    ) -> None:
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.pool_size = pool_size
        self.entries: dict[int, int] = {}  # slot -> token (absent = EMPTY)
        self.used = 0
        self.sinfos = [ModSeqInfo() for _ in range(n_seq)]

    # pool primitives (`common_ngram_mod`)
    def idx(self, tokens: list[int], start: int) -> int:
        return mod_hash(tokens, start, self.n) % self.pool_size

    def add(self, tokens: list[int], start: int) -> None:
        i = self.idx(tokens, start)
        if self.entries.get(i, MOD_EMPTY) == MOD_EMPTY:
            self.used += 1
        self.entries[i] = tokens[start + self.n]

    def get(self, tokens: list[int], start: int) -> int:
        return self.entries.get(self.idx(tokens, start), MOD_EMPTY)

    def reset(self) -> None:
        self.entries = {}
        self.used = 0

    # impl
    def begin(self, seq: int, prompt: list[int]) -> None:
        s = self.sinfos[seq]
        s.i_last = 0
        s.n_draft_last = 0
        n = self.n
        if len(prompt) < n:
            return
        for i in range(len(prompt) - n):
            self.add(prompt, i)
        s.i_last = len(prompt) - n
        if self.used / self.pool_size > 0.25:
            self.reset()

    def draft_one(self, seq: int, prompt: list[int], id_last: int) -> list[int]:
        s = self.sinfos[seq]
        s.n_draft_last = 0
        cur_len = len(prompt)
        n = self.n
        if cur_len < n:
            return []
        if s.i_last + MOD_CHUNK < cur_len:
            for i in range(s.i_last, cur_len - n):
                self.add(prompt, i)
            s.i_last = cur_len - n
        buf = [*prompt[cur_len - n + 1 : cur_len], id_last]
        for i in range(self.n_max):
            tok = self.get(buf, i)
            if tok == MOD_EMPTY:
                if i < self.n_min:
                    return []
                break
            buf.append(tok)
        result = buf[n:]
        s.n_draft_last = len(result)
        return result

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            return
        s = self.sinfos[seq]
        if s.n_draft_last > 0:
            if n_accepted / s.n_draft_last < 0.25:
                s.n_low += 1
                if s.n_low >= 5:
                    self.reset()
                    s.n_low = 0
                    s.i_last = 0
            else:
                s.n_low = 0
