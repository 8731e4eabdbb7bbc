"""Plain decoding throughput and verify-batch cost. Prints one JSON object.

    python benchmarks/decode.py [--model PATH] [--tokens 64]

Reports tokens/s of the on-device generation loop at B=1 and B=8, the wall time of a
(K+1)-token verify forward relative to a 1-token step for K = 1, 3, 7 (same cache, jitted,
host-synced), compile times and peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_TARGET, best_of, load_or_random, machine, peak_memory

import specjax
from specjax.models.llama import forward_fn


def decode_throughput(model: specjax.Model, batch: int, n_tokens: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.V, 32).tolist() for _ in range(batch)]
    first = specjax.generate(model, prompts, max_new_tokens=n_tokens)
    runs = [specjax.generate(model, prompts, max_new_tokens=n_tokens) for _ in range(3)]
    best = min(runs, key=lambda r: r.timings["decode_seconds"])
    return {
        "batch": batch,
        "tokens_per_second": best.timings["tokens_per_second"],
        "decode_seconds": best.timings["decode_seconds"],
        "generated_tokens": best.timings["generated_tokens"],
        "compile_seconds": first.timings["compile_seconds"],
    }


def verify_cost(model: specjax.Model, ks: tuple[int, ...]) -> dict[str, float]:
    fwd = jax.jit(forward_fn, static_argnames=("config", "hidden_layers"))
    cache = model.new_cache(1, 512)
    prompt = jnp.arange(256, dtype=jnp.int32)[None] % model.config.V
    _, cache, _ = fwd(model.config, model.params, prompt, jnp.arange(256)[None], cache)
    out: dict[str, float] = {}
    for width in (1,) + tuple(k + 1 for k in ks):
        toks = jnp.ones((1, width), jnp.int32)
        pos = 256 + jnp.arange(width)[None]
        t = time.perf_counter()
        jax.block_until_ready(fwd(model.config, model.params, toks, pos, cache))
        out[f"compile_seconds_T{width}"] = time.perf_counter() - t
        seconds, _ = best_of(
            lambda toks=toks, pos=pos: fwd(model.config, model.params, toks, pos, cache)[0], 20
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
    result = {
        "benchmark": "decode",
        "model": name,
        "params_millions": model.config.num_params() / 1e6,
        "machine": machine(),
        "plain_decoding": [decode_throughput(model, b, args.tokens) for b in (1, 8)],
        "verify_cost": verify_cost(model, (1, 3, 7)),
        "memory": peak_memory(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
