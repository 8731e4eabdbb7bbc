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

import argparse
import dataclasses
import json
import math
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

from specjax.models import eagle3 as e3
from specjax.models.config import ModelConfig
from specjax.models.llama import forward_compute, new_cache
from specjax.train.target import (
    DataConfig,
    OptimConfig,
    TokenSampler,
    learning_rate,
    make_optimizer,
    resolve_data,
)
from specjax.types import Array, Params


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
    run_dir: str = "runs/code-eagle3"
    seed: int = 0
    steps: int = 1000
    max_seconds: float = 0.0  # > 0: stop (and save) after this much wall time
    ttt_steps: int = 4
    step_decay: float = 0.8
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 16
    save_every: int = 100
    #: a run directory whose params.npz starts this run (fresh optimiser state); "" = init
    init_from: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3TrainConfig:
    head: dict[str, Any]
    target: str
    data: DataConfig
    optim: OptimConfig
    train: LoopConfig


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Eagle3TrainConfig:
    from specjax.train.target import _from_dict, apply_overrides

    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw = apply_overrides(raw, overrides)
    known = {"head", "target", "data", "optim", "train"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config sections: {', '.join(unknown)}")
    return Eagle3TrainConfig(
        head=dict(raw.get("head") or {}),
        target=str(raw["target"]),
        data=_from_dict(DataConfig, raw.get("data"), "data"),
        optim=_from_dict(OptimConfig, raw.get("optim"), "optim"),
        train=_from_dict(LoopConfig, raw.get("train"), "train"),
    )


def head_config(head: dict[str, Any], target: ModelConfig) -> e3.Eagle3Config:
    """The head's config: recipe fields plus what the target fixes (vocabulary, width)."""
    data = dict(head)
    data.setdefault("vocab_size", target.V)
    data.setdefault("target_hidden", target.D)
    data.setdefault("max_position", target.max_position)
    data.setdefault("rope_theta", target.rope_theta)
    data.setdefault("norm_eps", target.norm_eps)
    cfg = e3.Eagle3Config.from_dict(data)
    if not cfg.own_embed and cfg.D != target.D:
        raise ValueError(
            f"a head sharing the target's embeddings needs dim == target dim ({target.D}), "
            f"got {cfg.D}"
        )
    if max(cfg.target_layers) > target.L:
        raise ValueError(
            f"target layer ids {list(cfg.target_layers)} exceed the target's {target.L} layers"
        )
    return cfg


# ------------------------------------------------------------------------------- the loss
def target_outputs(
    target_cfg: ModelConfig, target_params: Params, layers: tuple[int, ...], inputs_BT: Array
) -> tuple[Array, dict[int, Array]]:
    """The frozen target over a window: logits [B, T, V] and features {layer: [B, T, Dt]}."""
    B, T = inputs_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = new_cache(target_cfg, B, T)
    layers = tuple(sorted(set(layers)))
    out = forward_compute(
        target_cfg, target_params, inputs_BT, positions, cache, layers, cache_empty=True
    )
    assert out.logits is not None
    return out.logits, dict(zip(layers, out.hidden))


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
        ce = -jnp.sum(tp * jnp.where(tp > 0, logq, 0.0), axis=-1)  # [B, T]
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
    def loss_fn(params: Params, shared: Params, target: Params, batch: Array) -> Any:
        inputs = batch[:, :-1]
        t_logits, hidden = target_outputs(target_cfg, target, cfg.target_layers, inputs)
        feats = jax.lax.stop_gradient(e3.gather_features(cfg, hidden))
        t_logits = jax.lax.stop_gradient(t_logits)
        return ttt_loss(
            cfg, loop.ttt_steps, loop.step_decay, params, shared, inputs, feats, t_logits
        )

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(
        params: Params,
        opt_state: Any,
        shared: Params,
        target: Params,
        batch: Array,
        i: Array,
        total: Array,
    ) -> Any:
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, shared, target, batch
        )
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        lr = learning_rate(optim, i, total)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, {"loss": loss, "lr": lr, **aux}

    @jax.jit
    def evaluate(params: Params, shared: Params, target: Params, batch: Array) -> Any:
        return loss_fn(params, shared, target, batch)

    return step, evaluate


def save_head(run_dir: Path, cfg: e3.Eagle3Config, params: Params, step: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    flat = {k: np.asarray(v) for k, v in params.items()}
    tmp = run_dir / "params.tmp.npz"
    np.savez(tmp, **flat)  # type: ignore[arg-type]
    tmp.replace(run_dir / "params.npz")
    (run_dir / "config.json").write_text(json.dumps({"head": cfg.to_dict(), "step": step}))


def load_head(run_dir: str | Path) -> tuple[e3.Eagle3Config, Params]:
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "config.json").read_text())
    cfg = e3.Eagle3Config.from_dict(meta["head"])
    with np.load(run_dir / "params.npz") as z:
        params = {k: jnp.asarray(z[k]) for k in z.files}
    e3.check_params(cfg, params)
    return cfg, params


def train(config: Eagle3TrainConfig) -> dict[str, Any]:
    from specjax.api import load

    loop = config.train
    target = load(config.target, dtype="float32")
    cfg = head_config(config.head, target.config)
    shared = e3.shared_weights(cfg, target.params, target.config.tie_embeddings)
    train_tokens, val_tokens = resolve_data(config.data)
    sampler = TokenSampler(train_tokens, config.data.seq_len, config.data.batch_size, loop.seed)
    optimizer = make_optimizer(config.optim)
    params = e3.init_params(cfg, jax.random.key(loop.seed))
    if loop.init_from:
        init_cfg, params = load_head(loop.init_from)
        if init_cfg != cfg:
            raise ValueError(f"{loop.init_from}: head config differs from the recipe's")
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(params)
    step_fn, eval_fn = make_step(cfg, target.config, loop, config.optim, optimizer)
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
    total = jnp.asarray(loop.steps, jnp.int32)
    t0 = time.time()
    print(
        f"eagle3 head: {cfg.num_params():,} params, target layers {list(cfg.target_layers)}",
        file=sys.stderr,
    )
    i = 0
    for i in range(loop.steps):
        batch = jnp.asarray(sampler.batch(i))
        params, opt_state, m = step_fn(
            params, opt_state, shared, target.params, batch, jnp.asarray(i, jnp.int32), total
        )
        elapsed = time.time() - t0
        if i % loop.log_every == 0 or i == loop.steps - 1:
            row = {"step": i, "seconds": round(elapsed, 1)}
            row.update({k: round(float(v), 4) for k, v in m.items()})
            log.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if val_batch is not None and (i + 1) % loop.eval_every == 0:
            _, vm = eval_fn(params, shared, target.params, val_batch)
            vrow: dict[str, Any] = {
                "step": i,
                "val": {k: round(float(v), 4) for k, v in vm.items()},
            }
            log.append(vrow)
            print(json.dumps(vrow), file=sys.stderr, flush=True)
        if (i + 1) % loop.save_every == 0:
            save_head(run_dir, cfg, params, i + 1)
            (run_dir / "train_log.json").write_text(json.dumps(log))
        if loop.max_seconds > 0 and elapsed > loop.max_seconds:
            break
    save_head(run_dir, cfg, params, i + 1)
    val = None if val_batch is None else eval_fn(params, shared, target.params, val_batch)[1]
    return finish_head_run(run_dir, log, i + 1, t0, val)


def export_gguf(run_dir: str, out: str, target_path: str, dtype: str = "f16") -> None:
    """Write a trained head as an `eagle3` GGUF (tokenizer metadata from the target)."""
    from specjax.api import load
    from specjax.io.eagle3_gguf import save_eagle3_gguf

    cfg, params = load_head(run_dir)
    target = load(target_path, dtype="float32")
    save_eagle3_gguf(out, cfg, params, target.tokenizer, dtype=dtype)


def finish_head_run(
    run_dir: Path, log: list[Any], steps: int, t0: float, val: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run's summary (steps, seconds, the final validation metrics `val` when given),
    appended to the log, written to `train_log.json` and printed; returned."""
    summary: dict[str, Any] = {"steps": steps, "seconds": round(time.time() - t0, 1)}
    if val is not None:
        summary["val"] = {k: round(float(v), 4) for k, v in val.items()}
    log.append({"summary": summary})
    (run_dir / "train_log.json").write_text(json.dumps(log, indent=0))
    print(json.dumps(summary), file=sys.stderr)
    return summary


def head_cli(
    prog: str, argv: Sequence[str] | None, train_fn: Any, load_config_fn: Any, export_fn: Any
) -> int:
    """`python -m PROG train --config C [--set k=v]` / `export --run R --out O`, shared by
    the head trainers."""
    ap = argparse.ArgumentParser(prog=prog)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--config", required=True)
    t.add_argument("--set", action="append", default=[])
    x = sub.add_parser("export")
    x.add_argument("--run", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--target", default="models/code-target/code-target-f16.gguf")
    x.add_argument("--dtype", default="f16")
    args = ap.parse_args(argv)
    if args.cmd == "train":
        train_fn(load_config_fn(args.config, args.set))
    else:
        export_fn(args.run, args.out, args.target, args.dtype)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return head_cli("python -m specjax.train.eagle3", argv, train, load_config, export_gguf)


if __name__ == "__main__":
    raise SystemExit(main())
