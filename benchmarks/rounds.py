"""What a round costs: time per round and XLA kernels per round. Modes:

    python benchmarks/rounds.py idle [--repeats 41] [--tokens 256] [--no-kernels] [--heads]
                                     [--out FILE]
    python benchmarks/rounds.py cost [--spec-types draft-dflash,draft-dspark] [--prompt main]
                                     [--tokens 128] [--repeats 9] [--out FILE]
    python benchmarks/rounds.py ab --base /tmp/base/specjax/decode/engine.py [--repeats 150]
                                   [--base-modules lookup_index] [--configs plain,...] [--out FILE]

Each prints one JSON object (and writes it to --out; an existing file only with --overwrite).

## `idle`: what a drafter that finds nothing costs per round

The shipped target, greedy, the `norepeat` prompt (as benchmarks/peers.py builds it) and an
n-gram size of 1024, so that no lookup can match: every configuration emits plain decoding's
tokens in one token per round. Runs are interleaved; for each configuration the JSON gives
the per-round decode time (minimum and median over the runs: on a shared machine the minimum
is the steadier figure) and its ratio to plain decoding's (also the median of each repeat's
ratio to that repeat's plain run; each repeat starts one configuration later than the last), and the draft governor's counters. A run of 256 tokens
takes ~50 ms, so repeats are cheap (41 by default). On the shared 2-core host the ratios
still move by ~5% between runs of this script; `rounds.py ab` compares two engines'
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

## `cost`: what one round of a speculative configuration costs

For A/B comparisons of an engine change: run it at two commits (`PYTHONPATH=<worktree>`),
interleaved a few times, and compare. Each spec type runs greedily on the shipped target with
its shipped draft or head (governor off, so every round drafts the same way), after one run
that compiles: the minimum and median of `--repeats` per-round decode times (decode seconds /
rounds; on a shared machine the minimum is the steadier figure) and the XLA kernels the
generation loop runs per round, counted in one profiled run (noise-free, but a proxy:
`idle` says what a kernel costs). Prints one JSON object.

## `ab`: two generation loops inside one process

This checkout's `specjax/decode/engine.py` against another one (a worktree of an earlier
commit), interleaved run by run:

    git worktree add /tmp/base <commit>
    python benchmarks/rounds.py ab --base /tmp/base/specjax/decode/engine.py

On the shared 2-core host, separate processes drift by 5-20% between runs (`idle`'s
ratios move that much between two runs of the same code), which hides the
few percent an engine change is worth. Here both loops are compiled in one process and each
configuration runs a pair of base and new `--repeats` times, base first in every other pair
(with base always first, `plain`, the same program on both sides, read 0.980 and 0.986 in
two runs: the second run of a pair was slower): `new_over_base_paired` is the median of base time / new time
over the pairs (> 1: the new loop is faster). `plain`'s ratio shows the method's own noise.

The base file is loaded as a module beside `specjax.decode.engine` and called with this checkout's
`Engine`, `GenState` and `RunParams` classes: it must be an engine.py whose generation loop
works with the rest of this checkout (a change confined to engine.py, or also to the modules
named by `--base-modules`, which the base engine then takes from its own folder; code outside
the loop, such as prefill, runs this checkout's modules on both sides). Each configuration's
tokens must be the same on both sides, or the script stops.

Configurations: `plain`; `<mode>/<drafter>` over the `norepeat` prompt with n-gram size
1024 (nothing matches; modes `governed`, `asked`, `never` as in `idle`);
`<drafter>/repetitive` with the drafter's defaults over the `repetitive` prompt (drafts
found and accepted); `plain/repetitive`. Times are per generated token, greedy, 256 tokens.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import re
import statistics
import sys
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    emit,
    llamacpp_prompt_ids,
    machine,
    mode_parser,
    profiled,
    refuse_overwrite,
    run_mode,
)
from peers import DEFAULT_DFLASH, DEFAULT_DSPARK, DEFAULT_EAGLE3, NO_MATCH_N, PROMPT_FILES, Specjax

import specjax
from specjax import api
from specjax.decode import engine as eng
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


# ------------------------------------------------------------------------------- idle
def idle(argv: list[str]) -> None:
    ap = mode_parser("idle", "what a drafter that finds nothing costs per round")
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--no-kernels", action="store_true", help="skip the profiled kernel count")
    ap.add_argument(
        "--heads", action="store_true", help="also the shipped EAGLE-3 and DFlash heads"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
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
        # place, and `ab` saw the second run of a pair run slower
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
    emit(report, args.out)


# ------------------------------------------------------------------------------- cost
#: The shipped draft or head of each spec type with one.
DRAFTS = {
    "draft-simple": DEFAULT_DRAFT,
    "draft-eagle3": DEFAULT_EAGLE3,
    "draft-dflash": DEFAULT_DFLASH,
    "draft-dspark": DEFAULT_DSPARK,
}


def cost(argv: list[str]) -> None:
    ap = mode_parser("cost", "what one round of a speculative configuration costs")
    ap.add_argument("--spec-types", default="draft-dflash,draft-dspark")
    ap.add_argument("--prompt", default="main", choices=sorted(PROMPT_FILES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    refuse_overwrite(args.out, args.overwrite)
    target = specjax.load(str(DEFAULT_TARGET))
    ids = llamacpp_prompt_ids(target, PROMPT_FILES[args.prompt].read_text())
    result: dict[str, Any] = {
        "benchmark": "round_cost",
        "prompt": args.prompt,
        "tokens": args.tokens,
        "machine": machine(),
        "configs": {},
    }
    for spec_type in args.spec_types.split(","):
        draft = specjax.load(str(DRAFTS[spec_type])) if spec_type in DRAFTS else None
        spec = specjax.SpecConfig(types=(spec_type,), adaptive=False)

        def run(spec: specjax.SpecConfig = spec, draft: Any = draft) -> Any:
            return specjax.generate(
                target, [ids], max_new_tokens=args.tokens, n_ctx=1024, spec=spec, draft=draft
            )

        first = run()
        ms = []
        for _ in range(args.repeats):
            r = run()
            ms.append(r.timings["decode_seconds"] / max(r.timings["n_rounds"], 1) * 1e3)
        kernels, by_scope, _ = kernels_per_round(run)
        result["configs"][spec_type] = {
            "ms_per_round_min": min(ms),
            "ms_per_round_median": statistics.median(ms),
            "kernels_per_round": kernels,
            "kernels_by_scope": by_scope,
            "rounds": first.timings["n_rounds"],
            "mean_acceptance_length": first.stats.to_dict()["mean_acceptance_length"],
        }
    emit(result, args.out)


# ------------------------------------------------------------------------------- ab
DEFAULT_CONFIGS = (
    "plain,governed/ngram-simple,governed/ngram-map-k,governed/ngram-mod,never/ngram-mod,"
    "asked/ngram-mod,plain/repetitive,ngram-mod/repetitive,ngram-map-k/repetitive"
)


def _load(name: str, path: Path) -> Any:
    """The module of the file at `path`, registered as `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"rounds.py ab: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while it loads)
    spec.loader.exec_module(module)
    return module


def load_base_loop(path: Path, modules: tuple[str, ...] = ()) -> Any:
    """The jitted generation loop of the engine file at `path`, bound to this checkout's
    state classes; each of `modules` (names of specjax modules the engine imports) is taken
    from the engine file's folder instead of this checkout."""
    module = _load("specjax._engine_base", path)
    for name in modules:
        setattr(module, name, _load(f"specjax._base_{name}", path.parent / f"{name}.py"))
    for name in ("Engine", "GenState", "RunParams"):
        setattr(module, name, getattr(eng, name))
    return module.generate_loop_jit


def config(name: str) -> tuple[specjax.SpecConfig | None, str]:
    """(spec, prompt name) of a configuration name."""
    if name == "plain":
        return None, "norepeat"
    if name == "plain/repetitive":
        return None, "repetitive"
    first, second = name.split("/")
    if second == "repetitive":
        return specjax.SpecConfig(types=(first,), draft_n_max=4), "repetitive"
    return specjax.SpecConfig(
        types=(second,), draft_n_max=4, **DRAFTERS[second], **MODES[first]
    ), "norepeat"


def ab(argv: list[str]) -> None:
    ap = mode_parser("ab", "A/B of two generation loops inside one process")
    ap.add_argument("--base", type=Path, required=True, help="the other engine.py")
    ap.add_argument(
        "--base-modules",
        default="",
        help="comma-separated specjax modules the base engine takes from its own folder "
        "(e.g. lookup_index); outside the loop (prefill) both sides use this checkout's",
    )
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--repeats", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    refuse_overwrite(args.out, args.overwrite)
    base_modules = tuple(m for m in args.base_modules.split(",") if m)
    loops = {"base": load_base_loop(args.base, base_modules), "new": eng.generate_loop_jit}
    peer = Specjax(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), args.tokens)
    prompts = {p: peer.ids(PROMPT_FILES[p].read_text()) for p in ("norepeat", "repetitive")}
    configs = {name: config(name) for name in args.configs.split(",")}
    kw = dict(max_new_tokens=args.tokens, n_ctx=2048, temperature=0.0)

    def run(side: str, name: str) -> Any:
        spec, prompt = configs[name]
        eng.generate_loop_jit = loops[side]  # (api calls the loop through this attribute)
        try:
            return specjax.generate(peer.model, [prompts[prompt]], spec=spec, **kw)
        finally:
            eng.generate_loop_jit = loops["new"]

    facts: dict[str, dict[str, Any]] = {}
    for name in configs:  # compile (or load) both programs; the same tokens on both sides
        base, new = run("base", name), run("new", name)
        if base.tokens != new.tokens:
            raise SystemExit(f"rounds.py ab: {name}: the two loops emit different tokens")
        stats = new.stats.to_dict() if new.stats is not None else {}
        facts[name] = {"rounds": int(new.timings["n_rounds"]), "governor": stats.get("governor")}
    times: dict[tuple[str, str], list[float]] = {(s, n): [] for s in loops for n in configs}
    for rep in range(args.repeats):
        for name in configs:
            for side in ("base", "new") if rep % 2 == 0 else ("new", "base"):
                r = run(side, name)
                per_token = r.timings["decode_seconds"] / max(r.timings["generated_tokens"] - 1, 1)
                times[side, name].append(per_token * 1e6)
    rows = {}
    for name in configs:
        base, new = times["base", name], times["new", name]
        rows[name] = {
            "base_us_per_token_min": min(base),
            "base_us_per_token_median": statistics.median(base),
            "new_us_per_token_min": min(new),
            "new_us_per_token_median": statistics.median(new),
            "new_over_base_paired": statistics.median(b / n for b, n in zip(base, new)),
            "new_over_base_min": min(base) / min(new),
            **facts[name],
        }
    emit(
        {
            "benchmark": "loop_ab",
            "base": str(args.base),
            "base_modules": list(base_modules),
            "tokens": args.tokens,
            "repeats": args.repeats,
            "machine": machine(),
            "configs": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    run_mode({"idle": idle, "cost": cost, "ab": ab}, __doc__)
