"""A/B of two generation loops inside one process: this checkout's `specjax/decode/engine.py` against
another one (a worktree of an earlier commit), interleaved run by run. Prints one JSON object.

    git worktree add /tmp/base <commit>
    python benchmarks/loop_ab.py --base /tmp/base/specjax/decode/engine.py [--repeats 150]
                                 [--base-modules lookup_index] [--configs plain,...] [--out FILE]

On the shared 2-core host, separate processes drift by 5-20% between runs (benchmarks/
idle_rounds.py's ratios move that much between two runs of the same code), which hides the
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
1024 (nothing matches; modes `governed`, `asked`, `never` as in benchmarks/idle_rounds.py);
`<drafter>/repetitive` with the drafter's defaults over the `repetitive` prompt (drafts
found and accepted); `plain/repetitive`. Times are per generated token, greedy, 256 tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, emit, machine, refuse_overwrite
from idle_rounds import DRAFTERS, MODES
from peers import PROMPT_FILES, Specjax

import specjax
from specjax.decode import engine as eng

DEFAULT_CONFIGS = (
    "plain,governed/ngram-simple,governed/ngram-map-k,governed/ngram-mod,never/ngram-mod,"
    "asked/ngram-mod,plain/repetitive,ngram-mod/repetitive,ngram-map-k/repetitive"
)


def _load(name: str, path: Path) -> Any:
    """The module of the file at `path`, registered as `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"loop_ab.py: cannot load {path}")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = ap.parse_args()
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
            raise SystemExit(f"loop_ab.py: {name}: the two loops emit different tokens")
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
    main()
