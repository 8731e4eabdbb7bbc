"""What the draft governor asks of drafters: rounds per run and rounds it asked.

    python benchmarks/governor_rounds.py [--tokens 256] [--cost-call C] [--out FILE]

Deterministic counts (no timing), for comparing governor settings at two commits
(`PYTHONPATH=<worktree>`): the shipped target, greedy, `--tokens` new tokens, governor on.

* `cases`: each of ngram-simple / ngram-map-k / ngram-mod / ngram-cache over the `main`,
  `repetitive` and `norepeat` prompts (as benchmarks/peers.py builds them): rounds taken
  (fewer = more tokens per target forward) and rounds in which the drafter was asked;
  `total_rounds` sums them. For a lookup drafter, `repeats`: of the generated tokens, those
  that end an n-gram of its `lookup_size` that also ends at least `lookup_gap` + 1
  positions earlier in the stream (prompt and output), by a plain-Python scan: where a
  lookup could draft at all (asks beyond these come from the lookup index's collisions). `draft_model`: draft-simple with the shipped draft over the same
  prompts, apart (its asks cost a draft model's steps and catch-up, not a lookup).
* `finds_nothing`: ngram-map-k with an n-gram size no text can match, asked rounds after
  64, 256 and 1,024 tokens: the probing a drafter that never drafts costs (the backoff in
  `specjax.decode.governor`; 0 since the lookup index, `specjax.drafters.lookup_index`, rules every round
  out).
* `generator`: one `specjax.Generator` with ngram-mod (B = 1, `-c 2048`) serving 16
  requests in turn, each the first 400 tokens of one of the installed `yaml` package's
  modules (sorted by name) and `--generator-tokens` new tokens: asks and drafts per request.
  Its pool and its lookup table outlive the requests, so the table fills request after
  request (`lookup_index`: a shared table is never cleared) and its collisions grow.

`--cost-call` sets `SpecConfig.cost_call` (the governor's price of asking the chain, in
target forwards) for every run: the trade-off between the two lists above. Without it each
chain has its own price (`prices.chain_call_price`, in `chain_call_price`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, emit, machine, refuse_overwrite
from peers import NO_MATCH_N, PROMPT_FILES, Specjax

import specjax
from specjax import api
from specjax.drafters.registry import build_drafters

DRAFTERS = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
PROMPTS = ("main", "repetitive", "norepeat")


def asked(result: Any) -> int:
    governor = result.stats.to_dict()["governor"]
    return governor["rounds"] - governor["off"]


def repeats(stream: Sequence[int], first: int, n: int, gap: int) -> int:
    """Positions p >= first of `stream` whose n-gram (ending at p) also ends at a position
    <= p - 1 - gap (the earliest occurrence of each n-gram is all that matters)."""
    earliest: dict[tuple[int, ...], int] = {}
    count = 0
    for p in range(n - 1, len(stream)):
        gram = tuple(stream[p - n + 1 : p + 1])
        seen = earliest.setdefault(gram, p)
        count += p >= first and seen <= p - 1 - gap
    return count


def generator_requests(model: Any, tokens: int, priced: dict[str, Any]) -> dict[str, Any]:
    """The `generator` section (module docstring)."""
    files = sorted(Path(yaml.__file__).parent.glob("*.py"))[:16]
    spec = specjax.SpecConfig(types=("ngram-mod",), draft_n_max=4, **priced)
    gen = specjax.Generator(model, spec=spec, n_ctx=2048)
    per_request = []
    for path in files:
        ids = model.tokenizer.encode(path.read_text())[:400]
        r = gen.generate([ids], max_new_tokens=tokens, temperature=0.0)
        stats = r.stats.to_dict()["drafters"]["ngram-mod"]
        per_request.append(
            {"file": path.name, "asked": stats["n_call_draft"], "drafts": stats["n_gen_drafts"]}
        )
    return {
        "requests": per_request,
        "asked": sum(r["asked"] for r in per_request),
        "drafts": sum(r["drafts"] for r in per_request),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--cost-call", type=float, default=None, help="default: SpecConfig's")
    ap.add_argument("--generator-tokens", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)
    peer = Specjax(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), args.tokens)
    model = peer.model
    ids = {p: peer.ids(PROMPT_FILES[p].read_text()) for p in PROMPTS}
    priced = {} if args.cost_call is None else {"cost_call": args.cost_call}
    cases: dict[str, dict[str, int]] = {}
    for drafter in DRAFTERS:
        spec = specjax.SpecConfig(types=(drafter,), draft_n_max=4, **priced)
        (built,), _ = build_drafters(spec, None, None)
        for prompt in PROMPTS:
            r = specjax.generate(
                model, [ids[prompt]], max_new_tokens=args.tokens, n_ctx=2048, spec=spec
            )
            case = cases[f"{drafter}/{prompt}"] = {
                "rounds": r.timings["n_rounds"],
                "asked": asked(r),
            }
            n = built.lookup_size()
            if n is not None:
                stream = ids[prompt] + r.tokens[0]
                case["repeats"] = repeats(stream, len(ids[prompt]), n, built.lookup_gap())
    draft_model = {}
    spec = specjax.SpecConfig(types=("draft-simple",), draft_n_max=4, **priced)
    for prompt in PROMPTS:
        r = specjax.generate(
            model,
            [ids[prompt]],
            max_new_tokens=args.tokens,
            n_ctx=2048,
            spec=spec,
            draft=peer.draft,
        )
        draft_model[f"draft-simple/{prompt}"] = {"rounds": r.timings["n_rounds"], "asked": asked(r)}
    never = specjax.SpecConfig(
        types=("ngram-map-k",), draft_n_max=4, ngram_map_k_size_n=NO_MATCH_N, **priced
    )
    finds_nothing = {}
    for n in (64, 256, 1024):
        r = specjax.generate(model, [ids["norepeat"]], max_new_tokens=n, n_ctx=4096, spec=never)
        finds_nothing[str(n)] = asked(r)
    emit(
        {
            "benchmark": "governor_rounds",
            "tokens": args.tokens,
            # None: each chain's own price (`prices.chain_call_price`), listed per drafter
            "cost_call": args.cost_call,
            "chain_call_price": {
                d: api.chain_call_price(
                    build_drafters(specjax.SpecConfig(types=(d,)), None, None)[0]
                )
                for d in DRAFTERS
            },
            "machine": machine(),
            "cases": cases,
            "total_rounds": sum(c["rounds"] for c in cases.values()),
            "finds_nothing_asked": finds_nothing,
            "draft_model": draft_model,
            "generator_tokens": args.generator_tokens,
            "generator": generator_requests(model, args.generator_tokens, priced),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
