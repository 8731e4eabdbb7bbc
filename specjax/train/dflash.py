"""Training a DFlash or DSpark head for a frozen target (optax).

Recipe: one YAML (configs/train/code-dflash.yaml, code-dspark.yaml), sections ``head``
(DFlashConfig fields except the ones read from the target), ``target``, ``data``, ``optim``
(as specjax.train.target), ``train`` and optionally ``generated`` (a second stage on the target's
own text, started from the first with ``train.init_from``)::

    python -m specjax.train.dflash train --config configs/train/code-dflash.yaml
    python -m specjax.train.dflash train --config configs/train/code-dflash-stage2.yaml
    python -m specjax.train.dflash export --run runs/code-dflash --out models/code-dflash/...gguf

Per window of T tokens the frozen target gives its features and logits; `g` and the K/V of
every position are computed once (`inject_kv`, as `process` writes them). From ``anchors``
random anchor positions n per window a block `[t_n, MASK x (W - 1)]` at positions n..n+W-1
is run exactly as `draft` runs it (`specjax.models.dflash.block_forward`): non-causal over
the block, attending to the injected context at positions < n.

* DFlash (block rows 1..W-1, row j predicts the token at n + j): soft cross-entropy against
  the target's distribution at n + j - 1, weight ``decay ** (j - 1)``.
* DSpark (anchor layout, row i predicts the token at n + i + 1; Markov bias teacher-forced
  with the data token at n + i as `prev`): ``0.1 * CE + 0.9 * TV`` against the target's
  distribution at n + i, plus the confidence BCE with label "the draft's argmax equals the
  target's" (stop-gradient), same weights ``decay ** i``.

With a ``generated`` section (`specjax.train.draft.GeneratedData`) the windows are the
target's own continuations of training-document prompts (`target_rows`, shared with the draft
trainer and its cache) instead of corpus windows; a row that ends early is scored only up to
its length. Validation stays on corpus windows.

Rows past the window are masked. Invariants: the batch at step s and the anchors are pure
functions of (seed, s); the head's graph is the drafter's own code.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from specjax.io.dflash_gguf import save_dflash_gguf
from specjax.models import dflash as df
from specjax.models.config import ModelConfig
from specjax.train import heads
from specjax.train.draft import GeneratedData, RowSampler, target_rows
from specjax.train.target import (
    OptimConfig,
    TokenSampler,
    _from_dict,
    flatten_params,
    unflatten_params,
)
from specjax.types import Array, Params


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig(heads.HeadLoop):
    """`heads.HeadLoop` plus the block loss's anchors and weights."""

    run_dir: str = "runs/code-dflash"
    anchors: int = 16  # blocks per window
    decay: float = 0.8  # position weight decay along the block
    ce_weight: float = 0.1  # DSpark
    tv_weight: float = 0.9  # DSpark
    conf_weight: float = 1.0  # DSpark


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashTrainConfig(heads.HeadRecipe):
    head: dict[str, Any]
    train: LoopConfig
    #: train on the target's own continuations (`specjax.train.draft.GeneratedData`) instead
    #: of corpus windows; validation stays on corpus windows
    generated: GeneratedData | None = None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> DFlashTrainConfig:
    raw = heads.read_recipe(path, overrides, extra=("head", "generated"))
    generated = raw.get("generated")
    return DFlashTrainConfig(
        head=dict(raw.get("head") or {}),
        **heads.recipe_sections(raw, LoopConfig),
        generated=None if generated is None else _from_dict(GeneratedData, generated, "generated"),
    )


def head_config(head: dict[str, Any], target: ModelConfig) -> df.DFlashConfig:
    cfg: df.DFlashConfig = heads.head_config_for(df.DFlashConfig, head, target)
    if (not cfg.own_embed or not cfg.own_lm_head) and cfg.D != target.D:
        raise ValueError(f"a head sharing the target's weights needs dim == {target.D}")
    return cfg


def anchor_positions(seed: int, step: Array, B: int, A: int, T: int) -> Array:
    """[B, A] anchors in 1..T-2 (at least one context row and one label), from (seed, step)."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.randint(key, (B, A), 1, T - 1)


def anchor_blocks(
    cfg: df.DFlashConfig,
    params: Params,
    shared: Params,
    inputs_BT: Array,
    feats_BTF: Array,
    anchors_BA: Array,
) -> tuple[Array, Array | None, Array, Array]:
    """Every anchor's block as the drafter runs it (DSpark: Markov bias teacher-forced with
    the data tokens): logits [B*A, W, V], confidences [B*A, W] (or None), the index of the
    position whose target distribution each row is scored against [B*A, W] (may exceed
    T - 1: past the window) and the supervised-row mask [B*A, W] (DFlash: rows 1..;
    DSpark: all rows from the anchor)."""
    B, T = inputs_BT.shape
    A = anchors_BA.shape[1]
    W = cfg.block_size
    g = df.encode(cfg, params, feats_BTF)
    pos_T = jnp.arange(T, dtype=jnp.int32)
    kv = df.inject_kv(cfg, params, g, jnp.broadcast_to(pos_T, (B, T)))
    # every anchor's context: the window's K/V at positions < n
    rep = lambda x: jnp.repeat(x, A, axis=0)  # noqa: E731  [B*A, T, G, E]
    ctx_kv = df.LayerKV(tuple(rep(k) for k in kv.k), tuple(rep(v) for v in kv.v))
    n = anchors_BA.reshape(B * A)
    ctx_pos = jnp.where(pos_T[None, :] < n[:, None], pos_T[None, :], -1)
    j = jnp.arange(W, dtype=jnp.int32)[None, :]
    tok_n = jnp.take_along_axis(rep(inputs_BT), n[:, None], axis=1)[:, 0]
    tokens = jnp.where(j == 0, tok_n[:, None], cfg.mask_token_id)
    positions = n[:, None] + j
    mask_pos = jnp.broadcast_to(n[:, None] + W - 1, positions.shape)
    prev = None
    if cfg.is_dspark:  # the Markov chain teacher-forced with the data's tokens
        prev = jnp.take_along_axis(rep(inputs_BT), jnp.clip(n[:, None] + j, 0, T - 1), axis=1)
    ctx = (ctx_kv, ctx_pos)
    out = df.block_forward(cfg, params, shared, tokens, positions, mask_pos, None, ctx, prev)
    # the token of DFlash row r goes to position n + r, DSpark's (from the anchor) to n + r + 1:
    # scored against the target's distribution that predicts it, at n + r - 1 / n + r
    shift = 1 if cfg.is_dspark else 0
    tgt_idx = n[:, None] + j + shift - 1
    valid = (tgt_idx <= T - 1) & (j >= (0 if cfg.is_dspark else 1))
    return out.logits, out.conf, tgt_idx, valid


def block_loss(
    cfg: df.DFlashConfig,
    loop: LoopConfig,
    params: Params,
    shared: Params,
    inputs_BT: Array,
    feats_BTF: Array,
    t_logits_BTV: Array,
    anchors_BA: Array,
    lengths_B: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The block loss of module docstring; metrics: per-row top-1 agreement. `lengths_B`:
    tokens of each row that are real (generated rows end early, 0-padded): rows scored past
    them are masked."""
    T = inputs_BT.shape[1]
    A = anchors_BA.shape[1]
    W = cfg.block_size
    base, conf, tgt_idx, valid = anchor_blocks(
        cfg, params, shared, inputs_BT, feats_BTF, anchors_BA
    )
    if lengths_B is not None:
        valid = valid & (tgt_idx < jnp.repeat(lengths_B, A)[:, None])
    j = jnp.arange(W, dtype=jnp.int32)[None, :]
    tgt_c = jnp.clip(tgt_idx, 0, T - 1)
    t_logits = jnp.take_along_axis(jnp.repeat(t_logits_BTV, A, axis=0), tgt_c[..., None], axis=1)
    t_prob = jax.nn.softmax(t_logits, axis=-1)
    logq = jax.nn.log_softmax(base, axis=-1)
    ce = heads.soft_cross_entropy(t_prob, logq)  # [BA, W]
    expo = (j - (0 if cfg.is_dspark else 1)).astype(jnp.float32)
    w = jnp.where(valid, jnp.float32(loop.decay) ** expo, 0.0)
    wsum = jnp.sum(w)
    agree = (jnp.argmax(base, -1) == jnp.argmax(t_logits, -1)).astype(jnp.float32)
    metrics: dict[str, Array] = {"ce": jnp.sum(ce * w) / wsum}
    for r in range(W):
        m = valid[:, r].astype(jnp.float32)
        metrics[f"acc{r}"] = jnp.sum(agree[:, r] * m) / jnp.maximum(jnp.sum(m), 1.0)
    if not cfg.is_dspark:
        return metrics["ce"], metrics
    tv = 0.5 * jnp.sum(jnp.abs(t_prob - jnp.exp(logq)), axis=-1)
    loss = loop.ce_weight * metrics["ce"] + loop.tv_weight * jnp.sum(tv * w) / wsum
    metrics["tv"] = jnp.sum(tv * w) / wsum
    if conf is not None:
        label = jax.lax.stop_gradient(agree)
        c = jnp.clip(conf, 1e-6, 1 - 1e-6)
        bce = -(label * jnp.log(c) + (1 - label) * jnp.log(1 - c))
        metrics["bce"] = jnp.sum(bce * w) / wsum
        loss = loss + loop.conf_weight * metrics["bce"]
    return loss, metrics


def make_step(
    cfg: df.DFlashConfig,
    target_cfg: ModelConfig,
    loop: LoopConfig,
    optim: OptimConfig,
    optimizer: optax.GradientTransformation,
) -> Any:
    """`specjax.train.heads.make_head_step` over the block loss: `step(params, opt_state, i,
    total, shared, target, batch, lengths)` (anchors from (seed, i)), `evaluate(params,
    shared, target, batch)` (anchors from (seed + 1, 0))."""

    def loss_fn(params, shared, target, batch, anchors, lengths=None):
        inputs = batch[:, :-1]
        t_logits, hidden = heads.target_outputs(target_cfg, target, cfg.target_layers, inputs)
        feats = jax.lax.stop_gradient(df.gather_features(cfg, hidden))
        t_logits = jax.lax.stop_gradient(t_logits)
        return block_loss(cfg, loop, params, shared, inputs, feats, t_logits, anchors, lengths)

    def anchors_of(seed: int, i: Array, batch: Array) -> Array:
        B, T = batch.shape[0], batch.shape[1] - 1
        return anchor_positions(seed, i, B, loop.anchors, T)

    def step_args(i, shared, target, batch, lengths=None):
        return shared, target, batch, anchors_of(loop.seed, i, batch), lengths

    def eval_args(shared, target, batch):
        return shared, target, batch, anchors_of(loop.seed + 1, jnp.asarray(0), batch)

    return heads.make_head_step(loss_fn, optim, optimizer, step_args, eval_args)


def save_head(run_dir: Path, cfg: df.DFlashConfig, params: Params, step: int) -> None:
    flat = flatten_params(params)
    heads.save_npz(run_dir, "params.npz", flat, {"head": cfg.to_dict(), "step": step})


def load_head(run_dir: str | Path) -> tuple[df.DFlashConfig, Params]:
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "config.json").read_text())
    cfg = df.DFlashConfig.from_dict(meta["head"])
    params = unflatten_params(heads.load_npz(run_dir / "params.npz"))
    df.check_params(cfg, params)
    return cfg, params


def train(config: DFlashTrainConfig) -> dict[str, Any]:
    def batches_for(sampler: TokenSampler, train_tokens: Any, val_tokens: Any) -> Any:
        """Step i's (windows, lengths): corpus windows (lengths None) or, with a
        `generated` section, the target's own rows and their lengths."""
        if config.generated is None:
            return lambda i: (jnp.asarray(sampler.batch(i)), None)
        config.generated.validate()
        rows = target_rows(
            config.generated, config.target, config.data.cache_dir, train_tokens, val_tokens
        )
        row_sampler = RowSampler(rows["train"].shape[0], config.data.batch_size, config.train.seed)
        print(f"{rows['train'].shape[0]:,} generated rows", file=sys.stderr)

        def batch(i: int) -> tuple[Array, Array]:
            idx = row_sampler.indices(i)
            return jnp.asarray(rows["train"][idx]), jnp.asarray(rows["train_len"][idx])

        return batch

    return heads.train_feature_head(
        config, head_config, df, make_step, save_head, load_head, batches_for
    )


#: `export_gguf(run_dir, out, target_path, dtype="f16")`: a trained head written as a
#: `dflash` GGUF, the tokenizer metadata from the target (`heads.export_head_gguf`).
export_gguf = partial(heads.export_head_gguf, load_head, save_dflash_gguf)


def main(argv: Sequence[str] | None = None) -> int:
    return heads.head_cli("python -m specjax.train.dflash", argv, train, load_config, export_gguf)


if __name__ == "__main__":
    raise SystemExit(main())
