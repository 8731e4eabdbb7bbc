"""The draft governor's start from the prompt (`engine.prompt_governor`): a chain of lookup
drafters is counted as asked at the prompt's last positions, hit where its n-gram occurred
earlier in the prompt.

Independent sources: a plain-Python scan of the prompts for repeated n-grams, and a
plain-Python transcription of the governor's hit update (`observe` in `specjax.adaptive`'s
docstring: decayed counts, a miss streak that a hit resets).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import adaptive
from specjax import continuous as cont
from specjax import engine as eng
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.drafters.base import prompt_lookup_hits
from specjax.drafters.ngram_cache import NgramCache
from specjax.drafters.ngram_mod import NgramMod
from specjax.drafters.ngram_simple import NgramSimple
from specjax.drafters.registry import build_drafters
from specjax.pytree import replace
from specjax.testing import run_params, tiny_model

M = adaptive.PROMPT_PROBES


def python_hits(tokens: list[int], sizes: list[int], probes: int) -> tuple[list[bool], list[bool]]:
    """Seen / valid for the last `probes` positions of `tokens` (oldest first)."""
    L = len(tokens)
    seen, valid = [], []
    for p in range(L - probes, L):
        valid.append(p >= 0)
        hit = False
        for n in sizes:
            if p >= n - 1:
                key = tokens[p - n + 1 : p + 1]
                hit |= any(tokens[q - n + 1 : q + 1] == key for q in range(n - 1, p))
        seen.append(hit and p >= 0)
    return seen, valid


@jax.jit
def _hits_3_5(tokens, lengths):
    return prompt_lookup_hits([NgramSimple(size_n=3), NgramMod(n_match=5)], tokens, lengths, M)


def test_prompt_hits_are_the_repeated_ngrams_a_python_scan_finds():
    """Rows of a small vocabulary (n-grams repeat) and of distinct tokens (none do), of
    lengths below, at and above the number of probed positions; a chain of two sizes."""
    rng = np.random.default_rng(1)
    S = 96
    rows = [
        rng.integers(0, 3, 90).tolist(),  # 3 tokens: most 3- and 5-grams repeat
        rng.integers(0, 6, 70).tolist(),
        list(range(40, 100)),  # no repeats at all
        [7, 8, 9, 7, 8, 9, 7],  # shorter than M: invalid positions first
        rng.integers(0, 4, M).tolist(),
    ]
    tokens = np.zeros((len(rows), S), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    seen, valid = (np.asarray(x) for x in _hits_3_5(jnp.asarray(tokens), lengths))
    n_seen = 0
    for b, r in enumerate(rows):
        want_seen, want_valid = python_hits(r, [3, 5], M)
        assert seen[b].tolist() == want_seen, b
        assert valid[b].tolist() == want_valid, b
        n_seen += sum(want_seen)
    assert n_seen > 20 and not seen[2].any() and seen[3].any() and not valid[3].all()


def test_a_chain_without_a_lookup_size_reads_nothing_from_the_prompt():
    tokens, lengths = jnp.zeros((1, 32), jnp.int32), jnp.asarray([20], jnp.int32)
    assert prompt_lookup_hits([NgramSimple(), NgramCache()], tokens, lengths, M) is None
    assert prompt_lookup_hits([NgramSimple(), object()], tokens, lengths, M) is None
    assert prompt_lookup_hits([], tokens, lengths, M) is None


def python_from_prompt(num, den, streak, seen, valid):
    for s, v in zip(seen, valid):
        if v:
            num, den = adaptive.DECAY * num + s, adaptive.DECAY * den + 1
            streak = 0 if s else streak + 1
    return num, den, streak


@pytest.mark.parametrize("start_streak", [0, 3])
def test_the_prompt_counts_as_asked_rounds_of_the_hit_update(start_streak):
    rng = np.random.default_rng(2)
    B = 6
    seen = rng.random((B, M)) < np.asarray([0.0, 0.2, 0.5, 0.9, 1.0, 0.3])[:, None]
    n_valid = np.asarray([M, M, 5, 1, 0, 9])
    valid = np.arange(M)[None, :] >= (M - n_valid)[:, None]
    gov = adaptive.Governor.create(B)
    gov = replace(gov, miss_streak=jnp.full((B,), start_streak, jnp.int32))
    got = adaptive.from_prompt(gov, jnp.asarray(seen & valid), jnp.asarray(valid))
    for b in range(B):
        num, den, streak = python_from_prompt(
            float(gov.hit_num[b]), float(gov.hit_den[b]), start_streak, seen[b] & valid[b], valid[b]
        )
        assert float(got.hit_num[b]) == pytest.approx(num, rel=1e-5)
        assert float(got.hit_den[b]) == pytest.approx(den, rel=1e-5)
        assert int(got.miss_streak[b]) == streak, b
    # nothing was verified: acceptance, idle rounds and the counters stay a fresh governor's
    for name in ("acc_num", "acc_den", "idle", "n_rounds", "n_throttled", "n_off"):
        assert np.array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(gov, name)))


def _engine(types, **kw):
    target = tiny_model(0)
    spec = SpecConfig(types=types, draft_n_max=4, **kw)
    drafters, dparams = build_drafters(spec, target, None)
    engine = eng.Engine(
        target=target.config, drafters=drafters, k_max=4, capacity=64, out_capacity=32
    )
    return target, engine, dparams


def _run(batch):
    return run_params([8] * batch)


REPEATS = [5, 6, 7, 8, 9] * 5  # every 4-gram after the first block occurred before
DISTINCT = list(range(10, 35))


def test_prefill_and_slot_admission_start_the_governor_from_the_prompt():
    """`engine.prefill` starts a row whose prompt repeats itself optimistic (a hit at every
    probed position) and a row whose prompt never repeats backed off (M misses in a row);
    continuous batching's admission of the same prompt in two chunks starts the slot with
    the same governor. A chain with a drafter that is not a lookup starts fresh."""
    target, engine, dparams = _engine(("ngram-simple",), ngram_simple_size_n=4)
    tokens = jnp.asarray([REPEATS, DISTINCT], jnp.int32)
    lengths = jnp.asarray([len(REPEATS), len(DISTINCT)], jnp.int32)
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, _run(2))
    gov = state.governor
    assert np.asarray(gov.miss_streak).tolist() == [0, M]
    hit, _ = adaptive.estimates(gov)
    fresh_hit, _ = adaptive.estimates(adaptive.Governor.create(1))
    assert float(hit[0]) == pytest.approx(float(fresh_hit[0]))  # hits keep the prior's 1.0
    assert float(hit[1]) < 0.2

    slots, slot_stats = cont.init_slots(engine, 2)
    chunk = jax.jit(cont.prefill_chunk, static_argnums=0)
    for start in (0, 16):
        piece = DISTINCT[start : start + 16]
        slots, slot_stats = chunk(
            engine, target.params, dparams, slots, slot_stats, jnp.asarray(1),
            jnp.asarray(piece + [0] * (16 - len(piece)), jnp.int32), jnp.asarray(start),
            jnp.asarray(len(piece)), jnp.asarray(start > 0), _run(1),
        )  # fmt: skip
    for name in ("hit_num", "hit_den", "miss_streak"):
        got, want = np.asarray(getattr(slots.governor, name)), np.asarray(getattr(gov, name))
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6, err_msg=name)

    target, engine, dparams = _engine(("ngram-simple", "ngram-cache"), ngram_simple_size_n=4)
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, _run(2))
    fresh = adaptive.Governor.create(2)
    for name in ("hit_num", "hit_den", "miss_streak"):
        assert np.array_equal(np.asarray(getattr(state.governor, name)), getattr(fresh, name))


def test_a_lookup_that_finds_nothing_in_the_prompt_is_not_probed_round_after_round():
    """Over a prompt without repeats and an n-gram no output repeats, a fresh governor asks
    the first rounds one after the other (the docstring's rule, 4-token drafts at the CPU
    prices: 17); started from the prompt it asks a few. The tokens are plain decoding's."""
    target = tiny_model(0)
    spec = SpecConfig(
        types=("ngram-simple",), ngram_simple_size_n=24, ngram_simple_size_m=4, draft_n_max=4
    )
    plain = generate(target, [DISTINCT], max_new_tokens=24, n_ctx=64)
    run = generate(target, [DISTINCT], max_new_tokens=24, n_ctx=64, spec=spec)
    assert run.tokens == plain.tokens
    g = run.stats.governor
    asked = g["rounds"] - g["off"]
    assert g["rounds"] >= 20 and run.stats.to_dict()["num_draft_tokens"] == 0
    assert 1 <= asked <= 3, g
