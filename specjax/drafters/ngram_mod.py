"""ngram-mod (llama.cpp `common/ngram-mod.*` + its impl in `speculative.cpp`, spec 5.7), on device.

State (`NgramModState`):
* ONE hash pool of P slots shared by all rows (upstream shares it across slots), so the state
  has no leading B there (do not `select_rows` it): `pool [P]` tokens + `stamp [P]` epochs; a
  slot holds a token only while `stamp == epoch` (`pool_view` gives upstream's `entries`,
  EMPTY = -1), so a reset is `epoch += 1, used = 0` and never touches the `[P]` arrays.
  `used []` counts occupied slots. Slot of an n-gram `t[0:n]` = `h mod P` with the 64-bit LCG
  `h = h*6364136223846793005 + t_i` (wraparound mod 2^64, int32 tokens sign-extended as C++
  converts them to `size_t`); `add` overwrites the slot with the next token.
* per row: `i_last` (next history index to ingest), `n_draft_last` (UNTRUNCATED length of the
  row's last draft), `n_low` (low-acceptance streak).
* Jit `begin`/`draft`/`accept` with the state donated (`donate_argnums`): the pool is then
  updated in place; without donation every call copies it (16 MiB x 2 at the default size).
  `renew` makes a fresh state in an old one's buffers (a new epoch): `generate` hands each
  one-shot call the last one's state instead of allocating and filling the pool again.

64-bit hashing without x64: JAX has no usable uint64 unless `jax_enable_x64` is on (it is not,
and must not be switched on globally), so a 64-bit value is a pair of uint32 halves (hi, lo).
The hash is evaluated as the polynomial `sum_k t_k * A^(n-1-k) mod 2^64` (equal to the Horner
loop), with the powers precomputed in Python: each term is a 64x64->64 product built from
32x32->64 partial products (16-bit limbs), and the sum carries 16-bit partial sums into the
high word. `mod P`: when P is a power of two (the default 4*1024*1024) only `lo & (P-1)` is
needed (the high word is never computed); otherwise the full 64-bit value is reduced by
feeding it through `r = (r * 2^b + chunk) mod P` in b-bit chunks, b = 31 - bitlen(P-1), which
never overflows uint32. Pool sizes up to 2^30 are supported.

Ordering (documented, exact w.r.t. upstream's sequential loops):
* Within one ingestion, positions are added in ascending order: when several n-grams hash to the
  same slot, the LAST one's next token stays; `used` grows by the number of distinct slots that
  were EMPTY. Done in steps of 64 positions (256 in `begin`), each a sort by (slot, position)
  and one scatter of the last per slot: the cost follows the ingested positions, never S.
* Rows are processed in order 0..B-1 in `begin` and `draft`: row r's ingestion and lookup
  chain see rows <= r's ingestion of this call (and not later rows'), as upstream's per-seq loop
  does. `begin` is a `fori_loop` over rows. `draft` runs all rows at once when the call adds at
  most `48 * B` n-grams in total (the usual case): one pass adds them in upstream's order (rows,
  then positions) and a row's lookup of a slot written in this call reads the call's write log
  (last write by a row <= its own, else the slot's value before the call); larger calls (a row
  that did not draft for a long time) go row by row. The paths are loops run 0 or 1 times, not
  `lax.cond`, whose branches would copy the pool.
* `begin` (rows in the optional `rows` mask): `i_last = n_draft_last = 0`; if the prompt has at
  least n tokens, add every n-gram starting at `0 .. len-n-1`, `i_last = len - n`, then reset the
  whole pool if `used / P > 0.25` (after ingesting). `n_low` is not touched (as upstream).
* `draft` (drafting rows): `n_draft_last = 0`; nothing if `L < n`; if `i_last + 32 < L`, add the
  n-grams starting at `i_last .. L-n-1` and set `i_last = L - n`; then chain lookups from
  `[t[L-n+1:L], last_token]` for up to `n_max` tokens: an EMPTY slot at step `i < n_min` means no
  draft at all, otherwise it ends the draft. The row's `n_draft_last` is the chain's full length
  even when `k_max` (the engine's K) is smaller: the returned draft is truncated to `k_max`,
  upstream's relay truncates to the row's `n_max`, and the acceptance fraction still divides by
  the untruncated length, as upstream does. So with `k_max < n_min`, a draft still needs `n_min`
  found tokens before it is non-empty, and is then cut to `k_max`.
* `accept` (rows `active & ~is_other` with `n_draft_last > 0`): `n / n_draft_last < 0.25`
  (evaluated exactly as `4n < n_draft_last`) grows `n_low`, else `n_low = 0`; reaching 5 resets
  the shared pool and that row's `n_low` and `i_last`. Rows are independent here (a reset is
  idempotent, so the order does not matter).
Token ids must be non-negative (an added token equal to EMPTY would be invisible, as upstream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.control import at_row, run_once
from specjax.drafters.base import DraftInput, DraftOutput, ModelFreeDrafter, TokenHistory
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array

POOL_SIZE = 4 * 1024 * 1024
EMPTY = -1
LCG_FACTOR = 6364136223846793005
CHUNK = 32  # ingestion happens once more than CHUNK new tokens are pending
#: `renew` starts the epochs over (filling the pool once) from here: a run's resets, one per
#: epoch, then still fit below int32's end.
EPOCH_LIMIT = 1 << 30
_DRAFT_CHUNK = 64  # n-grams per ingestion step in `draft` (one step for the usual ~9-40)
_BEGIN_CHUNK = 256  # n-grams per ingestion step in `begin` (whole prompts)
_LOG_PER_ROW = 48  # a draft call adding <= 48 * B n-grams in total takes the all-rows path
_M16 = 0xFFFF


# ---------------------------------------------------------------------------------------------
# 64-bit arithmetic on (hi, lo) uint32 pairs
# ---------------------------------------------------------------------------------------------


def _u32(x: Any) -> Array:
    return jnp.asarray(x, jnp.uint32)


def mul32_wide(a: Array, b: Array) -> tuple[Array, Array]:
    """Full 32x32 -> 64-bit product of uint32 arrays as (hi, lo)."""
    a0, a1 = a & _M16, a >> 16
    b0, b1 = b & _M16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & _M16) + (p10 & _M16)
    lo = (p00 & _M16) | (mid << 16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, lo


def mul64(a_hi: Array, a_lo: Array, b_hi: Array, b_lo: Array) -> tuple[Array, Array]:
    """(a * b) mod 2^64 on (hi, lo) uint32 pairs."""
    hi, lo = mul32_wide(a_lo, b_lo)
    return hi + a_lo * b_hi + a_hi * b_lo, lo


def sum64(hi: Array, lo: Array) -> tuple[Array, Array]:
    """Sum mod 2^64 over the last axis (at most 2^15 terms)."""
    s0 = jnp.sum(lo & _M16, axis=-1, dtype=jnp.uint32)
    s1 = jnp.sum(lo >> 16, axis=-1, dtype=jnp.uint32)
    t = (s0 >> 16) + s1
    return jnp.sum(hi, axis=-1, dtype=jnp.uint32) + (t >> 16), (s0 & _M16) | (t << 16)


def mod64(hi: Array, lo: Array, p: int) -> Array:
    """(hi * 2^32 + lo) mod p for 1 <= p <= 2^30, in uint32 (b-bit chunks, no overflow)."""
    b = 31 - max(int(p - 1).bit_length(), 1)
    r = jnp.zeros_like(lo)
    pp = _u32(p)
    for word in (hi, lo):
        s = 32
        while s > 0:
            w = min(b, s)
            chunk = (word >> (s - w)) & _u32((1 << w) - 1)
            r = ((r << w) + chunk) % pp
            s -= w
    return r


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A^(n-1-k) mod 2^64 for k < n, as (hi, lo) uint32 numpy arrays."""
    pw = [pow(LCG_FACTOR, n - 1 - k, 1 << 64) for k in range(n)]
    return (
        np.array([x >> 32 for x in pw], np.uint32),
        np.array([x & 0xFFFFFFFF for x in pw], np.uint32),
    )


def mod_hash_index(win_WN: Array, n: int, pool_size: int) -> Array:
    """`[W]` int32 pool slots of the n-gram windows `win [W, n]` (int32 tokens, W >= 1)."""
    p_hi, p_lo = _powers(n)
    t_lo = lax.bitcast_convert_type(win_WN.astype(jnp.int32), jnp.uint32)
    if pool_size & (pool_size - 1) == 0:  # power of two: only the low word matters
        lo = jnp.sum(t_lo * jnp.asarray(p_lo)[None, :], axis=-1, dtype=jnp.uint32)
        return (lo & _u32(pool_size - 1)).astype(jnp.int32)
    t_hi = jnp.where(win_WN < 0, _u32(0xFFFFFFFF), _u32(0))
    hi, lo = mul64(t_hi, t_lo, jnp.asarray(p_hi)[None, :], jnp.asarray(p_lo)[None, :])
    hi, lo = sum64(hi, lo)
    return mod64(hi, lo, pool_size).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# drafter
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class NgramModState:
    """Pool shared by all rows (no leading B) + per-row bookkeeping.

    A slot holds a token only if `stamp[slot] == epoch`; a reset is `epoch += 1, used = 0`, so no
    reset ever touches the `[P]` arrays (see `pool_view`).
    """

    pool: Array  # [P] int32 token written last (meaningful where stamp == epoch)
    stamp: Array  # [P] int32 epoch of the last write
    epoch: Array  # [] int32 current epoch (>= 1; stamps start at 0)
    used: Array  # [] int32 slots holding a token in this epoch
    i_last: Array  # [B] int32
    n_draft_last: Array  # [B] int32
    n_low: Array  # [B] int32


def pool_view(state: NgramModState) -> Array:
    """The upstream `entries` array: `[P]` int32 token per slot, EMPTY where unused."""
    return jnp.where(state.stamp == state.epoch, state.pool, EMPTY)


@dataclass(frozen=True)
class NgramMod(ModelFreeDrafter):
    """llama.cpp `ngram-mod` (`--spec-ngram-mod-n-match/-n-min/-n-max`)."""

    name: ClassVar[str] = "ngram-mod"
    #: A round in which no row drafts leaves the state as it is (no row ingests or looks up;
    #: `accept` applies only to rows whose verified draft was its own), so a round the
    #: governor turns off may skip the calls (`engine.spec_step`).
    idle_noop: ClassVar[bool] = True
    #: (the 64-bit hash of the n-gram and a chain of up to n_max dependent lookups)
    ask_steps: ClassVar[float] = 0.13
    #: `renew` makes a fresh state in an old one's buffers (the `[P]` pool is not allocated)
    can_renew: ClassVar[bool] = True
    spec_options: ClassVar[tuple[str, ...]] = ("n_match", "n_min", "n_max", "pool_size")
    n_match: int = 24
    n_min: int = 48
    n_max: int = 64
    pool_size: int = POOL_SIZE

    def __post_init__(self) -> None:
        if self.n_match < 1:
            raise ValueError("ngram-mod: n_match must be >= 1")
        if self.n_min < 0 or self.n_max < 0:
            raise ValueError("ngram-mod: n_min and n_max must be >= 0")
        if not 1 <= self.pool_size <= 2**30:
            raise ValueError("ngram-mod: pool_size must be in [1, 2^30]")

    def init(self, batch: int, capacity: int) -> NgramModState:
        del capacity
        # distinct buffers per field, so that the whole state can be donated
        return NgramModState(
            pool=jnp.full((self.pool_size,), EMPTY, jnp.int32),
            stamp=jnp.zeros((self.pool_size,), jnp.int32),
            epoch=jnp.ones((), jnp.int32),
            used=jnp.zeros((), jnp.int32),
            i_last=jnp.zeros((batch,), jnp.int32),
            n_draft_last=jnp.zeros((batch,), jnp.int32),
            n_low=jnp.zeros((batch,), jnp.int32),
        )

    def renew(self, state: NgramModState) -> NgramModState:
        """A fresh state (as `init` at the same B) in `state`'s buffers: every slot EMPTY by
        a new epoch, so the `[P]` arrays are neither allocated nor filled (`generate` hands
        each call the last call's state, `engine.prefill`'s `spare`). Near int32's end the
        epochs start over: the arrays are then filled once (`run_once`, not `lax.cond`,
        whose branches would copy the pool)."""

        def refill(c: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            pool, stamp, epoch = c
            return jnp.full_like(pool, EMPTY), jnp.zeros_like(stamp), jnp.zeros_like(epoch)

        pool, stamp, epoch = run_once(
            state.epoch >= EPOCH_LIMIT, refill, (state.pool, state.stamp, state.epoch)
        )
        zeros_B = jnp.zeros_like(state.i_last)
        return NgramModState(
            pool=pool,
            stamp=stamp,
            epoch=epoch + 1,
            used=jnp.zeros_like(state.used),
            i_last=zeros_B,
            n_draft_last=jnp.zeros_like(zeros_B),
            n_low=jnp.zeros_like(zeros_B),
        )

    # ------------------------------------------------------------------ pool primitives
    def _ingest(
        self, st: NgramModState, tokens_BS: Array, row: Array, lo: Array, hi: Array, chunk: int
    ) -> NgramModState:
        """Add the n-grams of `row` starting at `lo .. hi-1` (none if hi <= lo) to the shared
        pool, in ascending order, `chunk` positions per loop iteration (O(chunk) each).

        Within a chunk the n-grams are sorted by (slot, position) and only the last per slot is
        written (upstream's sequential overwrite); chunks run in order."""
        n, P = self.n_match, self.pool_size
        S = tokens_BS.shape[1]
        offs = jnp.arange(chunk, dtype=jnp.int32)
        cols = jnp.arange(n, dtype=jnp.int32)

        def body(c: tuple[Array, NgramModState]) -> tuple[Array, NgramModState]:
            p, st = c
            pos = p + offs
            idx = jnp.clip(pos[:, None] + cols[None, :], 0, S - 1)
            win = tokens_BS[row, idx]  # [chunk, n]
            slot = mod_hash_index(win, n, P)
            slot = jnp.where((pos >= lo) & (pos < hi), slot, P)
            s_slot, s_pos = lax.sort((slot, pos), num_keys=2)
            is_last = jnp.concatenate([s_slot[1:] != s_slot[:-1], jnp.ones((1,), bool)])
            s_slot = jnp.where(is_last, s_slot, P)
            tok = tokens_BS[row, jnp.clip(s_pos + n, 0, S - 1)]
            live = s_slot < P
            at = jnp.clip(s_slot, 0, P - 1)
            was_empty = (st.stamp[at] != st.epoch) | (st.pool[at] == EMPTY)
            n_new = jnp.sum((live & was_empty).astype(jnp.int32))
            # Make the scatters data-depend on the reads above (n_new >= 0 always): otherwise
            # XLA cannot prove the reads happen first and copies the [P] arrays instead of
            # updating them in place.
            s_slot = jnp.where(n_new < 0, P, s_slot)
            st = replace(
                st,
                pool=st.pool.at[s_slot].set(tok, mode="drop"),
                stamp=st.stamp.at[s_slot].set(
                    jnp.broadcast_to(st.epoch, s_slot.shape), mode="drop"
                ),
                used=st.used + n_new,
            )
            return p + chunk, st

        return lax.while_loop(lambda c: c[0] < hi, body, (lo, st))[1]

    def _reset_if(self, st: NgramModState, reset: Array) -> NgramModState:
        """`common_ngram_mod::reset` (all slots EMPTY) when `reset`, in O(1)."""
        return replace(
            st,
            epoch=st.epoch + reset.astype(jnp.int32),
            used=jnp.where(reset, 0, st.used),
        )

    # ------------------------------------------------------------------ begin
    def begin(
        self, state: NgramModState, history: TokenHistory, rows: Array | None = None
    ) -> NgramModState:
        """Ingest each starting row's prompt (rows in order), resetting on occupancy > 0.25."""
        n, P = self.n_match, self.pool_size
        B = history.tokens.shape[0]
        if rows is None:
            rows = jnp.ones((B,), bool)
        lengths = history.length.astype(jnp.int32)

        def body(r: Any, st: NgramModState) -> NgramModState:
            cur_len = at_row(lengths, r)  # (not lengths[r]: see `control.at_row`)
            on = at_row(rows, r)
            go = on & (cur_len >= n)
            hi = jnp.where(go, cur_len - n, 0)
            st = self._ingest(st, history.tokens, r, jnp.int32(0), hi, _BEGIN_CHUNK)
            st = self._reset_if(st, go & (st.used > P // 4))  # used / P > 0.25
            i_last = jnp.where(on, hi, at_row(st.i_last, r))
            ndl = jnp.where(on, 0, at_row(st.n_draft_last, r))
            return replace(
                st,
                i_last=st.i_last.at[r].set(i_last),
                n_draft_last=st.n_draft_last.at[r].set(ndl),
            )

        return lax.fori_loop(0, B, body, state)

    def lookup_size(self) -> int:
        return self.n_match

    @property
    def min_draft_len(self) -> int:
        """The shortest draft it makes when it drafts: a chain shorter than n_min is none,
        unless it stopped at n_max."""
        return max(min(self.n_min, self.n_max), 1)

    def lookup_gap(self) -> int:
        # the pool holds n-grams starting at <= L - n - 1 (each with its next token): end <= L - 2
        return 1

    # ------------------------------------------------------------------ draft
    def draft(
        self, params: Any, state: NgramModState, inp: DraftInput, k_max: int
    ) -> tuple[NgramModState, DraftOutput]:
        """All rows at once when this call ingests at most `_LOG_PER_ROW * B` n-grams in total
        (the usual case: a row adds ~9-41 every ~9 tokens), else row by row (both exact)."""
        del params
        n = self.n_match
        lengths = inp.history.length.astype(jnp.int32)
        go = inp.drafting & (lengths >= n)
        need = go & (state.i_last + CHUNK < lengths)
        total = jnp.sum(jnp.where(need, lengths - n - state.i_last, 0))
        B = lengths.shape[0]
        out0 = DraftOutput(
            tokens=jnp.zeros((B, k_max), jnp.int32), valid=jnp.zeros((B, k_max), bool)
        )

        def once(pred: Array, path: Any, st: NgramModState, out: DraftOutput) -> Any:
            # a loop run 0 or 1 times (not lax.cond, whose branches would copy the pool)
            def body(c: tuple[Array, NgramModState, DraftOutput]) -> Any:
                return (jnp.bool_(False), *path(c[1], inp, k_max))

            return lax.while_loop(lambda c: c[0], body, (pred, st, out))[1:]

        small = total <= _LOG_PER_ROW * B
        state, out = once(small, self._draft_rows, state, out0)
        return once(~small, self._draft_serial, state, out)

    def _draft_rows(
        self, state: NgramModState, inp: DraftInput, k_max: int
    ) -> tuple[NgramModState, DraftOutput]:
        """Vectorised over rows. All rows' new n-grams (<= `_LOG_PER_ROW * B`) are added in upstream's
        order (rows in order, positions ascending) in one pass; a row's lookups must see the
        pool after ITS ingestion only, so a read of a slot written in this call takes the last
        write by a row <= its own from the call's write log, else the slot's value before the
        call."""
        n, P = self.n_match, self.pool_size
        n_max, n_min = self.n_max, self.n_min
        tokens_BS = inp.history.tokens
        B, S = tokens_BS.shape
        bi = jnp.arange(B)
        lengths = inp.history.length.astype(jnp.int32)
        d = inp.drafting
        go = d & (lengths >= n)
        i_last = state.i_last
        need = go & (i_last + CHUNK < lengths)
        count = jnp.where(need, lengths - n - i_last, 0)  # n-grams each row adds
        end = jnp.cumsum(count)
        begin = end - count
        n_log = _LOG_PER_ROW * B
        e = jnp.arange(n_log, dtype=jnp.int32)
        cols = jnp.arange(n, dtype=jnp.int32)

        def ingest(c: Any) -> Any:
            _, pool, stamp, used, _, _, _, _ = c
            row = jnp.minimum(jnp.sum(e[:, None] >= end[None, :], axis=1), B - 1).astype(jnp.int32)
            valid = e < end[-1]
            pos = i_last[row] + e - begin[row]
            win = tokens_BS[row[:, None], jnp.clip(pos[:, None] + cols[None, :], 0, S - 1)]
            slot = jnp.where(valid, mod_hash_index(win, n, P), P)  # P = no write
            tok = tokens_BS[row, jnp.clip(pos + n, 0, S - 1)]
            at = jnp.clip(slot, 0, P - 1)
            pre = jnp.where(stamp[at] == state.epoch, pool[at], EMPTY)  # before the call
            # net writes: the last entry per slot (entries are in upstream's order)
            s_slot, s_e = lax.sort((slot, e), num_keys=2)
            is_last = jnp.concatenate([s_slot[1:] != s_slot[:-1], jnp.ones((1,), bool)])
            w_slot = jnp.where(is_last, s_slot, P)
            n_new = jnp.sum(((w_slot < P) & (pre[s_e] == EMPTY)).astype(jnp.int32))
            w_slot = jnp.where(n_new < 0, P, w_slot)  # scatter after the reads (in place)
            pool = pool.at[w_slot].set(tok[s_e], mode="drop")
            epochs = jnp.broadcast_to(state.epoch, w_slot.shape)
            stamp = stamp.at[w_slot].set(epochs, mode="drop")
            return jnp.bool_(False), pool, stamp, used + n_new, slot, row, tok, pre

        # run once when some row ingests (a loop, not lax.cond, so the pool is not copied)
        none = jnp.full((n_log,), P, jnp.int32)
        zeros = jnp.zeros((n_log,), jnp.int32)
        init = (end[-1] > 0, state.pool, state.stamp, state.used, none, zeros, zeros, zeros)
        _, pool, stamp, used, slot, row, tok, pre = lax.while_loop(lambda c: c[0], ingest, init)
        valid = slot < P
        epoch = state.epoch

        # lookups, all rows at once: chain from [t[L-n+1:L], last_token]
        width = n + max(n_max, k_max)
        key = tokens_BS[bi[:, None], jnp.clip(lengths[:, None] - n + 1 + cols[None, :], 0, S - 1)]
        key = jnp.where(cols[None, :] == n - 1, inp.last_token.astype(jnp.int32)[:, None], key)
        buf = jnp.zeros((B, width), jnp.int32).at[:, :n].set(key)

        def lookup(s_B: Array) -> Array:
            cur = jnp.where(stamp[s_B] == epoch, pool[s_B], EMPTY)
            hit = (slot[None, :] == s_B[:, None]) & valid[None, :]  # [B, LOG]
            mine = hit & (row[None, :] <= bi[:, None])
            last_mine = jnp.max(jnp.where(mine, e[None, :], -1), axis=1)
            first_hit = jnp.argmax(hit, axis=1)
            return jnp.where(
                last_mine >= 0,
                tok[jnp.maximum(last_mine, 0)],
                jnp.where(jnp.any(hit, axis=1), pre[first_hit], cur),
            )

        def c_body(c: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            i, b, act = c
            w = jnp.take_along_axis(b, i[:, None] + cols[None, :], axis=1)
            t = lookup(mod_hash_index(w, n, P))
            empty = t == EMPTY
            write = act & ~empty
            b = b.at[bi, jnp.where(write, n + i, width)].set(t, mode="drop")
            return jnp.where(write, i + 1, i), b, write & (i + 1 < n_max)

        stop0 = go & (n_max > 0)
        i, buf, _ = lax.while_loop(
            lambda c: jnp.any(c[2]), c_body, (jnp.zeros((B,), jnp.int32), buf, stop0)
        )
        # a chain ends at an EMPTY slot or at n_max; an EMPTY before n_min means no draft
        length = jnp.where(go, jnp.where((i < n_max) & (i < n_min), 0, i), 0)
        st = replace(
            state,
            pool=pool,
            stamp=stamp,
            used=used,
            i_last=jnp.where(need, lengths - n, i_last),
            n_draft_last=jnp.where(d, length, state.n_draft_last),
        )
        valid_k = jnp.arange(k_max, dtype=jnp.int32)[None, :] < length[:, None]
        toks = buf[:, n : n + k_max]
        return st, DraftOutput(tokens=jnp.where(valid_k, toks, 0), valid=valid_k)

    def _draft_serial(
        self, state: NgramModState, inp: DraftInput, k_max: int
    ) -> tuple[NgramModState, DraftOutput]:
        """Row by row (any amount of ingestion)."""
        n, P = self.n_match, self.pool_size
        n_max, n_min = self.n_max, self.n_min
        B, S = inp.history.tokens.shape
        tokens_BS = inp.history.tokens
        lengths = inp.history.length.astype(jnp.int32)
        width = n + max(n_max, k_max)
        cols = jnp.arange(n, dtype=jnp.int32)

        def body(
            r: Any, carry: tuple[NgramModState, Array, Array]
        ) -> tuple[NgramModState, Array, Array]:
            st, out_tok, out_len = carry
            # per-row scalars by `control.at_row`, not `x[r]`: on a GPU a dynamic slice by
            # the loop's counter is a host-driven copy, and this loop would run from the host
            cur_len = at_row(lengths, r)
            d = at_row(inp.drafting, r)
            go = d & (cur_len >= n)
            i_last = at_row(st.i_last, r)
            need = go & (i_last + CHUNK < cur_len)
            hi = jnp.where(need, cur_len - n, i_last)
            st = self._ingest(st, tokens_BS, r, i_last, hi, _DRAFT_CHUNK)
            i_last = hi
            pool, stamp, epoch = st.pool, st.stamp, st.epoch

            # pattern: the last n-1 history tokens, then id_last
            key = tokens_BS[r, jnp.clip(cur_len - n + 1 + cols, 0, S - 1)]
            key = jnp.where(cols == n - 1, at_row(inp.last_token, r).astype(jnp.int32), key)
            buf = lax.dynamic_update_slice(jnp.zeros((width,), jnp.int32), key, (0,))

            def c_cond(c: tuple[Array, Array, Array]) -> Array:
                i, _, stop = c
                return go & (i < n_max) & ~stop

            def c_body(c: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
                i, b, _ = c
                slot = mod_hash_index(lax.dynamic_slice(b, (i,), (n,))[None], n, P)[0]
                tok = jnp.where(stamp[slot] == epoch, pool[slot], EMPTY)
                empty = tok == EMPTY
                b = lax.dynamic_update_slice(b, jnp.where(empty, b[n + i], tok)[None], (n + i,))
                return jnp.where(empty, i, i + 1), b, empty

            i, buf, stop = lax.while_loop(c_cond, c_body, (jnp.int32(0), buf, jnp.bool_(False)))
            length = jnp.where(stop & (i < n_min), 0, i)
            st = replace(
                st,
                i_last=st.i_last.at[r].set(i_last),
                n_draft_last=st.n_draft_last.at[r].set(
                    jnp.where(d, length, at_row(st.n_draft_last, r))
                ),
            )
            out_tok = out_tok.at[r].set(lax.dynamic_slice(buf, (n,), (k_max,)))
            out_len = out_len.at[r].set(length)
            return st, out_tok, out_len

        init = (state, jnp.zeros((B, k_max), jnp.int32), jnp.zeros((B,), jnp.int32))
        state, toks, lens = lax.fori_loop(0, B, body, init)  # rows in order
        valid = jnp.arange(k_max, dtype=jnp.int32)[None, :] < lens[:, None]
        return state, DraftOutput(tokens=jnp.where(valid, toks, 0), valid=valid)

    # ------------------------------------------------------------------ accept
    def accept(
        self, state: NgramModState, n_accepted: Array, is_other: Array, active: Array
    ) -> NgramModState:
        ndl = state.n_draft_last
        apply = active & ~is_other & (ndl > 0)
        low = 4 * n_accepted.astype(jnp.int32) < ndl
        n_low = jnp.where(apply, jnp.where(low, state.n_low + 1, 0), state.n_low)
        reset = apply & low & (n_low >= 5)
        st = self._reset_if(state, jnp.any(reset))
        return replace(
            st,
            i_last=jnp.where(reset, 0, state.i_last),
            n_low=jnp.where(reset, 0, n_low),
        )
