"""ngram-cache at long histories against llama.cpp's recorded drafts (issue 52, item 10).

`fixtures/ngram-cache-long.jsonl.gz` (81 kB, made by `fixtures/record_ngram_cache_long.py`):
scenarios recorded from llama.cpp's own relay with `../shared/tools/ngram-oracle` (its
`make_vectors.py`, the format of `../shared/conformance/README.md`) on histories of 33k to 42k
tokens (CPython sources cut to 50 and 60 kB): ngram-cache alone and the five-drafter chain, 2,298
rounds. Upstream's context cache is a set of unbounded `std::unordered_map`s; the JAX drafter's
tables are sized from the history capacity and must keep everything too, whatever `table_size`
asks for (the harnesses of test_conformance*.py ask for 8,192 slots: below what these histories
need, the tables used to fill up and drop pairs, and the drafts diverged at round 0 or 2).

* `test_jax_long_alone`: the JAX ngram-cache alone, every round (fast).
* `test_jax_long_chain`: the JAX ngram-cache inside the reference relay of the chain (the other
  types' plain-Python references decide which rounds reach ngram-cache, as upstream's relay).
* `test_jax_long_chain_all_jax`: the chain of five JAX drafters (test_conformance.py's B=1
  relay at this file's capacity). The file takes ~30 s on a loaded 2-core host.
* `test_reference_long`: the plain-Python references replay every scenario.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from oracles import relay_reference as rr
from oracles.ngram_cache_reference import NgramCacheImplRef
from test_conformance import JAX_FACTORIES, compiled_calls
from test_conformance_ngram_cache import replay_through_relay

from specjax.drafters.base import PRIORITY
from specjax.drafters.ngram_cache import NgramCache

rr.register_reference("ngram-cache", lambda params, n_seq: NgramCacheImplRef(n_seq))

PATH = Path(__file__).parent / "fixtures" / "ngram-cache-long.jsonl.gz"
SCENARIOS = rr.load_scenarios(PATH)
#: history capacity: the smallest power of two above the longest recorded stream
S = 1 << max(len(s["tokens"]) for s in SCENARIOS).bit_length()
K = 16  # static draft width (>= every scenario's n_max)
#: the conformance harnesses' configuration: 8,192 slots asked for, fewer than these need
DRAFTER = NgramCache(reset_on_begin=False, table_size=8192)
ALONE = [i for i, s in enumerate(SCENARIOS) if rr.scenario_types(s) == ["ngram-cache"]]
CHAIN = [i for i, s in enumerate(SCENARIOS) if len(rr.scenario_types(s)) == 5]


def _id(i: int) -> str:
    s = SCENARIOS[i]
    return f"{i}-{s['source']}-{'alone' if i in ALONE else 'chain'}-{s['prompt_len']}"


def test_recordings_are_long() -> None:
    assert len(ALONE) >= 2 and len(CHAIN) >= 2
    assert all(SCENARIOS[i]["prompt_len"] >= 32768 for i in ALONE + CHAIN)
    assert all("ngram-cache" in rr.scenario_types(s) for s in SCENARIOS)


def _compiled(drafter: Any) -> tuple[Any, ...]:
    """Jitted begin / draft / accept (`test_conformance.compiled_calls`) over S cells."""
    return compiled_calls(drafter, S, K)


class JaxImpl:
    """One JAX drafter behind the reference relay's impl interface (one sequence)."""

    def __init__(self, drafter: Any, scenario: dict[str, Any]) -> None:
        stream = np.zeros((S + 1,), np.int32)
        stream[: len(scenario["tokens"])] = scenario["tokens"]
        self.stream = jnp.asarray(stream)
        rng = np.random.default_rng(1234)
        self.garbage = jnp.asarray(rng.integers(0, 256, S, dtype=np.int32))
        self.begin_fn, self.draft_fn, self.accept_fn = _compiled(drafter)
        self.state = drafter.init(1, S)
        self.calls = 0

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.state = self.begin_fn(self.state, self.stream, self.garbage, np.int32(len(prompt)))

    def draft_one(self, seq: int, prompt: list[int], id_last: int) -> list[int]:
        self.calls += 1
        n = len(prompt)
        assert int(self.stream[n]) == id_last
        self.state, toks, k = self.draft_fn(
            self.state, self.stream, self.garbage, np.int32(n), np.int32(0)
        )
        return [int(t) for t in np.asarray(toks)[: int(k)]]

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        pass  # ngram-cache's accept is a no-op (as upstream's)


def _check_state(impl: JaxImpl) -> None:
    state = impl.state
    assert state.count.shape[-1] == DRAFTER.slots_for(S) > DRAFTER.table_size
    assert int(np.asarray(state.n_dropped)[0]) == 0


def _replay(scenario: dict[str, Any]) -> JaxImpl:
    """Every round of `scenario` through the reference relay, ngram-cache the JAX drafter (the
    other types their references); returns ngram-cache's impl."""
    impl = JaxImpl(DRAFTER, scenario)
    replay_through_relay(impl, scenario)
    _check_state(impl)
    return impl


def _replay_all_jax(scenario: dict[str, Any]) -> JaxImpl:
    """Every round through five JAX drafters in test_conformance.py's B=1 relay: fixed
    priority, the first non-empty draft wins (truncated to n_max), accept to the winner with
    is_other=False and to the others with is_other=True, `active` = the round had a winner."""
    params = scenario.get("params", {})
    types = rr.scenario_types(scenario)
    impls = [
        JaxImpl(DRAFTER if t == "ngram-cache" else JAX_FACTORIES[t](params), scenario)
        for t in PRIORITY
        if t in types
    ]
    pos = scenario["prompt_len"]
    for impl in impls:
        impl.state = impl.begin_fn(impl.state, impl.stream, impl.garbage, np.int32(pos))
    n_max = scenario["n_max"]
    for rnd in scenario["rounds"]:
        assert rnd["pos0"] == pos
        got: list[int] = []
        winner = None
        for k, impl in enumerate(impls):
            impl.state, toks, n = impl.draft_fn(
                impl.state, impl.stream, impl.garbage, np.int32(pos), np.int32(n_max)
            )
            if int(n) > 0:
                winner = k
                got = [int(t) for t in np.asarray(toks)[: int(n)]][:n_max]
                break
        assert got == rnd["draft"], f"round {rnd['round']} (pos0 {pos})"
        for k, impl in enumerate(impls):
            impl.state = impl.accept_fn(
                impl.state,
                np.int32(rnd["n_accepted"]),
                np.bool_(k != winner),
                np.bool_(winner is not None),
            )
        pos += 1 + rnd["n_accepted"]
    (cache,) = [
        impl for t, impl in zip([t for t in PRIORITY if t in types], impls) if t == "ngram-cache"
    ]
    _check_state(cache)
    return cache


@pytest.mark.parametrize("idx", ALONE, ids=[_id(i) for i in ALONE])
def test_jax_long_alone(idx: int) -> None:
    impl = _replay(SCENARIOS[idx])
    # a 4-gram table holding more pairs than the 8,192 slots asked for: what used to drop
    assert int(np.asarray(impl.state.n_used)[0, 3]) > 8192


@pytest.mark.parametrize("idx", CHAIN, ids=[_id(i) for i in CHAIN])
def test_jax_long_chain(idx: int) -> None:
    _replay(SCENARIOS[idx])


@pytest.mark.parametrize("idx", CHAIN, ids=[_id(i) for i in CHAIN])
def test_jax_long_chain_all_jax(idx: int) -> None:
    _replay_all_jax(SCENARIOS[idx])


@pytest.mark.parametrize("idx", range(len(SCENARIOS)), ids=[_id(i) for i in range(len(SCENARIOS))])
def test_reference_long(idx: int) -> None:
    n = sum(1 for r in rr.replay_reference(SCENARIOS[idx]) if r.got == r.expected)
    assert n == len(SCENARIOS[idx]["rounds"])
