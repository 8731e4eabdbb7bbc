"""Hybrid (qwen35) target: PARTIAL_ONLY checkpoint bytes vs the full memory, and speculative
decoding per rollback path (RS planes, FULL checkpoint + replay) vs plain decoding, in one
interleaved run. Prints one JSON object.

    python benchmarks/hybrid_paths.py [--ctx 2048] [--new 64] [--repeats 3]

Bytes: `jax.eval_shape` of a one-row memory at --ctx cells (F16 KV, float32 recurrent state)
for a Qwen3.5-0.8B-shaped config and the random test model; the checkpoint is upstream's
PARTIAL_ONLY blob (the row's recurrent state), the full state adds the attention KV.
Speed: the random-init 8-token-vocabulary target of tests/test_hybrid_spec.py (its greedy text
repeats, so n-gram drafts are partly accepted), ngram-simple n=2 m=8, K=8, B=4; best of
--repeats after a compile run, each configuration in turn per repeat. `forwards_per_token`
(target forwards / generated tokens per row) is the hardware-independent measure.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import numpy as np

from specjax import api, slot_checkpoint
from specjax.config import SpecConfig
from specjax.hybrid import generate_hybrid
from specjax.hybrid_memory import HybridMemory
from specjax.models import qwen35 as q

QWEN35_08B_LIKE = q.Qwen35Config(
    vocab_size=248320,
    dim=1024,
    n_layers=24,
    n_heads=8,
    n_kv_heads=2,
    head_dim=256,
    ffn_dim=3584,
    rope_dim=64,
    ssm_state_size=128,
    ssm_k_heads=16,
    ssm_v_heads=16,
    full_attention_interval=4,
)
SMALL = q.Qwen35Config(
    vocab_size=8, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=48,
    rope_dim=8, rope_theta=10000.0, ssm_state_size=8, ssm_k_heads=2, ssm_v_heads=4,
    ssm_conv_kernel=4, full_attention_interval=2, max_position=256,
)  # fmt: skip


def _bytes(tree: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def state_bytes(config: q.Qwen35Config, ctx: int) -> dict[str, Any]:
    mem = jax.eval_shape(lambda: HybridMemory.init(config, 1, ctx, 0, "float16"))
    ckpt = jax.eval_shape(lambda m: slot_checkpoint.take(m, 0, 0), mem)
    full, part = _bytes(mem), _bytes(ckpt.data_tgt)
    return {"full_state_bytes": full, "checkpoint_bytes": part, "ratio": part / full}


def speed(n_new: int, repeats: int) -> dict[str, Any]:
    model = api.Model(config=SMALL, params=q.init_params(SMALL, jax.random.PRNGKey(1), std=0.2))
    rng = np.random.RandomState(0)
    prompts = [[int(t) for t in rng.randint(0, SMALL.V, size=n)] for n in (5, 12, 20, 9)]
    spec = SpecConfig(
        types=("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=8, k_max=8
    )
    runs = {
        "plain": {},
        "rs_n_rs_seq_4": {"spec": spec, "n_rs_seq": 4},
        "full_checkpoint": {"spec": spec, "n_rs_seq": 0},
    }
    best = {name: float("inf") for name in runs}
    results: dict[str, Any] = {}
    for name, kw in runs.items():  # compile
        results[name] = generate_hybrid(model, prompts, max_new_tokens=n_new, n_ctx=128, **kw)
    for _ in range(repeats):
        for name, kw in runs.items():
            t = time.perf_counter()
            results[name] = generate_hybrid(model, prompts, max_new_tokens=n_new, n_ctx=128, **kw)
            best[name] = min(best[name], time.perf_counter() - t)
    plain = results["plain"].tokens
    out: dict[str, Any] = {}
    for name, res in results.items():
        tokens = sum(len(t) for t in res.tokens)
        entry: dict[str, Any] = {
            "seconds": best[name],
            "tokens_per_second": tokens / best[name],
            "speedup_vs_plain": best["plain"] / best[name],
            "equals_plain": res.tokens == plain,
        }
        longest = max(len(t) for t in res.tokens)
        if res.stats is not None:
            d = res.stats.to_dict()
            entry.update(
                mean_acceptance_length=d["mean_acceptance_length"],
                rollback=d["rollback"],
                forwards_per_token=d["target_forwards"] / longest,
            )
        else:  # plain: prefill gives the first token, then one forward per token
            entry["forwards_per_token"] = (longest - 1) / longest
        out[name] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    report = {
        "ctx": args.ctx,
        "bytes": {
            "qwen35_0.8b_like": state_bytes(QWEN35_08B_LIKE, args.ctx),
            "random_test_model": state_bytes(SMALL, args.ctx),
        },
        "speed": speed(args.new, args.repeats),
        "backend": jax.default_backend(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
