"""Where a decode step's time goes on an accelerator: a profile summary, and XLA flag variants.

    python benchmarks/gpu_profile.py [--size 1b|tiny] [--dir DIR] [--tokens 128] [--prompt 128]
                                     [--batch 1] [--variants default,graphs,...]
                                     [--out benchmarks/results/gpu-profile.json]

The first accelerator run (benchmarks/results/gpu-h200.json) decoded the ~1B random-init
Llama of benchmarks/gpu.py at 1.89 ms per token at B=1: 29% of the measured memory bandwidth
(reading the weights once takes ~0.56 ms), and a 2-layer draft step cost ~0.75 ms. This
script says why, in one prepared run:

1. writes the GGUF once (`--dir`, shared with the variants);
2. for each variant (a child process: XLA flags are read at start), decodes greedily at
   `--batch` rows and reports the step time; the variants (`VARIANTS`) switch XLA's CUDA
   graphs (command buffers) on for more kinds of work, loops and conditionals included;
3. under the default flags, profiles one decode (`jax.profiler`) and summarises the trace
   per process lane: events per step, busy time per step (the union of the lane's events),
   and the 25 names that take the most time, with counts per step. On a GPU the device lanes
   hold the kernels: busy time against the step time is the gap launch overhead and host
   round trips leave, and the kernel names say which parts of a layer cost what.

On a CPU, `--size tiny` smoke-tests the same steps (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, machine, profiled, refuse_overwrite
from gpu import SIZES, model_dir, write_gguf

#: XLA flag sets tried, each in its own process (the default first).
VARIANTS: dict[str, str] = {
    "default": "",
    "graphs": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,"
    "CONDITIONAL --xla_gpu_graph_min_graph_size=1",
    "no_graphs": "--xla_gpu_enable_command_buffer=",
}


def decoder(target_path: Path, batch: int, prompt: int, tokens: int) -> Callable[[], Any]:
    """A thunk running one greedy decode of random prompts (the model loaded once)."""
    import numpy as np

    import specjax

    model = dataclasses.replace(specjax.load(str(target_path)), eog=())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.V, prompt).tolist() for _ in range(batch)]
    n_ctx = 1 << (prompt + tokens).bit_length()
    return lambda: specjax.generate(model, prompts, max_new_tokens=tokens, n_ctx=n_ctx)


def decode_step_seconds(run: Callable[[], Any]) -> dict:
    """The median of 3 decodes after one that compiles."""
    first = run()
    runs = sorted((run() for _ in range(3)), key=lambda r: r.timings["decode_seconds"])
    mid = runs[1].timings
    return {
        "step_seconds": mid["decode_seconds"] / max(mid["n_rounds"], 1),
        "tokens_per_second": mid["tokens_per_second"],
        "compile_seconds": first.timings["compile_seconds"],
    }


def profile_summary(run: Callable[[], Any]) -> dict:
    """One profiled decode (compiled before), summarised per process lane of the trace (see
    the docstring)."""
    run()  # compiled outside the trace
    result, events = profiled(run)
    lanes = {
        e["pid"]: e.get("args", {}).get("name", str(e["pid"]))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    loop = [e for e in spans if e["name"].startswith("PjitFunction(jit(generate_loop")]
    start = max(e["ts"] for e in loop) if loop else min(e["ts"] for e in spans)
    steps = max(int(result.timings.get("n_rounds", 0)), 1)
    # the decode's own events: from the loop's dispatch to its end (with slack for the last
    # kernels), not the profiler's teardown or Python's spans
    stop = start + 1.5e6 * result.timings["decode_seconds"] + 1e3
    by_lane: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in spans:
        if start <= e["ts"] and e["ts"] + e["dur"] <= stop and not e["name"].startswith("$"):
            by_lane[e["pid"]].append(e)
    summary = {}
    for pid, evs in by_lane.items():
        evs.sort(key=lambda e: e["ts"])
        busy, end = 0.0, -1.0
        for e in evs:  # the union of the lane's intervals
            lo, hi = max(e["ts"], end), e["ts"] + e["dur"]
            busy += max(hi - lo, 0.0)
            end = max(end, hi)
        total = collections.Counter()
        count = collections.Counter()
        for e in evs:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
        summary[lanes.get(pid, str(pid))] = {
            "events_per_step": len(evs) / steps,
            "busy_us_per_step": busy / steps,
            "span_us_per_step": (evs[-1]["ts"] + evs[-1]["dur"] - evs[0]["ts"]) / steps,
            "top": [
                {"name": n[:120], "us_per_step": t / steps, "per_step": count[n] / steps}
                for n, t in total.most_common(25)
            ],
        }
    return {
        "steps": steps,
        "decode_seconds": result.timings["decode_seconds"],
        "lanes": summary,
    }


def child(args: argparse.Namespace) -> None:
    """One variant: its step time (and, for `--profile`, the profile summary) as JSON."""
    run = decoder(Path(args.target), args.batch, args.prompt, args.tokens)
    out: dict[str, Any] = decode_step_seconds(run)
    if args.profile:
        out["profile"] = profile_summary(run)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dir", default=None, help="where to write the GGUF (default: a temp dir)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu-profile.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    ap.add_argument("--target", help=argparse.SUPPRESS)  # child mode: the GGUF to decode
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.target:
        child(args)
        return
    refuse_overwrite(args.out, args.overwrite)
    from specjax.io.tokenizer import Tokenizer

    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    result: dict[str, Any] = {
        "benchmark": "gpu_profile",
        "size": args.size,
        "batch": args.batch,
        "machine": machine(),
        "variants": {},
    }
    with model_dir(args.dir) as d:
        target = d / "target-f16.gguf"
        if not target.exists():
            tokenizer = Tokenizer.from_file(ROOT / "models" / "tokenizer")
            write_gguf(target, SIZES[args.size][0], tokenizer, seed=0)
        for name in variants:
            env = dict(os.environ)
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {VARIANTS[name]}".strip()
            env["PYTHONUNBUFFERED"] = "1"
            cmd = [sys.executable, __file__, "--target", str(target)]
            cmd += ["--batch", str(args.batch), "--prompt", str(args.prompt)]
            cmd += ["--tokens", str(args.tokens)] + (["--profile"] if name == "default" else [])
            try:
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=args.timeout
                )
            except subprocess.TimeoutExpired:
                result["variants"][name] = {"error": f"over {args.timeout} s"}
                continue
            if proc.returncode != 0:
                result["variants"][name] = {"error": proc.stderr[-1500:]}
            else:
                result["variants"][name] = json.loads(proc.stdout.strip().splitlines()[-1])
            result["variants"][name]["xla_flags"] = VARIANTS[name]
            print(
                name,
                {k: v for k, v in result["variants"][name].items() if k != "profile"},
                file=sys.stderr,
            )
            emit(result, args.out, partial=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()
