"""ngram-map-k / ngram-map-k4v (llama.cpp `common/ngram-map.*`, spec 5.6), per row, on device.

Every row owns one `common_ngram_map` (rows never interact):
* `key_map [B, H]` int32 (H = 2^18 by default): hash slot -> history index of an n-gram, 0 = empty.
  Hash = uint32 LCG `h = h*2654435761 + token` over the n tokens (uint32 wraparound), slot
  `h mod H`. Slots are written "first writer wins" in upstream's order: within one draft call
  positions are inserted descending, first the range below `size_last_begin`, then the range
  above it (a slot only takes a value while it is still 0).
* `keys`: a static table of `max_keys` entries (default: the history capacity S), `n_keys` live,
  kept in creation order (upstream's vector order; deletions in `begin` compact it stably).
  Each key: `key_idx` (history index of an occurrence), `stat_idx`, `key_num` (saturating at
  16380) and 4 value slots (`value_idx` (0 = unused), `value_num` (saturating), `n_accepted`).
  Occupied value slots always form a prefix.
* Per-row scalars: `key_map_last_idx`, `size_last_begin`, `idx_last_check` and the last-draft
  markers (`last_created`, `last_key` = table offset, `last_value` = slot).
* `key_index [B, KH]` (KH = a power of two >= 2 * max_keys): open-addressing (linear probing)
  index of the key table by n-gram content (LCG hash of `t[key_idx : key_idx+n]`), the first of
  equal contents in table order. Rebuilt by `begin`; a draft adds the key it creates.
  Assumption (as upstream's server): between two `begin` calls a row's history only grows, so
  the tokens under every key and map entry never change.

Per round the cost follows the new tokens, not the capacity: upstream's scan/insert ranges
(`(key_map_last_idx, size_last_begin-n-m-1]`, then `(max(size_last_begin, key_map_last_idx),
len-n-m-1]`, each descending: on a usual round only the newly accepted positions) are walked
in steps of 32 positions, hashing, inserting (first writer wins, in upstream's order) and
comparing each window with the key (the descending linear searches = the first match in that
order); the hash-map lookup and the key-table search are probes. Rows are batched by hand
(scatters into the flattened `[B*H]` map, no vmapped loops). k4v value statistics: the up-to-4
value slots are discovered in order (slot v is created by the FIRST occurrence whose m-gram
matches none of slots < v), then each occurrence counts for the first slot whose m-gram it
equals; this is exactly upstream's sequential scan (a novel m-gram with all 4 slots taken is
dropped). They scan the row's whole history (O(S)), only in calls where some row found a
match (`lax.cond`).

Policies / deviations:
* Key table full (`n_keys == max_keys`) when a new key would be created: the row gets no draft
  this round and no draft markers (upstream's vector grows without bound). With the default
  `max_keys = capacity` this cannot happen within one request (at most one key per round).
* `check_min_hits_key_only=True` makes ngram-map-k honour `min_hits` (upstream never checks it).
* `k4v_copy_majority=True` makes ngram-map-k4v copy the majority value's own continuation
  (`value_idx[slot_max]`) instead of the matched occurrence's continuation (upstream quirk).
* `begin(..., rows=None)` takes an optional `[B]` mask of rows starting a request (None = all).
* Drafts are truncated to the static `k_max`; `n_accepted` feedback arrives via `accept`.
* Jit with the state donated: the `[B, H]` map is then updated in place (the lookup is read
  from the map after this call's inserts, filtering entries newer than `key_map_last_idx`, so
  that XLA needs no copy).
* Token ids are assumed to fit int32 (they are added to the hash as their uint32 bit pattern,
  as upstream's implicit conversion does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from specjax.drafters.base import DraftInput, DraftOutput, ModelFreeDrafter, TokenHistory
from specjax.drafters.ngram_simple import pad_tokens, window_equal
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array

HASH_MAP_SIZE = 262144  # COMMON_NGRAM_HASH_MAP_SIZE
MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAX_VALUE_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT
LCG_FACTOR = 2654435761


def _u32(x: Array) -> Array:
    return lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)


def map_hash_windows(pad_P: Array, n: int, count: int) -> Array:
    """`[count]` uint32 LCG hashes of `pad[j:j+n]` for j < count (Horner over n shifted views)."""

    def body(k: Any, h: Array) -> Array:
        view = _u32(lax.dynamic_slice(pad_P, (k,), (count,)))
        return h * jnp.uint32(LCG_FACTOR) + view

    return lax.fori_loop(0, n, body, jnp.zeros((count,), jnp.uint32))


_SCAN_CHUNK = 32  # positions hashed/inserted per loop step (usually one step per round)
_INT_MAX = 2**31 - 1


def _lcg_hash(win: Array) -> Array:
    """uint32 LCG hash of the last axis (upstream's `common_ngram_map_hash`)."""
    h = jnp.zeros(win.shape[:-1], jnp.uint32)
    for k in range(win.shape[-1]):
        h = h * jnp.uint32(LCG_FACTOR) + _u32(win[..., k])
    return h


def _windows(tokens_BS: Array, start: Array, n: int) -> Array:
    """`[*start.shape, n]` tokens `t[b, start + j]` (indices clipped into the row)."""
    B, S = tokens_BS.shape
    offs = jnp.arange(n, dtype=jnp.int32).reshape((1,) * start.ndim + (n,))
    idx = jnp.clip(start[..., None] + offs, 0, S - 1)
    bi = jnp.arange(B).reshape((B,) + (1,) * (idx.ndim - 1))
    return tokens_BS[bi, idx]


def _index_size(max_keys: int) -> int:
    """Slots of the key index: a power of two >= 2 * max_keys (load <= 1/2)."""
    return 1 << max(1, (2 * max_keys - 1).bit_length())


def _index_home(content: Array, size: int) -> Array:
    return (_lcg_hash(content) & jnp.uint32(size - 1)).astype(jnp.int32)


@pytree_dataclass
class NgramMapState:
    key_map: Array  # [B, H] int32, history index (0 = empty)
    key_map_last_idx: Array  # [B] int32
    size_last_begin: Array  # [B] int32
    idx_last_check: Array  # [B] int32
    last_created: Array  # [B] bool
    last_key: Array  # [B] int32, offset into the key table
    last_value: Array  # [B] int32, value slot
    n_keys: Array  # [B] int32
    key_idx: Array  # [B, MK] int32
    stat_idx: Array  # [B, MK] int32
    key_num: Array  # [B, MK] int32
    value_idx: Array  # [B, MK, 4] int32 (0 = unused)
    value_num: Array  # [B, MK, 4] int32
    value_nacc: Array  # [B, MK, 4] int32 (n_accepted, -1 = unused)
    key_index: Array  # [B, KH] int32 key-table offset by n-gram content hash (-1 = empty)


@dataclass(frozen=True)
class NgramMap(ModelFreeDrafter):
    """llama.cpp `ngram-map-k` (`key_only=True`) / `ngram-map-k4v` (`key_only=False`).

    Prefer the `NgramMapK` / `NgramMapK4V` subclasses, whose `name` is the llama.cpp type name.
    """

    name: ClassVar[str] = "ngram-map"
    #: A round in which no row drafts leaves the state as it is (every update of `draft` is
    #: gated by the row drafting; `accept` applies only to a row's own verified draft), so a
    #: round the governor turns off may skip the calls (`engine.spec_step`).
    idle_noop: ClassVar[bool] = True
    ask_steps: ClassVar[float] = 0.1
    spec_options: ClassVar[tuple[str, ...]] = ("size_n", "size_m", "min_hits")
    key_only: bool = True
    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1
    check_min_hits_key_only: bool = False
    k4v_copy_majority: bool = False
    #: key-table capacity per row; None = the history capacity given to `init`.
    max_keys: int | None = None
    #: hash-map slots per row (upstream: 2^18; changing it changes collisions).
    hash_size: int = HASH_MAP_SIZE

    def __post_init__(self) -> None:
        if self.size_n < 1 or self.size_m < 1:
            raise ValueError("ngram-map: size_n and size_m must be >= 1")
        if not 1 <= self.hash_size <= 2**31 - 1:
            raise ValueError("ngram-map: hash_size must be in [1, 2^31)")

    # ------------------------------------------------------------------ init / begin
    def init(self, batch: int, capacity: int) -> NgramMapState:
        mk = self.max_keys if self.max_keys is not None else max(int(capacity), 1)

        # distinct buffers per field, so that the whole state can be donated
        def z(*shape: int) -> Array:
            return jnp.zeros((batch, *shape), jnp.int32)

        return NgramMapState(
            key_map=z(self.hash_size),
            key_map_last_idx=z(),
            size_last_begin=z(),
            idx_last_check=z(),
            last_created=jnp.zeros((batch,), bool),
            last_key=z(),
            last_value=z(),
            n_keys=z(),
            key_idx=z(mk),
            stat_idx=z(mk),
            key_num=z(mk),
            value_idx=z(mk, MAX_VALUES),
            value_num=z(mk, MAX_VALUES),
            value_nacc=jnp.full((batch, mk, MAX_VALUES), -1, jnp.int32),
            key_index=jnp.full((batch, _index_size(mk)), -1, jnp.int32),
        )

    def begin(
        self, state: NgramMapState, history: TokenHistory, rows: Array | None = None
    ) -> NgramMapState:
        """`common_ngram_map_begin` for the rows in `rows` (default all)."""
        B = history.length.shape[0]
        if rows is None:
            rows = jnp.ones((B,), bool)
        new = jax.vmap(self._begin_row)(state, history.length.astype(jnp.int32))
        new = replace(new, key_index=self._build_index(new, history.tokens))
        return _select(rows, new, state)

    def _build_index(self, st: NgramMapState, tokens_BS: Array) -> Array:
        """The key index of the live keys, in table order (the first of equal contents wins,
        as the draft's "first live key whose occurrence equals the key")."""
        B, mk = st.key_idx.shape
        kh = st.key_index.shape[1]
        bi = jnp.arange(B)[:, None]
        e = jnp.broadcast_to(jnp.arange(mk, dtype=jnp.int32)[None, :], (B, mk))
        content = _windows(tokens_BS, st.key_idx, self.size_n)  # [B, MK, n]
        home = _index_home(content, kh)
        none = jnp.int32(_INT_MAX)

        def body(c: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            probe, pending, idx = c
            slot = (home + probe) & (kh - 1)
            cur = idx[bi, slot]
            empty = pending & (cur == none)
            idx = idx.at[bi, jnp.where(empty, slot, kh)].min(e, mode="drop")
            won = empty & (idx[bi, slot] == e)
            cur_key = st.key_idx[bi, jnp.clip(cur, 0, mk - 1)]
            dup = (cur != none) & jnp.all(_windows(tokens_BS, cur_key, self.size_n) == content, -1)
            advance = pending & ~won & ~(empty & ~won) & ~dup
            return probe + advance.astype(jnp.int32), pending & ~won & ~dup, idx

        live = e < st.n_keys[:, None]
        init = (jnp.zeros((B, mk), jnp.int32), live, jnp.full((B, kh), none, jnp.int32))
        idx = lax.while_loop(lambda c: jnp.any(c[1]), body, init)[2]
        return jnp.where(idx == none, -1, idx)

    def _begin_row(self, st: NgramMapState, size: Array) -> NgramMapState:
        n, m = self.size_n, self.size_m
        c = st.size_last_begin
        c = jnp.where(c > size, jnp.where(size > n + m, size - n - m, 0), c)
        shrink = size < st.idx_last_check

        km = jnp.where(shrink & (st.key_map != 0) & (st.key_map >= c), 0, st.key_map)
        klast = jnp.where(shrink, jnp.maximum(c - 1, 0), st.key_map_last_idx)

        mk = st.key_idx.shape[0]
        live = jnp.arange(mk, dtype=jnp.int32) < st.n_keys
        kill = shrink & live & (st.key_idx >= c)
        vidx, vnum, vnac = st.value_idx, st.value_num, st.value_nacc
        if not self.key_only:
            # Upstream deletes values (value_idx >= c) from slot 3 down to 0, shifting the later
            # slots left and clearing idx/num of slot 3 (its n_accepted stays). Net effect: the
            # kept slots in order, then (0, 0, original n_accepted[3]) for the freed tail.
            apply = (shrink & live & ~kill)[:, None]  # [MK, 1]
            kept = ~(apply & (vidx != 0) & (vidx >= c))  # [MK, 4]
            rank = jnp.cumsum(kept.astype(jnp.int32), axis=1) - 1
            sel = kept[:, None, :] & (rank[:, None, :] == jnp.arange(MAX_VALUES)[None, :, None])
            has = jnp.any(sel, axis=2)  # [MK, 4] output slot k receives a kept slot

            def gather(a: Array, tail: Array) -> Array:
                got = jnp.sum(jnp.where(sel, a[:, None, :], 0), axis=2)
                return jnp.where(has, got, tail)

            vidx = gather(vidx, jnp.zeros_like(vidx))
            vnum = gather(vnum, jnp.zeros_like(vnum))
            vnac = gather(vnac, jnp.broadcast_to(vnac[:, -1:], vnac.shape))
            kill = kill | (apply[:, 0] & (vidx[:, 0] == 0))
        keep = live & ~kill
        dest = jnp.where(keep, jnp.cumsum(keep.astype(jnp.int32)) - 1, mk)

        def compact(a: Array, fill: int) -> Array:
            return jnp.full_like(a, fill).at[dest].set(a, mode="drop")

        return NgramMapState(
            key_map=km,
            key_map_last_idx=klast,
            size_last_begin=size,
            idx_last_check=size,
            last_created=st.last_created,
            last_key=st.last_key,
            last_value=st.last_value,
            n_keys=jnp.sum(keep.astype(jnp.int32)),
            key_idx=compact(st.key_idx, 0),
            stat_idx=compact(st.stat_idx, 0),
            key_num=compact(st.key_num, 0),
            value_idx=compact(vidx, 0),
            value_num=compact(vnum, 0),
            value_nacc=compact(vnac, -1),
            key_index=st.key_index,
        )

    def lookup_size(self) -> int:
        return self.size_n

    def lookup_gap(self) -> int:
        # occurrences start at <= L - n - m - 1 (upstream's scan range): end <= L - 1 - (m + 1)
        return self.size_m + 1

    # ------------------------------------------------------------------ draft
    def draft(
        self, params: Any, state: NgramMapState, inp: DraftInput, k_max: int
    ) -> tuple[NgramMapState, DraftOutput]:
        """All rows at once (batched by hand: no vmapped loops over whole maps)."""
        del params
        n, m, H = self.size_n, self.size_m, self.hash_size
        st = state
        tokens_BS = inp.history.tokens
        B, S = tokens_BS.shape
        mk = st.key_idx.shape[1]
        bi = jnp.arange(B)
        length = inp.history.length.astype(jnp.int32)
        drafting = inp.drafting

        ok = drafting & (length >= 2 * n + m)
        cols = jnp.arange(n, dtype=jnp.int32)
        key = tokens_BS[bi[:, None], jnp.clip(length[:, None] - n + 1 + cols[None, :], 0, S - 1)]
        key = jnp.where(cols[None, :] == n - 1, inp.last_token.astype(jnp.int32)[:, None], key)
        top = length - n - m - 1
        slb, klast = st.size_last_begin, st.key_map_last_idx

        # the positions upstream scans and inserts, in its order: r1 = (klast, slb-n-m-1] then
        # r2 = (max(slb, klast), top], each descending; one loop of W positions per step
        hi1 = slb - n - m - 1
        n1 = jnp.where(ok & (slb > n + m + 1), jnp.maximum(hi1 - klast, 0), 0)
        n2 = jnp.where(ok, jnp.maximum(top - jnp.maximum(slb, klast), 0), 0)
        W = _SCAN_CHUNK
        w = jnp.arange(W, dtype=jnp.int32)
        earlier = (w[None, :] < w[:, None])[None]  # [1, W, W]: j before i

        def body(c: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
            e0, km, m1, m2 = c
            e = e0 + w[None, :]  # [B, W] sequence index
            first = e < n1[:, None]
            pos = jnp.where(first, hi1[:, None] - e, top[:, None] - (e - n1[:, None]))
            valid = e < (n1 + n2)[:, None]
            win = _windows(tokens_BS, pos, n)  # [B, W, n]
            eqk = valid & jnp.all(win == key[:, None, :], axis=-1)
            m1 = jnp.maximum(m1, jnp.max(jnp.where(eqk & first, pos, 0), axis=1))
            m2 = jnp.maximum(m2, jnp.max(jnp.where(eqk & ~first, pos, 0), axis=1))
            slot = (_lcg_hash(win) % jnp.uint32(H)).astype(jnp.int32)
            flat = bi[:, None] * H + slot
            cand = valid & (km[flat] == 0)
            same = (slot[:, :, None] == slot[:, None, :]) & cand[:, None, :] & earlier
            winner = cand & ~jnp.any(same, axis=-1)  # first writer wins
            km = km.at[jnp.where(winner, flat, B * H)].set(pos, mode="drop")
            return e0 + W, km, m1, m2

        zero = jnp.zeros((B,), jnp.int32)
        init = (jnp.int32(0), st.key_map.reshape(-1), zero, zero)
        _, km_flat, m1, m2 = lax.while_loop(lambda c: jnp.any(c[0] < n1 + n2), body, init)

        # 1) hash-map lookup, 2) scan r1, 3) scan r2 (descending = largest match).
        # The lookup must see the map BEFORE this call's inserts; it is read from the updated
        # map (so the scatters above can run in place): inserts only fill empty slots, with
        # positions > key_map_last_idx, while every older entry is <= key_map_last_idx.
        hslot = (_lcg_hash(key) % jnp.uint32(H)).astype(jnp.int32)
        cand = km_flat[bi * H + hslot]
        cand = jnp.where(cand > klast, 0, cand)
        cand_eq = jnp.all(_windows(tokens_BS, cand, n) == key, axis=-1)
        hit = (cand != 0) & (cand < top) & cand_eq
        match = jnp.where(hit, cand, jnp.where(m1 > 0, m1, m2))
        match = jnp.where(ok, match, 0)
        klast = jnp.where(ok, jnp.maximum(top, klast), klast)
        idx_last_check = jnp.where(ok, length, st.idx_last_check)

        # key entry: the first live key whose occurrence equals the key (key index), else a new one
        have = match > 0
        found, e_found, free_slot = self._find_key(st, tokens_BS, key, have)
        usable = have & (found | (st.n_keys < mk))
        create = usable & ~found
        e = jnp.where(found, e_found, st.n_keys)
        e = jnp.minimum(e, mk - 1)
        kh = st.key_index.shape[1]
        key_index = st.key_index.at[bi, jnp.where(create, free_slot, kh)].set(e, mode="drop")

        key_idx = st.key_idx.at[bi, e].set(jnp.where(create, match, st.key_idx[bi, e]))
        stat0 = jnp.where(create, 0, st.stat_idx[bi, e])
        c4 = create[:, None]
        vidx = jnp.where(c4, 0, st.value_idx[bi, e])  # [B, 4]
        vnum = jnp.where(c4, 0, st.value_num[bi, e])
        vnac = jnp.where(c4, m, st.value_nacc[bi, e])
        knum_old = jnp.where(create, 0, st.key_num[bi, e])
        knum = jnp.where(usable, jnp.minimum(knum_old + 1, MAX_VALUE_COUNT), knum_old)
        n_keys = st.n_keys + create.astype(jnp.int32)

        start = match + n
        if self.key_only:
            gate = usable
            if self.check_min_hits_key_only:
                gate = gate & (knum >= self.min_hits)
            created = gate
            slot = jnp.zeros((B,), jnp.int32)
            stat_new = stat0
        else:
            do_stats = usable & (knum >= self.min_hits)

            def stats(_: Any) -> tuple[Array, Array, Array]:
                def row(tok_S: Array, key_N: Array, lo: Array, hi: Array, d: Array, vi, vn, va):
                    pad = pad_tokens(tok_S, n + m + 1)
                    pos = jnp.arange(S, dtype=jnp.int32)
                    occ = d & window_equal(pad, key_N, S) & (pos >= lo) & (pos <= hi)
                    return self._value_stats(pad, occ, vi, vn, va, S)

                return jax.vmap(row)(tokens_BS, key, stat0, match, do_stats, vidx, vnum, vnac)

            # O(S) per row, so only when some row counts occurrences (it found a match)
            vidx, vnum, vnac = lax.cond(
                jnp.any(do_stats), stats, lambda _: (vidx, vnum, vnac), None
            )
            stat_new = jnp.where(do_stats, match, stat0)
            slot = jnp.argmax(vnum, axis=1).astype(jnp.int32)  # first slot with the largest count
            mx = jnp.take_along_axis(vnum, slot[:, None], axis=1)[:, 0]
            others = jnp.sum(vnum, axis=1) - mx
            agree = ~((others > 0) & (mx < 2 * others))
            created = do_stats & agree
            if self.k4v_copy_majority:
                vs = jnp.take_along_axis(vidx, slot[:, None], axis=1)[:, 0]
                start = jnp.where(vs != 0, vs, start)
        n_draft = jnp.minimum(m, jnp.take_along_axis(vnac, slot[:, None], axis=1)[:, 0])
        n_draft = jnp.where(created, n_draft, 0)
        kk = jnp.arange(k_max, dtype=jnp.int32)
        start = jnp.clip(start, 0, S)
        at = start[:, None] + kk[None, :]
        toks = jnp.where(at < S, tokens_BS[bi[:, None], jnp.clip(at, 0, S - 1)], 0)
        valid = kk[None, :] < n_draft[:, None]
        out = DraftOutput(tokens=jnp.where(valid, toks, 0), valid=valid)

        u4 = usable[:, None]
        new = NgramMapState(
            key_map=km_flat.reshape(st.key_map.shape),
            key_map_last_idx=klast,
            size_last_begin=st.size_last_begin,
            idx_last_check=idx_last_check,
            # markers are reset by every draft call on a drafting row
            last_created=jnp.where(drafting, created, st.last_created),
            last_key=jnp.where(drafting, jnp.where(created, e, 0), st.last_key),
            last_value=jnp.where(drafting, jnp.where(created, slot, 0), st.last_value),
            n_keys=n_keys,
            key_idx=key_idx,
            stat_idx=st.stat_idx.at[bi, e].set(jnp.where(usable, stat_new, st.stat_idx[bi, e])),
            key_num=st.key_num.at[bi, e].set(jnp.where(usable, knum, st.key_num[bi, e])),
            value_idx=st.value_idx.at[bi, e].set(jnp.where(u4, vidx, st.value_idx[bi, e])),
            value_num=st.value_num.at[bi, e].set(jnp.where(u4, vnum, st.value_num[bi, e])),
            value_nacc=st.value_nacc.at[bi, e].set(jnp.where(u4, vnac, st.value_nacc[bi, e])),
            key_index=key_index,
        )
        # every other update above is already gated by `ok` / `usable` (both imply drafting)
        return new, out

    def _find_key(
        self, st: NgramMapState, tokens_BS: Array, key_BN: Array, rows: Array
    ) -> tuple[Array, Array, Array]:
        """Probe the key index for each row's key: (found, key offset, first free slot)."""
        B, kh = st.key_index.shape
        mk = st.key_idx.shape[1]
        bi = jnp.arange(B)
        home = _index_home(key_BN, kh)

        def body(c: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
            probe, pending, found, e = c
            slot = (home + probe) & (kh - 1)
            cur = st.key_index[bi, slot]
            at = st.key_idx[bi, jnp.clip(cur, 0, mk - 1)]
            eq = (cur >= 0) & jnp.all(_windows(tokens_BS, at, self.size_n) == key_BN, axis=-1)
            hit = pending & eq
            stop = hit | (cur < 0) | (probe + 1 >= kh)
            return (
                jnp.where(pending & ~stop, probe + 1, probe),
                pending & ~stop,
                found | hit,
                jnp.where(hit, cur, e),
            )

        zero = jnp.zeros((B,), jnp.int32)
        probe, _, found, e = lax.while_loop(
            lambda c: jnp.any(c[1]), body, (zero, rows, rows & False, zero)
        )
        return found, e, (home + probe) & (kh - 1)

    def _value_stats(
        self, pad: Array, occ: Array, vidx: Array, vnum: Array, vnac: Array, S: int
    ) -> tuple[Array, Array, Array]:
        """k4v: fold the key occurrences `occ [S]` into the 4 value slots (upstream order).

        Slot v (in order) keeps its m-gram if occupied, else takes the first occurrence whose
        m-gram matches none of slots < v; each occurrence counts for the first slot it matches.
        """
        n, m = self.size_n, self.size_m

        def body(
            v: Any, c: tuple[Array, Array, Array, Array, Array]
        ) -> tuple[Array, Array, Array, Array, Array]:
            vidx, vnum, vnac, taken, counts = c
            novel = occ & ~taken
            new_v = (vidx[v] == 0) & jnp.any(novel)
            p = jnp.where(new_v, jnp.argmax(novel).astype(jnp.int32) + n, vidx[v])
            vidx = vidx.at[v].set(p)
            vnum = vnum.at[v].set(jnp.where(new_v, 0, vnum[v]))
            vnac = vnac.at[v].set(jnp.where(new_v, m, vnac[v]))
            pat = lax.dynamic_slice(pad, (p,), (m,))
            eq_v = window_equal(pad, pat, S, offset=n) & (p != 0)
            counts = counts.at[v].set(jnp.sum((occ & eq_v & ~taken).astype(jnp.int32)))
            return vidx, vnum, vnac, taken | eq_v, counts

        init = (vidx, vnum, vnac, jnp.zeros((S,), bool), jnp.zeros((MAX_VALUES,), jnp.int32))
        vidx, vnum, vnac, _, counts = lax.fori_loop(0, MAX_VALUES, body, init)
        return vidx, jnp.minimum(vnum + counts, MAX_VALUE_COUNT), vnac

    # ------------------------------------------------------------------ accept
    def accept(
        self, state: NgramMapState, n_accepted: Array, is_other: Array, active: Array
    ) -> NgramMapState:
        """`common_ngram_map_accept`: the drafted value's `n_accepted` := n (own drafts only)."""
        apply = active & ~is_other & state.last_created
        b = jnp.arange(state.n_keys.shape[0])
        cur = state.value_nacc[b, state.last_key, state.last_value]
        val = jnp.where(apply, n_accepted.astype(jnp.int32), cur)
        nacc = state.value_nacc.at[b, state.last_key, state.last_value].set(val)
        return replace(state, value_nacc=nacc)


def _select(mask_B: Array, new: Any, old: Any) -> Any:
    def pick(a: Array, b: Array) -> Array:
        mm = mask_B.reshape(mask_B.shape + (1,) * (a.ndim - mask_B.ndim))
        return jnp.where(mm, a, b)

    return jax.tree.map(pick, new, old)


@dataclass(frozen=True)
class NgramMapK(NgramMap):
    """llama.cpp `ngram-map-k` (`--spec-ngram-map-k-size-n/-size-m/-min-hits`)."""

    name: ClassVar[str] = "ngram-map-k"
    key_only: bool = True


@dataclass(frozen=True)
class NgramMapK4V(NgramMap):
    """llama.cpp `ngram-map-k4v` (`--spec-ngram-map-k4v-size-n/-size-m/-min-hits`)."""

    name: ClassVar[str] = "ngram-map-k4v"
    key_only: bool = False
