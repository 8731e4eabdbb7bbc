"""Replay llama.cpp's recorded n-gram drafts (/work/shared/conformance) round by round.

Two drivers, both following the README's replay (begin on the prompt; per round: draft with
(history, id_last, n_max), compare with the recorded relay draft, accept the recorded
n_accepted, extend the history by id_last + the accepted tokens):
* the plain-Python references through `RelayReference` (all scenarios, fast);
* the JAX drafters through a small B=1 relay (`_JaxRelay`: fixed priority, first non-empty
  draft wins, truncation to n_max, accept to the winner with is_other=False and to the others
  with is_other=True, `active` = the round verified a non-empty draft). History cells at and
  beyond `length` hold random garbage, so a drafter reading past the history fails.

Drafter types are looked up in `JAX_FACTORIES` / `REFERENCE_FACTORIES`; a scenario using a type
missing there is skipped with the reason (ngram-cache registers itself elsewhere). One history
capacity `S` serves every scenario, so each drafter configuration compiles once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.ngram_cache_reference import NgramCacheImplRef
from oracles.relay_reference import (
    CONFORMANCE_PATH,
    REFERENCE_FACTORIES,
    load_scenarios,
    register_reference,
    replay_reference,
    scenario_types,
)

from specjax.drafters.base import PRIORITY, DraftInput, TokenHistory
from specjax.drafters.ngram_cache import NgramCache
from specjax.drafters.ngram_map import NgramMapK, NgramMapK4V
from specjax.drafters.ngram_mod import NgramMod
from specjax.drafters.ngram_simple import NgramSimple

register_reference("ngram-cache", lambda params, n_seq: NgramCacheImplRef(n_seq))

K = 64  # static draft width (>= every scenario's n_max)

#: llama.cpp type name -> JAX drafter factory from the conformance `params`.
JAX_FACTORIES: dict[str, Callable[[dict[str, int]], Any]] = {
    "ngram-simple": lambda p: NgramSimple(p.get("simple_n", 12), p.get("simple_m", 48)),
    "ngram-map-k": lambda p: NgramMapK(
        size_n=p.get("mapk_n", 12), size_m=p.get("mapk_m", 48), min_hits=p.get("mapk_hits", 1)
    ),
    "ngram-map-k4v": lambda p: NgramMapK4V(
        size_n=p.get("k4v_n", 12), size_m=p.get("k4v_m", 48), min_hits=p.get("k4v_hits", 1)
    ),
    "ngram-mod": lambda p: NgramMod(
        p.get("mod_match", 24), p.get("mod_min", 48), p.get("mod_max", 64)
    ),
    # upstream keeps the context cache across begin (bug #27852): replay it as recorded
    "ngram-cache": lambda p: NgramCache(reset_on_begin=False, table_size=8192),
}

SCENARIOS: list[dict[str, Any]] = load_scenarios() if CONFORMANCE_PATH.exists() else []


def history_capacity(scenarios: list[dict[str, Any]]) -> int:
    """One history capacity for every scenario (so each drafter configuration compiles once):
    the smallest power of two above the longest recorded stream, whatever the vectors hold."""
    longest = max((len(s["tokens"]) for s in scenarios), default=0)
    return 1 << max(4, longest.bit_length())


S = history_capacity(SCENARIOS)
IDS = [f"{i}-{s['types']}" for i, s in enumerate(SCENARIOS)]

#: Default (fast) JAX subset: the shortest-prompt scenario of each single-type configuration,
#: plus scenario 7 (ngram-mod 8/2/16, whose replay goes through 20 low-acceptance pool resets).
#: The rest (same configurations, longer prompts) is marked slow; all of it takes ~1.5 min on
#: an idle 2-core machine, most of it compilation.
FAST = [i for i, s in enumerate(SCENARIOS) if s["prompt_len"] < 4000 and "," not in s["types"]]
FAST += [i for i in (7,) if i < len(SCENARIOS) and i not in FAST]


def _skip_unknown(scenario: dict[str, Any], registry: dict[str, Any]) -> None:
    missing = [t for t in scenario_types(scenario) if t not in registry]
    if missing:
        pytest.skip(f"no drafter registered for {missing}")


def _expected_n_accepted(scenario: dict[str, Any], pos: int, draft: list[int]) -> int:
    """Tokens of `draft` equal to the stream after id_last (the oracle target's acceptance)."""
    toks = scenario["tokens"]
    n = 0
    while n < len(draft) and pos + 1 + n < len(toks) and draft[n] == toks[pos + 1 + n]:
        n += 1
    return n


# --------------------------------------------------------------------------------------------
# plain-Python references: every scenario of a registered type, every round
# --------------------------------------------------------------------------------------------

needs_vectors = pytest.mark.skipif(not SCENARIOS, reason=f"{CONFORMANCE_PATH} not present")


@needs_vectors
@pytest.mark.parametrize("idx", range(len(SCENARIOS)), ids=IDS)
def test_reference_reproduces_llamacpp(idx: int) -> None:
    scenario = SCENARIOS[idx]
    _skip_unknown(scenario, REFERENCE_FACTORIES)
    n = 0
    for r in replay_reference(scenario):
        assert r.got == r.expected, f"round {r.round} (pos0 {r.pos0})"
        n_exp = _expected_n_accepted(scenario, r.pos0, r.expected)
        at_end = r.pos0 + 1 + n_exp == len(scenario["tokens"])  # the record's stream stops here
        assert r.n_accepted == n_exp or (at_end and r.n_accepted > n_exp)
        n += 1
    assert n == len(scenario["rounds"])


# --------------------------------------------------------------------------------------------
# JAX drafters through a B=1 relay
# --------------------------------------------------------------------------------------------


@functools.cache
def compiled_calls(drafter: Any, capacity: int, width: int) -> tuple[Callable[..., Any], ...]:
    """Jitted begin / draft / accept for one drafter configuration (B=1, `capacity` cells of
    history, draft width `width`), state donated. The stream's first `capacity` tokens are the history's cells;
    cells past the history's length hold `garbage` (a drafter must not read them)."""

    def history(stream: jax.Array, garbage: jax.Array, length: jax.Array) -> TokenHistory:
        cells = jnp.where(jnp.arange(capacity) < length, stream[:capacity], garbage)
        return TokenHistory(tokens=cells[None, :], length=length[None])

    def begin(state: Any, stream: jax.Array, garbage: jax.Array, length: jax.Array) -> Any:
        return drafter.begin(state, history(stream, garbage, length))

    def draft(
        state: Any, stream: jax.Array, garbage: jax.Array, length: jax.Array, n_max: jax.Array
    ) -> tuple[Any, jax.Array, jax.Array]:
        inp = DraftInput(
            history=history(stream, garbage, length),
            last_token=stream[length][None],
            n_max=n_max[None],
            drafting=jnp.ones((1,), bool),
            n_min=jnp.int32(0),
            p_min=jnp.float32(0.0),
            temperature=jnp.zeros((1,), jnp.float32),
        )
        state, out = drafter.draft(None, state, inp, width)
        return state, out.tokens[0], out.length[0]

    def accept(state: Any, n: jax.Array, is_other: jax.Array, active: jax.Array) -> Any:
        return drafter.accept(state, n[None], is_other[None], active[None])

    return (
        jax.jit(begin, donate_argnums=0),
        jax.jit(draft, donate_argnums=0),
        jax.jit(accept, donate_argnums=0),
    )


def _compiled(drafter: Any) -> tuple[Callable[..., Any], ...]:
    return compiled_calls(drafter, S, K)


class _JaxRelay:
    """llama.cpp's relay (spec 4.4/4.5) over JAX drafters for one sequence."""

    def __init__(self, scenario: dict[str, Any]) -> None:
        types = scenario_types(scenario)
        params = scenario.get("params", {})
        self.drafters = [JAX_FACTORIES[t](params) for t in PRIORITY if t in types]
        self.fns = [_compiled(d) for d in self.drafters]
        self.states = [d.init(1, S) for d in self.drafters]
        toks = np.asarray(scenario["tokens"], np.int32)
        rng = np.random.default_rng(1234)
        self.garbage = jnp.asarray(rng.integers(0, 256, S, dtype=np.int32))
        stream = np.zeros((S,), np.int32)
        stream[: len(toks)] = toks
        self.stream = jnp.asarray(stream)
        self.winner: int | None = None

    def begin(self, length: int) -> None:
        for k, (begin, _, _) in enumerate(self.fns):
            self.states[k] = begin(self.states[k], self.stream, self.garbage, np.int32(length))

    def draft(self, length: int, n_max: int) -> list[int]:
        self.winner = None
        for k, (_, draft, _) in enumerate(self.fns):
            self.states[k], toks, n = draft(
                self.states[k], self.stream, self.garbage, np.int32(length), np.int32(n_max)
            )
            n = int(n)
            if n > 0:
                self.winner = k
                out = [int(t) for t in np.asarray(toks)[:n]]
                return out[:n_max] if n_max > 0 else out
        return []

    def accept(self, n_accepted: int) -> None:
        active = np.bool_(self.winner is not None)
        for k, (_, _, accept) in enumerate(self.fns):
            self.states[k] = accept(
                self.states[k], np.int32(n_accepted), np.bool_(k != self.winner), active
            )


def _replay_jax(scenario: dict[str, Any], max_rounds: int | None = None) -> int:
    relay = _JaxRelay(scenario)
    pos = scenario["prompt_len"]
    relay.begin(pos)
    rounds = scenario["rounds"][:max_rounds]
    for rnd in rounds:
        assert rnd["pos0"] == pos
        got = relay.draft(pos, scenario["n_max"])
        assert got == rnd["draft"], f"round {rnd['round']} (pos0 {pos})"
        relay.accept(rnd["n_accepted"])
        pos += 1 + rnd["n_accepted"]
    return len(rounds)


@needs_vectors
@pytest.mark.parametrize("idx", FAST, ids=[IDS[i] for i in FAST])
def test_jax_reproduces_llamacpp_fast(idx: int) -> None:
    scenario = SCENARIOS[idx]
    _skip_unknown(scenario, JAX_FACTORIES)
    t0 = time.perf_counter()
    n = _replay_jax(scenario)
    print(f"{IDS[idx]}: {n} rounds in {time.perf_counter() - t0:.1f}s")


@needs_vectors
@pytest.mark.slow
@pytest.mark.parametrize(
    "idx",
    [i for i in range(len(SCENARIOS)) if i not in FAST],
    ids=[IDS[i] for i in range(len(SCENARIOS)) if i not in FAST],
)
def test_jax_reproduces_llamacpp_all(idx: int) -> None:
    scenario = SCENARIOS[idx]
    _skip_unknown(scenario, JAX_FACTORIES)
    t0 = time.perf_counter()
    n = _replay_jax(scenario)
    print(f"{IDS[idx]}: {n} rounds in {time.perf_counter() - t0:.1f}s")


def test_conformance_vectors_are_present_in_ci() -> None:
    """Outside CI a checkout without shared/ skips the replays; CI must always run them."""
    import os

    if not os.environ.get("CI") and not SCENARIOS:
        pytest.skip(f"{CONFORMANCE_PATH} not present")
    assert len(SCENARIOS) == 40, CONFORMANCE_PATH
