"""ngram-cache against llama.cpp's recorded drafts (/work/shared/conformance, README replay).

* `NgramCacheImplRef` (plain Python) is registered as the `ngram-cache` reference of
  `oracles.relay_reference`, so the scenarios mixing all n-gram types replay through
  the reference relay too (here and in test_conformance.py).
* The JAX drafter replays the ngram-cache-only scenarios round by round, and the mixed ones
  inside the reference relay (the other types' references decide which rounds reach
  ngram-cache, exactly as upstream's relay; ngram-cache ingests the history only when asked).
  Scenarios are single requests, so `reset_on_begin` does not matter; upstream's (False) is used.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import relay_reference as rr
from oracles.ngram_cache_reference import NgramCacheImplRef

from specjax.drafters.base import DraftInput, TokenHistory
from specjax.drafters.ngram_cache import NgramCache

rr.register_reference("ngram-cache", lambda params, n_seq: NgramCacheImplRef(n_seq))

K = 8
DRAFTER = NgramCache(reset_on_begin=False, table_size=8192, block=64)

SCENARIOS = rr.load_scenarios() if rr.CONFORMANCE_PATH.exists() else []
# history capacity: the smallest power of two above the longest recorded stream
S = 1 << max(4, max((len(s["tokens"]) for s in SCENARIOS), default=0).bit_length())
PURE = [i for i, s in enumerate(SCENARIOS) if rr.scenario_types(s) == ["ngram-cache"]]
MIXED = [
    i
    for i, s in enumerate(SCENARIOS)
    if "ngram-cache" in rr.scenario_types(s) and len(rr.scenario_types(s)) > 1
]
MIXED_FAST = [i for i in MIXED if SCENARIOS[i]["prompt_len"] < 4000]


def _id(i: int) -> str:
    return f"{i}-{SCENARIOS[i]['source']}-{SCENARIOS[i]['types']}"


needs_vectors = pytest.mark.skipif(not SCENARIOS, reason=f"{rr.CONFORMANCE_PATH} not present")


@functools.lru_cache(maxsize=1)
def _draft_fn() -> Any:
    def draft(state: Any, stream: jax.Array, length: jax.Array, n_max: jax.Array) -> Any:
        hist = jnp.where(jnp.arange(S) < length, stream[:S], 99999)[None, :]  # garbage past length
        inp = DraftInput(
            history=TokenHistory(tokens=hist, length=length[None]),
            last_token=stream[length][None],
            n_max=n_max[None],
            drafting=jnp.ones((1,), bool),
            n_min=jnp.int32(0),
            p_min=jnp.float32(0.0),
            temperature=jnp.zeros((1,), jnp.float32),
        )
        state, out = DRAFTER.draft(None, state, inp, K)
        return state, out.tokens[0], out.length[0]

    return jax.jit(draft, donate_argnums=0)


class JaxImpl:
    """The JAX drafter behind the reference relay's impl interface (one sequence)."""

    def __init__(self, scenario: dict[str, Any]) -> None:
        stream = np.zeros((S + 1,), np.int32)
        stream[: len(scenario["tokens"])] = scenario["tokens"]
        self.stream = jnp.asarray(stream)
        self.state = DRAFTER.init(1, S)
        self.calls = 0

    def begin(self, seq: int, prompt: list[int]) -> None:
        hist = TokenHistory(tokens=self.stream[None, :S], length=jnp.asarray([len(prompt)]))
        self.state = DRAFTER.begin(self.state, hist)

    def draft_one(self, seq: int, prompt: list[int], id_last: int) -> list[int]:
        self.calls += 1
        n = len(prompt)
        assert int(self.stream[n]) == id_last
        self.state, toks, k = _draft_fn()(self.state, self.stream, np.int32(n), np.int32(0))
        return [int(t) for t in np.asarray(toks)[: int(k)]]

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        pass


def replay_through_relay(impl: Any, scenario: dict[str, Any]) -> int:
    """Every round of `scenario` through the reference relay with `impl` as its ngram-cache
    (the other types their references); asserts each round's draft is the recorded one and
    returns the number of rounds."""
    params = scenario.get("params", {})
    impls = {
        t: (impl if t == "ngram-cache" else rr.REFERENCE_FACTORIES[t](params, 1))
        for t in rr.scenario_types(scenario)
    }
    relay = rr.RelayReference(impls, n_seq=1)

    def draft_fn(hist: list[int], id_last: int, n_max: int) -> list[int]:
        return relay.draft([rr.DraftRequest(hist, id_last, n_max)])[0]

    n = 0
    for r in rr.replay(
        scenario, draft_fn, lambda k: relay.accept(0, k), lambda p: relay.begin(0, p)
    ):
        assert r.got == r.expected, f"round {r.round} (pos0 {r.pos0})"
        n += 1
    assert n == len(scenario["rounds"])
    return n


def _replay_with_jax(idx: int) -> tuple[int, int]:
    scenario = SCENARIOS[idx]
    impl = JaxImpl(scenario)
    n = replay_through_relay(impl, scenario)
    assert int(np.asarray(impl.state.n_dropped)[0]) == 0
    return n, impl.calls


@needs_vectors
@pytest.mark.parametrize("idx", PURE, ids=[_id(i) for i in PURE])
def test_reference_reproduces_llamacpp(idx: int) -> None:
    n = sum(1 for r in rr.replay_reference(SCENARIOS[idx]) if r.got == r.expected)
    assert n == len(SCENARIOS[idx]["rounds"])


@needs_vectors
@pytest.mark.parametrize("idx", PURE + MIXED_FAST, ids=[_id(i) for i in PURE + MIXED_FAST])
def test_jax_reproduces_llamacpp(idx: int) -> None:
    t0 = time.perf_counter()
    n, calls = _replay_with_jax(idx)
    print(f"{_id(idx)}: {n} rounds, {calls} ngram-cache calls, {time.perf_counter() - t0:.1f}s")


@needs_vectors
@pytest.mark.slow
@pytest.mark.parametrize(
    "idx",
    [i for i in MIXED if i not in MIXED_FAST],
    ids=[_id(i) for i in MIXED if i not in MIXED_FAST],
)
def test_jax_reproduces_llamacpp_mixed(idx: int) -> None:
    test_jax_reproduces_llamacpp(idx)
