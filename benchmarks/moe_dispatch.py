"""Times one mixture-of-experts FFN (`specjax.models.moe.moe_ffn`) in each dispatch on this
machine's default backend, at decode, verify and prompt sizes (tokens per call), and prints
what `specjax.control.moe_dispatch` chooses there.

    python benchmarks/moe_dispatch.py                  # tiny and medium layers, CPU
    python benchmarks/moe_dispatch.py --tokens 1 9 --json -

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 5, 9, 17, 64, 256])
    parser.add_argument("--dispatches", nargs="+", default=list(moe.DISPATCHES))
    parser.add_argument("--json", default="", help="write the rows here (- for stdout)")
    args = parser.parse_args()
    rows = []
    for name in args.layers:
        rows += time_layer(name, args.tokens, tuple(args.dispatches))
    if args.json:
        text = json.dumps({"backend": jax.default_backend(), "rows": rows}, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
