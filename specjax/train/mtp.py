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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from specjax.models import qwen35
from specjax.models.qwen35_mtp import new_nextn_cache, nextn_forward
from specjax.train import heads
from specjax.train.target import (
    OptimConfig,
)
from specjax.types import Array, Params

OBJECTIVES = ("target", "data")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig(heads.HeadLoop):
    """`heads.HeadLoop` plus the objective and where the block starts from (`init_from`: a
    run directory whose nextn.npz starts this run, e.g. a head trained on an earlier trunk;
    "" = the GGUF's block, or a fresh one with `reinit`)."""

    run_dir: str = "runs/code-hybrid-mtp"
    objective: str = "target"
    eval_every: int = 100
    save_every: int = 50
    #: re-initialise the block (N(0, 0.02)) instead of starting from the GGUF's
    reinit: bool = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpTrainConfig(heads.HeadRecipe):
    train: LoopConfig


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> MtpTrainConfig:
    return MtpTrainConfig(**heads.recipe_sections(heads.read_recipe(path, overrides), LoopConfig))


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
        ce = heads.soft_cross_entropy(tp, logq)
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
    """`specjax.train.heads.make_head_step` over the MTP loss: `step(nextn, opt_state, i,
    total, trunk, batch)`, `evaluate(nextn, trunk, batch)`."""

    def loss_fn(nextn: tuple[Params, ...], trunk: Params, batch: Array) -> Any:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        t_logits, h = trunk_outputs(cfg, trunk, inputs)
        t_logits, h = jax.lax.stop_gradient(t_logits), jax.lax.stop_gradient(h)
        return mtp_loss(cfg, loop.objective, nextn, trunk, inputs, targets, t_logits, h)

    return heads.make_head_step(loss_fn, optim, optimizer)


def _trunk_only(params: Params) -> Params:
    return {k: v for k, v in params.items() if k != "nextn"}


def save_run(run_dir: Path, nextn: tuple[Params, ...], step: int) -> None:
    flat = {f"{i}.{k}": v for i, b in enumerate(nextn) for k, v in b.items()}
    heads.save_npz(run_dir, "nextn.npz", flat, {"step": step})


def load_run(run_dir: str | Path) -> tuple[Params, ...]:
    blocks: dict[int, dict[str, Any]] = {}
    for key, arr in heads.load_npz(Path(run_dir) / "nextn.npz").items():
        i, name = key.split(".", 1)
        blocks.setdefault(int(i), {})[name] = arr
    return tuple(blocks[i] for i in sorted(blocks))


def _reinit(cfg: qwen35.Qwen35Config, key: Array, dtype: Any) -> tuple[Params, ...]:
    fresh = qwen35.init_params(cfg, key)["nextn"]
    return tuple({k: v.astype(dtype) for k, v in b.items()} for b in fresh)


def train(config: MtpTrainConfig) -> dict[str, Any]:
    from specjax.api import load

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
    sampler, _, val_tokens = heads.corpus(config.data, loop.seed)
    optimizer, opt_state = heads.init_optimizer(config.optim, nextn)
    step_fn, eval_fn = make_step(cfg, loop, config.optim, optimizer)
    return heads.run_loop(
        loop,
        nextn,
        opt_state,
        lambda p, s, i, total, batch: step_fn(p, s, i, total, trunk, batch),
        lambda i: jnp.asarray(sampler.batch(i)),
        lambda p, n: save_run(Path(loop.run_dir), p, n),
        lambda p, batch: eval_fn(p, trunk, batch),
        heads.validation_batch(val_tokens, config.data.seq_len, loop.eval_windows),
        eval_first=True,
    )


def export_gguf(run_dir: str, out: str, target_path: str, dtype: str = "f16") -> None:
    """Write the target GGUF again with the trained nextn block(s) (trunk unchanged)."""
    from specjax.io.gguf_qwen35 import load_qwen35_gguf, save_qwen35_gguf

    cfg, params, tokenizer = load_qwen35_gguf(target_path, dtype="float32")
    nextn = load_run(run_dir)
    if len(nextn) != cfg.n_nextn:
        raise ValueError(f"{run_dir} has {len(nextn)} nextn blocks, {target_path} {cfg.n_nextn}")
    save_qwen35_gguf(out, cfg, {**params, "nextn": nextn}, tokenizer, dtype=dtype)


def main(argv: Sequence[str] | None = None) -> int:
    return heads.head_cli("python -m specjax.train.mtp", argv, train, load_config, export_gguf)


if __name__ == "__main__":
    raise SystemExit(main())
