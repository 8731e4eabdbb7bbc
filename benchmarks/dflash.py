"""draft-dflash / draft-dspark (models/code-dflash, code-dspark) beside draft-eagle3 and
draft-simple on the validation files.

    python benchmarks/dflash.py [--files 6] [--prompt-tokens 128] [--n-predict 128]
        [--ks 4,7] [--p-min 0.5] [--repeats 1] [--out benchmarks/results/dflash.json]

Prompts: as benchmarks/eagle3.py (the first `--prompt-tokens` tokens of `--files` validation
files, all rows in one batch, greedy). Every case runs with the draft governor off (llama.cpp's
behaviour: every round drafts up to n_max), n_max = K for K in --ks (clamped by each head's
block: DFlash drafts at most block_size - 1, DSpark from the anchor block_size). DSpark runs
twice: without the confidence cut-off (p_min = 0) and with p_min = --p-min (the draft stops at
the first position whose confidence is below it). Reported per case: mean acceptance length
as llama.cpp prints it (1 + accepted / accept calls), acceptance rate per draft position,
drafted / accepted tokens, tokens per target forward, decode tok/s and the speedup over plain
decoding in the same run (cases interleaved, `--repeats` times, medians). Every speculative
case's tokens are checked equal to plain decoding's. Prints JSON, writes it to --out and a
PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, ROOT, machine, refuse_overwrite
from eagle3 import DEFAULT_EAGLE3, run_case, validation_prompts

import specjax

DEFAULT_DFLASH = ROOT / "models" / "code-dflash" / "code-dflash-f16.gguf"
DEFAULT_DSPARK = ROOT / "models" / "code-dspark" / "code-dspark-f16.gguf"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["cases"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = {
        "draft-simple": "tab:gray",
        "draft-eagle3": "tab:blue",
        "draft-dflash": "tab:orange",
        "draft-dspark": "tab:green",
    }
    col = [colors.get(n.split("/")[0], "tab:red") for n in names]
    for ax, key, title in (
        (axes[0], "mean_acc_len", "mean acceptance length (tau)"),
        (axes[1], "tokens_per_forward", "tokens per target forward"),
        (axes[2], "speedup_over_plain", "decode speedup over plain"),
    ):
        vals = [report["cases"][n][key] for n in names]
        ax.bar(range(len(names)), vals, color=col)
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
        if key == "speedup_over_plain":
            ax.axhline(1.0, color="k", lw=0.8)
    fig.suptitle(
        f"{len(report['files'])} validation prompts x {report['n_predict']} greedy tokens "
        f"({report['machine'].get('cpu', 'cpu')})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--eagle3", default=str(DEFAULT_EAGLE3))
    ap.add_argument("--dflash", default=str(DEFAULT_DFLASH))
    ap.add_argument("--dspark", default=str(DEFAULT_DSPARK))
    ap.add_argument("--files", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ks", default="4,7")
    ap.add_argument("--p-min", type=float, default=0.5, help="DSpark confidence cut-off")
    ap.add_argument("--no-simple", action="store_true", help="skip draft-simple")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dflash.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)
    if not 0.0 < args.p_min <= 1.0:
        raise SystemExit(f"dflash bench: --p-min must be in (0, 1], got {args.p_min}")

    model = specjax.load(args.model)
    heads: dict[str, Any] = {
        "draft-eagle3": specjax.load(args.eagle3),
        "draft-dflash": specjax.load(args.dflash),
        "draft-dspark": specjax.load(args.dspark),
    }
    if not args.no_simple:
        heads = {"draft-simple": specjax.load(args.draft), **heads}
    need = args.prompt_tokens + args.n_predict
    files = validation_prompts(model, args.files, args.prompt_tokens, need)
    prompts = [ids for _, ids in files]
    ks = [int(k) for k in args.ks.split(",")]
    cases: dict[str, tuple[Any, Any]] = {"plain": (None, None)}
    for k in ks:
        for name, draft in heads.items():
            spec = specjax.SpecConfig(types=(name,), draft_n_max=k, adaptive=False)
            cases[f"{name}/K{k}"] = (spec, draft)
            if name == "draft-dspark":
                spec = specjax.SpecConfig(
                    types=(name,), draft_n_max=k, adaptive=False, draft_p_min=args.p_min
                )
                cases[f"{name}/K{k}/p_min{args.p_min:g}"] = (spec, draft)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # n_max above a head's block: clamped, as upstream
        for spec, draft in cases.values():  # warm-up: compile
            run_case(model, draft, prompts, args.n_predict, spec)
        for rep in range(args.repeats):
            for name, (spec, draft) in cases.items():
                runs[name].append(run_case(model, draft, prompts, args.n_predict, spec))
                print(f"dflash bench: repeat {rep + 1} {name}", file=sys.stderr)
    plain_tps = statistics.median(r["decode_tps"] for r in runs["plain"])
    plain_tokens = runs["plain"][-1]["tokens"]
    report: dict[str, Any] = {
        "benchmark": "dflash",
        "machine": machine(),
        "target": args.model,
        "heads": {
            name: {
                "path": getattr(args, name.split("-")[1], args.draft),
                "params": m.config.num_params(),
            }
            for name, m in heads.items()
        },
        "files": [rel for rel, _ in files],
        "prompt_tokens": args.prompt_tokens,
        "n_predict": args.n_predict,
        "p_min": args.p_min,
        "plain_decode_tps": plain_tps,
        "plain_tokens_per_forward": runs["plain"][-1]["tokens_per_forward"],
        "cases": {},
    }
    for name, rs in runs.items():
        if name == "plain":
            continue
        last = rs[-1]
        tps = statistics.median(r["decode_tps"] for r in rs)
        report["cases"][name] = {
            "mean_acc_len": last["mean_acc_len"],
            "acc_rate_per_pos": [round(x, 4) for x in last["acc_rate_per_pos"]],
            "drafted": last["drafted"],
            "accepted": last["accepted"],
            "tokens_per_forward": last["tokens_per_forward"],
            "decode_tps": tps,
            "speedup_over_plain": tps / plain_tps,
            "same_tokens_as_plain": last["tokens"] == plain_tokens,
        }
    c = report["cases"]
    for k in ks:
        e = c[f"draft-eagle3/K{k}"]["mean_acc_len"]
        report[f"dflash_over_eagle3_acc_len_K{k}"] = c[f"draft-dflash/K{k}"]["mean_acc_len"] / e
        report[f"dspark_over_eagle3_acc_len_K{k}"] = c[f"draft-dspark/K{k}"]["mean_acc_len"] / e
    text = json.dumps(report, indent=1, default=lambda x: np.asarray(x).tolist())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    plot(report, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
