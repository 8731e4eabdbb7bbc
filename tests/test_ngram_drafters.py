"""JAX n-gram drafters vs the plain-Python references (tests/oracles/reference.py).

A driver runs the same random request/round sequence through a JAX drafter (B rows, capacity
S, draft width K, all jitted once per configuration) and through the reference impl with B
sequences, checking every draft and, after every call, the drafter state itself (ngram-map key
table + hash map, ngram-mod pool + per-row counters). Histories come from tiny alphabets or a
mutated repeating motif so that n-grams recur; cells past each row's length hold fresh garbage.
Rounds: random drafting rows, random acceptance (a prefix of the draft, as a verifier would
accept), random `is_other`; requests restart with `begin` on a shorter (history shrink) or longer
history. Plus targeted cases: k4v slot saturation / majority thresholds / count saturation,
ngram-mod occupancy and low-acceptance resets, k_max < n_min, the 64-bit hash.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.reference import (
    MOD_EMPTY,
    NgramMapImplRef,
    NgramModRef,
    NgramSimpleRef,
    map_hash,
    mod_hash,
)

from specjax.drafters.base import DraftInput, TokenHistory
from specjax.drafters.ngram_map import MAX_VALUE_COUNT, NgramMap, NgramMapK, NgramMapK4V
from specjax.drafters.ngram_mod import NgramMod, mod_hash_index, pool_view
from specjax.drafters.ngram_simple import NgramSimple
from specjax.pytree import replace

S = 128  # history capacity of the random drivers
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


@functools.cache
def _jitted(drafter: Any, k_max: int) -> tuple[Any, Any, Any]:
    return (
        jax.jit(drafter.begin),
        jax.jit(functools.partial(drafter.draft, None, k_max=k_max)),
        jax.jit(drafter.accept),
    )


def _reference(drafter: Any, batch: int) -> Any:
    if isinstance(drafter, NgramSimple):
        return NgramSimpleRef(drafter.size_n, drafter.size_m)
    if isinstance(drafter, NgramMap):
        return NgramMapImplRef(
            drafter.key_only,
            drafter.size_n,
            drafter.size_m,
            drafter.min_hits,
            n_seq=batch,
            check_min_hits_key_only=drafter.check_min_hits_key_only,
            k4v_copy_majority=drafter.k4v_copy_majority,
            hash_size=drafter.hash_size,
        )
    assert isinstance(drafter, NgramMod)
    return NgramModRef(
        drafter.n_match, drafter.n_min, drafter.n_max, drafter.pool_size, n_seq=batch
    )


class Pair:
    """A JAX drafter and its reference, driven in lockstep over B rows."""

    def __init__(self, drafter: Any, batch: int, k_max: int, seed: int = 0) -> None:
        self.d, self.B, self.K = drafter, batch, k_max
        self.ref = _reference(drafter, batch)
        self.begin_fn, self.draft_fn, self.accept_fn = _jitted(drafter, k_max)
        self.state = drafter.init(batch, S)
        self.rng = np.random.default_rng(seed)

    def _history(self, hists: list[list[int]]) -> TokenHistory:
        cells = self.rng.integers(0, 1 << 20, (self.B, S)).astype(np.int32)  # garbage
        for r, h in enumerate(hists):
            cells[r, : len(h)] = h
        lengths = np.array([len(h) for h in hists], np.int32)
        return TokenHistory(tokens=jnp.asarray(cells), length=jnp.asarray(lengths))

    def begin(self, hists: list[list[int]], rows: list[bool]) -> None:
        self.state = self.begin_fn(self.state, self._history(hists), jnp.asarray(rows))
        for r in range(self.B):
            if rows[r]:
                self.ref.begin(r, list(hists[r]))
        self.check_state()

    def draft(
        self, hists: list[list[int]], last: list[int], drafting: list[bool]
    ) -> list[list[int]]:
        inp = DraftInput(
            history=self._history(hists),
            last_token=jnp.asarray(last, jnp.int32),
            n_max=jnp.full((self.B,), self.K, jnp.int32),
            drafting=jnp.asarray(drafting),
            n_min=jnp.int32(0),
            p_min=jnp.float32(0.0),
            temperature=jnp.zeros((self.B,), jnp.float32),
        )
        self.state, out = self.draft_fn(self.state, inp)
        toks, lens = np.asarray(out.tokens), np.asarray(out.length)
        valid = np.asarray(out.valid)
        drafts = []
        for r in range(self.B):
            got = [int(t) for t in toks[r, : lens[r]]]
            assert valid[r].tolist() == [k < lens[r] for k in range(self.K)]  # prefix mask
            exp = self.ref.draft_one(r, list(hists[r]), last[r])[: self.K] if drafting[r] else []
            assert got == exp, f"row {r}: jax {got} != reference {exp}"
            drafts.append(got)
        self.check_state()
        return drafts

    def accept(self, n_acc: list[int], is_other: list[bool], active: list[bool]) -> None:
        self.state = self.accept_fn(
            self.state,
            jnp.asarray(n_acc, jnp.int32),
            jnp.asarray(is_other),
            jnp.asarray(active),
        )
        for r in range(self.B):
            if active[r]:
                self.ref.accept(r, n_acc[r], is_other[r])
        self.check_state()

    # ---- state comparison
    def check_state(self) -> None:
        if isinstance(self.d, NgramMap):
            _check_map_state(self.d, self.state, self.ref)
        elif isinstance(self.d, NgramMod):
            _check_mod_state(self.d, self.state, self.ref)


def _check_map_state(d: NgramMap, state: Any, ref: NgramMapImplRef) -> None:
    s = jax.tree.map(np.asarray, state)
    for r, mp in enumerate(ref.maps):
        assert s.n_keys[r] == len(mp.keys)
        for i, k in enumerate(mp.keys):
            assert (s.key_idx[r, i], s.stat_idx[r, i], s.key_num[r, i]) == (
                k.key_idx,
                k.stat_idx,
                k.key_num,
            ), f"row {r} key {i}"
            got_v = [
                tuple(int(x[r, i, v]) for x in (s.value_idx, s.value_num, s.value_nacc))
                for v in range(4)
            ]
            assert got_v == [(v.value_idx, v.value_num, v.n_accepted) for v in k.values]
        dense = np.zeros((d.hash_size,), np.int32)
        for h, idx in mp.key_map.items():
            dense[h] = idx
        np.testing.assert_array_equal(s.key_map[r], dense)
        assert s.key_map_last_idx[r] == mp.key_map_last_idx
        assert s.size_last_begin[r] == mp.size_last_begin
        assert s.idx_last_check[r] == mp.idx_last_check
        assert bool(s.last_created[r]) == mp.last_draft_created
        if mp.last_draft_created:
            assert (s.last_key[r], s.last_value[r]) == (
                mp.last_draft_key_idx,
                mp.last_draft_value_idx,
            )


def _check_mod_state(d: NgramMod, state: Any, ref: NgramModRef) -> None:
    dense = np.full((d.pool_size,), MOD_EMPTY, np.int32)
    for slot, tok in ref.entries.items():
        dense[slot] = tok
    np.testing.assert_array_equal(np.asarray(pool_view(state)), dense)
    assert int(state.used) == ref.used
    for r, info in enumerate(ref.sinfos):
        assert int(state.i_last[r]) == info.i_last
        assert int(state.n_draft_last[r]) == info.n_draft_last
        assert int(state.n_low[r]) == info.n_low


# --------------------------------------------------------------------------------------------
# random sessions
# --------------------------------------------------------------------------------------------


def _tokens(rng: random.Random, n: int, alphabet: int, motif: list[int] | None) -> list[int]:
    if motif is None:
        return [rng.randrange(alphabet) for _ in range(n)]
    out = []
    for i in range(n):
        t = motif[i % len(motif)]
        out.append(rng.randrange(alphabet) if rng.random() < 0.08 else t)
    return out


def run_session(
    drafter: Any, batch: int, k_max: int, seed: int, rounds: int = 30, p_begin: float = 0.12
) -> dict[str, int]:
    """Random begin/draft/accept session; returns counters (drafts, begins, shrinks)."""
    rng = random.Random(seed)
    alphabet = rng.choice([2, 3, 4])
    motif = None if rng.random() < 0.4 else _tokens(rng, rng.randrange(3, 9), alphabet, None)
    pair = Pair(drafter, batch, k_max, seed)
    stream = [_tokens(rng, 4 * S, alphabet, motif) for _ in range(batch)]
    hists = [stream[r][: rng.randrange(0, S // 2)] for r in range(batch)]
    pair.begin(hists, [True] * batch)
    stats = {"drafts": 0, "begins": 1, "shrinks": 0}
    for _ in range(rounds):
        if rng.random() < p_begin or any(len(h) + k_max + 2 >= S for h in hists):
            rows = [rng.random() < 0.7 or len(h) + k_max + 2 >= S for h in hists]
            for r in range(batch):
                if rows[r]:
                    new_len = rng.randrange(0, S // 2 + 8)
                    if new_len < len(hists[r]):
                        stats["shrinks"] += 1
                    # keep a prefix of the old history (all of it, or up to a random cut, as
                    # when a reasoning block is dropped), then new content
                    keep = min(len(hists[r]), new_len)
                    if rng.random() < 0.5:
                        keep = rng.randrange(keep + 1)
                    fresh = _tokens(rng, 4 * S, alphabet, motif)
                    stream[r] = hists[r][:keep] + fresh
                    hists[r] = stream[r][:new_len]
            pair.begin(hists, rows)
            stats["begins"] += 1
            continue
        last = [stream[r][len(hists[r])] for r in range(batch)]
        drafting = [rng.random() < 0.85 for _ in range(batch)]
        drafts = pair.draft(hists, last, drafting)
        n_acc, active = [], []
        for r in range(batch):
            dr = drafts[r]
            stats["drafts"] += bool(dr)
            if rng.random() < 0.5:  # verifier: accept while the draft follows the stream
                n = 0
                while n < len(dr) and dr[n] == stream[r][len(hists[r]) + 1 + n]:
                    n += 1
            else:
                n = rng.randrange(len(dr) + 1)
            n_acc.append(n)
            active.append(bool(dr))
            hists[r] = [*hists[r], last[r], *dr[:n]]
            stream[r] = hists[r] + stream[r][len(hists[r]) :]  # the future continues
        is_other = [rng.random() < 0.15 for _ in range(batch)]
        pair.accept(n_acc, is_other, active)
    return stats


SIMPLE = [NgramSimple(size_n=2, size_m=3), NgramSimple(size_n=3, size_m=6)]
MAP_K = [
    NgramMapK(size_n=2, size_m=3, hash_size=64),
    NgramMapK(size_n=3, size_m=4, min_hits=2, check_min_hits_key_only=True, hash_size=61),
]
MAP_K4V = [
    NgramMapK4V(size_n=2, size_m=2, hash_size=64),
    NgramMapK4V(size_n=1, size_m=2, min_hits=2, k4v_copy_majority=True, hash_size=31),
]
MOD = [
    NgramMod(n_match=2, n_min=1, n_max=6, pool_size=61),  # non-power-of-two: 64-bit mod path
    NgramMod(n_match=3, n_min=5, n_max=9, pool_size=256),  # K=4 below n_min: truncation
]


@pytest.mark.parametrize("drafter", SIMPLE, ids=str)
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_ngram_simple_matches_reference(drafter: NgramSimple, seed: int) -> None:
    run_session(drafter, batch=2, k_max=4, seed=seed)


@pytest.mark.parametrize("drafter", MAP_K + MAP_K4V, ids=str)
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_ngram_map_matches_reference(drafter: NgramMap, seed: int) -> None:
    run_session(drafter, batch=2, k_max=4, seed=seed)


@pytest.mark.parametrize("drafter", MOD, ids=str)
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_ngram_mod_matches_reference(drafter: NgramMod, seed: int) -> None:
    run_session(drafter, batch=2, k_max=4, seed=seed)


@pytest.mark.parametrize(
    "drafter",
    [NgramMapK(size_n=2, size_m=3, hash_size=63), NgramMapK4V(size_n=2, size_m=2, hash_size=63)],
    ids=str,
)
def test_map_key_index_exact_under_collisions(drafter: NgramMap, monkeypatch: Any) -> None:
    """Every key hashes to key-index slot 0 (one long probe chain): the draft still finds the
    first live key whose occurrence equals the key (configs unique to this test: own jit)."""
    from specjax.drafters import ngram_map

    def home(content: Any, size: int) -> Any:
        return jnp.zeros(content.shape[:-1], jnp.int32)

    monkeypatch.setattr(ngram_map, "_index_home", home)
    for seed in range(3):
        run_session(drafter, batch=2, k_max=4, seed=seed)


def test_mod_row_by_row_path_matches_reference(monkeypatch: Any) -> None:
    """Calls that ingest more than `_LOG_PER_ROW * B` n-grams take the row-by-row path: force it
    with a tiny log (configs unique to this test: own jit), so both paths meet the reference."""
    from specjax.drafters import ngram_mod

    monkeypatch.setattr(ngram_mod, "_LOG_PER_ROW", 2)
    for d in (
        NgramMod(n_match=2, n_min=1, n_max=6, pool_size=59),
        NgramMod(n_match=3, n_min=5, n_max=9, pool_size=128),
    ):
        for seed in range(3):
            run_session(d, batch=2, k_max=4, seed=seed)


def test_mod_row_by_row_path_with_accelerator_control_flow(monkeypatch: Any) -> None:
    """The row-by-row path as traced for a GPU or TPU (per-row reads by `control.at_row`'s
    one-hot reduction, not a dynamic slice by the row loop's counter), run here on CPU: it
    meets the reference as the CPU's does (configs unique to this test: own jit)."""
    from specjax import aot
    from specjax.drafters import ngram_mod

    monkeypatch.setattr(ngram_mod, "_LOG_PER_ROW", 2)
    with aot.backend_as("gpu"):
        for d in (
            NgramMod(n_match=2, n_min=1, n_max=6, pool_size=53),
            NgramMod(n_match=3, n_min=5, n_max=9, pool_size=512),
        ):
            for seed in range(3):
                run_session(d, batch=3, k_max=4, seed=seed)


def test_at_row_reads_the_row_on_every_backend() -> None:
    """`control.at_row(x, r)` inside a loop over rows equals `x[r]` on CPU and with the
    accelerators' one-hot reduction (int32 with negatives, bool)."""
    from specjax import aot, control

    ints = jnp.asarray([5, -7, 0, 2**31 - 1, -(2**31)], jnp.int32)
    bools = jnp.asarray([True, False, False, True, True])

    def gather(x: Any) -> Any:
        out = jnp.zeros_like(x)
        return jax.lax.fori_loop(0, x.shape[0], lambda r, o: o.at[r].set(control.at_row(x, r)), out)

    for backend in ("cpu", "gpu"):
        with aot.backend_as(backend):
            for x in (ints, bools):
                got = jax.jit(gather)(x)
                assert got.dtype == x.dtype and np.array_equal(np.asarray(got), np.asarray(x))
        jax.clear_caches()


def test_put_prefix_replaces_the_first_entries_on_every_backend() -> None:
    """`control.put_prefix(base, x, axis)` equals NumPy's `base[:, :n] = x` with the CPU's
    update in place and the GPU's concatenation, narrower and as wide as `base`."""
    from specjax import aot, control

    rng = np.random.default_rng(0)
    base = rng.standard_normal((2, 5, 3)).astype(np.float32)
    for n in (1, 3, 5):
        x = rng.standard_normal((2, n, 3)).astype(np.float32)
        want = base.copy()
        want[:, :n] = x
        for backend in ("cpu", "gpu"):
            with aot.backend_as(backend):
                got = jax.jit(lambda b, y: control.put_prefix(b, y, axis=1))(base, x)
            np.testing.assert_array_equal(np.asarray(got), want)
            jax.clear_caches()


def test_sessions_exercise_drafts_and_shrinks() -> None:
    """The random sessions above do produce drafts and history shrinks (non-vacuous)."""
    total = {"drafts": 0, "shrinks": 0}
    for d in (SIMPLE[0], MAP_K[0], MAP_K4V[0], MOD[0]):
        for seed in range(3):
            stats = run_session(d, batch=2, k_max=4, seed=seed)
            for k in total:
                total[k] += stats[k]
    assert total["drafts"] > 20 and total["shrinks"] > 2, total


# --------------------------------------------------------------------------------------------
# targeted cases
# --------------------------------------------------------------------------------------------


def _one_round(pair: Pair, hist: list[int], last: int, n_acc: int = 0) -> list[int]:
    dr = pair.draft([hist], [last], [True])[0]
    pair.accept([n_acc], [False], [bool(dr)])
    return dr


def test_simple_never_matches_position_zero() -> None:
    pair = Pair(NgramSimple(size_n=2, size_m=2), 1, 4)
    hist = [1, 2, 5, 6, 7, 8, 3, 1]  # pattern [1, 2] occurs only at position 0
    assert pair.draft([hist], [2], [True]) == [[]]
    assert pair.draft([[9, *hist]], [2], [True]) == [[5, 6]]  # at position 1 it counts


def test_k4v_majority_threshold_and_full_slots() -> None:
    d = NgramMapK4V(size_n=1, size_m=1, hash_size=64)
    # key 9 is followed by 1, 1, 2: counts (2, 1): 2 >= 2*1 -> draft (the match's continuation)
    pair = Pair(d, 1, 4)
    hist = [5, 9, 1, 7, 9, 1, 7, 9, 2, 7, 3, 3, 3]
    pair.begin([hist], [True])
    assert _one_round(pair, hist, 9) != []
    # counts (1, 1): 1 < 2*1 -> no draft
    pair = Pair(d, 1, 4)
    hist = [5, 9, 1, 7, 9, 2, 7, 3, 3, 3]
    pair.begin([hist], [True])
    assert _one_round(pair, hist, 9) == []
    # five distinct continuations: the fifth finds no free slot and is dropped
    pair = Pair(d, 1, 4)
    hist = [5, 9, 1, 9, 2, 9, 3, 9, 4, 9, 6, 9, 1, 9, 1, 9, 1, 9, 1, 0, 0, 0]
    pair.begin([hist], [True])
    _one_round(pair, hist, 9)
    vidx = np.asarray(pair.state.value_idx)[0, 0]
    assert (vidx != 0).all() and int(pair.state.value_num[0, 0].sum()) == 8


def test_k4v_occurrence_counts_for_first_equal_slot() -> None:
    """After a history rewrite two value slots can hold equal m-grams: count the first only."""
    d = NgramMapK4V(size_n=1, size_m=2, hash_size=64)
    pair = Pair(d, 1, 4)
    h1 = [5, 9, 1, 2, 9, 1, 3, 7, 7, 7, 7, 7]
    pair.begin([h1], [True])
    assert _one_round(pair, h1, 9) == []  # values [1,2] (idx 2) and [1,3] (idx 5): 1 vs 1
    h2 = [5, 9, 1, 2, 9, 1, 2, 9, 1]  # shrink to 9 (cut 6): slot 1 now reads [1, 2] too
    pair.begin([h2], [True])
    h3 = [*h2, 2, 9, 1, 2, 7, 7, 7, 7]
    assert _one_round(pair, h3, 9) == [1, 2]  # counts (2, 1): majority holds
    assert np.asarray(pair.state.value_num)[0, 0, :2].tolist() == [2, 1]


def test_k4v_count_saturation() -> None:
    d = NgramMapK4V(size_n=1, size_m=1, hash_size=64)
    pair = Pair(d, 1, 4)
    hist = [5, 9, 1, 9, 1, 4, 4, 4]
    pair.begin([hist], [True])
    _one_round(pair, hist, 9, n_acc=1)
    # push the counters next to the cap in both implementations (state checks compare them)
    near = MAX_VALUE_COUNT - 1
    mp = pair.ref.maps[0]
    mp.keys[0].key_num = near
    mp.keys[0].values[0].value_num = near
    pair.state = replace(
        pair.state,
        key_num=pair.state.key_num.at[0, 0].set(near),
        value_num=pair.state.value_num.at[0, 0, 0].set(near),
    )
    hist = [*hist, 9, 9, 1, 9, 1, 4, 4]
    for _ in range(2):  # each round counts the matched occurrence again: capped, not wrapped
        _one_round(pair, hist, 9, n_acc=1)
    assert int(pair.state.key_num[0, 0]) == MAX_VALUE_COUNT
    assert int(pair.state.value_num[0, 0, 0]) == MAX_VALUE_COUNT


def test_map_k_min_hits_quirk_and_flag() -> None:
    hist = [5, 9, 1, 2, 9, 1, 2, 7, 9]  # key [9, 1] seen once before: key_num = 1 < min_hits
    for flag, expect in ((False, [2, 7]), (True, [])):
        d = NgramMapK(size_n=2, size_m=2, min_hits=2, check_min_hits_key_only=flag, hash_size=64)
        pair = Pair(d, 1, 4)
        pair.begin([hist], [True])
        assert _one_round(pair, hist, 1) == expect


def test_map_k_acceptance_feedback_caps_drafts() -> None:
    d = NgramMapK(size_n=2, size_m=4, hash_size=64)
    pair = Pair(d, 1, 4)
    hist = [0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1]
    pair.begin([hist], [True])
    assert _one_round(pair, hist, 2, n_acc=1) == [3, 4, 8, 8]
    assert _one_round(pair, hist, 2, n_acc=0) == [3]  # capped to the last accepted count
    assert _one_round(pair, hist, 2) == []  # accepted 0 -> dead key


def test_map_history_shrink_deletes_keys() -> None:
    d = NgramMapK4V(size_n=1, size_m=1, hash_size=64)
    pair = Pair(d, 1, 4)
    hist = [5, 9, 1, 9, 1, 4, 4, 4]
    pair.begin([hist], [True])
    longer = [*hist, 9, 1, 3, 3, 2, 8, 2, 8, 8, 8, 8]
    _one_round(pair, hist, 9)
    _one_round(pair, longer, 2)  # a key created at an index beyond the next begin's cut
    n_before = int(pair.state.n_keys[0])
    pair.begin([hist[:6]], [True])  # shrink: keys/values/hashes at >= cut are dropped
    assert int(pair.state.n_keys[0]) < n_before


def test_map_k_shrink_cut_is_inclusive() -> None:
    d = NgramMapK(size_n=1, size_m=1, hash_size=64)
    pair = Pair(d, 1, 4)
    hist = [5, 9, 1, 9, 1, 4, 4, 4]
    pair.begin([hist], [True])
    assert _one_round(pair, hist, 9) == [1]  # creates the key with key_idx 3
    assert int(pair.state.n_keys[0]) == 1 and int(pair.state.key_idx[0, 0]) == 3
    pair.begin([hist[:5]], [True])  # shrink: cut = 5 - n - m = 3, keys at index >= 3 go
    assert int(pair.state.n_keys[0]) == 0


def test_mod_occupancy_reset_at_begin() -> None:
    # n_match=1: the slot of a unigram t is t mod P, so occupancy is exact here
    d = NgramMod(n_match=1, n_min=1, n_max=4, pool_size=16)
    pair = Pair(d, 1, 4)
    pair.begin([[0, 1, 2, 3, 4]], [True])  # 4 slots used: 4/16 = 0.25 is not > 0.25
    assert int(pair.state.used) == 4
    pair = Pair(d, 1, 4)
    pair.begin([[0, 1, 2, 3, 4, 5]], [True])  # 5/16 > 0.25 -> reset after ingesting
    assert int(pair.state.used) == 0 and int(pair.state.i_last[0]) == 5


def test_mod_low_acceptance_streak_resets_pool() -> None:
    d = NgramMod(n_match=2, n_min=1, n_max=4, pool_size=1024)
    pair = Pair(d, 1, 4)
    hist = [1, 2, 3] * 15
    pair.begin([hist], [True])
    for k in range(4):
        assert _one_round(pair, hist, 1, n_acc=0) != []
        assert int(pair.state.n_low[0]) == k + 1
    _one_round(pair, hist, 1, n_acc=2)  # 2/4 >= 0.25 breaks the streak
    assert int(pair.state.n_low[0]) == 0
    # is_other feedback is ignored
    pair.draft([hist], [1], [True])
    pair.accept([0], [True], [True])
    assert int(pair.state.n_low[0]) == 0
    for _ in range(5):
        _one_round(pair, hist, 1, n_acc=0)
    assert int(pair.state.used) == 0 and int(pair.state.i_last[0]) == 0
    assert int(pair.state.n_low[0]) == 0


def test_mod_k_max_below_n_min_keeps_full_length() -> None:
    d = NgramMod(n_match=2, n_min=6, n_max=8, pool_size=1024)
    pair = Pair(d, 1, 3)
    hist = [1, 2, 3, 4] * 10
    pair.begin([hist], [True])
    dr = pair.draft([hist], [1], [True])[0]
    assert dr == [2, 3, 4] and int(pair.state.n_draft_last[0]) == 8
    pair.accept([2], [False], [True])  # 2/8 = 0.25: not low
    assert int(pair.state.n_low[0]) == 0
    pair.draft([hist], [1], [True])
    pair.accept([1], [False], [True])  # 1/8 < 0.25 although 1/3 would not be
    assert int(pair.state.n_low[0]) == 1


def test_mod_rows_share_pool_in_row_order() -> None:
    """Row 1's lookup sees row 0's ingestion of the same call (rows run in order)."""
    d = NgramMod(n_match=2, n_min=1, n_max=3, pool_size=1024)
    pair = Pair(d, 2, 4)
    pair.begin([[], []], [True, True])
    row0 = [7, 8, 9, 7, 8, 9] * 7  # 42 tokens > 32: row 0 ingests during its draft
    row1 = [0, 0, 0, 7, 8]
    drafts = pair.draft([row0, row1], [7, 9], [True, True])
    assert drafts[1] == [7, 8, 9]


def test_mod_renew_is_a_fresh_state_in_the_same_buffers() -> None:
    """`renew` (what `generate` does to the last call's state, `engine.prefill`'s spare) leaves
    a state that drafts as `init`'s: every slot EMPTY, per-row fields 0, by a new epoch whose
    pool is not rewritten; at EPOCH_LIMIT the epochs start over with the pool filled."""
    from specjax.drafters import ngram_mod

    d = NgramMod(n_match=2, n_min=1, n_max=4, pool_size=64)
    pair = Pair(d, 2, 4)
    hist = [1, 2, 3] * 15
    pair.begin([hist, hist[:7]], [True, True])
    drafts = pair.draft([hist, hist[:7]], [1, 1], [True, True])
    pair.accept([0, 0], [False, False], [bool(dr) for dr in drafts])
    used = pair.state
    assert int(used.used) > 0 and int(used.n_low[0]) == 1 and int(used.i_last[0]) > 0
    old_pool = np.asarray(used.pool)
    fresh = d.init(2, 64)
    renewed = jax.jit(d.renew)(used)
    for field in ("used", "i_last", "n_draft_last", "n_low"):
        np.testing.assert_array_equal(getattr(renewed, field), getattr(fresh, field))
    np.testing.assert_array_equal(pool_view(renewed), pool_view(fresh))
    np.testing.assert_array_equal(renewed.pool, old_pool)  # not rewritten: a new epoch
    assert int(renewed.epoch) == int(used.epoch) + 1
    # a renewed state drafts as a fresh one: nothing before its own prompt is ingested
    again, new = Pair(d, 2, 4), Pair(d, 2, 4)
    again.state = renewed
    for p in (again, new):
        p.begin([[5, 6, 1, 2], [9, 9]], [True, True])
    assert again.draft([hist, [9, 9]], [1, 9], [True, True]) == new.draft(
        [hist, [9, 9]], [1, 9], [True, True]
    )
    late = replace(used, epoch=jnp.asarray(ngram_mod.EPOCH_LIMIT, jnp.int32))
    restarted = d.renew(late)
    assert int(restarted.epoch) == 1 and int(restarted.used) == 0
    np.testing.assert_array_equal(restarted.pool, np.full(64, ngram_mod.EMPTY))
    np.testing.assert_array_equal(restarted.stamp, np.zeros(64))


def test_mod_hash_matches_uint64_reference() -> None:
    rng = random.Random(0)
    for p in (4 * 1024 * 1024, 61, 12345, 1000003, 1, 2**30):
        for n in (1, 3, 24):
            wins = [
                [
                    rng.choice([0, 1, 255, -1, 2**31 - 1, -(2**31), rng.randrange(-(2**31), 2**31)])
                    for _ in range(n)
                ]
                for _ in range(40)
            ]
            got = np.asarray(mod_hash_index(jnp.asarray(wins, jnp.int32), n, p))
            assert got.tolist() == [mod_hash(w, 0, n) % p for w in wins], (p, n)


def test_map_hash_matches_uint32_reference() -> None:
    from specjax.drafters.ngram_map import map_hash_windows

    rng = random.Random(1)
    toks = [rng.randrange(-(2**31), 2**31) for _ in range(40)]
    got = np.asarray(map_hash_windows(jnp.asarray(toks + [0] * 12, jnp.int32), 12, 40))
    assert got.tolist() == [map_hash(toks + [0] * 12, j, 12) for j in range(40)]


def test_protocol_names_and_hashable_configs() -> None:
    from specjax.drafters.base import Drafter

    for d, name in (
        (NgramSimple(), "ngram-simple"),
        (NgramMapK(), "ngram-map-k"),
        (NgramMapK4V(), "ngram-map-k4v"),
        (NgramMod(), "ngram-mod"),
    ):
        assert d.name == name and isinstance(d, Drafter)
        assert hash(d) == hash(type(d)()) and d == type(d)()
    assert NgramMapK().key_only and not NgramMapK4V().key_only


def test_from_spec_reads_each_type_s_own_options() -> None:
    """Each type takes its own `--spec-<type>-*` options (values all distinct, none the
    default), written out by hand here as llama.cpp's flags name them."""
    from specjax.config import SpecConfig

    spec = SpecConfig(
        ngram_simple_size_n=3,
        ngram_simple_size_m=5,
        ngram_map_k_size_n=4,
        ngram_map_k_size_m=6,
        ngram_map_k_min_hits=2,
        ngram_map_k4v_size_n=7,
        ngram_map_k4v_size_m=9,
        ngram_map_k4v_min_hits=3,
        ngram_mod_n_match=8,
        ngram_mod_n_min=11,
        ngram_mod_n_max=13,
        ngram_mod_pool_size=1024,
    )
    for want in (
        NgramSimple(size_n=3, size_m=5),
        NgramMapK(size_n=4, size_m=6, min_hits=2),
        NgramMapK4V(size_n=7, size_m=9, min_hits=3),
        NgramMod(n_match=8, n_min=11, n_max=13, pool_size=1024),
    ):
        assert type(want).from_spec(spec, None, None) == (want, None)
