"""Prefill (prompt processing) speed against prompt length, and attention's share of it.

    SPECJAX_LLAMACPP_BIN=/path/to/llama.cpp/build/bin python benchmarks/prefill.py
        [--lengths 360,700,1024,1441,2048,4096] [--repeats 5] [--threads 2] [--ubatch 256,512]
        [--out benchmarks/results/prefill.json] [--overwrite]

For each prompt length, one row of random token ids of the shipped target:

* `specjax_ms_min` / `_median`: the prefill as `specjax.generate` runs it (`max_new_tokens=1`,
  the timings' `prefill_seconds`), over `--repeats` calls after one that compiles;
* `specjax_ub<N>_ms_min` (with `--ubatch N,...`): the same with the prompt in chunks of N
  tokens (`n_ubatch`, llama.cpp's -ub), each chunk's forward reading the cache the earlier
  ones wrote;
* `llama_tps`: llama.cpp's `llama-bench -p LENGTH -n 0 -t THREADS -r REPEATS` (its mean tok/s;
  skipped with a message when SPECJAX_LLAMACPP_BIN is unset or lacks llama-bench), run right
  before specjax's calls of the same length;
* `forward_ms` and `attention_ms`: the prefill forward alone (`forward_compute` of the padded
  prompt on the decode weights, with the prefill's compiler options), and that forward minus
  the same compiled shape with attention replaced by identity. That ablation is how XLA's
  T x T prompt attention was found to take 700 of the 830 ms of a 1,536-token prefill.

Prints JSON and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_TARGET, ROOT, emit, machine, refuse_overwrite

import specjax
from specjax import api
from specjax.decode import engine, executables
from specjax.models import llama


def llama_bench_tps(bin_dir: Path, model: str, length: int, threads: int, repeats: int) -> float:
    cmd = [str(bin_dir / "llama-bench"), "-m", model, "-p", str(length), "-n", "0"]
    cmd += ["-t", str(threads), "-r", str(repeats), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    (row,) = [r for r in json.loads(out) if r.get("n_prompt") == length]
    return float(row["avg_ts"])


def forward_seconds(model: specjax.Model, length: int, repeats: int) -> tuple[float, float]:
    """The fastest of `repeats` prefill forwards of `length` tokens padded to the engine's
    prompt bucket, and of the same forward with every layer's attention replaced by its
    queries; the two executables run alternately (this machine's speed drifts)."""
    cfg = model.config
    params = api.decode_params(model.params)
    T = api.prompt_bucket(length)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.V, (1, T)), jnp.int32)
    positions = jnp.where(jnp.arange(T) < length, jnp.arange(T), -1)[None].astype(jnp.int32)
    cache = llama.new_cache(cfg, 1, T, jnp.float16, jnp.float16)
    last = jnp.asarray([length - 1], jnp.int32)
    options = executables._compiler_options(engine.prefill_jit)  # the prefill's, as generate's

    def compile_prefill() -> Any:
        # a new function each time: jit caches traces by function, and the ablation differs
        # only in what `llama._attention_over_cells` (the forward's attention) is while tracing
        def prefill(p: Any, t: jax.Array, pos: jax.Array, c: Any) -> Any:
            return llama.forward_compute(cfg, p, t, pos, c, cache_empty=True, logit_index=last)

        lowered = jax.jit(prefill).lower(params, tokens, positions, cache)
        return lowered.compile(compiler_options=options)

    def identity(config: Any, i: int, q: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        B, T_, H, E = q.shape
        return q.reshape(B, T_, H * E)

    exes = [compile_prefill()]
    original = llama._attention_over_cells
    llama._attention_over_cells = identity
    try:
        exes.append(compile_prefill())
    finally:
        llama._attention_over_cells = original
    times: list[list[float]] = [[], []]
    for _ in range(repeats + 1):  # the first of each is a warm-up
        for exe, out in zip(exes, times):
            start = time.perf_counter()
            jax.block_until_ready(exe(params, tokens, positions, cache))
            out.append(time.perf_counter() - start)
    return min(times[0][1:]), min(times[1][1:])


def prefill_seconds(
    model: specjax.Model, ids: list[int], n_ctx: int, n_ubatch: int, repeats: int
) -> list[float]:
    """`prefill_seconds` of `repeats` `specjax.generate` calls after one that compiles."""

    def run() -> float:
        out = specjax.generate(model, [ids], max_new_tokens=1, n_ctx=n_ctx, n_ubatch=n_ubatch)
        return float(out.timings["prefill_seconds"])

    run()
    return [run() for _ in range(repeats)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--lengths", default="360,700,1024,1441,2048,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ubatch", default="", help="also prefill in chunks of these sizes (-ub)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    ubatches = [int(x) for x in args.ubatch.split(",") if x]
    if not lengths or min(lengths) < 2 or args.repeats < 1 or min(ubatches, default=1) < 1:
        ap.error(
            f"--lengths must be >= 2, --ubatch >= 1 and --repeats >= 1, got {lengths} / "
            f"{ubatches} / {args.repeats}"
        )

    bin_dir = Path(os.environ.get("SPECJAX_LLAMACPP_BIN", ""))
    use_llama = bool(os.environ.get("SPECJAX_LLAMACPP_BIN")) and (bin_dir / "llama-bench").exists()
    if not use_llama:
        print(
            "prefill: no llama-bench in SPECJAX_LLAMACPP_BIN: skipping llama.cpp", file=sys.stderr
        )
    model = specjax.load(args.model)
    rows: dict[str, Any] = {}
    for length in lengths:
        ids = np.random.default_rng(length).integers(3, model.config.V, length).tolist()
        n_ctx = api.prompt_bucket(length) + 64
        row: dict[str, Any] = {"bucket": api.prompt_bucket(length)}
        if use_llama:
            row["llama_tps"] = llama_bench_tps(
                bin_dir, args.model, length, args.threads, args.repeats
            )
        seconds = prefill_seconds(model, ids, n_ctx, 0, args.repeats)
        row["specjax_ms_min"] = min(seconds) * 1e3
        row["specjax_ms_median"] = statistics.median(seconds) * 1e3
        row["specjax_tps"] = length / min(seconds)
        for ub in ubatches:  # the prompt in chunks of `ub` tokens (llama.cpp's -ub)
            row[f"specjax_ub{ub}_ms_min"] = (
                min(prefill_seconds(model, ids, n_ctx, ub, args.repeats)) * 1e3
            )
        if use_llama:
            row["specjax_over_llama"] = row["specjax_tps"] / row["llama_tps"]
        full, without_attention = forward_seconds(model, length, 2 * args.repeats)
        row["forward_ms"] = full * 1e3
        row["attention_ms"] = (full - without_attention) * 1e3
        rows[str(length)] = row
        print(f"prefill: {length} tokens done", file=sys.stderr)
    emit(
        {"benchmark": "prefill", "machine": machine(), "model": args.model, "lengths": rows},
        args.out,
    )


if __name__ == "__main__":
    main()
