"""ngram-cache on device (`specjax.drafters.ngram_cache`) against the plain-Python reference.

Every test drives the JAX drafter and `NgramCacheImplRef` (which reproduces llama.cpp's recorded
drafts, see test_conformance_ngram_cache.py) through the same rounds and compares the drafts.
Shapes are fixed (B=2, S=40, K=8, padded read-only tables) so one compilation per combination
of present caches serves all hypothesis examples.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.ngram_cache_reference import (
    NgramCacheImplRef,
    build_cache,
    part_items,
    stl_iteration_order,
    token_hash,
)

from specjax.drafters.base import DraftInput, TokenHistory
from specjax.drafters.ngram_cache import NgramCache, NgramCacheTables, context_cache
from specjax.io.lookup_file import build_lookup_table, make_tables
from specjax.kernels import cpu as cpu_kernels

B, S, K = 2, 40, 8
PAD = (256, 256, 8, 16)  # read-only table shape: n-grams, entries, longest part, probes
DRAFTER = NgramCache(table_size=64, block=8)


def make_input(
    streams: list[list[int]], lengths: list[int], drafting: list[bool], n_max: list[int]
) -> DraftInput:
    hist = np.full((len(streams), S), 7777, np.int32)  # garbage beyond the history
    for b, (s, n) in enumerate(zip(streams, lengths, strict=True)):
        hist[b, :n] = s[:n]
    return DraftInput(
        history=TokenHistory(tokens=jnp.asarray(hist), length=jnp.asarray(lengths, jnp.int32)),
        last_token=jnp.asarray([s[n] for s, n in zip(streams, lengths, strict=True)], jnp.int32),
        n_max=jnp.asarray(n_max, jnp.int32),
        drafting=jnp.asarray(drafting),
        n_min=jnp.int32(0),
        p_min=jnp.float32(0.0),
        temperature=jnp.zeros((len(streams),), jnp.float32),
    )


#: Ingestion runs on the native kernel where it is available; both paths are tested.
PATHS = [pytest.param(False, id="xla"), pytest.param(True, id="native")]


def ingest_path(native: bool) -> Any:
    """A context in which `NgramCache.ingest` takes the native kernel or XLA's loops."""
    if native and not cpu_kernels.available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    return contextlib.nullcontext() if native else cpu_kernels.disabled()


def jitted(drafter: NgramCache, k_max: int) -> tuple[Any, Any]:
    return _jitted(drafter, k_max, cpu_kernels.available())


@functools.cache
def _jitted(drafter: NgramCache, k_max: int, native: bool) -> tuple[Any, Any]:
    # new functions per path: the path is chosen when the drafter is traced
    del native
    return (
        jax.jit(lambda state, history: drafter.begin(state, history)),
        jax.jit(lambda params, state, inp: drafter.draft(params, state, inp, k_max=k_max)),
    )


def padded_tables(static: Any, dynamic: Any) -> NgramCacheTables | None:
    """Tables padded to PAD (one compile per combination of present caches). An absent cache
    stays None: without a static cache the drafter reads its part summaries, with one it scans
    (both paths are exercised)."""
    st_t = build_lookup_table(static, PAD) if static is not None else None
    dy_t = build_lookup_table(dynamic, PAD) if dynamic is not None else None
    if st_t is None and dy_t is None:
        return None
    return NgramCacheTables(static=st_t, dynamic=dy_t)


def drafts_of(out: Any) -> list[list[int]]:
    toks, valid = np.asarray(out.tokens), np.asarray(out.valid)
    assert (np.cumprod(valid, axis=1) == valid).all(), "valid must be a prefix mask"
    return [[int(t) for t in toks[b][valid[b]]] for b in range(toks.shape[0])]


def replay(
    drafter: NgramCache,
    streams,
    starts,
    rounds,
    static=None,
    dynamic=None,
    k_max: int = K,
    pad: bool = True,
    refs=None,
    state=None,
) -> tuple[Any, list[Any]]:
    """Run `rounds` = [(advance per row, drafting per row, n_max per row)] through both."""
    begin, draft = jitted(drafter, k_max)
    params = padded_tables(static, dynamic) if pad else make_tables(static, dynamic)
    if refs is None:
        refs = [
            NgramCacheImplRef(
                1, static=static, dynamic=dynamic, reset_on_begin=drafter.reset_on_begin
            )
            for _ in streams
        ]
    lengths = list(starts)
    inp = make_input(streams, lengths, [True] * len(streams), [0] * len(streams))
    if state is None:
        state = drafter.init(len(streams), S)
    state = begin(state, inp.history)
    for b, ref in enumerate(refs):
        ref.begin(0, streams[b][: lengths[b]])
    for r, (advance, drafting, n_max) in enumerate(rounds):
        inp = make_input(streams, lengths, drafting, n_max)
        state, out = draft(params, state, inp)
        got = drafts_of(out)
        for b, ref in enumerate(refs):
            if drafting[b]:
                want = ref.draft_one(0, streams[b][: lengths[b]], streams[b][lengths[b]])
                want = want[:k_max]
                if n_max[b] > 0:
                    want = want[: n_max[b]]
            else:
                want = []
            assert got[b] == want, f"round {r} row {b} length {lengths[b]}"
        lengths = [min(S - 1, n + a) for n, a in zip(lengths, advance, strict=True)]
    assert int(np.asarray(state.n_dropped).sum()) == 0
    return state, refs


ALPHABETS = [(0, 1), (0, 1, 2), (3, 1, 4, 0, 2), (1, 14, 27, 2, 15)]  # last: mod-13 collisions


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    alpha = draw(st.sampled_from(ALPHABETS))
    tok = st.sampled_from(alpha)
    streams = [draw(st.lists(tok, min_size=S + 1, max_size=S + 1)) for _ in range(B)]
    starts = [draw(st.integers(0, S - 12)) for _ in range(B)]
    n_rounds = draw(st.integers(1, 6))
    rounds = [
        (
            [draw(st.integers(1, 6)) for _ in range(B)],
            [draw(st.booleans()) or r == 0 for _ in range(B)],
            [draw(st.sampled_from([0, 2, 8])) for _ in range(B)],
        )
        for r in range(n_rounds)
    ]
    static = dynamic = None
    if draw(st.booleans()):
        static = build_cache(draw(st.lists(tok, min_size=2, max_size=60)), 2, 2)
    if draw(st.booleans()):
        dynamic = build_cache(draw(st.lists(tok, min_size=2, max_size=60)), 1, 4)
    return dict(streams=streams, starts=starts, rounds=rounds, static=static, dynamic=dynamic)


@pytest.mark.parametrize("native", PATHS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_drafts_match_reference(native: bool, sc: dict[str, Any]) -> None:
    with ingest_path(native):
        replay(DRAFTER, sc["streams"], sc["starts"], sc["rounds"], sc["static"], sc["dynamic"])


def _contents(state: Any, row: int) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """Row `row`'s tables by key, whatever their slots: pair -> (count, first stamp, bucket
    stamp); part -> (sum, best member, bucket stamps)."""
    st = jax.tree.map(lambda x: np.asarray(x)[row], state)
    pairs = {
        (tuple(st.keys[t, i]), int(st.tok[t, i])): (st.count[t, i], st.stamp[t, i], st.gs[t, i])
        for t, i in zip(*np.nonzero(st.count > 0), strict=True)
    }
    parts = {
        tuple(st.ng_keys[t, i]): (
            st.ng_sum[t, i],
            tuple(st.ng_best[t, i]),
            tuple(st.ng_heads[t, i]),
        )
        for t, i in zip(*np.nonzero(st.ng_occ), strict=True)
    }
    return pairs, parts


@pytest.mark.parametrize("update", ["speculative", "lookup"])
def test_native_ingestion_fills_the_tables_xla_fills(update: str) -> None:
    """The native kernel and XLA's loops count the same pairs into the same parts (counts,
    stamps, bucket stamps, sums, best members), at one position or many a call, whatever slots
    they took; the kernel updates the donated state in place (no copy of a table)."""
    ingest_path(True)  # skips without the kernel
    drafter = NgramCache(table_size=64, context_update=update)
    rng = np.random.default_rng(3)
    streams = [list(rng.integers(0, 4, S + 1)), list(rng.integers(0, 9, S + 1))]
    states = []
    for native in (False, True):
        with ingest_path(native):
            begin, draft = jitted(drafter, K)
            lengths = [7, 0]
            state = begin(
                drafter.init(B, S), make_input(streams, lengths, [True] * B, [0] * B).history
            )
            for advance in ([1, 5], [9, 1], [1, 1], [12, 20]):
                lengths = [min(S - 1, n + a) for n, a in zip(lengths, advance, strict=True)]
                drafting = [True, advance[1] > 1]
                state, _ = draft(None, state, make_input(streams, lengths, drafting, [0] * B))
            states.append(state)
    xla, native = states
    for row in range(B):
        assert _contents(native, row) == _contents(xla, row)
        assert int(native.cache_size[row]) == int(xla.cache_size[row])
    assert int(np.asarray(native.n_dropped).sum()) == 0
    np.testing.assert_array_equal(native.n_used, xla.n_used)
    np.testing.assert_array_equal(native.seq_start, xla.seq_start)
    with ingest_path(True):  # an ask: the tables updated where they lie
        inp = make_input(streams, [30, 30], [True] * B, [0] * B)
        ask = jax.jit(lambda st, i: drafter.draft(None, st, i, K), donate_argnums=0)
        text = ask.lower(drafter.init(B, S), inp).compile().as_text()
    assert text is not None
    (call,) = [line for line in text.splitlines() if cpu_kernels.NGRAM_CACHE_TARGET in line]
    assert "output_to_operand_aliasing" in call
    assert not [line for line in text.splitlines() if " copy(" in line and ",4,64" in line]


def test_repetitive_history_long_drafts() -> None:
    """A periodic stream drafts full 8-token runs; the context export equals the reference."""
    period = [5, 6, 7, 5, 8]
    streams = [(period * 10)[: S + 1], ([1, 2] * 30)[: S + 1]]
    rounds = [([3, 2], [True, True], [0, 0])] * 6
    state, refs = replay(DRAFTER, streams, [12, 3], rounds)
    for b in range(B):
        got, want = context_cache(state, b), refs[b].context[0]
        assert got == want
        for ng in want:  # same insertion order inside every part (drives ties)
            assert list(got[ng]) == list(want[ng])
    _, draft = jitted(DRAFTER, K)
    params = padded_tables(None, None)
    _, out = draft(params, state, make_input(streams, [30, 30], [True, True], [0, 0]))
    assert all(len(d) == 8 for d in drafts_of(out))


def _tie_streams(c: int) -> list[list[int]]:
    # part of 2-gram (9, 9): followed by 1 (once), 2 (twice), c (once) -> inserted 1, 2, c
    s = [9, 9, 1, 9, 9, 2, 9, 9, 2, 9, 9, c, 6, 6, 6, 6, 6, 6, 9, 9]
    return [(s + [0] * S)[: S + 1]] * B


@pytest.mark.parametrize("c", [14, 3])
def test_weighted_tie_follows_libstdcxx_order(c: int) -> None:
    """Static weights make 2 (count 2, static count 1) and c (count 1, static count 2) tie at
    2*100 == 1*200; only 2 passes the 50% threshold, so the draft shows which came first in
    libstdc++ order (c wins and fails -> the static-only try drafts c)."""
    static = {(9, 9, -1, -1): {2: 1, c: 2}}
    streams = _tie_streams(c)
    order = [[1, 2, c][i] for i in stl_iteration_order([token_hash(t) for t in (1, 2, c)])]
    # c = 14 shares bucket 1 with token 1: order [2, 14, 1]; c = 3 has its own: [3, 2, 1]
    assert order == ([2, 14, 1] if c == 14 else [3, 2, 1])
    rounds = [([1, 1], [True, False], [0, 0])]
    replay(DRAFTER, streams, [19, 19], rounds, static=static)
    ref = NgramCacheImplRef(1, static=static)
    first = ref.draft_one(0, streams[0][:19], streams[0][19])
    assert (first[:1] == [2]) == (c == 14)


def test_context_part_order_matches_reference_parts() -> None:
    """Parts exported from the device are in upstream insertion order (libstdc++ order follows)."""
    streams = [[1, 14, 27, 1, 2, 1, 14, 1, 27, 1, 1, 2] * 4][0][: S + 1]
    state, refs = replay(DRAFTER, [streams, streams], [30, 5], [([1, 1], [True, True], [0, 0])])
    want = refs[0].context[0][(1, -1, -1, -1)]
    got = context_cache(state, 0)[(1, -1, -1, -1)]
    assert part_items(got) == part_items(want)


def test_no_static_no_dynamic_params_none() -> None:
    streams = [([3, 1, 4, 1, 5, 9, 2, 6] * 6)[: S + 1], ([0, 1] * 30)[: S + 1]]
    rounds = [([2, 1], [True, True], [0, 3]), ([1, 4], [True, False], [0, 0])] * 3
    replay(DRAFTER, streams, [10, 4], rounds, pad=False)


def test_short_histories_and_k_max() -> None:
    """|inp| < 2 drafts nothing; n-grams starting before position 0 never match; k_max < 8."""
    streams = [[2, 2, 2, 2, 2, 2, 2] + [0] * S, [1, 2, 1, 2, 1, 2] + [0] * S]
    streams = [s[: S + 1] for s in streams]
    rounds = [([1, 1], [True, True], [0, 0])] * 5
    replay(DRAFTER, streams, [0, 0], rounds, k_max=3)


def test_non_drafting_rows_are_untouched() -> None:
    begin, draft = jitted(DRAFTER, K)
    streams = [([1, 2, 3] * 20)[: S + 1]] * B
    state = begin(DRAFTER.init(B, S), make_input(streams, [20, 20], [True] * B, [0, 0]).history)
    before = jax.tree.map(np.asarray, state)
    state, out = draft(None, state, make_input(streams, [20, 20], [True, False], [0, 0]))
    after = jax.tree.map(np.asarray, state)
    assert drafts_of(out)[1] == [] and len(drafts_of(out)[0]) == 8
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a[1], b[1])
    assert int(after.cache_size[0]) == 21 and int(after.cache_size[1]) == 20  # begin: prompt


@pytest.mark.parametrize("native", PATHS)
def test_begin_counts_the_prompt_and_the_first_draft_continues_its_sequence(native: bool) -> None:
    """`begin` counts the prompt (every n-gram inside it, `cache_size` = its length); a first
    draft, asked at once or only after rounds off, counts the rest as the same sequence: the
    n-grams across the prompt's end are there and drafts and caches equal upstream's, which
    counts `[0, length + 1)` at its first draft."""
    with ingest_path(native):
        _begin_then_first_draft()


def _begin_then_first_draft() -> None:
    begin, _ = jitted(DRAFTER, K)
    # (3, 4) continues both ways; which one wins the size-2 vote depends on the n-grams that
    # cross the prompt's end (prompt ... 3 | 4 3 5 ...)
    stream = ([1, 3, 4, 2, 3, 5, 2, 3] * 6)[: S + 1]
    prompts = [12, 16]
    state = begin(
        DRAFTER.init(B, S), make_input([stream] * B, prompts, [True] * B, [0] * B).history
    )
    for b, n in enumerate(prompts):
        assert int(state.cache_size[b]) == n
        assert context_cache(state, b) == build_cache(stream[:n], 1, 4)
    # row 0 drafts at once, row 1 first after 3 rounds off (its stream grew by 5 tokens)
    rounds = [([1, 2], [True, False], [0, 0]), ([1, 3], [True, False], [0, 0])]
    rounds += [([1, 1], [True, True], [0, 0])] * 3
    state, refs = replay(DRAFTER, [stream] * B, prompts, rounds)
    for b in range(B):
        assert context_cache(state, b) == refs[b].context[0]


def test_reset_on_begin_vs_upstream_bug() -> None:
    """A second request on the same row: reset (default) equals a fresh cache; with
    reset_on_begin=False the stale cache and cache_size persist exactly as upstream."""
    first = ([4, 4, 5] * 20)[: S + 1]
    second = ([6, 7, 6, 8] * 20)[: S + 1]
    for reset in (True, False):
        drafter = NgramCache(table_size=64, block=8, reset_on_begin=reset)
        state, refs = replay(drafter, [first, first], [30, 30], [([2, 2], [True, True], [0, 0])])
        state, _ = replay(
            drafter,
            [second, second],
            [10, 10],
            [([3, 3], [True, True], [0, 0])] * 4,
            refs=refs,
            state=state,
        )
        stale = any(ng[:1] == (4,) for ng in context_cache(state, 0))
        assert stale != reset


def test_small_table_size_is_a_floor_nothing_dropped() -> None:
    """A `table_size` below what the capacity needs is raised to it (`slots_for`): a tiny
    table no longer fills up and drops pairs, every pair of the history is counted exactly."""
    drafter = NgramCache(table_size=8, max_load=0.5, block=8)
    assert drafter.slots_for(S) == 128 and NgramCache(table_size=256).slots_for(S) == 256
    begin, draft = jitted(drafter, K)
    rng = np.random.default_rng(0)
    streams = [list(rng.integers(0, 50, S + 1)), list(rng.integers(0, 3, S + 1))]
    state = begin(drafter.init(B, S), make_input(streams, [30, 30], [True] * B, [0, 0]).history)
    state, _ = draft(None, state, make_input(streams, [30, 30], [True] * B, [0, 0]))
    assert state.count.shape[-1] == 128
    assert int(np.asarray(state.n_dropped).sum()) == 0
    for b in range(B):
        assert context_cache(state, b) == build_cache(streams[b][:31], 1, 4)


@pytest.mark.parametrize(
    "native,cap",
    [
        pytest.param(False, 24575, id="xla-24575"),
        pytest.param(True, 24575, id="native-24575"),
        pytest.param(True, 98303, id="native-98303"),
    ],
)
def test_full_history_of_distinct_pairs_is_kept(native: bool, cap: int) -> None:
    """The worst case at a long history: a large vocabulary, every pair distinct, a history
    filling the capacity, tables at their highest load (capacity 24,575: 32,768 slots, load
    0.75; 98,303: 131,072 slots). Every pair is kept (none dropped: before, a 64-probe limit
    dropped 22 and 90 of them)."""
    drafter = NgramCache()
    toks = np.random.default_rng(0).integers(0, 1 << 30, cap).astype(np.int32)
    with ingest_path(native):
        state = jax.jit(drafter.begin)(
            drafter.init(1, cap),
            TokenHistory(tokens=jnp.asarray(toks)[None], length=jnp.asarray([cap], jnp.int32)),
        )
    assert state.count.shape[-1] == (cap + 1) * 4 // 3
    assert int(state.n_dropped[0]) == 0
    # the prompt [0, cap) holds cap - s pairs of size s, all distinct
    np.testing.assert_array_equal(np.asarray(state.n_used)[0], [cap - s for s in range(1, 5)])
    assert int(np.sum(np.asarray(state.count)[0] > 0)) == 4 * cap - 10


def test_lookup_update_mode_counts_every_ngram() -> None:
    """context_update='lookup' holds every n-gram of the stream (no boundary misses)."""
    drafter = NgramCache(table_size=64, block=8, context_update="lookup")
    begin, draft = jitted(drafter, K)
    stream = ([1, 2, 3, 1, 2, 4, 1, 3] * 6)[: S + 1]
    streams = [stream, stream]
    state = begin(drafter.init(B, S), make_input(streams, [5, 5], [True] * B, [0, 0]).history)
    for n in (5, 6, 9, 17, 30):
        state, _ = draft(None, state, make_input(streams, [n, n], [True] * B, [0, 0]))
        assert context_cache(state, 0) == build_cache(stream[: n + 1], 1, 4)


def test_static_weight_beats_frequent_token() -> None:
    """(7,7) is followed by 1 eleven times and by 2 once; the static cache knows (7,7)->2, so 2
    weighs 100 > 11, wins every size and fails the threshold: nothing is drafted (a weight below
    11 would draft 1)."""
    stream = ([7, 7, 1] * 11 + [7, 7, 2, 7, 7] + [0] * S)[: S + 1]
    static = {(7, 7, -1, -1): {2: 1}}
    assert NgramCacheImplRef(1, static=static).draft_one(0, stream[:37], stream[37]) == []
    assert NgramCacheImplRef(1).draft_one(0, stream[:37], stream[37])[:1] == [1]
    replay(DRAFTER, [stream, stream], [37, 20], [([1, 1], [True, True], [0, 0])], static=static)


@pytest.mark.parametrize("a,b", [(1, 14), (14, 1), (1, 3), (3, 1)])
def test_context_tie_follows_libstdcxx_order(a: int, b: int) -> None:
    """No static cache: (9, 9) is followed once by a, then once by b (a 50% tie that passes the
    size-2 threshold); upstream drafts the first in libstdc++ order: the later insertion when
    both share a bucket (mod 13), else the later bucket group."""
    s = [5, 9, 9, a, 6, 9, 9, b, 7, 8, 9, 9]
    streams = [(s + [0] * S)[: S + 1]] * B
    want = NgramCacheImplRef(1).draft_one(0, s[:11], s[11])
    assert want[:1] == [b]  # the later insertion / later group wins in both layouts
    replay(DRAFTER, streams, [11, 11], [([1, 1], [True, True], [0, 0])])
