"""Plain-Python relay driver (llama.cpp `common_speculative_{begin,draft,accept}`, spec 4.4/4.5).

Invariants:
* Impls run in llama.cpp's fixed PRIORITY order, whatever order the types were given in.
* For each impl in that order, every sequence that is still drafting is offered to it
  (`draft_one`, sequences in ascending order); the first impl whose draft for a sequence is
  non-empty wins it: the draft is truncated to the sequence's `n_max` (when `n_max > 0`) and
  `impl_last[seq]` is set. Sequences without a draft keep an empty one; `impl_last` is NOT reset.
* `accept(seq, n)` goes to `impl_last[seq]` with `is_other=False` and to every other impl with
  `is_other=True`; with no `impl_last`, `n` must be 0 and nothing happens.

Impls are duck-typed objects with `begin(seq, prompt)`, `draft_one(seq, prompt, id_last)` and
`accept(seq, n_accepted, is_other)` (see `oracles.reference`). `REFERENCE_FACTORIES`
maps a llama.cpp type name to a factory `(params, n_seq) -> impl` reading the conformance file's
parameter keys; other drafter types register themselves with `register_reference`.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oracles.reference import NgramMapImplRef, NgramModRef, NgramSimpleRef
from specjax.drafters.base import PRIORITY

Factory = Callable[[dict[str, int], int], Any]


def _simple(p: dict[str, int], n_seq: int) -> Any:
    del n_seq
    return NgramSimpleRef(p.get("simple_n", 12), p.get("simple_m", 48))


def _map_k(p: dict[str, int], n_seq: int) -> Any:
    return NgramMapImplRef(
        True, p.get("mapk_n", 12), p.get("mapk_m", 48), p.get("mapk_hits", 1), n_seq=n_seq
    )


def _map_k4v(p: dict[str, int], n_seq: int) -> Any:
    return NgramMapImplRef(
        False, p.get("k4v_n", 12), p.get("k4v_m", 48), p.get("k4v_hits", 1), n_seq=n_seq
    )


def _mod(p: dict[str, int], n_seq: int) -> Any:
    return NgramModRef(
        p.get("mod_match", 24), p.get("mod_min", 48), p.get("mod_max", 64), n_seq=n_seq
    )


#: llama.cpp type name -> reference impl factory `(params, n_seq) -> impl`.
REFERENCE_FACTORIES: dict[str, Factory] = {
    "ngram-simple": _simple,
    "ngram-map-k": _map_k,
    "ngram-map-k4v": _map_k4v,
    "ngram-mod": _mod,
}


def register_reference(type_name: str, factory: Factory) -> None:
    """Add (or replace) the reference factory of a drafter type."""
    REFERENCE_FACTORIES[type_name] = factory


@dataclass
class DraftRequest:
    """One sequence's `common_speculative_draft_params` for a round."""

    prompt: list[int]  # tokens in memory (excluding id_last)
    id_last: int
    n_max: int
    drafting: bool = True


class RelayReference:
    """`common_speculative` over `n_seq` sequences with impls given as {type name: impl}."""

    def __init__(self, impls: dict[str, Any], n_seq: int = 1) -> None:
        unknown = set(impls) - set(PRIORITY)
        if unknown:
            raise ValueError(f"unknown speculative type(s): {sorted(unknown)}")
        self.order: list[str] = [t for t in PRIORITY if t in impls]
        self.impls = impls
        self.n_seq = n_seq
        self.impl_last: list[str | None] = [None] * n_seq

    def begin(self, seq: int, prompt: list[int]) -> None:
        for t in self.order:
            self.impls[t].begin(seq, list(prompt))

    def draft(self, requests: list[DraftRequest]) -> list[list[int]]:
        assert len(requests) == self.n_seq
        results: list[list[int]] = [[] for _ in requests]
        drafting = [r.drafting for r in requests]
        if not any(drafting):
            return results
        for t in self.order:
            impl = self.impls[t]
            for seq, r in enumerate(requests):
                if drafting[seq]:
                    results[seq] = list(impl.draft_one(seq, r.prompt, r.id_last))
            for seq, r in enumerate(requests):
                if drafting[seq] and results[seq]:
                    drafting[seq] = False
                    if r.n_max > 0:
                        results[seq] = results[seq][: r.n_max]
                    self.impl_last[seq] = t
            if not any(drafting):
                break
        return results

    def accept(self, seq: int, n_accepted: int) -> None:
        last = self.impl_last[seq]
        if last is None:
            assert n_accepted == 0
            return
        self.impls[last].accept(seq, n_accepted, False)
        for t in self.order:
            if t != last:
                self.impls[t].accept(seq, n_accepted, True)


# --------------------------------------------------------------------------------------------
# conformance vectors
# --------------------------------------------------------------------------------------------


def _conformance_path() -> Path:
    """$SPECJAX_CONFORMANCE, else `shared/` beside the checkout (as CI lays it out)."""
    env = os.environ.get("SPECJAX_CONFORMANCE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for root in (repo.parent / "shared", repo / "shared", Path("/work/shared")):
        candidate = root / "conformance" / "ngram-drafts.jsonl.gz"
        if candidate.exists():
            return candidate
    return repo.parent / "shared" / "conformance" / "ngram-drafts.jsonl.gz"


CONFORMANCE_PATH = _conformance_path()


def load_scenarios(path: Path | str = CONFORMANCE_PATH) -> list[dict[str, Any]]:
    """All scenarios of a conformance file (one JSON object per line, gzip)."""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def scenario_types(scenario: dict[str, Any]) -> list[str]:
    return [t for t in scenario["types"].split(",") if t]


@dataclass
class RoundResult:
    round: int
    pos0: int
    expected: list[int]
    got: list[int]
    n_accepted: int


def replay(
    scenario: dict[str, Any],
    draft_fn: Callable[[list[int], int, int], list[int]],
    accept_fn: Callable[[int], None],
    begin_fn: Callable[[list[int]], None],
    max_rounds: int | None = None,
) -> Iterator[RoundResult]:
    """Replay one scenario (README: begin on the prompt, then draft/compare/accept/extend).

    `draft_fn(history, id_last, n_max) -> draft` is the relay's draft for sequence 0;
    `accept_fn(n_accepted)` and `begin_fn(prompt)` its feedback/begin. The history is extended
    by `id_last` + the accepted draft tokens; the recorded `pos0`/`id_last` are checked to
    stay consistent with the stream.
    """
    tokens: list[int] = scenario["tokens"]
    prompt_len: int = scenario["prompt_len"]
    begin_fn(list(tokens[:prompt_len]))
    pos = prompt_len
    for k, rnd in enumerate(scenario["rounds"]):
        if max_rounds is not None and k >= max_rounds:
            break
        assert rnd["pos0"] == pos and rnd["id_last"] == tokens[pos], "stream out of sync"
        got = draft_fn(tokens[:pos], tokens[pos], scenario["n_max"])
        yield RoundResult(rnd["round"], pos, rnd["draft"], got, rnd["n_accepted"])
        accept_fn(rnd["n_accepted"])
        pos += 1 + rnd["n_accepted"]


def reference_relay(scenario: dict[str, Any]) -> RelayReference:
    """A one-sequence reference relay for a scenario (KeyError for an unregistered type)."""
    types = scenario_types(scenario)
    params = scenario.get("params", {})
    return RelayReference({t: REFERENCE_FACTORIES[t](params, 1) for t in types}, n_seq=1)


def replay_reference(
    scenario: dict[str, Any], max_rounds: int | None = None
) -> Iterator[RoundResult]:
    """Replay a scenario through the plain-Python references."""
    relay = reference_relay(scenario)

    def draft_fn(hist: list[int], id_last: int, n_max: int) -> list[int]:
        return relay.draft([DraftRequest(hist, id_last, n_max)])[0]

    return replay(
        scenario, draft_fn, lambda n: relay.accept(0, n), lambda p: relay.begin(0, p), max_rounds
    )
