"""Plain decoding throughput and verify-batch cost. Prints one JSON object.

    python benchmarks/decode.py [--model PATH] [--tokens 64]

Reports tokens/s of the on-device generation loop at B=1, 8 and 32, and for B >= 8 the
fraction of the machine's matmul throughput it reaches (FLOP/s of plain `jnp.dot`s of the
same weight shapes at the same batch, measured in the same run; 2 FLOPs per weight per
token); B=1 tokens/s at capacities 512 and 8192 for the same prompt and output (cost must
follow the used context); the wall time of a (K+1)-token verify forward relative to a
1-token step for K = 1, 3, 7 (same cache, jitted, host-synced); compile times, KV cache
bytes and peak memory. Where the native CPU kernel (`specjax.kernels.cpu`) is in use, every
throughput is also measured on XLA's dot, interleaved run by run, with the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_TARGET, best_of, load_or_random, machine, peak_memory

import specjax
from specjax import api
from specjax.kernels import cpu as cpu_kernels
from specjax.models.llama import forward_fn


def decode_throughput(
    model: specjax.Model, batch: int, n_tokens: int, n_ctx: int | None = None
) -> dict[str, Any]:
    """Median tokens/s over 5 runs; where the native kernel is in use, also the same runs on
    XLA's dot (`cpu_kernels.disabled()`), interleaved run by run."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.V, 32).tolist() for _ in range(batch)]
    kw = dict(max_new_tokens=n_tokens, n_ctx=n_ctx)
    modes = {"kernel": contextlib.nullcontext} if cpu_kernels.available() else {}
    modes["xla_dot"] = cpu_kernels.disabled
    first = {}
    for mode, ctx in modes.items():
        with ctx():
            first[mode] = specjax.generate(model, prompts, **kw)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(5):
        for mode, ctx in modes.items():
            with ctx():
                rates[mode].append(
                    specjax.generate(model, prompts, **kw).timings["tokens_per_second"]
                )
    main_mode = next(iter(modes))
    out: dict[str, Any] = {
        "batch": batch,
        "n_ctx": first[main_mode].timings.get("n_ctx", n_ctx),
        "decode_path": main_mode,
        "tokens_per_second": statistics.median(rates[main_mode]),
        "tokens_per_second_runs": sorted(rates[main_mode]),
        "generated_tokens": first[main_mode].timings["generated_tokens"],
        "compile_seconds": first[main_mode].timings["compile_seconds"],
        "kv_cache_bytes": first[main_mode].timings.get("kv_cache_bytes"),
    }
    if main_mode == "kernel":
        out["xla_dot_tokens_per_second"] = statistics.median(rates["xla_dot"])
        out["kernel_over_xla_dot"] = out["tokens_per_second"] / out["xla_dot_tokens_per_second"]
        out["same_tokens_as_xla_dot"] = first["kernel"].tokens == first["xla_dot"].tokens
    return out


def _matrices(model: specjax.Model) -> list[jax.Array]:
    mats = [w for layer in model.params["layers"] for w in layer.values() if w.ndim == 2]
    head = model.params["embed"] if model.config.tie_embeddings else model.params["lm_head"]
    return [*mats, head]


def matmul_flops(model: specjax.Model, batch: int) -> float:
    """FLOP/s of plain jnp.dots over the model's weight shapes at `batch` rows (one jit)."""
    mats = _matrices(model)
    xs = [jnp.ones((batch, w.shape[1]), w.dtype) for w in mats]
    f = jax.jit(lambda xs, ws: [x @ w.T for x, w in zip(xs, ws)])
    seconds, _ = best_of(lambda: f(xs, mats), 20)
    return sum(2.0 * batch * w.size for w in mats) / seconds


def verify_cost(model: specjax.Model, ks: tuple[int, ...]) -> dict[str, float]:
    fwd = jax.jit(forward_fn, static_argnames=("config", "hidden_layers"))
    params = api.decode_params(model.params)  # the form the engine decodes with
    cache = model.new_cache(1, 512)
    prompt = jnp.arange(256, dtype=jnp.int32)[None] % model.config.V
    _, cache, _ = fwd(model.config, params, prompt, jnp.arange(256)[None], cache)
    out: dict[str, float] = {}
    for width in (1,) + tuple(k + 1 for k in ks):
        toks = jnp.ones((1, width), jnp.int32)
        pos = 256 + jnp.arange(width)[None]
        t = time.perf_counter()
        jax.block_until_ready(fwd(model.config, params, toks, pos, cache))
        out[f"compile_seconds_T{width}"] = time.perf_counter() - t
        seconds, _ = best_of(
            lambda toks=toks, pos=pos: fwd(model.config, params, toks, pos, cache)[0], 20
        )
        out[f"seconds_T{width}"] = seconds
    for k in ks:
        out[f"verify_K{k}_over_step"] = out[f"seconds_T{k + 1}"] / out["seconds_T1"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    model, name = load_or_random(args.model)
    plain = [decode_throughput(model, b, args.tokens) for b in (1, 8, 32)]
    by_ctx = {n: decode_throughput(model, 1, 128, n_ctx=n) for n in (512, 8192)}
    result = {
        "benchmark": "decode",
        "model": name,
        "params_millions": model.config.num_params() / 1e6,
        "machine": machine(),
        "plain_decoding": plain,
        "capacity": {
            "tokens_per_second_c512": by_ctx[512]["tokens_per_second"],
            "tokens_per_second_c8192": by_ctx[8192]["tokens_per_second"],
            "ratio_8192_over_512": by_ctx[8192]["tokens_per_second"]
            / by_ctx[512]["tokens_per_second"],
            "kv_cache_bytes": {n: r["kv_cache_bytes"] for n, r in by_ctx.items()},
        },
        "matmul_fraction": {
            f"B{r['batch']}": r["tokens_per_second"]
            * 2.0
            * sum(w.size for w in _matrices(model))
            / matmul_flops(model, r["batch"])
            for r in plain
            if r["batch"] >= 8
        },
        "verify_cost": verify_cost(model, (1, 3, 7)),
        "memory": peak_memory(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
