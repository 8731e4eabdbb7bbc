"""Training an EAGLE-3 head for a frozen target (optax), with the training-time test rollout.

Recipe: one YAML (configs/train/code-eagle3.yaml), sections ``head`` (Eagle3Config fields
except the ones read from the target), ``target`` (path of the target GGUF), ``data`` and
``optim`` (as specjax.train.target), ``train``::

    python -m specjax.train.eagle3 train --config configs/train/code-eagle3.yaml
    python -m specjax.train.eagle3 export --run runs/code-eagle3 --out models/code-eagle3/...gguf

The loss (training-time test, EAGLE-3): for every anchor position P of a window the head is
rolled out ``ttt_steps`` steps exactly as it drafts at inference:

* step 0 reads ``(t_{P+1}, g_P)`` at position P, ``g = fc(target features)``; it attends to
  the step-0 rows of every anchor p' <= P (the rows `process` writes into the draft cache);
* step j >= 1 reads ``(t_{P+j+1}, prenorm_{j-1}(P))`` -- its own previous pre-norm hidden,
  not the target's feature -- at position P + j and attends to the same step-0 rows plus
  its own anchor's rows of steps 1..j (the drafted rows of one draft);
* step j's logits are scored against the target's distribution at position P + j + 1
  (soft cross-entropy), weighted by ``step_decay ** j``; positions past the window are masked.

Tokens fed at steps >= 1 are the data tokens (teacher forcing). The target runs inside the
jitted step (frozen, float32) to produce its features and logits, so nothing is precomputed.
Invariants: the batch at step s is a pure function of (seed, s) (`specjax.train.target.TokenSampler`);
the head's projections are `specjax.models.eagle3.decoder_qkv` / `decoder_out`, the same code
the drafter runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from specjax.io.eagle3_gguf import save_eagle3_gguf
from specjax.models import eagle3 as e3
from specjax.models.config import ModelConfig
from specjax.train import heads
from specjax.train.heads import finish_head_run, head_cli, target_outputs
from specjax.train.target import (
    OptimConfig,
)
from specjax.types import Array, Params

#: (`finish_head_run`, `head_cli` and `target_outputs` live in `specjax.train.heads`; the
#: names stay importable from here.)
__all__ = ["finish_head_run", "head_cli", "target_outputs"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig(heads.HeadLoop):
    """`heads.HeadLoop` plus the training-time test's rollout length and step weights."""

    run_dir: str = "runs/code-eagle3"
    ttt_steps: int = 4
    step_decay: float = 0.8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3TrainConfig(heads.HeadRecipe):
    head: dict[str, Any]
    train: LoopConfig


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Eagle3TrainConfig:
    raw = heads.read_recipe(path, overrides, extra=("head",))
    return Eagle3TrainConfig(
        head=dict(raw.get("head") or {}), **heads.recipe_sections(raw, LoopConfig)
    )


def head_config(head: dict[str, Any], target: ModelConfig) -> e3.Eagle3Config:
    """The head's config: recipe fields plus what the target fixes (vocabulary, width)."""
    cfg: e3.Eagle3Config = heads.head_config_for(e3.Eagle3Config, head, target)
    if not cfg.own_embed and cfg.D != target.D:
        raise ValueError(
            f"a head sharing the target's embeddings needs dim == target dim ({target.D}), "
            f"got {cfg.D}"
        )
    return cfg


# ------------------------------------------------------------------------------- the loss
def _ttt_attention(cfg: e3.Eagle3Config, q: Array, ks: list[Array], vs: list[Array]) -> Array:
    """Step j's attention (j = len(ks) - 1): anchor-causal over step-0 rows + own-anchor rows
    of steps 1..j. q [B, T, H, E], ks/vs [B, T, G, E] per step; returns [B, T, H * E]."""
    B, T, H, E = q.shape
    G = cfg.G
    R = H // G
    qg = q.reshape(B, T, G, R, E)
    scale = 1.0 / math.sqrt(E)
    s0 = jnp.einsum("btgre,bsge->bgrts", qg, ks[0], preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
    s0 = jnp.where(causal[None, None, None], s0, -1e30)
    diag = [
        jnp.einsum("btgre,btge->bgrt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale
        for k in ks[1:]
    ]
    s = jnp.concatenate([s0, *diag], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bgrts,bsge->btgre", p[..., :T], vs[0])
    for i, v in enumerate(vs[1:]):
        out = out + p[..., T + i].transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :]
    return out.reshape(B, T, H * E)


def ttt_rollout(
    cfg: e3.Eagle3Config,
    n_steps: int,
    params: Params,
    shared: Params,
    inputs_BT: Array,
    feats_BTF: Array,
) -> list[Array]:
    """The head rolled out `n_steps` steps from every anchor P of the window: step j's
    logits [B, T, V] at anchor P read token `inputs[P + j + 1]` (clipped at the window end)
    and predict the token at position P + j + 2."""
    B, T = inputs_BT.shape
    g = e3.encode(cfg, params, feats_BTF)
    anchors = jnp.arange(T, dtype=jnp.int32)
    ks: list[Array] = []
    vs: list[Array] = []
    out = []
    for j in range(n_steps):
        tok = inputs_BT[:, jnp.minimum(anchors + j + 1, T - 1)]
        pos = jnp.broadcast_to(anchors + j, (B, T))
        qkv = e3.decoder_qkv(cfg, params, shared, tok, g, pos)
        ks.append(qkv.k)
        vs.append(qkv.v)
        attn = _ttt_attention(cfg, qkv.q, ks, vs)
        g = e3.decoder_out(cfg, params, attn, qkv.residual)
        out.append(e3.head_logits(cfg, params, shared, g))
    return out


def ttt_loss(
    cfg: e3.Eagle3Config,
    n_steps: int,
    decay: float,
    params: Params,
    shared: Params,
    inputs_BT: Array,
    feats_BTF: Array,
    t_logits_BTV: Array,
) -> tuple[Array, dict[str, Array]]:
    """Weighted soft cross-entropy of the rolled-out head against the target, per step."""
    B, T = inputs_BT.shape
    anchors = jnp.arange(T, dtype=jnp.int32)
    t_prob = jax.nn.softmax(t_logits_BTV, axis=-1)
    t_top = jnp.argmax(t_logits_BTV, axis=-1)
    total = jnp.zeros((), jnp.float32)
    wsum = 0.0
    metrics: dict[str, Array] = {}
    for j, logits in enumerate(ttt_rollout(cfg, n_steps, params, shared, inputs_BT, feats_BTF)):
        idx = anchors + j + 1  # the target's distribution at P + j + 1
        idx_c = jnp.minimum(idx, T - 1)
        logq = jax.nn.log_softmax(logits, axis=-1)
        tp = t_prob[:, idx_c]
        ce = heads.soft_cross_entropy(tp, logq)  # [B, T]
        m = jnp.broadcast_to((idx <= T - 1)[None, :], (B, T)).astype(jnp.float32)
        ce_j = jnp.sum(ce * m) / jnp.sum(m)
        agree = (jnp.argmax(logits, axis=-1) == t_top[:, idx_c]).astype(jnp.float32)
        w = decay**j
        total = total + w * ce_j
        wsum += w
        metrics[f"ce{j}"] = ce_j
        metrics[f"acc{j}"] = jnp.sum(agree * m) / jnp.sum(m)
    return total / wsum, metrics


# ------------------------------------------------------------------------------- the loop
def make_step(
    cfg: e3.Eagle3Config,
    target_cfg: ModelConfig,
    loop: LoopConfig,
    optim: OptimConfig,
    optimizer: optax.GradientTransformation,
) -> Any:
    """`specjax.train.heads.make_head_step` over the TTT loss: `step(params, opt_state, i,
    total, shared, target, batch)`, `evaluate(params, shared, target, batch)`."""

    def loss_fn(params: Params, shared: Params, target: Params, batch: Array) -> Any:
        inputs = batch[:, :-1]
        t_logits, hidden = target_outputs(target_cfg, target, cfg.target_layers, inputs)
        feats = jax.lax.stop_gradient(e3.gather_features(cfg, hidden))
        t_logits = jax.lax.stop_gradient(t_logits)
        return ttt_loss(
            cfg, loop.ttt_steps, loop.step_decay, params, shared, inputs, feats, t_logits
        )

    return heads.make_head_step(loss_fn, optim, optimizer)


def save_head(run_dir: Path, cfg: e3.Eagle3Config, params: Params, step: int) -> None:
    heads.save_npz(run_dir, "params.npz", params, {"head": cfg.to_dict(), "step": step})


def load_head(run_dir: str | Path) -> tuple[e3.Eagle3Config, Params]:
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "config.json").read_text())
    cfg = e3.Eagle3Config.from_dict(meta["head"])
    params = heads.load_npz(run_dir / "params.npz")
    e3.check_params(cfg, params)
    return cfg, params


def train(config: Eagle3TrainConfig) -> dict[str, Any]:
    return heads.train_feature_head(config, head_config, e3, make_step, save_head, load_head)


#: `export_gguf(run_dir, out, target_path, dtype="f16")`: a trained head written as an
#: `eagle3` GGUF, the tokenizer metadata from the target (`heads.export_head_gguf`).
export_gguf = partial(heads.export_head_gguf, load_head, save_eagle3_gguf)


def main(argv: Sequence[str] | None = None) -> int:
    return head_cli("python -m specjax.train.eagle3", argv, train, load_config, export_gguf)


if __name__ == "__main__":
    raise SystemExit(main())
