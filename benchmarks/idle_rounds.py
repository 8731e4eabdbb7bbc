"""What a drafter that finds nothing costs per round. Prints one JSON object.

    python benchmarks/idle_rounds.py [--repeats 41] [--tokens 256] [--no-kernels] [--out FILE]

The shipped target, greedy, the `norepeat` prompt (as benchmarks/peers.py builds it) and an
n-gram size of 1024, so that no lookup can match: every configuration emits plain decoding's
tokens in one token per round. Runs are interleaved; for each configuration the JSON gives
the per-round decode time (minimum and median over the runs: on a shared machine the minimum
is the steadier figure) and its ratio to plain decoding's (also the median of each repeat's
ratio to that repeat's plain run; each repeat starts one configuration later than the last), and the draft governor's counters. A run of 256 tokens
takes ~50 ms, so repeats are cheap (41 by default). On the shared 2-core host the ratios
still move by ~5% between runs of this script; `benchmarks/loop_ab.py` compares two engines'
loops inside one process, which cancels more of that drift.

* `governed/<drafter>`: the default (the governor asks for a draft in some rounds only; none
  here since the lookup index, `specjax.drafters.lookup_index`: no n-gram repeats, so every round is
  an off round that also keeps the index);
* `asked/<drafter>`: `adaptive=False`, asked every round: `extra_ms` is then the fixed cost of
  a speculative round that drafts nothing over a plain round (issue 8, goal 3: a drafter that
  proposes nothing costs at most 3%).
* `never/<drafter>`: a cost model under which drafting never pays, so every round is an off
  round: what carrying a chain the governor has turned off costs. `generate` would leave
  such a chain out of the run (`prices.unpaying_drafters`: the governor never asks it from its
  prior); here it is kept in, as a chain the governor turned off after measuring it is.
* `never/draft-eagle3`, `never/draft-dflash` (with `--heads`, the shipped heads): the same
  for the feature drafters, which must see every verify batch: in an off round they only
  `record` it (`specjax.drafters.base`, `idle_record`) and apply their log when next asked
  or when it is full. `governed/<head>`: the default governor (it asks now and then: these
  heads always draft when asked, so the ratio also holds its probes' cost; at B = 1 on CPU
  it leaves EAGLE-3 out of the run, `prices.unpaying_drafters`, whose ask no draft pays for).

`kernels_per_round`: XLA kernels (thunks) the generation loop runs per round, counted in one
profiled run (`jax.profiler`): the noise-free companion of the times (on a shared machine,
run-to-run swings of 10-40% hide differences of a few percent). It counts work, not time: an
un-profiled launch of a small kernel is cheap (cutting a plain round from 291 to 200 kernels
changed its time by under 3% on a quiet host), so read it beside the minimum times.
`kernels_by_scope` splits that count by the engine's named scope of each kernel (relay, plan,
bookkeeping, verify<width>, ...: where an asked round's extra kernels come from).
`profiled_us_per_round`: the same profiled run's kernel time per round by scope and its
costliest kernels (inflated by the profiler; compare configurations within one run).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, machine, profiled, refuse_overwrite
from peers import DEFAULT_DFLASH, DEFAULT_EAGLE3, NO_MATCH_N, PROMPT_FILES, Specjax

import specjax
from specjax import api
from specjax.decode import executables, prices

DRAFTERS: dict[str, dict[str, Any]] = {
    "ngram-simple": {"ngram_simple_size_n": NO_MATCH_N},
    "ngram-map-k": {"ngram_map_k_size_n": NO_MATCH_N},
    "ngram-mod": {"ngram_mod_n_match": NO_MATCH_N},
}


#: How the governor treats the drafter: the default, asked every round, never asked (a cost
#: model under which drafting never pays).
MODES: dict[str, dict[str, Any]] = {
    "governed": {},
    "asked": {"adaptive": False},
    "never": {"cost_call": 1e6},
}


#: Profiler events that are not XLA kernels (host-side spans, executor bookkeeping).
_NOT_KERNELS = (
    *("$", "end: ", "PjitFunction", "ThunkExecutor", "CommonPjRt", "Threadpool"),
    *("ArrayImpl", "np.asarray", "Wait for"),
)


#: The engine's named scopes (`jax.named_scope` in specjax.decode.engine), innermost first wins.
SCOPES = (
    *("relay", "plan", "bookkeeping", "feedback", "commit", "accept", "verify", "off_rounds"),
    *("lookup", "record"),
)


def _scope(op_name: str) -> str:
    """The innermost engine scope in an HLO instruction's `op_name` path ("unnamed": none)."""
    for part in reversed(op_name.split("/")):
        if part.startswith(SCOPES):
            return part
    return "unnamed"


def kernels_per_round(run: Any) -> tuple[float, dict[str, float], dict[str, Any]]:
    """XLA kernels per round of one profiled `run()` (which returns a `generate` result),
    counted from the generation loop's start, the same count by the engine's scope of each
    kernel (from the loop executable's HLO metadata; "unnamed": no engine scope, such as the
    copies and reductions XLA adds), and the profiled time per round: by scope, and the
    costliest kernels (name without its number, scope). Control-flow thunks (`while`,
    `cond`), whose spans hold their bodies' kernels, are counted but not timed. Profiled
    times are inflated and swing with the machine's load: compare them within one run."""
    result, events = profiled(run)
    spans = [e for e in events if e.get("ph") == "X"]
    start = max(e["ts"] for e in spans if e["name"].startswith("PjitFunction(jit(generate_loop"))
    kernels = [e for e in spans if e["ts"] >= start and not e["name"].startswith(_NOT_KERNELS)]
    loops = [
        exe for key, exe in executables._COMPILED.items() if key[0] is api.eng.generate_loop_jit
    ]
    op_names = dict(re.findall(r"%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", loops[-1].as_text()))
    rounds = max(int(result.timings.get("n_rounds", 0)), 1)
    scope_of = [_scope(op_names.get(e["name"], "")) for e in kernels]
    by_scope = collections.Counter(scope_of)
    us_by_scope: collections.Counter[str] = collections.Counter()
    us_by_kernel: collections.Counter[tuple[str, str]] = collections.Counter()
    for e, scope in zip(kernels, scope_of):
        if not e["name"].startswith(("while", "cond")):
            us_by_scope[scope] += e.get("dur", 0.0)
            us_by_kernel[re.sub(r"\.\d+$", "", e["name"]), scope] += e.get("dur", 0.0)
    profiled_us = {
        "by_scope": {k: v / rounds for k, v in sorted(us_by_scope.items())},
        "costliest": [
            {"kernel": name, "scope": scope, "us_per_round": v / rounds}
            for (name, scope), v in us_by_kernel.most_common(8)
        ],
    }
    return len(kernels) / rounds, {k: v / rounds for k, v in sorted(by_scope.items())}, profiled_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--no-kernels", action="store_true", help="skip the profiled kernel count")
    ap.add_argument(
        "--heads", action="store_true", help="also the shipped EAGLE-3 and DFlash heads"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)

    peer = Specjax(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), args.tokens)
    model = peer.model
    ids = peer.ids(PROMPT_FILES["norepeat"].read_text())  # as peers.py builds its prompts
    configs: dict[str, specjax.SpecConfig | None] = {"plain": None}
    for name, kwargs in DRAFTERS.items():
        for mode, priced in MODES.items():
            configs[f"{mode}/{name}"] = specjax.SpecConfig(
                types=(name,), draft_n_max=4, **kwargs, **priced
            )
    heads: dict[str, Any] = {}  # config name -> the head it drafts with
    if args.heads:
        for kind, path in (("draft-eagle3", DEFAULT_EAGLE3), ("draft-dflash", DEFAULT_DFLASH)):
            head = specjax.load(str(path))
            for mode in ("governed", "never"):
                heads[f"{mode}/{kind}"] = head
                configs[f"{mode}/{kind}"] = specjax.SpecConfig(
                    types=(kind,), draft_n_max=4, **MODES[mode]
                )
    kw = dict(max_new_tokens=args.tokens, n_ctx=2048, temperature=0.0)

    def generate(name: str) -> Any:
        # `never/`: in the run although never asked (see the module docstring)
        kept = mock.patch.object(prices, "unpaying_drafters", lambda *a, **k: {})
        with kept if name.startswith("never/") else contextlib.nullcontext():
            return specjax.generate(model, [ids], spec=configs[name], draft=heads.get(name), **kw)

    for name in configs:  # compile (or load) every program first
        generate(name)

    per_round: dict[str, list[float]] = {k: [] for k in configs}
    facts: dict[str, dict[str, Any]] = {}
    names = list(configs)
    for rep in range(args.repeats):
        # each repeat starts one configuration later: a fixed order gives each one a fixed
        # place, and benchmarks/loop_ab.py saw the second run of a pair run slower
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            r = generate(name)
            rounds = max(int(r.timings.get("n_rounds", 0)), 1)
            per_round[name].append(r.timings["decode_seconds"] / rounds * 1e3)
            stats = r.stats.to_dict() if r.stats is not None else {}
            facts[name] = {
                "rounds": rounds,
                "drafted_tokens": stats.get("num_draft_tokens"),
                "governor": stats.get("governor"),
                "tokens": r.tokens[0],
            }
    if not args.no_kernels:
        for name in configs:
            fact = facts[name]
            fact["kernels_per_round"], fact["kernels_by_scope"], fact["profiled_us_per_round"] = (
                kernels_per_round(lambda name=name: generate(name))
            )
    plain_min = min(per_round["plain"])
    plain_median = statistics.median(per_round["plain"])
    plain_tokens = facts["plain"]["tokens"]
    rows = {}
    for name, times in per_round.items():
        fact = facts[name]
        fact["same_tokens_as_plain"] = fact.pop("tokens") == plain_tokens
        if "kernels_per_round" in fact:
            plain_kernels = facts["plain"]["kernels_per_round"]
            fact["extra_kernels_per_round"] = fact["kernels_per_round"] - plain_kernels
        rows[name] = {
            "ms_per_round_min": min(times),
            "ms_per_round_median": statistics.median(times),
            "speed_vs_plain_min": plain_min / min(times),
            "speed_vs_plain_median": plain_median / statistics.median(times),
            # each repeat's plain run (close in time): slow drifts cancel
            "speed_vs_plain_paired": statistics.median(
                p / t for p, t in zip(per_round["plain"], times)
            ),
            "extra_ms_min": min(times) - plain_min,
            **fact,
        }
    report = {
        "benchmark": "idle_rounds",
        "model": str(DEFAULT_TARGET.relative_to(DEFAULT_TARGET.parents[2])),
        "prompt": "norepeat",
        "n_gram": NO_MATCH_N,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "machine": machine(),
        "configs": rows,
    }
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
