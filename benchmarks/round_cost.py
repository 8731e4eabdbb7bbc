"""What one round of a speculative configuration costs: time per round and XLA kernels per round.

    python benchmarks/round_cost.py [--spec-types draft-dflash,draft-dspark] [--prompt main]
                                    [--tokens 128] [--repeats 9] [--out FILE]

For A/B comparisons of an engine change: run it at two commits (`PYTHONPATH=<worktree>`),
interleaved a few times, and compare. Each spec type runs greedily on the shipped target with
its shipped draft or head (governor off, so every round drafts the same way), after one run
that compiles: the minimum and median of `--repeats` per-round decode times (decode seconds /
rounds; on a shared machine the minimum is the steadier figure) and the XLA kernels the
generation loop runs per round, counted in one profiled run (noise-free, but a proxy:
`benchmarks/idle_rounds.py` says what a kernel costs). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    emit,
    llamacpp_prompt_ids,
    machine,
    refuse_overwrite,
)
from idle_rounds import kernels_per_round
from peers import DEFAULT_DFLASH, DEFAULT_DSPARK, DEFAULT_EAGLE3, PROMPT_FILES

import specjax

#: The shipped draft or head of each spec type with one.
DRAFTS = {
    "draft-simple": DEFAULT_DRAFT,
    "draft-eagle3": DEFAULT_EAGLE3,
    "draft-dflash": DEFAULT_DFLASH,
    "draft-dspark": DEFAULT_DSPARK,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-types", default="draft-dflash,draft-dspark")
    ap.add_argument("--prompt", default="main", choices=sorted(PROMPT_FILES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
