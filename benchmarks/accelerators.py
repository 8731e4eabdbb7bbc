"""Deviceless compiles of what `specjax.generate` runs, for TPU v5e / v6e and an H100 (issue 50).

Each configuration is captured as a user gets it (`specjax.aot.capture_generate`: `generate`
with the executables recorded instead of compiled), then every captured program is compiled
for each target with abstract arguments (`specjax.aot.compile_captured`). Nothing runs:
the figures are the compiled programs' (see `specjax/aot.py` for what each one counts).

    python benchmarks/accelerators.py                  # tiny config, B=1 and 32, all targets
    python benchmarks/accelerators.py --shipped        # also models/code-target (minutes)
    python benchmarks/accelerators.py --configs plain --batches 1 --targets h100 --json -

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

CONFIGS = ("plain", "draft-simple", "ngram-mod+draft-simple", "hybrid-plain")
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "accelerators.json"
SHIPPED_TARGET = ROOT / "models" / "code-target" / "code-target-f16.gguf"
SHIPPED_DRAFT = ROOT / "models" / "code-draft" / "code-draft-f16.gguf"


#: The tiny configuration's shape: a handful of layers, 64-wide heads (an accelerator's: XLA's
#: GPU compiler, untuned deviceless, fails to tile some products of 8-wide heads).
TINY_SHAPE = dict(dim=128, n_heads=2, n_kv_heads=1, ffn_dim=256)
#: Layers added to the target (and to the draft) of a twin configuration to count kernels per
#: layer: the difference in a round's kernels over the difference in layers (a round's fixed
#: part cancels).
EXTRA_LAYERS = 2


def tiny_models(n_ctx: int, target_extra: int = 0, draft_extra: int = 0) -> dict[str, Any]:
    import jax

    from specjax import api
    from specjax.models import qwen35 as q
    from specjax.testing import tiny_model

    pos = max(4096, n_ctx)
    shape: dict[str, Any] = dict(TINY_SHAPE, max_position=pos)
    hybrid_cfg = q.Qwen35Config(  # tests/test_hybrid_spec.py's, with room for the context
        vocab_size=8, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=48,
        rope_dim=8, rope_theta=10000.0, ssm_state_size=8, ssm_k_heads=2, ssm_v_heads=4,
        ssm_conv_kernel=4, full_attention_interval=2, max_position=pos,
    )  # fmt: skip
    return {
        "target": tiny_model(0, n_layers=2 + target_extra, **shape),
        "draft": tiny_model(1, n_layers=1 + draft_extra, **shape),
        "hybrid": api.Model(
            config=hybrid_cfg,  # type: ignore[arg-type]
            params=q.init_params(hybrid_cfg, jax.random.PRNGKey(1), std=0.2),
        ),
    }


def shipped_models() -> dict[str, Any]:
    import specjax

    return {
        "target": specjax.load(str(SHIPPED_TARGET), dtype="float16"),
        "draft": specjax.load(str(SHIPPED_DRAFT), dtype="float16"),
    }


def spec_for(config: str, tiny: bool) -> Any:
    from specjax.config import SpecConfig

    if config == "draft-simple":
        return SpecConfig(types=("draft-simple",), draft_n_max=4, cost_calibrate=False)
    if config == "ngram-mod+draft-simple":
        small = dict(ngram_mod_n_match=4, ngram_mod_n_min=2, ngram_mod_n_max=8) if tiny else {}
        pool = {"ngram_mod_pool_size": 1 << 12} if tiny else {}
        return SpecConfig(
            types=("ngram-mod", "draft-simple"), draft_n_max=4, cost_calibrate=False,
            **small, **pool,  # type: ignore[arg-type]
        )  # fmt: skip
    return None


def cache_layer_bytes(config: Any, batch: int, cells: int) -> int:
    """Bytes of one layer's K (or V) buffer in F16: the smallest cache-sized buffer."""
    head_dim = getattr(config, "head_dim", 0) or config.dim // config.n_heads
    return int(batch * cells * config.n_kv_heads * head_dim * 2)


def capture(
    models: dict[str, Any], config: str, batch: int, n_ctx: int, tiny: bool
) -> dict[str, Any]:
    target = models["hybrid"] if config == "hybrid-plain" else models["target"]
    spec = spec_for(config, tiny)
    vocab = target.config.vocab_size
    prompts = [[(3 + 7 * i + j) % vocab for j in range(12)] for i in range(batch)]
    kwargs: dict[str, Any] = dict(max_new_tokens=32, n_ctx=n_ctx)
    if spec is not None:
        kwargs.update(spec=spec, draft=models["draft"])
    t0 = time.perf_counter()
    caps, error = aot.capture_generate(target, prompts, **kwargs)
    engine = caps[-1].engine if caps else None
    cells = int(getattr(engine, "capacity", n_ctx) or n_ctx)
    return {
        "captured": caps,
        "capture_s": time.perf_counter() - t0,
        "capture_error": error,
        "programs": [c.name for c in caps],
        "drafters": [getattr(d, "name", str(d)) for d in getattr(engine, "drafters", ())],
        "target_layers": int(target.config.n_layers),
        "draft_layers": int(models["draft"].config.n_layers) if spec is not None else None,
        "cells": cells,
        "large_min_bytes": cache_layer_bytes(target.config, batch, cells),
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


def run(
    configs: list[str], batches: list[int], targets: list[str], n_ctx: int, shipped: bool
) -> list[dict[str, Any]]:
    sets = [("tiny", True, tiny_models(n_ctx))]
    deeper_target = tiny_models(n_ctx, target_extra=EXTRA_LAYERS)
    deeper_draft = tiny_models(n_ctx, draft_extra=EXTRA_LAYERS)
    if shipped:
        sets.append(("code-target", False, shipped_models()))
    rows = []
    for model_name, tiny, models in sets:
        for config in configs:
            if config == "hybrid-plain" and "hybrid" not in models:
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
                if tiny and batch == batches[0] and config != "hybrid-plain":
                    twins["per_target_layer"] = capture(deeper_target, config, batch, n_ctx, tiny)
                    if cap["draft_layers"]:
                        twins["per_draft_layer"] = capture(deeper_draft, config, batch, n_ctx, tiny)
                for target in targets:
                    reports = aot.compile_captured(
                        cap["captured"], target, min_bytes=cap["large_min_bytes"]
                    )
                    summary = summarise(reports, cap["target_layers"])
                    for key, twin in twins.items():
                        deep = summarise(aot.compile_captured(twin["captured"], target), 1)
                        summary[key] = per_layer(summary, deep, EXTRA_LAYERS)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batches", default="1,32")
    p.add_argument("--targets", default=",".join(aot.TARGETS))
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--shipped", action="store_true", help="also models/code-target (minutes)")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="output path, '-' for none")
    a = p.parse_args(argv)
    aot.ensure_compilers()  # before jax is imported: may re-execute under .venv-aot
    import jax

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
    )
    result = {
        "what": "deviceless compiles of specjax.generate's programs (specjax/aot.py)",
        "jax": jax.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    if a.json != "-":
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
