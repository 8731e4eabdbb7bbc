"""draft-mtp on the hybrid target: specjax vs llama.cpp's `llama-speculative-simple --spec-type
draft-mtp` on the same GGUF (its own nextn block is the drafter) and the same prompt at
temperature 0. Prints one JSON object.

    python benchmarks/mtp.py [--model models/code-hybrid/code-hybrid-f16.gguf]
        [--prompt benchmarks/prompts/repetitive.py] [--new 128] [--n-max 3] [--repeats 2]

Both sides run the RS path as upstream does for draft-mtp (n_rs_seq = draft n_max, so no draft
needs a checkpoint). The compared number is the mean acceptance length, 1 + accepted draft
tokens / verification rounds (llama.cpp's statistics line: 1 + #acc tokens / #calls(a));
`llama_cpp` is null without SPECJAX_LLAMACPP_BIN. Speed (specjax, this machine, one row):
tokens/s of draft-mtp and of plain greedy decoding, best of --repeats after a compile run,
interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import specjax
from specjax.api import generate
from specjax.config import SpecConfig

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "code-hybrid" / "code-hybrid-f16.gguf"
PROMPT = ROOT / "benchmarks" / "prompts" / "repetitive.py"
STATS = re.compile(
    r"statistics\s+draft-mtp:\s*#calls\(b,g,a\)\s*=\s*\d+\s+\d+\s+(\d+),.*?"
    r"#gen tokens\s*=\s*(\d+),\s*#acc tokens\s*=\s*(\d+)"
)


def prompt_ids(model: Any, path: Path) -> list[int]:
    """llama.cpp's `-f` prompt: the file minus one trailing newline, BOS first."""
    text = path.read_text()
    text = text[:-1] if text.endswith("\n") else text
    return [int(model.tokenizer.bos_id), *model.tokenizer.encode(text)]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--prompt", default=str(PROMPT))
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--n-max", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
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
    main()
