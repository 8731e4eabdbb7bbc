"""The draft heads' benchmarks. Modes:

    python benchmarks/heads.py accept [--heads draft-simple,draft-eagle3,draft-dflash,draft-dspark]
        [--files 6] [--prompt-tokens 128] [--n-predict 128] [--ks 4,7] [--p-min 0.5]
        [--repeats 1] [--out benchmarks/results/heads.json] [--overwrite]
    python benchmarks/heads.py mtp [--model models/code-hybrid/code-hybrid-f16.gguf]
        [--prompt benchmarks/prompts/repetitive.py] [--new 128] [--n-max 3] [--repeats 2]

`accept`: the shipped heads (draft-eagle3: models/code-eagle3, draft-dflash / draft-dspark:
models/code-dflash, code-dspark) beside draft-simple (models/code-draft) on the validation
files. Prompts: the first `--prompt-tokens` tokens of `--files` validation files of the stdlib
split (every 50th file, `specjax.train.data.split_files`; files long enough, in path order),
all rows in one batch, greedy. Every case runs with the draft governor off (llama.cpp's
behaviour: every round drafts up to n_max), n_max = K for K in --ks (clamped by each head's
block: DFlash drafts at most block_size - 1, DSpark from the anchor block_size). DSpark runs
twice: without the confidence cut-off (p_min = 0) and with p_min = --p-min (the draft stops at
the first position whose confidence is below it). Reported per case: mean acceptance length as
llama.cpp prints it (1 + accepted / accept calls), acceptance rate per draft position,
drafted / accepted tokens, tokens per target forward, decode tok/s and the speedup over plain
decoding in the same run (cases interleaved, `--repeats` times, medians), and the acceptance
length ratios of each head to the one before it (eagle3 / simple, dflash and dspark / eagle3)
at each K. Every speculative case's tokens are checked equal to plain decoding's. Prints JSON,
writes it to --out and a PNG beside it. benchmarks/results/heads.json (+ PNG) is the
default run (recorded by the former benchmarks/dflash.py, the same cases);
benchmarks/results/heads-eagle3.json is `accept --heads draft-simple,draft-eagle3 --ks 4,8
--files 6 --repeats 1` (recorded by the former benchmarks/eagle3.py, with its key names:
`draft_simple`, `draft_eagle3` instead of `heads`).

`mtp`: draft-mtp on the hybrid target: specjax vs llama.cpp's `llama-speculative-simple
--spec-type draft-mtp` on the same GGUF (its own nextn block is the drafter) and the same
prompt at temperature 0. Both sides run the RS path as upstream does for draft-mtp (n_rs_seq =
draft n_max, so no draft needs a checkpoint). The compared number is the mean acceptance
length, 1 + accepted draft tokens / verification rounds (llama.cpp's statistics line: 1 + #acc
tokens / #calls(a)); `llama_cpp` is null without SPECJAX_LLAMACPP_BIN. Speed (specjax, this
machine, one row): tokens/s of draft-mtp and of plain greedy decoding, best of --repeats after
a compile run, interleaved. Prints one JSON object (tests/test_mtp_llamacpp.py runs its
functions).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    ROOT,
    llamacpp_prompt_ids,
    machine,
    mode_parser,
    refuse_overwrite,
    run_mode,
)
from peers import DEFAULT_DFLASH, DEFAULT_DSPARK, DEFAULT_EAGLE3

import specjax
from specjax.api import generate
from specjax.config import SpecConfig

#: The drafters `accept` compares, with their shipped drafts / heads.
HEADS = {
    "draft-simple": DEFAULT_DRAFT,
    "draft-eagle3": DEFAULT_EAGLE3,
    "draft-dflash": DEFAULT_DFLASH,
    "draft-dspark": DEFAULT_DSPARK,
}
#: Acceptance-length ratios `accept` reports: (head, the one it is compared with).
RATIOS = (
    ("draft-eagle3", "draft-simple"),
    ("draft-dflash", "draft-eagle3"),
    ("draft-dspark", "draft-eagle3"),
)
MODEL = ROOT / "models" / "code-hybrid" / "code-hybrid-f16.gguf"
PROMPT = ROOT / "benchmarks" / "prompts" / "repetitive.py"
STATS = re.compile(
    r"statistics\s+draft-mtp:\s*#calls\(b,g,a\)\s*=\s*\d+\s+\d+\s+(\d+),.*?"
    r"#gen tokens\s*=\s*(\d+),\s*#acc tokens\s*=\s*(\d+)"
)


# ------------------------------------------------------------------------------- accept
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


def accept(argv: list[str]) -> None:
    ap = mode_parser("accept", "shipped heads beside draft-simple on the validation files")
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--heads", default=",".join(HEADS), help="drafter types to compare")
    for name, path in HEADS.items():
        ap.add_argument(f"--{name.split('-')[1]}", default=str(path), help=f"{name}'s GGUF")
    ap.add_argument("--files", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ks", default="4,7")
    ap.add_argument("--p-min", type=float, default=0.5, help="DSpark confidence cut-off")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "heads.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    refuse_overwrite(args.out, args.overwrite)
    if not 0.0 < args.p_min <= 1.0:
        raise SystemExit(f"heads bench: --p-min must be in (0, 1], got {args.p_min}")
    names = [n for n in args.heads.split(",") if n]
    unknown = sorted(set(names) - set(HEADS))
    if unknown:
        raise SystemExit(f"heads bench: unknown --heads {unknown}; known: {', '.join(HEADS)}")

    model = specjax.load(args.model)
    paths = {name: getattr(args, name.split("-")[1]) for name in names}
    heads = {name: specjax.load(path) for name, path in paths.items()}
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
                print(f"heads bench: repeat {rep + 1} {name}", file=sys.stderr)
    plain_tps = statistics.median(r["decode_tps"] for r in runs["plain"])
    plain_tokens = runs["plain"][-1]["tokens"]
    report: dict[str, Any] = {
        "benchmark": "heads",
        "machine": machine(),
        "target": args.model,
        "heads": {
            name: {"path": paths[name], "params": m.config.num_params()}
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
        for head, base in RATIOS:
            if head in heads and base in heads:
                key = f"{head.split('-')[1]}_over_{base.split('-')[1]}_acc_len_K{k}"
                report[key] = c[f"{head}/K{k}"]["mean_acc_len"] / c[f"{base}/K{k}"]["mean_acc_len"]
    text = json.dumps(report, indent=1, default=lambda x: np.asarray(x).tolist())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    plot(report, out.with_suffix(".png"))
    print(text)


# ------------------------------------------------------------------------------- mtp
def prompt_ids(model: Any, path: Path) -> list[int]:
    """llama.cpp's `-f` prompt: the file minus one trailing newline, BOS first."""
    return llamacpp_prompt_ids(model, path.read_text())


def llama_cpp(model: Path, prompt: Path, n_new: int, n_max: int, n_ctx: int) -> dict | None:
    """Run llama-speculative-simple and parse its draft-mtp statistics (None: no binary)."""
    bin_dir = os.environ.get("SPECJAX_LLAMACPP_BIN")
    tool = shutil.which("llama-speculative-simple", path=bin_dir) if bin_dir else None
    if not tool:
        return None
    cmd = [
        tool,
        *("-m", str(model), "--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)),
        *("-f", str(prompt), "-n", str(n_new), "--temp", "0", "-c", str(n_ctx), "-t", "2"),
        *("--seed", "0", "-lv", "4"),
    ]
    # llama.cpp's logger thread is not joined at exit (issue #22142): the statistics line is
    # sometimes lost on a busy machine; such a run is repeated.
    for _ in range(6):
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_WAIT_POLICY": "passive"},
            timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"llama-speculative-simple failed: {proc.stderr[-800:]}")
        m = STATS.search(proc.stderr)
        if m:
            calls, gen, acc = (int(g) for g in m.groups())
            return {
                "command": " ".join(cmd),
                "rounds": calls,
                "num_draft_tokens": gen,
                "num_accepted_tokens": acc,
                "mean_acceptance_length": 1 + acc / calls if calls else 1.0,
            }
    raise RuntimeError("llama-speculative-simple printed no draft-mtp statistics")


def specjax_mtp(
    model: Any, ids: list[int], n_new: int, n_max: int, n_ctx: int, repeats: int
) -> dict:
    spec = SpecConfig(types=("draft-mtp",), draft_n_max=n_max)

    def spec_run() -> Any:
        return generate(model, [ids], max_new_tokens=n_new, n_ctx=n_ctx, spec=spec)

    def plain_run() -> Any:
        return generate(model, [ids], max_new_tokens=n_new, n_ctx=n_ctx)

    res, plain = spec_run(), plain_run()  # compile
    best = {"spec": float("inf"), "plain": float("inf")}
    for _ in range(repeats):
        for name, fn in (("spec", spec_run), ("plain", plain_run)):
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    d = res.stats.to_dict()
    n_tok = len(res.tokens[0])
    return {
        "same_tokens_as_plain": res.tokens == plain.tokens,
        "generated": n_tok,
        "rounds": d["num_drafts"],
        "num_draft_tokens": d["num_draft_tokens"],
        "num_accepted_tokens": d["num_accepted_tokens"],
        "mean_acceptance_length": d["mean_acceptance_length"],
        "rollback": d["rollback"],
        "seq_rm_type": d["seq_rm_type"],
        "n_rs_seq": d["n_rs_seq"],
        "tokens_per_s": n_tok / best["spec"],
        "plain_tokens_per_s": n_tok / best["plain"],
    }


def mtp(argv: list[str]) -> None:
    ap = mode_parser("mtp", "draft-mtp on the hybrid target, specjax and llama.cpp")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--prompt", default=str(PROMPT))
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--n-max", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    model = specjax.load(args.model)
    ids = prompt_ids(model, Path(args.prompt))
    ours = specjax_mtp(model, ids, args.new, args.n_max, args.ctx, args.repeats)
    peer = llama_cpp(Path(args.model), Path(args.prompt), args.new, args.n_max, args.ctx)
    out: dict[str, Any] = {
        "model": args.model,
        "prompt": args.prompt,
        "prompt_tokens": len(ids),
        "n_new": args.new,
        "draft_n_max": args.n_max,
        "specjax": ours,
        "llama_cpp": peer,
    }
    if peer is not None:
        out["acceptance_length_ratio"] = (
            ours["mean_acceptance_length"] / peer["mean_acceptance_length"]
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_mode({"accept": accept, "mtp": mtp}, __doc__)
