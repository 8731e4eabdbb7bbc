"""Hybrid (qwen35) target: PARTIAL_ONLY checkpoint bytes vs the full memory, and speculative
decoding per rollback path (RS planes, FULL checkpoint + replay) vs plain decoding, in one
interleaved run. Prints one JSON object and writes it to --out (default
benchmarks/results/hybrid_paths.json); never collected as a test.

    python benchmarks/hybrid_paths.py [--model GGUF | --random] [--ctx 2048] [--new 128]
                                      [--repeats 3] [--out FILE.json]

Bytes: `jax.eval_shape` of a one-row memory at --ctx cells (F16 KV, float32 recurrent state)
for the target, a Qwen3.5-0.8B-shaped config and the random test model; the checkpoint is
upstream's PARTIAL_ONLY blob (the row's recurrent state), the full state adds the attention KV
(issue 12's goal: checkpoint <= 1% of the full state at 2k context).
Speed: by default the shipped models/code-hybrid (its nextn head is draft-mtp's drafter) on
B = 2 real code prompts (benchmarks/prompts), drafters draft-mtp, ngram-mod and draft-simple
(draft = models/code-draft, the same vocabulary), n_max 6, each with n_rs_seq = 4 (RS) and
n_rs_seq = 0 (FULL). `--random`: the random-init 8-token-vocabulary target of
tests/test_hybrid_spec.py with ngram-simple and ngram-mod. One compile run per configuration,
then --repeats rounds that run every configuration in turn; medians of the wall time of the
whole `generate` call. Every configuration's tokens are checked against plain greedy
decoding; `forwards_per_token` (target forwards / generated tokens of the longest row) is the
hardware-independent measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, ROOT, emit, refuse_overwrite

import specjax
from specjax import api
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.memory import checkpoint as slot_checkpoint
from specjax.memory.hybrid import HybridMemory
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
    """Bytes at `ctx` cells, and the context at which the checkpoint is 1% of the full state
    (the recurrent state is fixed per row; only the attention KV grows with the context)."""

    def full_bytes(cells: int) -> int:
        return _bytes(jax.eval_shape(lambda: HybridMemory.init(config, 1, cells, 0, "float16")))

    mem = jax.eval_shape(lambda: HybridMemory.init(config, 1, ctx, 0, "float16"))
    ckpt = jax.eval_shape(lambda m: slot_checkpoint.take(m, 0, 0), mem)
    full, part = _bytes(mem), _bytes(ckpt.data_tgt)
    per_cell = (full_bytes(2 * ctx) - full) / ctx
    fixed = full - per_cell * ctx
    return {
        "full_state_bytes": full,
        "checkpoint_bytes": part,
        "ratio": part / full,
        "kv_bytes_per_cell": per_cell,
        "context_for_1_percent": int(np.ceil((part / 0.01 - fixed) / per_cell)),
    }


HYBRID_GGUF = ROOT / "models" / "code-hybrid" / "code-hybrid-f16.gguf"
#: (file under benchmarks/prompts, prompt length in tokens): rows of different lengths
CODE_ROWS = (("humaneval_main.py", 120), ("repetitive.py", 200))
N_MAX = 6  # drafts longer and shorter than the 4 RS planes


def _drafters(shipped: bool) -> dict[str, tuple[SpecConfig, Any]]:
    mod = SpecConfig(types=("ngram-mod",), ngram_mod_n_match=2, ngram_mod_n_min=2,
                     ngram_mod_n_max=N_MAX, ngram_mod_pool_size=4096, k_max=N_MAX)  # fmt: skip
    if not shipped:
        simple = SpecConfig(types=("ngram-simple",), ngram_simple_size_n=2,
                            ngram_simple_size_m=8, k_max=8)  # fmt: skip
        return {"ngram-simple": (simple, None), "ngram-mod": (mod, None)}
    return {
        "draft-mtp": (SpecConfig(types=("draft-mtp",), draft_n_max=N_MAX), None),
        "ngram-mod": (mod, None),
        "draft-simple": (
            SpecConfig(types=("draft-simple",), draft_n_max=N_MAX, k_max=N_MAX),
            specjax.load(str(DEFAULT_DRAFT)),
        ),
    }


def speed(
    model: api.Model, prompts: list[list[int]], n_new: int, repeats: int, n_ctx: int,
    shipped: bool,
) -> dict[str, Any]:  # fmt: skip
    runs: dict[str, dict[str, Any]] = {"plain": {}}
    for name, (spec, draft) in _drafters(shipped).items():
        runs[f"{name}/rs_n_rs_seq_4"] = {"spec": spec, "draft": draft, "n_rs_seq": 4}
        runs[f"{name}/full_checkpoint"] = {"spec": spec, "draft": draft, "n_rs_seq": 0}
    times: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, Any] = {}

    def go(kw: dict[str, Any]) -> Any:
        return generate(model, prompts, max_new_tokens=n_new, n_ctx=n_ctx, **kw)

    for name, kw in runs.items():  # compile
        results[name] = go(kw)
    for _ in range(repeats):  # interleaved: machine noise hits every configuration alike
        for name, kw in runs.items():
            t = time.perf_counter()
            results[name] = go(kw)
            times[name].append(time.perf_counter() - t)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    plain = results["plain"].tokens
    out: dict[str, Any] = {}
    for name, res in results.items():
        tokens = sum(len(t) for t in res.tokens)
        entry: dict[str, Any] = {
            "median_seconds": median[name],
            "seconds": times[name],
            "tokens_per_second": tokens / median[name],
            "speedup_vs_plain": median["plain"] / median[name],
            "equals_plain": res.tokens == plain,
        }
        longest = max(len(t) for t in res.tokens)
        if res.stats is not None:
            d = res.stats.to_dict()
            entry.update(
                seq_rm_type=d["seq_rm_type"],
                mean_acceptance_length=d["mean_acceptance_length"],
                num_draft_tokens=d["num_draft_tokens"],
                num_accepted_tokens=d["num_accepted_tokens"],
                rollback=d["rollback"],
                forwards_per_token=d["target_forwards"] / longest,
            )
        else:  # plain: prefill gives the first token, then one forward per token
            entry["forwards_per_token"] = (longest - 1) / longest
        out[name] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(HYBRID_GGUF), help="qwen35 GGUF (default code-hybrid)")
    ap.add_argument("--random", action="store_true", help="the random-init test model instead")
    ap.add_argument("--ctx", type=int, default=2048, help="context of the bytes comparison")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_paths.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)
    if args.random:
        model = api.Model(config=SMALL, params=q.init_params(SMALL, jax.random.PRNGKey(1), std=0.2))
        rng = np.random.RandomState(0)
        prompts = [[int(t) for t in rng.randint(0, SMALL.V, size=n)] for n in (5, 12, 20, 9)]
        n_ctx, name = 128, "random_test_model"
    else:
        model = specjax.load(args.model)
        text = [(ROOT / "benchmarks" / "prompts" / f).read_text() for f, _ in CODE_ROWS]
        prompts = [model.tokenizer.encode(t)[:n] for t, (_, n) in zip(text, CODE_ROWS)]
        n_ctx, name = 512, Path(args.model).stem
    report = {
        "model": name,
        "prompt_lengths": [len(p) for p in prompts],
        "max_new_tokens": args.new,
        "repeats": args.repeats,
        "ctx": args.ctx,
        "bytes": {
            name: state_bytes(model.config, args.ctx),
            "qwen35_0.8b_like": state_bytes(QWEN35_08B_LIKE, args.ctx),
            "random_test_model": state_bytes(SMALL, args.ctx),
        },
        "checkpoint_goal_ratio": 0.01,
        "speed": speed(model, prompts, args.new, args.repeats, n_ctx, not args.random),
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
