"""Per-call times of the native CPU kernels. Prints one JSON object.

    python benchmarks/kernels.py [--calls 300] [--repeats 7] [--only attend,linear,blocks,forward]
                                 [--out FILE]

`cpu_kernels.attend_cache` at the shipped target's attention shapes (2 KV groups, head size
64, F16 cache of 2048 cells) for a decode step (2 query rows per group: 1 token x 2 heads) and
verifies of 5, 17 and 65 tokens (10, 34 and 130 rows; 65 = ngram-mod's 64-token drafts), over
450 and 2000 used cells, with GFLOP/s (4 x rows x cells x head size per group: scores and
value sums); and the linear kernel at the
target's F16 matrices (Q/K/V 512 x 256, output 256 x 256, gate/up 1536 x 256, down 256 x
768, LM head 2048 x 256) for 1 and 5 activation rows, with `per_forward_us`: 8 layers' four
matrices and the head, what one forward's linear layers cost; and at 16, 64, 128, 512 and
1024 rows (verify batches, prompt blocks; `cpu_kernels.MAX_ROWS` is where the engine hands a
product to XLA's dot) the kernel's GFLOP/s beside XLA's dot of the float32 weights
(`linear_block_rows`). Microseconds per call (and GFLOP/s), the minimum over repeats of a
jitted loop of `--calls` calls (each call's input depends on the last result, so none is
skipped). Weights are packed as the engine holds them (`cpu_kernels.pack_panels`, once)
where the kernel takes panels; at commits before it, in their `[out, in]` layout. `--only`
runs some of the four sections (attend, linear, blocks, forward; all by default).
`forward_ms`: one whole forward of the shipped target of 1, 5, 17 and 65 tokens after the
repetitive prompt (benchmarks/prompts/repetitive.py, F16 cache of 2048 cells; 65 = a verify
of ngram-mod's 64-token drafts), the fastest of `--repeats`, with `verify_token`: each token
past the first in 1-token forwards (the draft governor's price). Run it at two commits to
compare kernels; a generation's end-to-end speed is benchmarks/decode.py's and
benchmarks/peers.py's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_TARGET,
    ROOT,
    emit,
    forward_timer,
    llamacpp_prompt_ids,
    machine,
    refuse_overwrite,
)

import specjax
from specjax.kernels import cpu as cpu_kernels

GROUPS, HEAD, CELLS = 2, 64, 2048
#: (query rows per group, tokens)
CASES = {"decode": (2, 1), "verify5": (10, 5), "verify17": (34, 17), "verify65": (130, 65)}
SECTIONS = ("attend", "linear", "blocks", "forward")


def per_call_us(rows: int, tokens: int, used: int, calls: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    k, v = (
        jnp.asarray(rng.standard_normal((1, GROUPS, CELLS, HEAD)), jnp.float16) for _ in range(2)
    )
    k_pos = jnp.where(jnp.arange(CELLS) < used, jnp.arange(CELLS), -1)[None].astype(jnp.int32)
    q_pos = (used + jnp.arange(tokens))[None].astype(jnp.int32)
    q0 = jnp.asarray(rng.standard_normal((1, GROUPS, rows, HEAD)), jnp.float32)

    def step(q: jax.Array) -> jax.Array:
        _, total, acc = cpu_kernels.attend_cache(q, k, v, k_pos, q_pos, used, 0)
        return q + 1e-3 * acc / total[..., None]

    return best_us_per_call(step, q0, calls, repeats)


def best_us_per_call(
    step: Callable[[jax.Array], jax.Array], start_value: jax.Array, calls: int, repeats: int
) -> float:
    """Microseconds per `step` in a jitted loop of `calls` steps (each fed the last one's
    result, so none is skipped): the minimum over `repeats` timed loops."""

    @jax.jit
    def loop(x: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, calls, lambda _, x: step(x), x)

    loop(start_value).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        loop(start_value).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


#: The shipped target's linear matrices (out, in) and how many of each a forward runs.
LINEAR = {
    "wqkv": ((512, 256), 8),
    "wo": ((256, 256), 8),
    "w_gate_up": ((1536, 256), 8),
    "w_down": ((256, 768), 8),
    "lm_head": ((2048, 256), 1),
}


def linear_us(
    out: int, inp: int, rows: int, calls: int, repeats: int, xla_dot: bool = False
) -> float:
    """One product's microseconds on the kernel, or (`xla_dot`) on XLA's dot of the float32
    weights, what the engine runs for blocks above `cpu_kernels.MAX_ROWS` rows."""
    rng = np.random.default_rng(1)
    w_host = (rng.standard_normal((out, inp)) * 0.05).astype(np.float16)
    if xla_dot:
        w = jnp.asarray(w_host.astype(np.float32))

        def product(x: jax.Array) -> jax.Array:
            return jnp.einsum("ri,oi->ro", x, w)
    elif hasattr(cpu_kernels, "pack_panels"):  # the engine's form: packed once
        w = jnp.asarray(cpu_kernels.pack_panels(w_host))

        def product(x: jax.Array) -> jax.Array:
            return cpu_kernels.linear_panels(x, w, out)
    else:  # earlier kernels read [out, in] as stored
        w = jnp.asarray(w_host)

        def product(x: jax.Array) -> jax.Array:
            return cpu_kernels.linear_rows(x, w)

    x0 = jnp.asarray(rng.standard_normal((rows, inp)), jnp.float32)

    return best_us_per_call(lambda x: x + 1e-6 * product(x)[:, :1], x0, calls, repeats)


def attend_section(calls: int, repeats: int) -> dict[str, Any]:
    us: dict[str, float] = {}
    gflops: dict[str, float] = {}
    for name, (rows, tokens) in CASES.items():
        for used in (450, 2000):
            n = max(10, calls * 10 // max(rows, 10))  # about the same time per case
            key = f"{name}/cells{used}"
            us[key] = per_call_us(rows, tokens, used, n, repeats)
            gflops[key] = round(4 * GROUPS * rows * used * HEAD / us[key] / 1e3, 1)
    return {"attend_cache_us_per_call": us, "attend_cache_gflops": gflops}


def linear_section(calls: int, repeats: int) -> dict[str, Any]:
    linear: dict[str, dict[str, float]] = {}
    per_forward = {}
    for rows in (1, 5):
        total = 0.0
        for name, ((out, inp), count) in LINEAR.items():
            us = linear_us(out, inp, rows, calls, repeats)
            linear[f"{name}/rows{rows}"] = {
                "us": round(us, 2),
                "gflops": round(2 * out * inp * rows / us / 1e3, 1),
            }
            total += count * us
        per_forward[f"rows{rows}"] = round(total, 1)
    return {"linear_us_per_call": linear, "linear_per_forward_us": per_forward}


def blocks_section(calls: int, repeats: int) -> dict[str, Any]:
    """Prompt-block sizes: the kernel against XLA's dot (which of the two takes a block)."""
    blocks: dict[str, dict[str, float]] = {}
    for rows in (16, 64, 128, 512, 1024):
        n = max(4, calls * 16 // rows)  # about the same time per size
        for name, ((out, inp), _) in LINEAR.items():
            flops = 2 * out * inp * rows / 1e3
            kernel = linear_us(out, inp, rows, n, repeats)
            dot = linear_us(out, inp, rows, n, repeats, xla_dot=True)
            blocks[f"{name}/rows{rows}"] = {
                "kernel_gflops": round(flops / kernel, 1),
                "xla_dot_gflops": round(flops / dot, 1),
            }
    return {"linear_block_rows": blocks}


def forward_section(repeats: int) -> dict[str, Any]:
    """Whole forwards of the engine's verify widths."""
    model = specjax.load(str(DEFAULT_TARGET))
    prompt = (ROOT / "benchmarks" / "prompts" / "repetitive.py").read_text(encoding="utf-8")
    ids = llamacpp_prompt_ids(model, prompt)
    timers = {width: forward_timer(model, ids, width, 2048) for width in (1, 5, 17, 65)}
    runs: dict[int, list[float]] = {width: [] for width in timers}
    for _ in range(repeats):  # the widths in turn, so a slow stretch hits them all
        for width, timer in timers.items():
            runs[width].append(timer())
    seconds = {width: min(times) for width, times in runs.items()}
    forward_ms = {f"width{w}": round(s * 1e3, 3) for w, s in seconds.items()}
    verify_token = {
        f"width{w}": round((s / seconds[1] - 1.0) / (w - 1), 3) for w, s in seconds.items() if w > 1
    }
    return {"forward_ms": forward_ms, "verify_token": verify_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    sections = [x for x in args.only.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        ap.error(f"--only: unknown section(s) {unknown or args.only!r}; choose from {SECTIONS}")
    refuse_overwrite(args.out, args.overwrite)
    if not cpu_kernels.available():
        print(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
        return
    result: dict[str, Any] = {
        "benchmark": "kernels",
        "machine": machine(),
        "shapes": {"groups": GROUPS, "head": HEAD, "cells": CELLS, "cache": "f16"},
        "sections": sections,
    }
    if "attend" in sections:
        result.update(attend_section(args.calls, args.repeats))
    if "linear" in sections:
        result.update(linear_section(args.calls, args.repeats))
    if "blocks" in sections:
        result.update(blocks_section(args.calls, args.repeats))
    if "forward" in sections:
        result.update(forward_section(args.repeats))
    emit(result, args.out)


if __name__ == "__main__":
    main()
