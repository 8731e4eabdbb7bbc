"""ngram-map-k / ngram-map-k4v (llama.cpp `common/ngram-map.*`, spec 5.6), per row, on device.

Every row owns one `common_ngram_map` (rows never interact), vmapped over B:
* `key_map [B, H]` int32 (H = 2^18 by default): hash slot -> history index of an n-gram, 0 = empty.
  Hash = uint32 LCG `h = h*2654435761 + token` over the n tokens (uint32 wraparound), slot
  `h mod H`. Slots are written "first writer wins" in upstream's order: within one draft call
  positions are inserted descending, first the range below `size_last_begin`, then the range
  above it. Implemented as two masked scatter-max passes (a slot only takes a value while it is
  still 0, and among the positions of one pass hashing to it the largest wins).
* `keys`: a static table of `max_keys` entries (default: the history capacity S), `n_keys` live,
  kept in creation order (upstream's vector order; deletions in `begin` compact it stably).
  Each key: `key_idx` (history index of an occurrence), `stat_idx`, `key_num` (saturating at
  16380) and 4 value slots (`value_idx` (0 = unused), `value_num` (saturating), `n_accepted`).
  Occupied value slots always form a prefix.
* Per-row scalars: `key_map_last_idx`, `size_last_begin`, `idx_last_check` and the last-draft
  markers (`last_created`, `last_key` = table offset, `last_value` = slot).

Searches are vectorised: one sliding-window equality of the key against the whole `[S]`
history gives the descending linear searches (masked max), the key-table lookup (gather at
`key_idx`) and the k4v occurrence scan `[stat_idx, match]`. k4v value statistics: the up-to-4
value slots are discovered in order (slot v is created by the FIRST occurrence whose m-gram
matches none of slots < v), then each occurrence counts for the first slot whose m-gram it
equals; this is exactly upstream's sequential scan (a novel m-gram with all 4 slots taken is
dropped).

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
from specjax.drafters.ngram_simple import last_pattern, pad_tokens, slice_draft, window_equal
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


@dataclass(frozen=True)
class NgramMap(ModelFreeDrafter):
    """llama.cpp `ngram-map-k` (`key_only=True`) / `ngram-map-k4v` (`key_only=False`).

    Prefer the `NgramMapK` / `NgramMapK4V` subclasses, whose `name` is the llama.cpp type name.
    """

    name: ClassVar[str] = "ngram-map"
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
        )

    def begin(
        self, state: NgramMapState, history: TokenHistory, rows: Array | None = None
    ) -> NgramMapState:
        """`common_ngram_map_begin` for the rows in `rows` (default all)."""
        B = history.length.shape[0]
        if rows is None:
            rows = jnp.ones((B,), bool)
        new = jax.vmap(self._begin_row)(state, history.length.astype(jnp.int32))
        return _select(rows, new, state)

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
        )

    # ------------------------------------------------------------------ draft
    def draft(
        self, params: Any, state: NgramMapState, inp: DraftInput, k_max: int
    ) -> tuple[NgramMapState, DraftOutput]:
        del params

        def row(
            st: NgramMapState, tokens_S: Array, length: Array, sampled: Array, drafting: Array
        ) -> tuple[NgramMapState, DraftOutput]:
            return self._draft_row(st, tokens_S, length, sampled, drafting, k_max)

        return jax.vmap(row)(
            state,
            inp.history.tokens,
            inp.history.length.astype(jnp.int32),
            inp.last_token,
            inp.drafting,
        )

    def _draft_row(
        self,
        st: NgramMapState,
        tokens_S: Array,
        length: Array,
        sampled: Array,
        drafting: Array,
        k_max: int,
    ) -> tuple[NgramMapState, DraftOutput]:
        n, m, H = self.size_n, self.size_m, self.hash_size
        S = tokens_S.shape[0]
        mk = st.key_idx.shape[0]
        pad = pad_tokens(tokens_S, n + m + k_max + 1)
        pos = jnp.arange(S, dtype=jnp.int32)

        ok = drafting & (length >= 2 * n + m)
        key = last_pattern(pad, length, sampled, n)
        weq = window_equal(pad, key, S)  # [S] window j equals the key
        top = length - n - m - 1
        slb, klast = st.size_last_begin, st.key_map_last_idx

        r1 = (slb > n + m + 1) & (pos <= slb - n - m - 1) & (pos > klast)
        r2 = (pos <= top) & (pos > jnp.maximum(slb, klast))

        # insert the newly scanned positions (first writer wins, upstream order: r1 then r2)
        slots = (map_hash_windows(pad, n, S) % jnp.uint32(H)).astype(jnp.int32)
        km = st.key_map
        for rng in (r1, r2):
            free = km[slots] == 0
            km = km.at[slots].max(jnp.where(ok & rng & free, pos, 0))

        # 1) hash-map lookup, 2) scan r1, 3) scan r2 (descending = largest match).
        # The lookup must see the map BEFORE this call's inserts; it is read from the updated
        # map (so the scatters above can run in place): inserts only fill empty slots, with
        # positions > key_map_last_idx, while every older entry is <= key_map_last_idx.
        hkey = map_hash_windows(key, n, 1)[0]
        cand = km[(hkey % jnp.uint32(H)).astype(jnp.int32)]
        cand = jnp.where(cand > klast, 0, cand)
        hit = (cand != 0) & (cand < top) & weq[jnp.clip(cand, 0, S - 1)]
        m1 = jnp.max(jnp.where(r1 & weq, pos, 0))
        m2 = jnp.max(jnp.where(r2 & weq, pos, 0))
        match = jnp.where(hit, cand, jnp.where(m1 > 0, m1, m2))
        match = jnp.where(ok, match, 0)
        klast = jnp.where(ok, jnp.maximum(top, klast), klast)
        idx_last_check = jnp.where(ok, length, st.idx_last_check)

        # key entry: first live key whose occurrence equals the key, else a new one
        live = jnp.arange(mk, dtype=jnp.int32) < st.n_keys
        kmatch = live & weq[jnp.clip(st.key_idx, 0, S - 1)]
        found = jnp.any(kmatch)
        have = match > 0
        usable = have & (found | (st.n_keys < mk))
        create = usable & ~found
        e = jnp.where(found, jnp.argmax(kmatch).astype(jnp.int32), st.n_keys)
        e = jnp.minimum(e, mk - 1)

        key_idx = st.key_idx.at[e].set(jnp.where(create, match, st.key_idx[e]))
        stat0 = jnp.where(create, 0, st.stat_idx[e])
        vidx = jnp.where(create, 0, st.value_idx[e])  # [4]
        vnum = jnp.where(create, 0, st.value_num[e])
        vnac = jnp.where(create, m, st.value_nacc[e])
        knum_old = jnp.where(create, 0, st.key_num[e])
        knum = jnp.where(usable, jnp.minimum(knum_old + 1, MAX_VALUE_COUNT), knum_old)
        n_keys = st.n_keys + create.astype(jnp.int32)

        start = match + n
        if self.key_only:
            gate = usable
            if self.check_min_hits_key_only:
                gate = gate & (knum >= self.min_hits)
            created = gate
            slot = jnp.int32(0)
            stat_new = stat0
        else:
            do_stats = usable & (knum >= self.min_hits)
            occ = do_stats & weq & (pos >= stat0) & (pos <= match)
            vidx, vnum, vnac = self._value_stats(pad, occ, vidx, vnum, vnac, S)
            stat_new = jnp.where(do_stats, match, stat0)
            slot = jnp.argmax(vnum).astype(jnp.int32)  # first slot with the largest count
            mx = vnum[slot]
            others = jnp.sum(vnum) - mx
            agree = ~((others > 0) & (mx < 2 * others))
            created = do_stats & agree
            if self.k4v_copy_majority:
                start = jnp.where(vidx[slot] != 0, vidx[slot], start)
        n_draft = jnp.minimum(m, vnac[slot])
        out = slice_draft(pad, jnp.clip(start, 0, S), jnp.where(created, n_draft, 0), k_max)

        new = NgramMapState(
            key_map=km,
            key_map_last_idx=klast,
            size_last_begin=st.size_last_begin,
            idx_last_check=idx_last_check,
            # markers are reset by every draft call on a drafting row
            last_created=jnp.where(drafting, created, st.last_created),
            last_key=jnp.where(drafting, jnp.where(created, e, 0), st.last_key),
            last_value=jnp.where(drafting, jnp.where(created, slot, 0), st.last_value),
            n_keys=n_keys,
            key_idx=key_idx,
            stat_idx=st.stat_idx.at[e].set(jnp.where(usable, stat_new, st.stat_idx[e])),
            key_num=st.key_num.at[e].set(jnp.where(usable, knum, st.key_num[e])),
            value_idx=st.value_idx.at[e].set(jnp.where(usable, vidx, st.value_idx[e])),
            value_num=st.value_num.at[e].set(jnp.where(usable, vnum, st.value_num[e])),
            value_nacc=st.value_nacc.at[e].set(jnp.where(usable, vnac, st.value_nacc[e])),
        )
        # every other update above is already gated by `ok` / `usable` (both imply drafting)
        return new, out

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
