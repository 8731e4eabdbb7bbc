"""Deviceless compiles of what `specjax.generate` runs, for TPU v5e / v6e and an H100 (issue 50).

Each configuration is captured as a user gets it (`specjax.aot.capture_generate`: `generate`
with the executables recorded instead of compiled), then every captured program is compiled
for each target with abstract arguments (`specjax.aot.compile_captured`). Nothing runs:
the figures are the compiled programs' (see `specjax/aot.py` for what each one counts).

    python benchmarks/accelerators.py                  # tiny config, B=1 and 32, all targets
    python benchmarks/accelerators.py --shipped        # also models/code-target (minutes)
    python benchmarks/accelerators.py --configs plain --batches 1 --targets h100 --json -
    python benchmarks/accelerators.py --scale          # issue 50 item 5: 8B + 1B draft, abstract

"draft-eagle3" and "draft-dflash" draft with random heads (64-wide attention heads, as the
target's) reading the tiny target's layers 0, 1 and L; "hybrid-mtp" is the tiny qwen35
hybrid target with one nextn block drafting for it (draft-mtp, its recurrent state rolled
back by `draft_n_max` snapshot planes); "hybrid-ngram-mod+mtp" chains ngram-mod before it,
whose drafts outgrow the planes (the round's checkpoint path). In the hybrid configurations
a copy of a recurrent state (a delta-net layer's conv inputs, conv window or SSM state, with
or without its planes) inside a loop body counts as a large copy too, however small
(`large_shapes`).

The "moe-" configurations decode a tiny qwen3moe target (TINY_SHAPE's attention, MOE_SHAPE's
experts; issue 53), plainly and with the tiny draft model: its MoE layers run the dispatch
`control.moe_dispatch` picks per accelerator (TPU: `lax.ragged_dot`; GPU: pair by pair up to
one token-expert pair per expert, dense beyond).

`--scale` (issue 50 item 5) compiles, instead, a Llama-3.1-8B-shaped target with a
Llama-3.2-1B-shaped draft, bf16 weights that never exist (`jax.eval_shape` of the init), in
the batch job's programs (`specjax.jobs.continuous`: a prefill chunk and a segment of rounds)
sharded as the batch job shards them (`specjax.jobs.sharding`, a ("data", "model") mesh):
on a TPU v5e-8 (`v5e:2x4`, 8 chips) at 32 rows x 4096 cells and on one H100 at 32 rows x 8192,
plain and draft-simple (K=4). Its figures go under the JSON's "scale" key.

It re-executes itself under the deviceless compilers' interpreter (`.venv-aot`, `make aot`)
when the running one lacks them. Writes benchmarks/results/accelerators.json (`--json PATH`,
`-` for stdout only) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specjax import aot  # noqa: E402  (imports no jax)

CONFIGS = (
    "plain",
    "draft-simple",
    "ngram-mod+draft-simple",
    "draft-eagle3",
    "draft-dflash",
    "hybrid-plain",
    "hybrid-mtp",
    "hybrid-ngram-mod+mtp",
    "moe-plain",
    "moe-draft-simple",
)
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "accelerators.json"
SHIPPED_TARGET = ROOT / "models" / "code-target" / "code-target-f16.gguf"
SHIPPED_DRAFT = ROOT / "models" / "code-draft" / "code-draft-f16.gguf"


#: The tiny configuration's shape: a handful of layers, 64-wide heads (an accelerator's: XLA's
#: GPU compiler, untuned deviceless, fails to tile some products of 8-wide heads).
TINY_SHAPE = dict(dim=128, n_heads=2, n_kv_heads=1, ffn_dim=256)
#: The tiny qwen3moe target's experts (the "moe-" configurations).
MOE_SHAPE = dict(n_experts=8, n_experts_used=2, expert_ffn_dim=128, norm_topk_prob=True)
#: Layers added to the target (and to the draft) of a twin configuration to count kernels per
#: layer: the difference in a round's kernels over the difference in layers (a round's fixed
#: part cancels).
EXTRA_LAYERS = 2


def tiny_models(n_ctx: int, target_extra: int = 0, draft_extra: int = 0) -> dict[str, Any]:
    import jax

    from specjax import api
    from specjax.models import eagle3 as e3
    from specjax.models import qwen35 as q
    from specjax.testing import tiny_block_head, tiny_model

    pos = max(4096, n_ctx)
    shape: dict[str, Any] = dict(TINY_SHAPE, max_position=pos)
    hybrid_cfg = q.Qwen35Config(  # tests/test_hybrid_spec.py's, with room for the context
        vocab_size=8, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=48,
        rope_dim=8, rope_theta=10000.0, ssm_state_size=8, ssm_k_heads=2, ssm_v_heads=4,
        ssm_conv_kernel=4, full_attention_interval=2, max_position=pos,
    )  # fmt: skip
    mtp_cfg = q.Qwen35Config.from_dict({**hybrid_cfg.to_dict(), "n_nextn": 1})
    target = tiny_model(0, n_layers=2 + target_extra, **shape)
    tc = target.config
    # the feature heads (tests/test_eagle3.py, specjax.testing.tiny_block_head) at the
    # target's width and head shape, reading its layers 0, 1 and L
    head: dict[str, Any] = dict(
        vocab_size=tc.V, dim=tc.D, n_heads=TINY_SHAPE["n_heads"],
        n_kv_heads=TINY_SHAPE["n_kv_heads"], ffn_dim=TINY_SHAPE["ffn_dim"], target_hidden=tc.D,
        target_layers=(0, 1, tc.L), own_lm_head=True, max_position=pos,
    )  # fmt: skip
    eagle3_cfg = e3.Eagle3Config(**head)
    eagle3 = api.Model(
        config=eagle3_cfg,  # type: ignore[arg-type]
        params=e3.init_params(eagle3_cfg, jax.random.key(3)),
    )
    # block_size 5: the four draft tokens of `spec_for`'s draft_n_max (DFlash drafts
    # block_size - 1)
    head = {k: v for k, v in head.items() if k not in ("vocab_size", "target_hidden")}
    dflash = tiny_block_head(target, n_layers=1 + draft_extra, block_size=5, **head)
    return {
        "target": target,
        "draft": tiny_model(1, n_layers=1 + draft_extra, **shape),
        "eagle3": eagle3,
        "dflash": dflash,
        "moe": tiny_model(
            2, n_layers=2 + target_extra, arch="qwen3moe", qk_norm=True, **MOE_SHAPE, **shape
        ),
        "hybrid": api.Model(
            config=hybrid_cfg,  # type: ignore[arg-type]
            params=q.init_params(hybrid_cfg, jax.random.PRNGKey(1), std=0.2),
        ),
        "hybrid-mtp": api.Model(
            config=mtp_cfg,  # type: ignore[arg-type]
            params=q.init_params(mtp_cfg, jax.random.PRNGKey(1), std=0.2),
        ),
    }


def shipped_models() -> dict[str, Any]:
    import specjax

    return {
        "target": specjax.load(str(SHIPPED_TARGET), dtype="float16"),
        "draft": specjax.load(str(SHIPPED_DRAFT), dtype="float16"),
    }


def spec_for(config: str, tiny: bool) -> Any:
    """The configuration's speculative settings. The draft governor is off: with it on, a
    drafter it would never ask at the run's shapes is left out of the compiled chain (a twin's
    deeper draft model, say), and the programs compared would not hold the same chain."""
    from specjax.config import SpecConfig

    common: dict[str, Any] = dict(draft_n_max=4, cost_calibrate=False, adaptive=False)
    if config in ("draft-simple", "moe-draft-simple", "draft-eagle3", "draft-dflash"):
        return SpecConfig(types=(config.removeprefix("moe-"),), **common)
    if config == "hybrid-mtp":
        return SpecConfig(types=("draft-mtp",), **common)
    if config in ("ngram-mod+draft-simple", "hybrid-ngram-mod+mtp"):
        small = dict(ngram_mod_n_match=4, ngram_mod_n_min=2, ngram_mod_n_max=8) if tiny else {}
        pool = {"ngram_mod_pool_size": 1 << 12} if tiny else {}
        second = "draft-simple" if config == "ngram-mod+draft-simple" else "draft-mtp"
        return SpecConfig(types=("ngram-mod", second), **common, **small, **pool)
    return None


def cache_layer_bytes(config: Any, batch: int, cells: int) -> int:
    """Bytes of one layer's K (or V) buffer in F16: the smallest cache-sized buffer."""
    head_dim = getattr(config, "head_dim", 0) or config.dim // config.n_heads
    return int(batch * cells * config.n_kv_heads * head_dim * 2)


def recurrent_state_shapes(config: Any, batch: int, planes: int) -> list[tuple[int, ...]]:
    """A qwen35 target's recurrent state as `memory.hybrid.RecurrentMemory` holds it, per
    delta-net layer: the conv inputs [d_conv - 1 + P - 1, B, C] and the SSM planes
    [P, B, Hv, S, S], and as the forward reads it: a conv window [B, d_conv - 1, C] (also with
    P in front) and one SSM state [B, Hv, S, S]. Empty for a target without one."""
    if not getattr(config, "recurrent_layers", ()):
        return []
    window = config.ssm_conv_kernel - 1
    conv = (batch, window, config.conv_dim)
    ring = (window + planes - 1, batch, config.conv_dim)
    ssm = (batch, config.Hv, config.S, config.S)
    return [conv, ring, ssm, (planes, *conv), (planes, *ssm)]


#: The configuration -> (target, draft) keys of `tiny_models` (draft None: no drafter model).
MODELS_OF = {
    "plain": ("target", None),
    "draft-simple": ("target", "draft"),
    "ngram-mod+draft-simple": ("target", "draft"),
    "draft-eagle3": ("target", "eagle3"),
    "draft-dflash": ("target", "dflash"),
    "hybrid-plain": ("hybrid", None),
    "hybrid-mtp": ("hybrid-mtp", None),
    "hybrid-ngram-mod+mtp": ("hybrid-mtp", None),
    "moe-plain": ("moe", None),
    "moe-draft-simple": ("moe", "draft"),
}


def capture(
    models: dict[str, Any], config: str, batch: int, n_ctx: int, tiny: bool
) -> dict[str, Any]:
    target_key, draft_key = MODELS_OF[config]
    target = models[target_key]
    draft = models[draft_key] if draft_key else None
    spec = spec_for(config, tiny)
    vocab = target.config.vocab_size
    prompts = [[(3 + 7 * i + j) % vocab for j in range(12)] for i in range(batch)]
    kwargs: dict[str, Any] = dict(max_new_tokens=32, n_ctx=n_ctx)
    if spec is not None:
        kwargs.update(spec=spec, draft=draft)
    t0 = time.perf_counter()
    caps, error = aot.capture_generate(target, prompts, **kwargs)
    engine = caps[-1].engine if caps else None
    cells = int(getattr(engine, "capacity", n_ctx) or n_ctx)
    planes = int(getattr(engine, "n_rs_seq", 0) or 0) + 1
    return {
        "captured": caps,
        "capture_s": time.perf_counter() - t0,
        "capture_error": error,
        "programs": [c.name for c in caps],
        "drafters": [getattr(d, "name", str(d)) for d in getattr(engine, "drafters", ())],
        "target_layers": int(target.config.n_layers),
        "draft_layers": int(draft.config.L) if draft is not None else None,
        "cells": cells,
        "large_min_bytes": cache_layer_bytes(target.config, batch, cells),
        "large_shapes": recurrent_state_shapes(target.config, batch, planes),
    }


def summarise(reports: list[aot.ProgramReport], layers: int) -> dict[str, Any]:
    """One (configuration, target): the round is the program whose top-level loop holds the
    most kernels (GPU) / fusions (TPU); host loops and large copies summed over programs (a
    `generate` call runs each program once). `per_target_layer` here is the round over the
    target's layers (fixed part included); `run` replaces it by the count per added layer
    where it compiled a deeper twin."""
    ok = [r for r in reports if r.compiled]
    gpu = any(r.kernels is not None for r in ok)
    per_round = [(r.round_kernels if gpu else r.round_fusions) or 0 for r in ok]
    best = max(range(len(ok)), key=lambda i: per_round[i]) if ok else None
    return {
        "compiled": bool(reports) and len(ok) == len(reports),
        "errors": [f"{r.program}: {r.error}" for r in reports if not r.compiled],
        "round_program": ok[best].program if best is not None else None,
        "per_round": per_round[best] if best is not None else None,
        "round_loop_kernels": ok[best].loop_kernels if best is not None and gpu else None,
        "per_target_layer": round(per_round[best] / layers, 1) if best is not None else None,
        "kernels_total": sum((r.kernels if gpu else r.fusions) or 0 for r in ok),
        "host_whiles": sum(r.host_whiles or 0 for r in ok) if gpu else None,
        "large_copies": sum(len(r.large_copies) for r in ok),
        "memory_bytes": max((r.memory.get("total", 0) for r in ok), default=0),
        "compile_s": round(sum(r.compile_s for r in reports), 2),
    }


def per_layer(base: dict[str, Any], deep: dict[str, Any], layers: int) -> float | None:
    """Kernels (fusions) a round adds per layer: the deeper twin's round less the base's."""
    if not (base["compiled"] and deep["compiled"]) or layers <= 0:
        return None
    return round((deep["per_round"] - base["per_round"]) / layers, 1)


def per_layer_loops(base: dict[str, Any], deep: dict[str, Any], layers: int) -> list[float]:
    """GPU: what each loop of the round adds per layer, for the loops that grow with the
    depth (program order; `ThunkStats.loop_kernels`): a loop whose body is one forward step
    (a draft step of draft-simple, say) gives that step's kernels per layer."""
    b, d = base.get("round_loop_kernels"), deep.get("round_loop_kernels")
    if not b or not d or len(b) != len(d) or layers <= 0:
        return []
    return [round((y - x) / layers, 1) for x, y in zip(b, d) if y != x]


def run(
    configs: list[str],
    batches: list[int],
    targets: list[str],
    n_ctx: int,
    shipped: bool,
    with_twins: bool = True,
) -> list[dict[str, Any]]:
    sets = [("tiny", True, tiny_models(n_ctx))]
    deeper_target = tiny_models(n_ctx, target_extra=EXTRA_LAYERS)
    deeper_draft = tiny_models(n_ctx, draft_extra=EXTRA_LAYERS)
    if shipped:
        sets.append(("code-target", False, shipped_models()))
    rows = []
    for model_name, tiny, models in sets:
        for config in configs:
            if any(k and k not in models for k in MODELS_OF[config]):
                continue
            for batch in batches:
                cap = capture(models, config, batch, n_ctx, tiny)
                row = {k: v for k, v in cap.items() if k != "captured"}
                row.update(model=model_name, config=config, batch=batch, n_ctx=n_ctx)
                row["targets"] = {}
                if not cap["captured"]:
                    row["note"] = "generate made no executable through api._compiled"
                # the tiny set's first B: deeper twins count kernels per layer
                twins = {}
                # (the hybrid target and the EAGLE-3 head have no deeper twins)
                if with_twins and tiny and batch == batches[0] and "hybrid" not in config:
                    twins["per_target_layer"] = capture(deeper_target, config, batch, n_ctx, tiny)
                    if cap["draft_layers"] and config != "draft-eagle3":
                        twins["per_draft_layer"] = capture(deeper_draft, config, batch, n_ctx, tiny)
                for target in targets:
                    reports = aot.compile_captured(
                        cap["captured"], target, min_bytes=cap["large_min_bytes"],
                        shapes=cap["large_shapes"],
                    )  # fmt: skip
                    summary = summarise(reports, cap["target_layers"])
                    for key, twin in twins.items():
                        deep = summarise(aot.compile_captured(twin["captured"], target), 1)
                        summary[key] = per_layer(summary, deep, EXTRA_LAYERS)
                        summary[f"{key}_loops"] = per_layer_loops(summary, deep, EXTRA_LAYERS)
                    row["targets"][target] = {
                        "summary": summary,
                        "programs": [r.to_json() for r in reports],
                    }
                    print(f"# {model_name} {config} B={batch} {target}: "
                          f"{row['targets'][target]['summary']}", file=sys.stderr, flush=True)  # fmt: skip
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | program | B | target | compiled | kernels (GPU) / fusions (TPU) per round "
        "| per target layer | per draft layer | host-driven loops | large copies in loop bodies "
        "| memory / device | compile s |"
    )
    lines = [head, "|" + "---|" * 12]
    for row in rows:
        if not row["targets"] or not row["programs"]:
            lines.append(
                f"| {row['model']} | {row['config']} | {row['batch']} | all | "
                f"not captured: {row.get('note') or row.get('capture_error')} ||||||||"
            )
            continue
        for target, t in row["targets"].items():
            s = t["summary"]
            compiled = "yes" if s["compiled"] else "no: " + "; ".join(s["errors"])[:120]
            host = "-" if s["host_whiles"] is None else str(s["host_whiles"])
            mib = s["memory_bytes"] / 2**20
            lines.append(
                f"| {row['model']} | {row['config']} | {row['batch']} | {target} | {compiled} "
                f"| {s['per_round']} | {s['per_target_layer']} | {s.get('per_draft_layer', '-')} "
                f"| {host} | {s['large_copies']} "
                f"| {mib:.2f} MiB | {s['compile_s']} |"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Scale (issue 50 item 5): 8B-shaped target, 1B-shaped draft, abstract weights

#: Per-device budgets: item 5's 14 GiB on a v5e chip (16 GiB of HBM); an H100 SXM's 80 GB
#: less what CUDA keeps (~79 GiB visible; JAX preallocates 75% of it unless
#: XLA_PYTHON_CLIENT_MEM_FRACTION says more).
SCALE_BUDGET = {"tpu-v5e-8": 14 * 2**30, "h100": 79 * 2**30}
#: target -> (rows, cells, mesh axes (data, model)): the batch job's mesh on the v5e-8 (KV
#: heads and the target's fused projections over `model`), one device on the H100.
SCALE_TARGETS: dict[str, tuple[int, int, tuple[int, int]]] = {
    "tpu-v5e-8": (32, 4096, (1, 8)),
    "h100": (32, 8192, (1, 1)),
}
SCALE_CONFIGS = ("plain", "draft-simple")
SCALE_PROGRAMS = ("prefill_chunk", "run_segment")
#: The batch job's defaults (`specjax.jobs.batch.batch`): prefill chunk, K/V cache type.
SCALE_CHUNK = 64
SCALE_CACHE_TYPE = "f16"


def scale_configs() -> tuple[Any, Any]:
    """(Llama-3.1-8B, Llama-3.2-1B) shapes as `ModelConfig`s in bf16."""
    from specjax.models.config import ModelConfig, RopeScaling

    common: dict[str, Any] = dict(
        arch="llama", vocab_size=128256, n_heads=32, n_kv_heads=8, rope_theta=500000.0,
        norm_eps=1e-5, max_position=131072, dtype="bfloat16",
    )  # fmt: skip
    target = ModelConfig(
        dim=4096, n_layers=32, ffn_dim=14336, rope_scaling=RopeScaling(factor=8.0), **common
    )
    draft = ModelConfig(
        dim=2048, n_layers=16, ffn_dim=8192, tie_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0), **common,
    )  # fmt: skip
    return target, draft


def abstract_params(config: Any) -> Any:
    """The init's parameter tree as `ShapeDtypeStruct`s: nothing is allocated."""
    import jax

    from specjax.models import llama

    return jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))


def scale_programs(config: str, target: str, k: int) -> dict[str, Any]:
    """The batch job's programs for one configuration and target, with abstract arguments
    placed as `specjax.jobs.batch._Runner._place` places them: (name -> (jitted fn, engine,
    args)), and the figures the report needs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from specjax import api, sampling
    from specjax.config import SpecConfig
    from specjax.decode import engine as eng
    from specjax.decode import prices
    from specjax.drafters.registry import build_drafters
    from specjax.jobs import continuous as cont
    from specjax.jobs import sharding as bs
    from specjax.memory.kv import cache_dtype

    rows, cells, (n_data, n_model) = SCALE_TARGETS[target]
    tcfg, dcfg = scale_configs()
    model = api.Model(config=tcfg, params=abstract_params(tcfg), eog=(128001, 128009))
    draft = api.Model(config=dcfg, params=abstract_params(dcfg), eog=(128001, 128009))
    spec = None
    if config == "draft-simple":
        spec = SpecConfig(types=("draft-simple",), draft_n_max=k, k_max=k, cost_calibrate=False)
    k_max = spec.resolved_k_max() if spec else 0
    # as the batch job (`_Runner`), less `prices.leave_out_unpaying`: the governor's static
    # pruning could leave the draft out at 32 rows, and the draft's program is what is measured
    drafters, drafter_params = build_drafters(spec, model, draft if spec else None)
    out_cap = min(cells, 512) + k_max + 1
    out_cap += -out_cap % 32
    engine = eng.Engine(
        target=tcfg, drafters=drafters, k_max=k_max, capacity=cells, out_capacity=out_cap,
        eog_ids=model.eog_ids, cache_type_k=cache_dtype(SCALE_CACHE_TYPE),
        cache_type_v=cache_dtype(SCALE_CACHE_TYPE),
    )  # fmt: skip
    devices = aot.mesh_devices(target)[: n_data * n_model]
    mesh = Mesh(np.asarray(devices).reshape(n_data, n_model), ("data", "model"))

    def place(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )

    rep = NamedSharding(mesh, P())
    params = place(model.params, bs.param_shardings(mesh, model.params))
    dparams = place(drafter_params, bs.drafter_param_shardings(mesh, drafter_params))
    state, ss = jax.eval_shape(lambda: cont.init_slots(engine, rows))
    st_sh, ss_sh = bs.state_shardings(mesh, engine, state, ss)
    state, ss = place(state, st_sh), place(ss, ss_sh)
    cost = prices.cost_model(
        spec, model, draft if spec else None, batch=rows, k_max=k_max, capacity=cells,
        drafters=drafters,
    )  # fmt: skip
    run = eng.RunParams(
        sampling=sampling.SamplingParams(
            temperature=jnp.zeros(rows, jnp.float32), top_k=jnp.zeros(rows, jnp.int32),
            top_p=jnp.ones(rows, jnp.float32), min_p=jnp.zeros(rows, jnp.float32),
            repeat_penalty=jnp.ones(rows, jnp.float32), seed=jnp.zeros(rows, jnp.uint32),
        ),
        max_new=jnp.ones(rows, jnp.int32),
        n_max=jnp.asarray(k, jnp.int32), chain_n_max=jnp.asarray(k if spec else 0, jnp.int32),
        n_min=jnp.asarray(0, jnp.int32), p_min=jnp.asarray(0.0, jnp.float32),
        synth_rates=jnp.zeros((max(k_max, 1),), jnp.float32), cost=cost,
    )  # fmt: skip

    def small(x: Any) -> Any:  # host values: replicated, as an uncommitted array under jit
        x = jnp.asarray(x) if not hasattr(x, "shape") else x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=rep)

    run = jax.tree.map(small, run)
    scalar = small(np.int32(0))
    donate = ("state", "slot_stats")
    prefill = jax.jit(
        cont.prefill_chunk, static_argnames=("engine",), donate_argnames=donate,
        out_shardings=(st_sh, ss_sh),
    )  # fmt: skip
    segment = jax.jit(
        cont.run_segment, static_argnames=("engine",), donate_argnames=donate,
        out_shardings=(st_sh, ss_sh, rep),
    )  # fmt: skip
    prefill.__name__ = "prefill_chunk"  # type: ignore[attr-defined]
    segment.__name__ = "run_segment"  # type: ignore[attr-defined]
    chunk, final, busy = (
        small(np.zeros(SCALE_CHUNK, np.int32)),
        small(np.bool_(True)),
        small(np.zeros(rows, bool)),
    )
    programs = {
        "prefill_chunk": (
            prefill,
            (params, dparams, state, ss, scalar, chunk, scalar, scalar, final, run),
        ),
        "run_segment": (segment, (params, dparams, state, ss, run, busy, scalar)),
    }
    # the smallest cache-sized buffer as one device holds it: a K (or V) layer's shard
    E = lambda c: c.head_dim or c.dim // c.n_heads  # noqa: E731
    heads = lambda c: c.n_kv_heads // n_model if c.n_kv_heads % n_model == 0 else c.n_kv_heads  # noqa: E731
    layer_cfgs = [tcfg] + ([dcfg] if spec else [])
    min_bytes = min(rows // n_data * cells * heads(c) * E(c) * 2 for c in layer_cfgs)
    return {
        "engine": engine,
        "programs": programs,
        "min_bytes": min_bytes,
        "mesh": {"data": n_data, "model": n_model},
        "rows": rows,
        "cells": cells,
        "k_max": k_max,
    }


def run_scale(
    configs: list[str], targets: list[str], k: int, programs: tuple[str, ...] = SCALE_PROGRAMS
) -> list[dict[str, Any]]:
    """Compile each (configuration, target, program) of `scale_programs`, one at a time."""
    import jax

    out = []
    for target in targets:
        backend = "tpu" if aot.platform_of(target) == "tpu" else "gpu"
        for config in configs:
            with aot.backend_as(backend):  # trace the accelerator's forms
                built = scale_programs(config, target, k)
            for name, (fn, args) in built["programs"].items():
                if name not in programs:
                    continue
                r = aot.compile_for(
                    fn, args, target, static=(built["engine"],), program=name,
                    min_bytes=built["min_bytes"], placed=True,
                )  # fmt: skip
                row = {
                    "config": config, "target": target, "program": name,
                    "rows": built["rows"], "cells": built["cells"], "k_max": built["k_max"],
                    "mesh": built["mesh"], "budget_bytes": SCALE_BUDGET[target],
                    "within_budget": bool(
                        r.compiled and r.memory.get("total", 0) <= SCALE_BUDGET[target]
                    ),
                    **r.to_json(),
                }  # fmt: skip
                out.append(row)
                mem = r.memory.get("total", 0) / 2**30
                print(f"# scale {config} {target} {name}: compiled={r.compiled} "
                      f"{mem:.2f} GiB/device {r.compile_s:.1f}s {r.error or ''}"[:600],
                      file=sys.stderr, flush=True)  # fmt: skip
                jax.clear_caches()
    return out


def scale_table(rows: list[dict[str, Any]]) -> str:
    gib = 2**30
    lines = [
        "| program | config | target (mesh) | rows x cells | compiled | argument / output / temp "
        "/ total GiB per device | within budget (v5e 14 GiB, H100 79 GiB) | compile s | host-driven loops | large copies "
        "in loop bodies |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        m = r["memory"]
        mem = (
            " / ".join(f"{m.get(k, 0) / gib:.2f}" for k in ("argument", "output", "temp", "total"))
            if m
            else "-"
        )
        compiled = "yes" if r["compiled"] else "no: " + (r["error"] or "")[:160]
        host = "-" if r["host_whiles"] is None else str(r["host_whiles"])
        mesh = f"data={r['mesh']['data']},model={r['mesh']['model']}"
        lines.append(
            f"| {r['program']} | {r['config']} | {r['target']} ({mesh}) | {r['rows']} x "
            f"{r['cells']} | {compiled} | {mem} | {'yes' if r['within_budget'] else 'no'} "
            f"| {r['compile_s']:.1f} | {host} | {len(r['large_copies'])} |"
        )
    return "\n".join(lines)


def write_section(path: str, key: str | None, section: dict[str, Any]) -> None:
    """Write one mode's results into the JSON at `path` ('-': nowhere), keeping the other
    mode's: `key` names the section (`scale`), None the top level (the default mode)."""
    if path == "-":
        return
    doc: dict[str, Any] = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    doc.update(section if key is None else {key: section})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batches", default="1,32")
    p.add_argument("--targets", default=",".join(aot.TARGETS))
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--shipped", action="store_true", help="also models/code-target (minutes)")
    p.add_argument(
        "--no-twins", action="store_true", help="no deeper twins (no per-layer counts): faster"
    )
    p.add_argument("--json", default=str(DEFAULT_JSON), help="output path, '-' for none")
    p.add_argument(
        "--scale", action="store_true", help="issue 50 item 5: 8B target + 1B draft, abstract"
    )
    p.add_argument("--scale-configs", default=",".join(SCALE_CONFIGS))
    p.add_argument("--scale-targets", default=",".join(SCALE_TARGETS))
    p.add_argument("--scale-programs", default=",".join(SCALE_PROGRAMS))
    p.add_argument("--scale-k", type=int, default=4, help="draft-simple's K (n_max and width)")
    a = p.parse_args(argv)
    aot.ensure_compilers()  # before jax is imported: may re-execute under .venv-aot
    import jax

    if a.scale:
        configs = [c for c in a.scale_configs.split(",") if c]
        targets = [t for t in a.scale_targets.split(",") if t]
        bad = (set(configs) - set(SCALE_CONFIGS)) | (set(targets) - set(SCALE_TARGETS))
        bad |= set(a.scale_programs.split(",")) - set(SCALE_PROGRAMS)
        if bad:
            p.error(f"unknown {sorted(bad)}; known: {SCALE_CONFIGS}, {tuple(SCALE_TARGETS)}")
        t0 = time.perf_counter()
        programs = tuple(x for x in a.scale_programs.split(",") if x)
        scale = run_scale(configs, targets, a.scale_k, programs)
        write_section(
            a.json,
            "scale",
            {
                "what": "issue 50 item 5: Llama-3.1-8B-shaped target + Llama-3.2-1B-shaped "
                "draft, abstract bf16 weights, the batch job's programs and shardings",
                "jax": jax.__version__,
                "seconds": round(time.perf_counter() - t0, 1),
                "rows": scale,
            },
        )
        print(scale_table(scale))
        return

    configs = [c for c in a.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; known: {CONFIGS}")
    t0 = time.perf_counter()
    rows = run(
        configs,
        [int(b) for b in a.batches.split(",")],
        [t for t in a.targets.split(",") if t],
        a.n_ctx,
        a.shipped,
        with_twins=not a.no_twins,
    )
    write_section(
        a.json,
        None,
        {
            "what": "deviceless compiles of specjax.generate's programs (specjax/aot.py)",
            "jax": jax.__version__,
            "seconds": round(time.perf_counter() - t0, 1),
            "rows": rows,
        },
    )
    print(table(rows))


if __name__ == "__main__":
    main()
