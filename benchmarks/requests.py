"""What a request costs around its tokens: one-shot `generate` calls and `Generator` requests.

    python benchmarks/requests.py [--repeats 21] [--tokens 64] [--out FILE]

The shipped target, greedy, benchmarks/prompts/humaneval_main.py (as benchmarks/peers.py
builds it), `-c 2048`. Configurations, run interleaved (each repeat starts one later):

* `generate/plain`, `generate/ngram-mod`: `specjax.generate`, one call per request; the
  drafter state is made for the call (ngram-mod's pool: 2 x 16 MB at the default size).
* `generator/plain`, `generator/ngram-mod`: `specjax.Generator.generate`, the drafter state
  carried from the previous request, as llama.cpp's server keeps a slot's drafters.

For each: the wall time of a call, its prefill and decode seconds (minimum and median over
the repeats; on a shared host the minimum is the steadier figure), the process's minor page
faults during a call (median: fresh memory the call touched), each row's ratio to the plain
row of the same kind (medians of the per-repeat ratios) and the tokens its last call drafted.
A one-shot ngram-mod call drafts nothing over this prompt's 64 new tokens, so its ratio is
what its state costs; a Generator's pool holds the earlier requests (the same prompt), so
it drafts their continuation, which moves its decode time as well. `kept_results`: the process's resident memory before and after keeping
`--keep` one-shot ngram-mod results in a list (what a kept result pins). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_TARGET, emit, machine, refuse_overwrite
from peers import PROMPT_FILES, llamacpp_prompt_ids

import specjax


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rss_mb() -> float:
    """Resident memory of this process in MiB (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--keep", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)

    model = specjax.load(str(DEFAULT_TARGET))
    ids = llamacpp_prompt_ids(model, PROMPT_FILES["main"].read_text(encoding="utf-8"))
    n_ctx = 2048
    specs: dict[str, specjax.SpecConfig | None] = {
        "plain": None,
        "ngram-mod": specjax.SpecConfig(types=("ngram-mod",)),
    }
    generators = {k: specjax.Generator(model, spec=s, n_ctx=n_ctx) for k, s in specs.items()}

    def request(name: str) -> Any:
        kind, cfg = name.split("/")
        if kind == "generator":
            return generators[cfg].generate([ids], max_new_tokens=args.tokens)
        return specjax.generate(
            model, [ids], max_new_tokens=args.tokens, n_ctx=n_ctx, spec=specs[cfg]
        )

    names = [f"{kind}/{cfg}" for kind in ("generate", "generator") for cfg in specs]
    for name in names:  # compile (or load) first; a Generator's states then come from a call
        request(name)
        request(name)
    rows: dict[str, dict[str, list[float]]] = {
        n: {"wall_ms": [], "prefill_ms": [], "decode_ms": [], "faults": []} for n in names
    }
    tokens: dict[str, list[int]] = {}
    drafted: dict[str, int] = {}
    for rep in range(args.repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            f0, t0 = _faults(), time.perf_counter()
            out = request(name)
            wall, faults = time.perf_counter() - t0, _faults() - f0
            row = rows[name]
            row["wall_ms"].append(wall * 1e3)
            row["prefill_ms"].append(out.timings["prefill_seconds"] * 1e3)
            row["decode_ms"].append(out.timings["decode_seconds"] * 1e3)
            row["faults"].append(faults)
            tokens[name] = out.tokens[0]
            drafted[name] = (out.stats.to_dict() if out.stats is not None else {}).get(
                "num_draft_tokens", 0
            )

    kept: list[Any] = []
    rss_before = _rss_mb()
    for _ in range(args.keep):
        kept.append(request("generate/ngram-mod"))
    kept_results = {"results": args.keep, "rss_mb_before": rss_before, "rss_mb_after": _rss_mb()}
    del kept

    report_rows: dict[str, Any] = {}
    for name, row in rows.items():
        plain = rows[name.split("/")[0] + "/plain"]
        summary: dict[str, Any] = {}
        for key in ("wall_ms", "prefill_ms", "decode_ms"):
            summary[key + "_min"] = min(row[key])
            summary[key + "_median"] = statistics.median(row[key])
        summary["faults_median"] = statistics.median(row["faults"])
        summary["wall_vs_plain_paired"] = statistics.median(
            t / p for t, p in zip(row["wall_ms"], plain["wall_ms"])
        )
        summary["same_tokens_as_plain"] = tokens[name] == tokens["generate/plain"]
        summary["drafted_tokens_last_call"] = drafted[name]
        report_rows[name] = summary
    report = {
        "benchmark": "requests",
        "model": str(DEFAULT_TARGET.relative_to(DEFAULT_TARGET.parents[2])),
        "prompt": "main",
        "prompt_tokens": len(ids),
        "tokens": args.tokens,
        "n_ctx": n_ctx,
        "repeats": args.repeats,
        "machine": machine(),
        "configs": report_rows,
        "kept_results": kept_results,
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
