"""Training a qwen35 hybrid target (gated delta-net + gated attention) with specjax.train.target's loop.

Recipe (one YAML, the sections of specjax.train.target with ``model.arch: qwen35``; see
configs/train/code-hybrid.yaml)::

    python -m specjax.train.hybrid --config configs/train/code-hybrid.yaml \\
        [--out models/code-hybrid/code-hybrid-f16.gguf] [--set train.steps=100 ...]
    python -m specjax.train.hybrid export --params runs/code-hybrid/params.npz --out M.gguf

Everything but the model is `specjax.train.target`'s: config loading, `TokenSampler` batches (a pure
function of (seed, step)), AdamW + warm-up/cosine, optional distillation from a llama-family
teacher (``distill.teacher``: a GGUF or .npz), ``train.init_from`` (embeddings / output matrix
copied from a GGUF of the same vocabulary and width), validation bits per byte, orbax
checkpoints, the params .npz. The training forward is `specjax.models.qwen35.forward` over a
fresh state of capacity ``seq_len`` (chunked delta-net scan), so training and inference compute
the same function (tests/test_train_hybrid.py checks it against the token-by-token recurrence).

Invariants:
* NextN/MTP blocks (``model.n_nextn``) are part of the parameter pytree so the params .npz and
  the GGUF carry them, but the trunk's loss never reads them: their gradient is zero and they
  stay at their random init (up to AdamW's weight decay). They are trained separately on the
  frozen trunk.
* After each in-loop validation the run's parameters are written as ``run_dir/snapshot.npz``
  and ``run_dir/snapshot-f16.gguf`` (atomic replaces), so an intermediate model is usable while
  training goes on; at the end ``--out`` (default ``run_dir/model-f16.gguf``) and
  ``run_dir/train_log.json`` (the run summary) are written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specjax.models.qwen35 import Qwen35Config
from specjax.train.target import (
    TrainConfig,
    add_overrides_arg,
    export_gguf,
    export_main,
    load_config,
    save_params_npz,
    train,
)
from specjax.types import Params


def train_hybrid(
    cfg: TrainConfig,
    out: str | Path | None = None,
    tokenizer: str | Path = "models/tokenizer",
    dtype: str = "f16",
) -> dict[str, Any]:
    """Train the qwen35 model of `cfg` (snapshots after each validation) and export it as GGUF.

    Returns the run summary (also run_dir/train_log.json) with ``gguf`` set to the file."""
    if not isinstance(cfg.model, Qwen35Config):
        raise ValueError(
            f"specjax.train.hybrid trains model.arch: qwen35, got {cfg.model.arch!r} "
            "(use specjax.train.target for llama-family models)"
        )
    run_dir = Path(cfg.train.run_dir)

    def snapshot(step: int, params: Params, result: dict[str, float]) -> None:
        save_params_npz(run_dir / "snapshot.npz", cfg.model, params, "float32")
        export_gguf(run_dir / "snapshot.npz", run_dir / "snapshot-f16.gguf", tokenizer, dtype)
        info = {"step": step, "val_bpb": result["bpb"], "gguf": str(run_dir / "snapshot-f16.gguf")}
        (run_dir / "snapshot.json").write_text(json.dumps(info))

    summary = train(cfg, on_validate=snapshot)
    if summary["stopped"] == "stop_at_step":
        return summary
    gguf_path = Path(out) if out else run_dir / f"model-{dtype}.gguf"
    export_gguf(run_dir / "params.npz", gguf_path, tokenizer, dtype)
    summary["gguf"] = str(gguf_path)
    (run_dir / "train_log.json").write_text(json.dumps(summary))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specjax.train.hybrid --config FILE [--out M.gguf] [--set section.key=value]`."""
    p = argparse.ArgumentParser(
        prog="specjax.train.hybrid", description="train a qwen35 hybrid target"
    )
    p.add_argument("--config", required=True, help="recipe YAML (configs/train/code-hybrid.yaml)")
    p.add_argument("--out", default=None, help="GGUF to write at the end (default run_dir/...)")
    p.add_argument("--tokenizer", default="models/tokenizer", help="tokenizer.json or its folder")
    p.add_argument("--dtype", default="f16", help="f32, f16, bf16 or q8_0 (2-D weights)")
    add_overrides_arg(p)
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    summary = train_hybrid(cfg, args.out, args.tokenizer, args.dtype)
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=1))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] == "export":
        raise SystemExit(export_main(argv[1:]))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main(argv))
