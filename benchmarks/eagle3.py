"""draft-eagle3 (models/code-eagle3) beside draft-simple (models/code-draft) on the validation files.

    python benchmarks/eagle3.py [--files 8] [--prompt-tokens 128] [--n-predict 128]
        [--repeats 2] [--out benchmarks/results/eagle3.json]

Prompts: the first `--prompt-tokens` tokens of `--files` validation files of the stdlib split
(every 50th file, `specjax.train.data.split_files`; files long enough, in path order), all rows in
one batch, greedy. Each case runs with the draft governor off (llama.cpp's behaviour: every
round drafts the full n_max), draft n_max = K for K in (4, 8). Reported per case: mean
acceptance length as llama.cpp prints it (1 + accepted / accept calls), acceptance rate per
draft position, tokens per target forward, decode tok/s and the speedup over plain decoding
measured in the same run (cases interleaved, `--repeats` times, medians). Every speculative
case's tokens are checked equal to plain decoding's. Prints JSON and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, ROOT, machine, refuse_overwrite

import specjax

DEFAULT_EAGLE3 = ROOT / "models" / "code-eagle3" / "code-eagle3-f16.gguf"


def validation_prompts(model: specjax.Model, n_files: int, n_tokens: int, need: int) -> list:
    """First `n_tokens` tokens (BOS + text) of the first `n_files` validation files that have
    at least `need` tokens."""
    from specjax.train.data import read_text, split_files, stdlib_files, stdlib_root

    _, val = split_files(stdlib_files())
    out = []
    for rel in val:
        ids = model.encode(read_text(Path(stdlib_root()) / rel))
        if len(ids) >= need:
            out.append((rel, ids[:n_tokens]))
        if len(out) == n_files:
            break
    return out


def run_case(model, draft, prompts, n_predict, spec) -> dict[str, Any]:
    res = specjax.generate(
        model, prompts, max_new_tokens=n_predict, temperature=0.0, spec=spec, draft=draft
    )
    t = res.timings
    stepped = int(t["generated_tokens"]) - len(prompts)
    out: dict[str, Any] = {
        "decode_tps": stepped / max(t["decode_seconds"], 1e-9),
        "tokens_per_forward": stepped / max(int(t["n_rounds"]), 1),
        "compile_seconds": t["compile_seconds"],
        "tokens": res.tokens,
    }
    if res.stats is not None:
        s = res.stats.to_dict()
        (d,) = s["drafters"].values()
        calls = max(d["n_call_accept"], 1)
        out.update(
            mean_acc_len=d["mean_acc_len"],
            acc_rate_per_pos=[x / calls for x in d["n_acc_tokens_per_pos"]],
            drafted=d["n_gen_tokens"],
            accepted=d["n_acc_tokens"],
            drafts=d["n_gen_drafts"],
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--eagle3", default=str(DEFAULT_EAGLE3))
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eagle3.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)

    model = specjax.load(args.model)
    simple = specjax.load(args.draft)
    eagle = specjax.load(args.eagle3)
    need = args.prompt_tokens + args.n_predict
    files = validation_prompts(model, args.files, args.prompt_tokens, need)
    prompts = [ids for _, ids in files]
    ks = [int(k) for k in args.ks.split(",")]
    cases: dict[str, tuple[Any, Any]] = {"plain": (None, None)}
    for k in ks:
        for name, draft in (("draft-simple", simple), ("draft-eagle3", eagle)):
            spec = specjax.SpecConfig(types=(name,), draft_n_max=k, adaptive=False)
            cases[f"{name}/K{k}"] = (spec, draft)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for spec, draft in cases.values():  # warm-up: compile
        run_case(model, draft, prompts, args.n_predict, spec)
    for rep in range(args.repeats):
        for name, (spec, draft) in cases.items():
            runs[name].append(run_case(model, draft, prompts, args.n_predict, spec))
            print(f"eagle3 bench: repeat {rep + 1} {name}", file=sys.stderr)
    plain_tps = statistics.median(r["decode_tps"] for r in runs["plain"])
    plain_tokens = runs["plain"][-1]["tokens"]
    report: dict[str, Any] = {
        "machine": machine(),
        "target": args.model,
        "draft_simple": {"path": args.draft, "params": simple.config.num_params()},
        "draft_eagle3": {"path": args.eagle3, "params": eagle.config.num_params()},
        "files": [rel for rel, _ in files],
        "prompt_tokens": args.prompt_tokens,
        "n_predict": args.n_predict,
        "plain_decode_tps": plain_tps,
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
    for k in ks:
        e, s = report["cases"][f"draft-eagle3/K{k}"], report["cases"][f"draft-simple/K{k}"]
        report[f"eagle3_over_simple_acc_len_K{k}"] = e["mean_acc_len"] / s["mean_acc_len"]
    text = json.dumps(report, indent=1, default=lambda x: np.asarray(x).tolist())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
