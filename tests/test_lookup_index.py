"""The lookup index (`specjax.drafters.lookup_index`): a chain of lookup drafters is asked only for rows
whose stream's last n-gram occurred before.

Independent sources: a plain-Python transcription of the index (the polynomial hash mod 2^32
of an n-gram's key, its two slots = the top bits of two mixes, every n-gram of the stream) and
a plain-Python scan for repeated n-grams; plain decoding's tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.api import generate
from specjax.config import SpecConfig
from specjax.decode import engine as eng
from specjax.decode import governor as adaptive
from specjax.drafters import lookup_index
from specjax.drafters.base import DraftInput, TokenHistory
from specjax.drafters.ngram_cache import NgramCache
from specjax.drafters.ngram_map import NgramMapK
from specjax.drafters.ngram_mod import NgramMod
from specjax.drafters.ngram_simple import NgramSimple
from specjax.drafters.registry import build_drafters
from specjax.jobs import continuous as cont
from specjax.pytree import replace
from specjax.testing import run_params, tiny_model

A = 0x9E3779B1


def python_key(gram: list[int]) -> list[int]:
    """The tokens of an n-gram its hash reads: all of them up to 32, else 32 spread evenly
    (offset k (n - 1) // 31: the first, the last and between)."""
    n = len(gram)
    return gram if n <= 32 else [gram[k * (n - 1) // 31] for k in range(32)]


def python_slots(gram: list[int], slots: int) -> set[int]:
    """The two slots an n-gram sets: the top bits of fmix32 of its hash, and of that mix
    folded (x ^ x >> 15) and multiplied by 0x2C1B3C6D."""
    key = python_key(gram)
    h = sum((t + 1) * pow(A, k, 1 << 32) for k, t in enumerate(key)) % (1 << 32)
    h ^= h >> 16  # MurmurHash3's fmix32
    h = (h * 0x85EBCA6B) % (1 << 32)
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % (1 << 32)
    h ^= h >> 16
    second = ((h ^ (h >> 15)) * 0x2C1B3C6D) % (1 << 32)
    shift = 32 - (slots.bit_length() - 1)
    return {h >> shift, second >> shift}


def python_table(stream: list[int], length: int, n: int, slots: int, gap: int = 0) -> set[int]:
    """Slots set by the n-grams ending at positions n-1 .. length-1-gap of `stream`."""
    return set().union(
        *(python_slots(stream[p - n + 1 : p + 1], slots) for p in range(n - 1, length - gap))
    )


def repeats(stream: list[int], n: int, gap: int = 0) -> bool:
    """Whether the n-gram ending at the stream's last token (position L) also ends at a
    position <= L - 1 - gap."""
    L = len(stream) - 1
    return n - 1 <= L and any(
        stream[q - n + 1 : q + 1] == stream[L - n + 1 :] for q in range(n - 1, L - gap)
    )


ROWS = [
    [3, 1, 3, 1, 3, 1, 2, 3, 1, 3],  # small vocabulary: most 2- and 3-grams repeat
    list(range(10, 40)),  # no repeats
    [7, 8, 9, 7, 8],  # short
    [5, 5, 5, 5, 5, 5, 5, 5],  # one token repeated
    [4],
]


@pytest.mark.parametrize("n, gap", [(1, 0), (3, 0), (2, 3)])
def test_build_insert_and_query_are_the_python_index(n, gap):
    S, slots = 48, 1024
    B = len(ROWS)
    history = np.zeros((B, S), np.int32)
    for b, r in enumerate(ROWS):
        history[b, : len(r)] = r
    hist = jnp.asarray(history)
    # the prompt minus its last 4 tokens, then those in one insert (a round's window path)
    part = jnp.asarray([max(len(r) - 4, 0) for r in ROWS], jnp.int32)
    full = jnp.asarray([len(r) for r in ROWS], jnp.int32)
    table = lookup_index.build(hist, part, n, (B, slots), gap)
    table = lookup_index.insert(table, hist, part - gap, full - part, n, 4)
    assert np.array_equal(table, lookup_index.build(hist, full, n, (B, slots), gap))
    for b, r in enumerate(ROWS):
        want = python_table(r, len(r), n, slots, gap)
        assert set(np.flatnonzero(np.asarray(table[b]))) == want, b
    # next tokens: a row's first (its last n-gram may repeat) or a new one (it cannot)
    nexts = [ROWS[0][0], 99, ROWS[2][0], 5, 98]
    last = jnp.asarray(nexts, jnp.int32)
    got = np.asarray(lookup_index.query(table, hist, full, last, n))
    want = []
    for b, r in enumerate(ROWS):
        stream = r + [nexts[b]]
        L = len(r)
        inside = n - 1 <= L and python_slots(stream[L - n + 1 :], slots) <= python_table(
            r, L, n, slots, gap
        )
        want.append(inside)
        assert inside or not repeats(stream, n, gap)  # a False is exact
    assert got.tolist() == want
    assert any(want) and not all(want)
    # one table for all rows: each row's query sees every row's n-grams
    shared = lookup_index.build(hist, full, n, (1, slots), gap)
    assert set(np.flatnonzero(np.asarray(shared[0]))) == set().union(
        *(python_table(r, len(r), n, slots, gap) for r in ROWS)
    )


def test_a_long_ngram_is_hashed_by_its_key_and_a_false_stays_exact():
    """n > 32: the hash reads 32 of the n-gram's tokens. Rows: a block that recurs (the
    query's n-gram occurred: True), the same with one token changed off the key (True, by
    design: the key is all the index compares) and on the key (False, as no earlier n-gram
    is equal), and no repeat at all."""
    n, S, slots = 40, 160, 1024
    rng = np.random.default_rng(0)
    block = rng.integers(100, 900, size=n + 5).tolist()
    key_offsets = {k * (n - 1) // 31 for k in range(32)}
    off_key = next(o for o in range(n) if o not in key_offsets)
    assert lookup_index.key_offsets(n).tolist() == sorted(key_offsets)

    def changed(at: int) -> list[int]:  # the block's first occurrence, one token changed
        first = list(block)
        first[5 + at] += 1000  # (offset `at` of the n-gram the query ends with)
        return first

    # the query's n-gram: the last n tokens of block + the next token, block[-1]
    streams = [block + block[:-1], changed(off_key) + block[:-1], changed(0) + block[:-1]]
    streams.append(rng.integers(1000, 1900, size=2 * n + 9).tolist())
    B = len(streams)
    history = np.zeros((B, S), np.int32)
    for b, r in enumerate(streams):
        history[b, : len(r)] = r
    full = jnp.asarray([len(r) for r in streams], jnp.int32)
    table = lookup_index.build(jnp.asarray(history), full, n, (B, slots))
    for b, r in enumerate(streams):
        assert set(np.flatnonzero(np.asarray(table[b]))) == python_table(r, len(r), n, slots), b
    last = jnp.asarray([block[-1]] * 3 + [5], jnp.int32)
    got = np.asarray(lookup_index.query(table, jnp.asarray(history), full, last, n))
    assert got.tolist() == [True, True, False, False]
    stream = streams[1] + [block[-1]]
    assert not repeats(stream, n)  # (row 1's True: the key matched, the n-gram did not)
    assert repeats(streams[0] + [block[-1]], n)


def test_a_third_full_table_answers_true_for_few_new_ngrams():
    """Each True that is not a repeat costs an ask that finds nothing. With a third of the
    row's cells holding n-grams, 4,000 n-grams that never occurred come back True at about
    (1 - e^(-2/24))^2 = 0.6% (two slots at 8 per cell; one slot read 4%, and at 4 per cell
    8%): a shared table, read by 4,000 rows that end the same stream with new tokens."""
    S, n, Q = 256, 3, 4000
    filled = S // 3
    stream = np.random.default_rng(1).choice(50_000, size=filled, replace=False)
    history = np.zeros((1, S), np.int32)
    history[0, :filled] = stream
    shape = lookup_index.table_shape(1, S, shared=False)
    assert shape == (1, 2048)
    table = lookup_index.build(jnp.asarray(history), jnp.asarray([filled]), n, shape)
    rows = jnp.broadcast_to(jnp.asarray(history), (Q, S))
    new_tokens = jnp.arange(60_000, 60_000 + Q, dtype=jnp.int32)
    got = np.asarray(lookup_index.query(table, rows, jnp.full((Q,), filled), new_tokens, n))
    assert 0 < got.sum() < 0.015 * Q, got.sum()
    # and every n-gram the stream holds is found
    seen = lookup_index.query(table, rows[:1], jnp.asarray([filled - 1]), history[:, filled - 1], n)
    assert bool(seen[0])


def test_a_chain_has_an_index_only_when_every_drafter_is_a_lookup():
    assert lookup_index.lookup_n([NgramSimple(size_n=3), NgramMod(n_match=5)]) == 3
    assert lookup_index.lookup_n([NgramSimple(), NgramCache()]) is None
    assert lookup_index.lookup_n([]) is None
    assert not lookup_index.shares_memory([NgramSimple()], 64)
    assert lookup_index.shares_memory([NgramSimple(), NgramMod(pool_size=64)], 64)
    assert lookup_index.table_shape(4, 64, shared=False) == (4, 1024)
    assert lookup_index.table_shape(4, 1024, shared=True) == (1, 131072)
    assert lookup_index.table_shape(64, 32768, shared=True) == (1, 1 << 24)  # (16 MB at most)


def _engine(types, **kw):
    target = tiny_model(0)
    spec = SpecConfig(types=types, draft_n_max=4, **kw)
    drafters, dparams = build_drafters(spec, target, None)
    engine = eng.Engine(
        target=target.config, drafters=drafters, k_max=4, capacity=64, out_capacity=40
    )
    return target, engine, dparams


#: the governor on, at the CPU defaults' prices (`SpecConfig`)
_CPU_PRICES = adaptive.CostModel(
    enabled=jnp.asarray(True),
    verify_token=jnp.asarray(0.4, jnp.float32),
    draft_step=jnp.asarray(0.0, jnp.float32),
    call=jnp.asarray(0.08, jnp.float32),
)
DISTINCT = list(range(10, 25))


def echo_prompt(target) -> list[int]:
    """A prompt, what greedy decoding continues it with, and the prompt again: the output
    then repeats n-grams of the prompt (drafts made, some accepted, some rejected)."""
    head = [3, 14, 15, 9, 2, 6]
    out = generate(target, [head], max_new_tokens=12, n_ctx=64).tokens[0]
    return head + out + head


@pytest.mark.parametrize("adaptive_on", [True, False])
def test_generation_keeps_the_index_of_every_ngram_it_holds(adaptive_on):
    """After prefill and a whole generation (rounds with and without drafts), the table is
    the one built from scratch from the stream: every round added what it committed."""
    target, engine, dparams = _engine(
        ("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=4
    )
    tokens = jnp.asarray([echo_prompt(target), DISTINCT + [0] * 9], jnp.int32)
    lengths = jnp.asarray([24, len(DISTINCT)], jnp.int32)
    run = run_params([30, 30], cost=_CPU_PRICES if adaptive_on else None)
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, run)
    shape = lookup_index.table_shape(2, 64, shared=False)
    assert engine.lookup_gap == 2  # (ngram-simple: its size_n)
    built = lookup_index.build(state.history, lengths, 2, shape, 2)
    assert np.array_equal(state.lookup_seen, built)
    state = eng.generate_loop_jit(engine, target.params, dparams, state, run)
    assert int(state.stats.n_draft_tokens) > 0
    rebuilt = lookup_index.build(state.history, state.length, 2, shape, 2)
    assert np.array_equal(state.lookup_seen, rebuilt)
    # and the answer the state carries for its next round is the rebuilt table's
    fresh = lookup_index.query(rebuilt, state.history, state.length, state.last_token, 2)
    assert np.array_equal(state.lookup_next, fresh)


def test_a_lookup_that_can_find_nothing_is_never_asked_and_one_that_can_is():
    """Over a prompt without repeats and an n-gram no output repeats, the governed chain is
    not asked in any round (probing from the prior asked several); over a prompt the output
    echoes, it is asked and drafts. The tokens are plain decoding's."""
    target = tiny_model(0)

    def governed(prompt: list[int], n: int) -> tuple[dict[str, int], int]:
        """The governor's counters and the drafted tokens of a governed ngram-simple run."""
        spec = SpecConfig(
            types=("ngram-simple",), ngram_simple_size_n=n, ngram_simple_size_m=4, draft_n_max=4
        )
        plain = generate(target, [prompt], max_new_tokens=24, n_ctx=64)
        run = generate(target, [prompt], max_new_tokens=24, n_ctx=64, spec=spec)
        assert run.tokens == plain.tokens
        return run.stats.governor, run.stats.to_dict()["num_draft_tokens"]

    g, _ = governed(DISTINCT, 24)
    assert g["rounds"] >= 20 and g["rounds"] == g["off"], g
    g, drafted = governed(echo_prompt(target), 2)
    assert g["rounds"] > g["off"] and drafted > 0, g


def _chunks(engine, target, dparams, slots, slot_stats, slot, prompt, C=8):
    chunk = jax.jit(cont.prefill_chunk, static_argnums=0)
    for start in range(0, len(prompt), C):
        piece = prompt[start : start + C]
        slots, slot_stats = chunk(
            engine, target.params, dparams, slots, slot_stats, jnp.asarray(slot),
            jnp.asarray(piece + [0] * (C - len(piece)), jnp.int32), jnp.asarray(start),
            jnp.asarray(len(piece)), jnp.asarray(start + C >= len(prompt)), run_params([4]),
        )  # fmt: skip
    return slots, slot_stats


def test_slot_admission_indexes_the_new_request_and_a_shared_table_keeps_the_old():
    """Continuous batching: a slot that starts a new request holds that prompt's n-grams
    only (its row cleared first); with ngram-mod in the chain (a pool shared by the slots
    and kept across requests) the one table keeps every request's n-grams."""
    first, second = list(range(30, 50)), [3, 1, 3, 1, 2, 7, 3, 1, 2]
    for types, shared in ((("ngram-simple",), False), (("ngram-simple", "ngram-mod"), True)):
        target, engine, dparams = _engine(types, ngram_simple_size_n=2, ngram_mod_n_match=3)
        assert engine.lookup_shared == shared
        slots, slot_stats = cont.init_slots(engine, 2)
        slots, slot_stats = _chunks(engine, target, dparams, slots, slot_stats, 1, first)
        slots, slot_stats = _chunks(engine, target, dparams, slots, slot_stats, 1, second)
        table = np.asarray(slots.lookup_seen)
        M, gap = table.shape[1], engine.lookup_gap
        assert gap == (1 if shared else 2)  # (ngram-mod's 1, ngram-simple's size_n)
        want = python_table(second, len(second), 2, M, gap)
        if shared:
            assert table.shape == (1, M)
            want |= python_table(first, len(first), 2, M, gap)
            assert set(np.flatnonzero(table[0])) == want
        else:
            assert table.shape == (2, M) and not table[0].any()
            assert set(np.flatnonzero(table[1])) == want
        # the slot's answer for its first round: its stream, ending with the sampled token
        stream = second + [int(slots.last_token[1])]
        L, n = len(second), 2
        assert bool(slots.lookup_next[1]) == (python_slots(stream[L - n + 1 :], M) <= want)


def test_drafter_memory_carried_into_a_call_leaves_a_shared_table_full():
    """Carried drafter states (a server slot's) may hold any n-gram in a shared pool: every
    row stays askable. Per-row lookups start from the prompt as usual."""
    for types, full in ((("ngram-simple",), False), (("ngram-simple", "ngram-mod"), True)):
        target, engine, dparams = _engine(types, ngram_simple_size_n=2, ngram_mod_n_match=3)
        tokens = jnp.asarray([DISTINCT], jnp.int32)
        lengths = jnp.asarray([len(DISTINCT)], jnp.int32)
        carried = tuple(d.init(1, 64) for d in engine.drafters)
        state = eng.prefill_jit(
            engine, target.params, dparams, tokens, lengths, run_params([4]), carried
        )
        assert bool(np.asarray(state.lookup_seen).all()) == full
        assert np.asarray(state.lookup_seen).any()


def test_off_runs_that_no_row_could_draft_in_leave_the_rounds_state():
    """`engine.generate_loop` keeps running off rounds past the governor's plan while no
    active row could draft (`GenState.lookup_next`); the whole generation must leave the state that
    `spec_step` round by round leaves (which plans every round, the index included), with
    such rounds, asked rounds and drafts all taken."""
    from test_batch_lean import _copy, assert_same_state

    target, engine, dparams = _engine(
        ("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=4
    )
    head = [3, 14, 15, 9, 2, 6]  # the output loops with period 10 after a few tokens
    tokens = jnp.asarray([head + [0] * 9, DISTINCT], jnp.int32)
    lengths = jnp.asarray([len(head), len(DISTINCT)], jnp.int32)
    cheap = adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(0.05, jnp.float32),
        draft_step=jnp.asarray(0.0, jnp.float32),
        call=jnp.asarray(0.04, jnp.float32),
    )
    run = run_params([36, 36], cost=cheap)
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, run)
    want, quiet = _copy(state), 0
    while bool(jnp.any(~want.done)) and int(want.n_rounds) < engine.out_capacity:
        could = np.asarray(want.lookup_next) & ~np.asarray(want.done)
        unindexed = eng.draft_budget(engine, replace(want, lookup_next=None), run)
        quiet += (not could.any()) and bool(jnp.any(unindexed[0] > 0))
        want = eng.step_jit(engine, target.params, dparams, want, run)
    got = eng.generate_loop_jit(engine, target.params, dparams, _copy(state), run)
    assert quiet >= 3  # rounds the governor alone would have asked in, that nobody could
    assert int(want.stats.n_draft_tokens) > 0
    assert 0 < int(want.governor.n_off) < int(want.governor.n_rounds)
    assert_same_state(got, want)


@pytest.mark.parametrize("drafter", ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod"])
def test_every_draft_comes_in_a_round_the_index_allows(drafter):
    """The declared n-gram sizes and gaps against the drafters themselves: asked every round
    (governor off), a drafter drafts only in rounds in which `GenState.lookup_next` is True;
    the index still rules out some rounds."""
    sizes = dict(
        ngram_simple_size_n=2, ngram_simple_size_m=4, ngram_map_k_size_n=2,
        ngram_map_k_size_m=4, ngram_map_k4v_size_n=2, ngram_map_k4v_size_m=4,
        ngram_mod_n_match=2, ngram_mod_n_min=1, ngram_mod_n_max=8, ngram_mod_pool_size=1 << 10,
    )  # fmt: skip
    target, engine, dparams = _engine((drafter,), **sizes)
    drafted_rounds, ruled_out = 0, 0
    for prompt in (echo_prompt(target), [3, 14, 15, 9, 2, 6]):
        run = run_params([36])
        tokens, lengths = jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32)
        state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, run)
        while not bool(state.done[0]):
            could = bool(state.lookup_next[0])
            n_draft = int(state.stats.n_draft_tokens)
            state = eng.step_jit(engine, target.params, dparams, state, run)
            drafted = int(state.stats.n_draft_tokens) > n_draft
            assert could or not drafted, int(state.n_rounds)
            drafted_rounds += drafted
            ruled_out += not could
    assert drafted_rounds > 0 and ruled_out > 0


@pytest.mark.parametrize(
    "drafter",
    [
        NgramSimple(size_n=2, size_m=3),
        NgramMapK(size_n=2, size_m=3),
        NgramMod(n_match=2, n_min=1, pool_size=1 << 10),
    ],
    ids=lambda d: d.name,
)
def test_the_declared_gap_is_the_drafters_own(drafter):
    """Over many random histories (3 tokens: n-grams repeat at every distance), a drafter
    asked once drafts only where the index built with its n and gap allows it, and at some
    where an index one position stricter would not: the gap is neither too large (lost
    drafts) nor, by more than the drafters' other conditions, too small."""
    B, S = 256, 48
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 3, (B, S)), jnp.int32)
    lengths = jnp.asarray(rng.integers(12, S - 1, B), jnp.int32)
    last = jnp.asarray(rng.integers(0, 3, B), jnp.int32)

    def first_draft_token(tokens_S: jax.Array, length: jax.Array, last_token: jax.Array):
        """Whether the drafter drafts for one row, in a state of its own (ngram-mod's pool is
        shared by a call's rows: each row here is a call of one row)."""
        history = TokenHistory(tokens=tokens_S[None], length=length[None])
        state = drafter.begin(drafter.init(1, S), history)
        inp = DraftInput(
            history=history, last_token=last_token[None], n_max=jnp.full((1,), 4, jnp.int32),
            drafting=jnp.ones((1,), bool), n_min=jnp.asarray(0), p_min=jnp.asarray(0.0),
            temperature=jnp.zeros((1,), jnp.float32),
        )  # fmt: skip
        return drafter.draft(None, state, inp, 4)[1].valid[0, 0]

    drafted = np.asarray(jax.jit(jax.vmap(first_draft_token))(tokens, lengths, last))
    n, gap = drafter.lookup_size(), drafter.lookup_gap()

    def allowed(g: int) -> np.ndarray:
        table = lookup_index.build(tokens, lengths, n, (B, 1024), g)
        return np.asarray(lookup_index.query(table, tokens, lengths, last, n))

    assert drafted.sum() > 20
    assert not (drafted & ~allowed(gap)).any()
    assert (drafted & ~allowed(gap + 1)).any()
