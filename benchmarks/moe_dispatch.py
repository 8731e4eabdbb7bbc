"""Times one mixture-of-experts FFN (`specjax.models.moe.moe_ffn`) in each dispatch on this
machine's default backend, at decode, verify and prompt sizes (tokens per call), and prints
what `specjax.control.moe_dispatch` chooses there.

    python benchmarks/moe_dispatch.py                  # tiny and medium layers, CPU
    python benchmarks/moe_dispatch.py --tokens 1 9 --json -
    python benchmarks/moe_dispatch.py --aot                 # deviceless H100 / TPU v5e compiles

`--aot` compiles one Qwen3-30B-A3B-shaped MoE layer (D 2048, 128 experts, top-8, F' 768,
bfloat16, abstract weights) in each dispatch for an H100 and a TPU v5e (`specjax.aot`; it
re-executes under the deviceless compilers' interpreter) and reports kernels (GPU) / fusions
(TPU), loops the GPU drives from the host, temporary memory and, on TPU, XLA's cost analysis
(flops, bytes accessed). Nothing runs: no times.

Tiny: D 64, 8 experts, top-2, F' 32. Medium: D 768, 32 experts, top-4, F' 384 (float32,
113 MB of experts). Each figure is the fastest of REPEATS timed loops of CALLS calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if "--aot" in sys.argv:
    from specjax import aot

    aot.ensure_compilers()  # before jax is imported: may re-execute under .venv-aot

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from specjax.control import moe_dispatch  # noqa: E402
from specjax.models import moe  # noqa: E402
from specjax.testing import tiny_config  # noqa: E402

LAYERS = {
    "tiny": dict(dim=64, n_experts=8, n_experts_used=2, expert_ffn_dim=32),
    "medium": dict(dim=768, n_experts=32, n_experts_used=4, expert_ffn_dim=384),
}
CALLS = 8
REPEATS = 5


def time_layer(name: str, tokens: list[int], dispatches: tuple[str, ...]) -> list[dict]:
    shape = LAYERS[name]
    config = tiny_config(arch="qwen3moe", qk_norm=True, norm_topk_prob=True, **shape)
    layer = moe.init_moe_layer(config, jax.random.PRNGKey(0), 0.02, 0.02)
    rows = []
    for T in tokens:
        h = jax.random.normal(jax.random.PRNGKey(T), (1, T, config.D), jnp.float32)
        row = {
            "layer": name,
            "tokens": T,
            "chosen": moe_dispatch(T * config.n_experts_used, config.n_experts),
        }
        for d in dispatches:

            def loop(layer: dict, h: jax.Array, d: str = d) -> jax.Array:
                def body(_: int, x: jax.Array) -> jax.Array:
                    return x + moe.moe_ffn(config, layer, x, d)

                return jax.lax.fori_loop(0, CALLS, body, h)

            f = jax.jit(loop)
            jax.block_until_ready(f(layer, h))
            best = float("inf")
            for _ in range(REPEATS):
                t = time.perf_counter()
                jax.block_until_ready(f(layer, h))
                best = min(best, (time.perf_counter() - t) / CALLS)
            row[d + "_us"] = round(best * 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


#: Qwen3-30B-A3B's MoE layer (config.json: hidden_size 2048, num_experts 128,
#: num_experts_per_tok 8, moe_intermediate_size 768).
QWEN3_30B_LAYER = dict(dim=2048, n_experts=128, n_experts_used=8, expert_ffn_dim=768)


def compile_layer(tokens: list[int], targets: list[str]) -> list[dict]:
    """Deviceless compiles of one bf16 Qwen3-30B-A3B-shaped MoE layer per dispatch."""
    from specjax import aot

    config = tiny_config(
        arch="qwen3moe", qk_norm=True, norm_topk_prob=True, dtype="bfloat16", **QWEN3_30B_LAYER
    )
    layer = jax.eval_shape(lambda: moe.init_moe_layer(config, jax.random.PRNGKey(0), 0.02, 0.02))
    rows = []
    for T in tokens:
        h = jax.ShapeDtypeStruct((1, T, config.D), jnp.bfloat16)
        for d in moe.DISPATCHES:
            fn = jax.jit(lambda layer, h, d=d: moe.moe_ffn(config, layer, h, d))
            fn.__name__ = f"moe_{d}_T{T}"  # type: ignore[attr-defined]
            for target in targets:
                r = aot.compile_for(fn, (layer, h), target)
                row = {
                    "tokens": T, "dispatch": d, "target": target, "compiled": r.compiled,
                    "kernels": r.kernels, "host_whiles": r.host_whiles, "fusions": r.fusions,
                    "hlo_whiles": r.hlo_whiles, "temp_MiB": round(r.memory.get("temp", 0) / 2**20, 1),
                    "error": (r.error or "")[:300],
                }  # fmt: skip
                if r.compiled:
                    row.update(hlo_facts(fn, (layer, h), target))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def hlo_facts(fn: object, args: tuple, target: str) -> dict:
    """From the optimised program: how XLA kept the expert products (ragged-dot
    instructions, custom calls such as cuBLAS GEMMs, dots) and, on TPU, its cost analysis
    (GFLOP, GB accessed)."""
    from specjax import aot

    platform = aot.platform_of(target)
    with aot.backend_as({"tpu": "tpu", "cuda": "gpu"}[platform]):
        lowered = fn.lower(*aot.abstract(args, aot.replicated(target)))  # type: ignore[attr-defined]
        compiled = lowered.compile()
    text = compiled.as_text()
    out = {
        "hlo_ragged_dots": text.count(" ragged-dot("),
        "hlo_dots": text.count(" dot("),
        "hlo_custom_calls": text.count(" custom-call("),
    }
    if platform == "tpu":
        cost = compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, list) else cost
        out["gflop"] = round(float(cost.get("flops", 0.0)) / 1e9, 2)
        out["gb_accessed"] = round(float(cost.get("bytes accessed", 0.0)) / 1e9, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 5, 9, 17, 64, 256])
    parser.add_argument("--dispatches", nargs="+", default=list(moe.DISPATCHES))
    parser.add_argument("--json", default="", help="write the rows here (- for stdout)")
    parser.add_argument("--aot", action="store_true", help="deviceless H100 / TPU v5e compiles")
    parser.add_argument("--targets", nargs="+", default=["h100", "tpu-v5e"])
    args = parser.parse_args()
    rows = []
    if args.aot:
        rows = compile_layer(args.tokens, args.targets)
    for name in args.layers if not args.aot else ():
        rows += time_layer(name, args.tokens, tuple(args.dispatches))
    if args.json:
        text = json.dumps({"backend": jax.default_backend(), "rows": rows}, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
