"""On an accelerator: decode of a ~1B random-init Llama GGUF against its memory bandwidth
(`decode`, the default mode), and where a decode step's time goes (`profile`).

    python benchmarks/gpu.py [decode] [--size 1b|tiny] [--dir DIR] [--tokens 256] [--prompt 128]
                             [--batches 1,32] [--out benchmarks/results/gpu.json]
    python benchmarks/gpu.py profile [--size 1b|tiny] [--dir DIR] [--tokens 128] [--prompt 128]
                                     [--batch 1] [--variants default,graphs,...]
                                     [--out benchmarks/results/gpu-profile.json]

## `decode`

The speed issue's accelerator goal, as one prepared script. It:

1. writes a random-init Llama GGUF (F16; `--size 1b`: L=16, D=2048, 32 heads / 8 KV heads,
   F=8192, V=32000, ~1.1B parameters) and a small random draft GGUF with the same
   vocabulary into `--dir` (default: a temporary directory, deleted at the end; these
   files are never committed), both with the shipped tokenizer;
2. loads them with `specjax.load`, as a user would (the file's dtype on accelerators);
3. measures the device's memory bandwidth in the same run: a jitted sum over a 2 GiB
   buffer and `x + 1` over it, bytes moved / seconds (the best of 20; the higher of the two);
4. decodes greedily at each batch size (`--batches`, default 1 and 32; random prompts of
   `--prompt` tokens, `--tokens` new tokens, end-of-generation ids off so every row runs to
   the end) and reports tokens/s, the step time (decode seconds / rounds) and the fraction
   of the measured bandwidth the step reaches: bytes per step = every weight matrix read
   once (the embedding: one row per token) + the K/V cells in use, read once per row
   (averaged over the run), over the step time;
5. decodes speculatively with draft-simple, K=4 (`draft_n_max=4`, `draft_n_min=0`,
   `draft_p_min=0`, so every round drafts 4 tokens) and synthetic acceptance length 3.5
   (llama.cpp's `--spec-synthetic-acceptance-length`: acceptance is drawn, not checked, so
   the tokens are not the model's), and reports its speed-up over plain decoding at the
   same batch size, with the mean acceptance length it reached, plus the verify forward's
   cost (K+1 tokens) against a 1-token step, measured alone.

Goals (issue 8): >= 70% of bandwidth at B=1 and >= 2x speed-up. On a CPU, `--size tiny`
runs the same steps on a small model in seconds (a smoke run; its numbers mean nothing).

## `profile`

The first accelerator run (benchmarks/results/gpu-h200.json) decoded the ~1B random-init
Llama of `decode` at 1.89 ms per token at B=1: 29% of the measured memory bandwidth
(reading the weights once takes ~0.56 ms), and a 2-layer draft step cost ~0.75 ms. This
mode says why, in one prepared run:

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
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    ROOT,
    best_of,
    emit,
    forward_timer,
    machine,
    mode_parser,
    peak_memory,
    profiled,
    refuse_overwrite,
    run_mode,
)

import specjax
from specjax.config import SpecConfig
from specjax.io.gguf_io import save_gguf
from specjax.io.tokenizer import Tokenizer
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params

SIZES: dict[str, tuple[ModelConfig, ModelConfig]] = {
    "1b": (
        ModelConfig(
            vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192
        ),
        ModelConfig(vocab_size=32000, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=768),
    ),
    "tiny": (
        ModelConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768),
        ModelConfig(vocab_size=4096, dim=64, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=128),
    ),
}
ACCEPTANCE_LENGTH = 3.5
K = 4


def write_gguf(path: Path, config: ModelConfig, tokenizer: Tokenizer, seed: int) -> float:
    """Random-init weights (`init_params`) saved as an F16 GGUF; returns the seconds taken."""
    t = time.perf_counter()
    params = jax.device_get(init_params(config, jax.random.PRNGKey(seed)))
    save_gguf(path, config, params, tokenizer, dtype="f16")
    return time.perf_counter() - t


def memory_bandwidth(n_bytes: int = 2 << 30) -> dict[str, float]:
    """Bytes/s moved by a jitted sum over an `n_bytes` float32 buffer (reads) and by `x + 1`
    (reads and writes), the best of 20 each; `best` is the higher, the one fractions use."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    out = {}
    for name, fn, moved in (("sum", jnp.sum, n_bytes), ("add", lambda a: a + 1, 2 * n_bytes)):
        f = jax.jit(fn)
        jax.block_until_ready(f(x))
        seconds, _ = best_of(lambda f=f: f(x), 20)
        out[name] = moved / seconds
    out["best"] = max(out["sum"], out["add"])
    return out


def weight_bytes_per_step(model: specjax.Model, batch: int) -> int:
    """Bytes of the weights one decode step reads: every matrix once, one embedding row per
    token (a tied embedding is read whole by the LM head)."""
    total = 0
    for layer in model.params["layers"]:
        total += sum(int(w.nbytes) for w in layer.values())
    total += int(model.params["final_norm"].nbytes)
    embed = model.params["embed"]
    if model.config.tie_embeddings:
        total += int(embed.nbytes)
    else:
        total += int(model.params["lm_head"].nbytes)
        total += batch * int(embed.nbytes) // embed.shape[0]
    return total


def kv_bytes_per_cell(model: specjax.Model) -> int:
    """K and V bytes of one cell over all layers (F16 cache, the default)."""
    c = model.config
    return c.L * 2 * c.G * c.E * 2


@contextlib.contextmanager
def model_dir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory(prefix="specjax-gpu-") as d:
            yield Path(d)


def decode(
    model: specjax.Model,
    prompts: list[list[int]],
    n_tokens: int,
    n_ctx: int,
    spec: SpecConfig | None = None,
    draft: specjax.Model | None = None,
    repeats: int = 3,
) -> dict[str, Any]:
    """The median of `repeats` runs after one that compiles."""
    kw: dict[str, Any] = dict(max_new_tokens=n_tokens, n_ctx=n_ctx, spec=spec, draft=draft)
    first = specjax.generate(model, prompts, **kw)
    runs = [specjax.generate(model, prompts, **kw) for _ in range(repeats)]
    runs.sort(key=lambda r: r.timings["decode_seconds"])
    mid = runs[len(runs) // 2]
    out: dict[str, Any] = {
        "tokens_per_second": mid.timings["tokens_per_second"],
        "tokens_per_second_runs": [r.timings["tokens_per_second"] for r in runs],
        "decode_seconds": mid.timings["decode_seconds"],
        "rounds": mid.timings["n_rounds"],
        "step_seconds": mid.timings["decode_seconds"] / max(mid.timings["n_rounds"], 1),
        "generated_tokens": mid.timings["generated_tokens"],
        "compile_seconds": first.timings["compile_seconds"],
    }
    if mid.stats is not None:
        s = mid.stats.to_dict()
        out["mean_acceptance_length"] = s["mean_acceptance_length"]
        out["acceptance_rate"] = s["acceptance_rate"]
    return out


def verify_over_step(model: specjax.Model, n_ctx: int, prompt: int) -> dict[str, float]:
    """Wall time of a (K+1)-token target forward over a 1-token step, same cache."""
    ids = [t % model.config.V for t in range(prompt)]
    seconds = {}
    for width in (1, K + 1):
        timer = forward_timer(model, ids, width, n_ctx)
        seconds[width] = statistics.median(timer() for _ in range(5))
    return {
        "step_seconds_T1": seconds[1],
        f"step_seconds_T{K + 1}": seconds[K + 1],
        f"verify_K{K}_over_step": seconds[K + 1] / seconds[1],
    }


def decode_main(argv: list[str]) -> None:
    ap = mode_parser("decode", "decode of a random-init Llama against the memory bandwidth")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dir", default=None, help="where to write the GGUFs (default: a temp dir)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    refuse_overwrite(args.out, args.overwrite)
    batches = [int(b) for b in args.batches.split(",")]
    target_config, draft_config = SIZES[args.size]
    tokenizer = Tokenizer.from_file(ROOT / "models" / "tokenizer")
    n_ctx = 1 << (args.prompt + args.tokens + K + 1).bit_length()  # a power of two above it

    result: dict[str, Any] = {"benchmark": "gpu", "size": args.size, "machine": machine()}
    with model_dir(args.dir) as d:
        target_path, draft_path = d / "target-f16.gguf", d / "draft-f16.gguf"
        result["write_seconds"] = write_gguf(target_path, target_config, tokenizer, seed=0)
        write_gguf(draft_path, draft_config, tokenizer, seed=1)
        # random weights: no end-of-generation, so every row decodes --tokens tokens
        target = dataclasses.replace(specjax.load(str(target_path)), eog=())
        draft = dataclasses.replace(specjax.load(str(draft_path)), eog=())
        file_bytes = target_path.stat().st_size
    result["target"] = {
        "params_millions": target.config.num_params() / 1e6,
        "dtype": target.config.dtype,
        "file_bytes": file_bytes,
    }
    result["draft_params_millions"] = draft.config.num_params() / 1e6
    measured = memory_bandwidth()
    result["memory_bandwidth_bytes_per_second"] = measured
    bandwidth = measured["best"]
    result["n_ctx"] = n_ctx
    spec = SpecConfig(
        types=("draft-simple",),
        draft_n_max=K,
        draft_n_min=0,
        draft_p_min=0.0,
        synth_len=ACCEPTANCE_LENGTH,
    )
    rng = np.random.default_rng(0)
    cell = kv_bytes_per_cell(target)
    for batch in batches:
        prompts = [
            rng.integers(3, tokenizer.vocab_size, args.prompt).tolist() for _ in range(batch)
        ]
        plain = decode(target, prompts, args.tokens, n_ctx, repeats=args.repeats)
        # cells read per row: the prompt plus the tokens written before each step, on average
        mean_cells = args.prompt + (args.tokens - 1) / 2
        step_bytes = weight_bytes_per_step(target, batch) + batch * mean_cells * cell
        plain["bytes_per_step"] = step_bytes
        plain["bandwidth_fraction"] = step_bytes / plain["step_seconds"] / bandwidth
        speculative = decode(target, prompts, args.tokens, n_ctx, spec, draft, args.repeats)
        speculative["speedup_over_plain"] = (
            speculative["tokens_per_second"] / plain["tokens_per_second"]
        )
        result[f"B{batch}"] = {"plain": plain, "speculative": speculative}
        print(
            f"B={batch}: plain {plain['tokens_per_second']:.0f} tok/s "
            f"({plain['bandwidth_fraction']:.0%} of bandwidth), speculative x"
            f"{speculative['speedup_over_plain']:.2f}",
            file=sys.stderr,
        )
        emit(result, args.out, partial=True)
    # diagnostic, after the goals' numbers so a run cut short keeps those
    result["verify"] = verify_over_step(target, n_ctx, args.prompt)
    result.update(peak_memory())
    emit(result, args.out)


# ------------------------------------------------------------------------------- profile
#: XLA flag sets tried, each in its own process (the default first).
VARIANTS: dict[str, str] = {
    "default": "",
    "graphs": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,"
    "CONDITIONAL --xla_gpu_graph_min_graph_size=1",
    "no_graphs": "--xla_gpu_enable_command_buffer=",
}


def decoder(target_path: Path, batch: int, prompt: int, tokens: int) -> Callable[[], Any]:
    """A thunk running one greedy decode of random prompts (the model loaded once)."""
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


def profile_main(argv: list[str]) -> None:
    ap = mode_parser("profile", "where a decode step's time goes, and XLA flag variants")
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
    args = ap.parse_args(argv)
    if args.target:
        child(args)
        return
    refuse_overwrite(args.out, args.overwrite)
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
            cmd = [sys.executable, __file__, "profile", "--target", str(target)]
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
    run_mode({"decode": decode_main, "profile": profile_main}, __doc__, default="decode")
