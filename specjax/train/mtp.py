"""Training the NextN/MTP block of a qwen35 model on its frozen trunk (optax).

Recipe: one YAML (configs/train/code-hybrid-mtp.yaml), sections ``target`` (the qwen35 GGUF
whose nextn block is trained; its trunk stays frozen), ``data`` and ``optim`` (as
specjax.train.target) and ``train``::

    python -m specjax.train.mtp train --config configs/train/code-hybrid-mtp.yaml
    python -m specjax.train.mtp export --run runs/code-hybrid-mtp \
        --target models/code-hybrid/code-hybrid-f16.gguf --out models/code-hybrid/code-hybrid-f16.gguf

Teacher forcing, exactly the rows the drafter's `process` writes: for a window x_0..x_{T-1}
the frozen trunk gives h_nextn h_0..h_{T-1}; block row p is `(x_p, h_{p-1})` (h_{-1} = 0, as
upstream's zero `pending_h` before the first batch) at position p, attending causally to rows
0..p (its own KV, `qwen35_mtp.nextn_forward`, the code the drafter runs). Row p predicts the
token at p + 1, i.e. the pair (h_p, x_{p+1}) predicts x_{p+2}. The loss is the cross-entropy
against the trunk's own next-token distribution at p (``objective: target``, distillation:
what greedy verification accepts) or against the data token x_{p+1} (``objective: data``).
Only `params["nextn"]` is trained; the trunk, its embeddings and LM head (which the block
shares) get no gradient. Invariant: the batch at step s is a pure function of (seed, s).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from specjax.models import qwen35
from specjax.models.qwen35_mtp import new_nextn_cache, nextn_forward
from specjax.train.target import (
    DataConfig,
    OptimConfig,
    TokenSampler,
    learning_rate,
    make_optimizer,
    resolve_data,
)
from specjax.types import Array, Params

OBJECTIVES = ("target", "data")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
    run_dir: str = "runs/code-hybrid-mtp"
    seed: int = 0
    steps: int = 1000
    max_seconds: float = 0.0  # > 0: stop (and save) after this much wall time
    objective: str = "target"
    log_every: int = 10
    eval_every: int = 100
    eval_windows: int = 16
    save_every: int = 50
    #: re-initialise the block (N(0, 0.02)) instead of starting from the GGUF's
    reinit: bool = False
    #: a run directory whose nextn.npz starts this run (e.g. a head trained on an earlier
    #: trunk; fresh optimiser state); "" = the GGUF's block (or reinit)
    init_from: str = ""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpTrainConfig:
    target: str
    data: DataConfig
    optim: OptimConfig
    train: LoopConfig


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> MtpTrainConfig:
    from specjax.train.target import _from_dict, apply_overrides

    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw = apply_overrides(raw, overrides)
    unknown = sorted(set(raw) - {"target", "data", "optim", "train"})
    if unknown:
        raise ValueError(f"unknown config sections: {', '.join(unknown)}")
    return MtpTrainConfig(
        target=str(raw["target"]),
        data=_from_dict(DataConfig, raw.get("data"), "data"),
        optim=_from_dict(OptimConfig, raw.get("optim"), "optim"),
        train=_from_dict(LoopConfig, raw.get("train"), "train"),
    )


# ------------------------------------------------------------------------------- the loss
def trunk_outputs(cfg: qwen35.Qwen35Config, trunk: Params, inputs_BT: Array) -> tuple[Array, Array]:
    """The frozen trunk over a window: logits [B, T, V] and h_nextn [B, T, D]."""
    B, T = inputs_BT.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = qwen35.forward(
        cfg, trunk, inputs_BT, pos, qwen35.new_state(cfg, B, T), cache_empty=True,
        return_hidden=True,
    )  # fmt: skip
    assert out.hidden is not None
    return out.logits, out.hidden


def mtp_loss(
    cfg: qwen35.Qwen35Config,
    objective: str,
    nextn: tuple[Params, ...],
    trunk: Params,
    inputs_BT: Array,
    targets_BT: Array,
    t_logits_BTV: Array,
    h_BTD: Array,
) -> tuple[Array, dict[str, Array]]:
    """Block 0 over rows (x_p, h_{p-1}); CE at every row p (predicting position p + 1)."""
    B, T = inputs_BT.shape
    h_in = jnp.concatenate([jnp.zeros_like(h_BTD[:, :1]), h_BTD[:, :-1]], axis=1)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    params = {**trunk, "nextn": nextn}
    out = nextn_forward(
        cfg, params, 0, inputs_BT, h_in, pos, new_nextn_cache(cfg, B, T), cache_empty=True
    )
    logq = jax.nn.log_softmax(out.logits, axis=-1)
    t_top = jnp.argmax(t_logits_BTV, axis=-1)
    if objective == "target":
        tp = jax.nn.softmax(t_logits_BTV, axis=-1)
        ce = -jnp.sum(tp * jnp.where(tp > 0, logq, 0.0), axis=-1)
    else:
        ce = -jnp.take_along_axis(logq, targets_BT[..., None], axis=-1)[..., 0]
    pred = jnp.argmax(out.logits, axis=-1)
    metrics = {
        "ce": jnp.mean(ce),
        # first-draft-token acceptance under greedy verification (block vs trunk argmax)
        "acc_target": jnp.mean((pred == t_top).astype(jnp.float32)),
        "acc_data": jnp.mean((pred == targets_BT).astype(jnp.float32)),
    }
    return jnp.mean(ce), metrics


def make_step(
    cfg: qwen35.Qwen35Config,
    loop: LoopConfig,
    optim: OptimConfig,
    optimizer: optax.GradientTransformation,
) -> Any:
    def loss_fn(nextn: tuple[Params, ...], trunk: Params, batch: Array) -> Any:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        t_logits, h = trunk_outputs(cfg, trunk, inputs)
        t_logits, h = jax.lax.stop_gradient(t_logits), jax.lax.stop_gradient(h)
        return mtp_loss(cfg, loop.objective, nextn, trunk, inputs, targets, t_logits, h)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(
        nextn: tuple[Params, ...], opt_state: Any, trunk: Params, batch: Array, i: Array,
        total: Array,
    ) -> Any:  # fmt: skip
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(nextn, trunk, batch)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, nextn)
        lr = learning_rate(optim, i, total)
        nextn = jax.tree.map(lambda p, u: p - lr * u, nextn, updates)
        return nextn, opt_state, {"loss": loss, "lr": lr, **aux}

    @jax.jit
    def evaluate(nextn: tuple[Params, ...], trunk: Params, batch: Array) -> Any:
        return loss_fn(nextn, trunk, batch)

    return step, evaluate


def _trunk_only(params: Params) -> Params:
    return {k: v for k, v in params.items() if k != "nextn"}


def save_run(run_dir: Path, nextn: tuple[Params, ...], step: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    flat = {f"{i}.{k}": np.asarray(v) for i, b in enumerate(nextn) for k, v in b.items()}
    tmp = run_dir / "nextn.tmp.npz"
    np.savez(tmp, **flat)  # type: ignore[arg-type]
    tmp.replace(run_dir / "nextn.npz")
    (run_dir / "config.json").write_text(json.dumps({"step": step}))


def load_run(run_dir: str | Path) -> tuple[Params, ...]:
    blocks: dict[int, dict[str, Any]] = {}
    with np.load(Path(run_dir) / "nextn.npz") as z:
        for key in z.files:
            i, name = key.split(".", 1)
            blocks.setdefault(int(i), {})[name] = jnp.asarray(z[key])
    return tuple(blocks[i] for i in sorted(blocks))


def _reinit(cfg: qwen35.Qwen35Config, key: Array, dtype: Any) -> tuple[Params, ...]:
    fresh = qwen35.init_params(cfg, key)["nextn"]
    return tuple({k: v.astype(dtype) for k, v in b.items()} for b in fresh)


def train(config: MtpTrainConfig) -> dict[str, Any]:
    from specjax.api import load
    from specjax.train.eagle3 import finish_head_run

    loop = config.train
    model = load(config.target, dtype="float32")
    cfg = model.config
    if not isinstance(cfg, qwen35.Qwen35Config) or cfg.n_nextn < 1:
        raise ValueError(f"{config.target}: needs a qwen35 model with a nextn block")
    trunk = _trunk_only(model.params)
    nextn = tuple(dict(b) for b in model.params["nextn"])
    if loop.reinit:
        nextn = _reinit(cfg, jax.random.key(loop.seed), jnp.float32)
    if loop.init_from:
        nextn = load_run(loop.init_from)
        if len(nextn) != cfg.n_nextn:
            raise ValueError(
                f"{loop.init_from} has {len(nextn)} nextn blocks, the target {cfg.n_nextn}"
            )
    train_tokens, val_tokens = resolve_data(config.data)
    sampler = TokenSampler(train_tokens, config.data.seq_len, config.data.batch_size, loop.seed)
    optimizer = make_optimizer(config.optim)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(nextn)
    step_fn, eval_fn = make_step(cfg, loop, config.optim, optimizer)
    run_dir = Path(loop.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log: list[dict[str, Any]] = []
    val_batch = None
    if val_tokens is not None:
        T = config.data.seq_len
        n = min(loop.eval_windows, (val_tokens.size - 1) // T)
        starts = np.arange(n) * ((val_tokens.size - T - 1) // max(n, 1))
        val_batch = jnp.asarray(
            np.stack([val_tokens[s : s + T + 1] for s in starts]).astype(np.int32)
        )
    if val_batch is not None:
        _, vm = eval_fn(nextn, trunk, val_batch)
        row0 = {"step": -1, "val": {k: round(float(v), 4) for k, v in vm.items()}}
        log.append(row0)
        print(json.dumps(row0), file=sys.stderr, flush=True)
    total = jnp.asarray(loop.steps, jnp.int32)
    t0 = time.time()
    i = 0
    for i in range(loop.steps):
        batch = jnp.asarray(sampler.batch(i))
        nextn, opt_state, m = step_fn(
            nextn, opt_state, trunk, batch, jnp.asarray(i, jnp.int32), total
        )
        elapsed = time.time() - t0
        if i % loop.log_every == 0 or i == loop.steps - 1:
            row = {"step": i, "seconds": round(elapsed, 1)}
            row.update({k: round(float(v), 4) for k, v in m.items()})
            log.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if val_batch is not None and (i + 1) % loop.eval_every == 0:
            _, vm = eval_fn(nextn, trunk, val_batch)
            vrow = {"step": i, "val": {k: round(float(v), 4) for k, v in vm.items()}}
            log.append(vrow)
            print(json.dumps(vrow), file=sys.stderr, flush=True)
        if (i + 1) % loop.save_every == 0:
            save_run(run_dir, nextn, i + 1)
            (run_dir / "train_log.json").write_text(json.dumps(log))
        if loop.max_seconds > 0 and elapsed > loop.max_seconds:
            break
    save_run(run_dir, nextn, i + 1)
    val = None if val_batch is None else eval_fn(nextn, trunk, val_batch)[1]
    return finish_head_run(run_dir, log, i + 1, t0, val)


def export_gguf(run_dir: str, out: str, target_path: str, dtype: str = "f16") -> None:
    """Write the target GGUF again with the trained nextn block(s) (trunk unchanged)."""
    from specjax.io.gguf_qwen35 import load_qwen35_gguf, save_qwen35_gguf

    cfg, params, tokenizer = load_qwen35_gguf(target_path, dtype="float32")
    nextn = load_run(run_dir)
    if len(nextn) != cfg.n_nextn:
        raise ValueError(f"{run_dir} has {len(nextn)} nextn blocks, {target_path} {cfg.n_nextn}")
    save_qwen35_gguf(out, cfg, {**params, "nextn": nextn}, tokenizer, dtype=dtype)


def main(argv: Sequence[str] | None = None) -> int:
    from specjax.train.eagle3 import head_cli

    return head_cli("python -m specjax.train.mtp", argv, train, load_config, export_gguf)


if __name__ == "__main__":
    raise SystemExit(main())
