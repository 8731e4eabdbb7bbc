"""Speculative vs plain decoding on the shipped models. Prints JSON, writes a PNG plot.

    python benchmarks/speculative.py [--batches 1,4,16] [--drafters all] [--tokens 96]
                                     [--temperature 0] [--out benchmarks/results/speculative.json]

For each workload, drafter chain and batch size: tokens/s of speculative and plain decoding
measured in the same run (best of --repeats after a warm-up that compiles), mean acceptance
length, per-position acceptance, and target forwards per generated token (the
hardware-independent speed-up). `--temperature T > 0` samples with llama.cpp's other defaults
(top_k 40, top_p 0.95, min_p 0.05, seed 1; rejection sampling on the speculative side).
Workloads:
  code-edit   a function from a validation file, then a request to write it again with a
              rename: the answer repeats the prompt, where n-gram drafting should shine;
  open-ended  the start of a validation file: continuation with little repetition.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    load_or_random,
    machine,
    peak_memory,
    refuse_overwrite,
)

import specjax
from specjax.config import SpecConfig

CHAINS: dict[str, tuple[str, ...]] = {
    "draft-simple": ("draft-simple",),
    "ngram-simple": ("ngram-simple",),
    "ngram-map-k": ("ngram-map-k",),
    "ngram-map-k4v": ("ngram-map-k4v",),
    "ngram-mod": ("ngram-mod",),
    "ngram-cache": ("ngram-cache",),
    "ngram-mod+draft-simple": ("ngram-mod", "draft-simple"),
}


def _validation_sources(n: int) -> list[str]:
    """Held-out stdlib files (the training split's validation files) that define functions."""
    from specjax.train.data import read_texts, split_files, stdlib_files

    _, val = split_files(stdlib_files())
    return [text for text in read_texts(val) if "\ndef " in text][:n]


def workloads(batch: int) -> dict[str, list[str]]:
    sources = _validation_sources(max(batch, 4))
    edit, open_ended = [], []
    for text in sources:
        start = text.index("\ndef ") + 1
        end = text.find("\n\n", start)
        func = text[start : end if end > 0 else start + 600][:600]
        name = func[4 : func.index("(")] if "(" in func else "f"
        edit.append(
            f"{func}\n\n\n# The same function again, renamed to {name}_v2:\n"
            f"def {name}_v2{func[4 + len(name) : func.index(':') + 1 if ':' in func else 0]}"
        )
        open_ended.append(text[:400])
    return {"code-edit": (edit * batch)[:batch], "open-ended": (open_ended * batch)[:batch]}


def run_one(model, draft, prompts, spec, tokens, repeats, temperature=0.0) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    if temperature > 0:
        sampling = dict(temperature=temperature, top_k=40, top_p=0.95, min_p=0.05, seed=1)

    def once() -> Any:
        return specjax.generate(
            model, prompts, max_new_tokens=tokens, spec=spec, draft=draft, **sampling
        )

    once()  # compile
    runs = [once() for _ in range(repeats)]
    best = min(runs, key=lambda r: r.timings["decode_seconds"])
    t = best.timings
    rows = len(prompts)
    out: dict[str, Any] = {
        "tokens_per_second": t["tokens_per_second"],
        "decode_seconds": t["decode_seconds"],
        "generated_tokens": t["generated_tokens"],
        "target_forwards_per_token": t["n_rounds"] * rows / max(t["generated_tokens"], 1),
    }
    if best.stats is not None:
        s = best.stats.to_dict()
        out.update(
            mean_acceptance_length=s["mean_acceptance_length"],
            acceptance_rate=s["acceptance_rate"],
            acceptance_rate_per_position=s["acceptance_rate_per_position"][:16],
            num_drafts=s["num_drafts"],
            num_draft_tokens=s["num_draft_tokens"],
        )
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads_seen = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(
        1, len(workloads_seen), figsize=(6 * len(workloads_seen), 4), squeeze=False
    )
    for ax, wl in zip(axes[0], workloads_seen):
        rows = [r for r in results if r["workload"] == wl]
        chains = sorted({r["chain"] for r in rows})
        batches = sorted({r["batch"] for r in rows})
        width = 0.8 / max(len(batches), 1)
        for j, b in enumerate(batches):
            ys = [
                next((r["speedup"] for r in rows if r["chain"] == c and r["batch"] == b), 0)
                for c in chains
            ]
            ax.bar([i + j * width for i in range(len(chains))], ys, width, label=f"B={b}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(chains))])
        ax.set_xticklabels(chains, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speed-up vs plain (same run)")
        ax.set_title(wl)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--drafters", default="all", help="comma list of chain names, or 'all'")
    ap.add_argument("--workloads", default="code-edit,open-ended")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--n-max", type=int, default=3, help="--spec-draft-n-max")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "speculative.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)

    model, model_name = load_or_random(args.model)
    draft, draft_name = load_or_random(args.draft)
    chains = CHAINS if args.drafters == "all" else {c: CHAINS[c] for c in args.drafters.split(",")}
    results: list[dict[str, Any]] = []
    for batch in (int(b) for b in args.batches.split(",")):
        loads = workloads(batch)
        for wl in args.workloads.split(","):
            prompts = loads[wl]
            plain = run_one(model, None, prompts, None, args.tokens, args.repeats, args.temperature)
            for name, types in chains.items():
                spec = SpecConfig(types=types, draft_n_max=args.n_max)
                r = run_one(
                    model, draft, prompts, spec, args.tokens, args.repeats, args.temperature
                )
                r.update(
                    workload=wl,
                    chain=name,
                    batch=batch,
                    plain_tokens_per_second=plain["tokens_per_second"],
                    speedup=r["tokens_per_second"] / plain["tokens_per_second"],
                )
                results.append(r)
                print(
                    f"{wl:10s} B={batch:2d} {name:24s} {r['speedup']:.2f}x "
                    f"mean_len={r.get('mean_acceptance_length', 1):.2f}",
                    file=sys.stderr,
                )
    report = {
        "benchmark": "speculative",
        "model": model_name,
        "draft": draft_name,
        "tokens": args.tokens,
        "temperature": args.temperature,
        "machine": machine(),
        "results": results,
        "memory": peak_memory(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
