"""Training loop for the shipped code models: AdamW + warm-up/cosine, orbax checkpoints, bpb.

Recipe (one YAML, sections ``model``, ``data``, ``optim``, ``distill``, ``train``; see
configs/train/code-target.yaml)::

    specjax train --config configs/train/code-target.yaml [--set train.steps=100 ...]
    python -m specjax.train.target --config ...            # same entry point

Invariants:
* The batch at step ``s`` is a pure function of ``(seed, s)`` (`TokenSampler`), so a killed
  run that resumes from its last orbax checkpoint sees the same data order and reproduces the
  same loss curve and parameters as an uninterrupted run.
* Parameters stay float32; ``train.compute_dtype: bfloat16`` casts them for the forward only.
* Validation reports bits per byte: total nats over every next-token target of the validation
  array / ln 2 / total UTF-8 bytes those targets decode to (byte-level BPE: each token id has
  an exact byte length; specials count 0). Every target is scored exactly once.
* With ``distill.teacher`` (a params .npz written by this module) the loss is
  ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE``.

The forward is the inference forward over an empty cache of capacity ``seq_len``, positions
``arange(seq_len)``: `specjax.models.llama.forward_compute` for a `ModelConfig`,
`specjax.models.qwen35.forward` (chunked delta-net scan) for a `Qwen35Config` (``model.arch:
qwen35``; see specjax.train.hybrid). ``train.init_from`` copies the top-level tensors
(embeddings, output matrix, final norm) of equal shape from a GGUF / .npz before step 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from specjax.models import qwen35
from specjax.models.config import ModelConfig
from specjax.models.llama import forward_compute, init_params, new_cache
from specjax.pytree import check_known_keys, pytree_dataclass
from specjax.types import Array, Params

# ---------------------------------------------------------------------------------------------
# Configuration

#: The model families this trainer trains: a Llama-family decoder or a qwen35 hybrid.
AnyModelConfig = ModelConfig | qwen35.Qwen35Config


def model_config_from_dict(data: dict[str, Any]) -> AnyModelConfig:
    """A `Qwen35Config` when ``arch == "qwen35"``, else a `ModelConfig`."""
    if data.get("arch") == "qwen35":
        return qwen35.Qwen35Config.from_dict(data)
    return ModelConfig.from_dict(data)


def _from_dict(cls: type, data: dict[str, Any] | None, section: str) -> Any:
    data = dict(data or {})
    check_known_keys(cls, data, f"unknown keys in config section {section!r}")
    return cls(**data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    #: tokenizer.json; gives byte lengths for bpb (null: every token counts as one byte).
    tokenizer: str | None = "models/tokenizer/tokenizer.json"
    #: pre-tokenized uint16 .npy for training; null -> tokenize the local stdlib (cached).
    tokens_path: str | None = None
    #: pre-tokenized validation .npy; null -> the stdlib validation split (when tokens_path is
    #: null too), else no validation.
    val_tokens_path: str | None = None
    cache_dir: str = "runs/data"
    seq_len: int = 256
    batch_size: int = 32
    #: validate on at most this many tokens of the validation array (0 = all of it).
    val_max_tokens: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 200  # clamped to steps // 5
    weight_decay: float = 0.1  # AdamW, matrices only (no decay on norms)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global gradient norm clip (0 = off)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
    teacher: str | None = None  # params .npz of the teacher (config embedded); null = off
    alpha: float = 0.9  # weight of the KL term; 1 - alpha weighs the data cross-entropy
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
    run_dir: str = "runs/train"
    seed: int = 0
    steps: int = 1000
    #: > 0: before training, time the jitted step and set `steps` to fill this many seconds
    #: (recorded in run_dir/plan.json, so a resumed run keeps the same schedule).
    auto_steps_seconds: float = 0.0
    #: > 0: wall-clock budget; the loop stops (checkpoint + export) when it is spent.
    max_seconds: float = 0.0
    compute_dtype: str = "float32"  # or "bfloat16"
    log_every: int = 50
    eval_every: int = 1000  # 0 = only at the end
    checkpoint_every: int = 1000  # 0 = no checkpoints (no resume)
    keep_checkpoints: int = 2
    #: > 0: stop after this step as if killed (no export); used by the resume tests.
    stop_at_step: int = 0
    export_float16: bool = False  # also write params-f16.npz
    #: a GGUF or params .npz: its top-level tensors (embed, lm_head, final_norm) of equal shape
    #: replace the random init at step 0 ("" = off); named in summary["init_from"].
    init_from: str = ""
    progress: bool = True
    progress_interval: float = 1.0  # tqdm mininterval (seconds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: AnyModelConfig
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    distill: DistillConfig = DistillConfig()
    train: LoopConfig = LoopConfig()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        unknown = sorted(set(data) - {"model", "data", "optim", "distill", "train"})
        if unknown:
            raise ValueError(f"unknown config sections: {', '.join(unknown)}")
        if "model" not in data:
            raise ValueError("config needs a 'model' section")
        return cls(
            model=model_config_from_dict(data["model"]),
            data=_from_dict(DataConfig, data.get("data"), "data"),
            optim=_from_dict(OptimConfig, data.get("optim"), "optim"),
            distill=_from_dict(DistillConfig, data.get("distill"), "distill"),
            train=_from_dict(LoopConfig, data.get("train"), "train"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "data": dataclasses.asdict(self.data),
            "optim": dataclasses.asdict(self.optim),
            "distill": dataclasses.asdict(self.distill),
            "train": dataclasses.asdict(self.train),
        }


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as YAML) to a raw config dict."""
    raw = json.loads(json.dumps(raw))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form section.key=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def add_overrides_arg(
    p: argparse.ArgumentParser, metavar: str = "SECTION.KEY=VALUE", what: str = "config"
) -> None:
    """The trainers' repeatable `--set KEY=VALUE` (YAML-parsed recipe overrides, as
    `args.overrides`)."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar=metavar,
        help=f"override a {what} value (YAML-parsed), e.g. --set train.steps=100",
    )


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    return TrainConfig.from_dict(apply_overrides(raw, overrides))


# ---------------------------------------------------------------------------------------------
# Data


class TokenSampler:
    """Batches of ``seq_len + 1`` tokens; batch ``s`` is a pure function of ``(seed, s)``.

    Epoch ``e`` cuts the array into non-overlapping windows starting at a random offset
    ``o_e < seq_len`` and visits them in a random permutation; both come from
    ``np.random.default_rng([seed, e])``. Example ``i = s * B + b`` is window
    ``perm_e[i % n]`` of epoch ``e = i // n``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens = tokens
        self.T = seq_len
        self.B = batch_size
        self.seed = seed
        self.n_windows = (tokens.size - seq_len) // seq_len
        if self.n_windows < 1:
            raise ValueError(
                f"token array of {tokens.size} tokens is too short for seq_len {seq_len}"
            )

    @lru_cache(maxsize=4)  # noqa: B019 - a sampler lives as long as its run
    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(self.T))
        return offset, rng.permutation(self.n_windows)

    def starts(self, step: int) -> np.ndarray:
        out = np.empty((self.B,), np.int64)
        for b in range(self.B):
            i = step * self.B + b
            offset, perm = self._epoch(i // self.n_windows)
            out[b] = offset + int(perm[i % self.n_windows]) * self.T
        return out

    def batch(self, step: int) -> np.ndarray:
        """[B, seq_len + 1] int32."""
        idx = self.starts(step)[:, None] + np.arange(self.T + 1)[None, :]
        return self.tokens[idx].astype(np.int32)


def eval_windows(tokens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows [W, seq_len + 1] overlapping by one token, and a target mask [W, seq_len].

    Every next-token target ``tokens[1:]`` is scored exactly once.
    """
    n_targets = tokens.size - 1
    W = max(1, math.ceil(n_targets / seq_len))
    padded = np.zeros((W * seq_len + 1,), np.int32)
    padded[: tokens.size] = tokens
    idx = np.arange(W)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    mask = (idx[:, 1:] <= n_targets).astype(np.float32)
    return padded[idx], mask


def load_tokens(path: str | Path) -> np.ndarray:
    arr = np.load(path, mmap_mode=None)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer token array, got {arr.dtype}{arr.shape}")
    return arr


def resolve_data(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """Train tokens and validation tokens (or None) per the config."""
    if cfg.tokens_path:
        train = load_tokens(cfg.tokens_path)
        val = load_tokens(cfg.val_tokens_path) if cfg.val_tokens_path else None
        return train, val
    if not cfg.tokenizer:
        raise ValueError("data.tokens_path or data.tokenizer is required")
    from specjax.train.data import build_token_arrays

    paths = build_token_arrays(cfg.tokenizer, cfg.cache_dir)
    val_path = cfg.val_tokens_path or paths["val"]
    return load_tokens(paths["train"]), load_tokens(val_path)


def byte_lengths(cfg: DataConfig, vocab_size: int) -> np.ndarray:
    """[V] float32 bytes per token id (all ones without a tokenizer)."""
    if not cfg.tokenizer:
        return np.ones((vocab_size,), np.float32)
    from specjax.train.data import load_tokenizer, token_byte_lengths

    lengths = token_byte_lengths(load_tokenizer(cfg.tokenizer))
    out = np.zeros((vocab_size,), np.float32)
    out[: min(vocab_size, lengths.size)] = lengths[:vocab_size]
    return out


# ---------------------------------------------------------------------------------------------
# Parameters on disk (.npz, config embedded)


#: Top-level entries that are tuples of per-block dicts ("nextn": qwen35's MTP blocks).
_BLOCK_KEYS = ("layers", "nextn")


def flatten_params(params: Params) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in params.items():
        if k in _BLOCK_KEYS:
            for i, layer in enumerate(v):
                for name, arr in layer.items():
                    flat[f"{k}.{i}.{name}"] = arr
        else:
            flat[k] = v
    return flat


def unflatten_params(flat: dict[str, Any]) -> Params:
    params: Params = {}
    blocks: dict[str, dict[int, dict[str, Any]]] = {"layers": {}}
    for k, v in flat.items():
        head = k.split(".", 1)[0]
        if head in _BLOCK_KEYS:
            _, i, name = k.split(".", 2)
            blocks.setdefault(head, {}).setdefault(int(i), {})[name] = v
        else:
            params[k] = v
    for head, layers in blocks.items():
        params[head] = tuple(layers[i] for i in range(len(layers)))
    return params


def save_params_npz(
    path: str | Path, config: AnyModelConfig, params: Params, dtype: str = "float32"
) -> None:
    """Write params (cast to `dtype`) and the model config (JSON under ``__config__``)."""
    flat = {
        k: np.asarray(jax.device_get(v)).astype(dtype) for k, v in flatten_params(params).items()
    }
    flat["__config__"] = np.array(json.dumps(config.to_dict()))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **flat)  # type: ignore[arg-type]
    tmp.replace(path)


def load_params_npz(path: str | Path, dtype: str | None = None) -> tuple[AnyModelConfig, Params]:
    """Inverse of `save_params_npz`; arrays come back as numpy (cast to `dtype` if given)."""
    with np.load(path) as z:
        config = model_config_from_dict(json.loads(str(z["__config__"])))
        flat = {k: (z[k].astype(dtype) if dtype else z[k]) for k in z.files if k != "__config__"}
    return config, unflatten_params(flat)


# ---------------------------------------------------------------------------------------------
# Model functions


@pytree_dataclass
class TrainState:
    step: Array  # [] int32
    params: Params
    opt_state: Any


def model_logits(config: AnyModelConfig, params: Params, inputs_BT: Array) -> Array:
    """Full-sequence logits [B, T, V] float32: the inference forward over an empty cache
    (for qwen35: a fresh state of capacity T, the chunked delta-net scan)."""
    B, T = inputs_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if isinstance(config, qwen35.Qwen35Config):
        state = qwen35.new_state(config, B, T)
        return qwen35.forward(
            config, params, inputs_BT, positions_BT, state, cache_empty=True
        ).logits
    cache = new_cache(config, B, T)
    out = forward_compute(config, params, inputs_BT, positions_BT, cache, cache_empty=True)
    assert out.logits is not None
    return out.logits


def _cast(params: Params, dtype: str) -> Params:
    return jax.tree.map(lambda x: x.astype(dtype), params)


def learning_rate(cfg: OptimConfig, step: Array, total_steps: Array) -> Array:
    """Linear warm-up to cfg.lr over min(warmup_steps, total // 5) steps, then cosine decay to
    cfg.lr * min_lr_ratio at `total_steps`. `total_steps` is traced: changing it never
    recompiles."""
    step = step.astype(jnp.float32)
    total = jnp.maximum(total_steps.astype(jnp.float32), 1.0)
    warmup = jnp.minimum(jnp.float32(cfg.warmup_steps), jnp.floor(total / 5.0))
    warm = cfg.lr * step / jnp.maximum(warmup, 1.0)
    progress = jnp.clip((step - warmup) / jnp.maximum(total - warmup, 1.0), 0.0, 1.0)
    end = cfg.lr * cfg.min_lr_ratio
    cosine = end + (cfg.lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(step < warmup, warm, cosine)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW without the learning rate (global-norm clip, Adam, decoupled weight decay on
    matrices only); the step function scales the update by -learning_rate(...)."""

    def decay_mask(params: Params) -> Any:
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts += [
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
    ]
    return optax.chain(*parts)


def model_init_params(config: AnyModelConfig, key: Array) -> Params:
    """Random parameters of either model family."""
    if isinstance(config, qwen35.Qwen35Config):
        return qwen35.init_params(config, key)
    return init_params(config, key)


def load_any_params(path: str | Path) -> tuple[AnyModelConfig, Params]:
    """(config, float32 numpy params) from a params .npz or a GGUF (llama family or qwen35)."""
    if str(path).endswith(".npz"):
        return load_params_npz(path, dtype="float32")
    from specjax.io.gguf_io import read_architecture

    config: AnyModelConfig
    if read_architecture(str(path)) == "qwen35":
        from specjax.io.gguf_qwen35 import load_qwen35_gguf

        config, params, _ = load_qwen35_gguf(path, dtype="float32")
    else:
        from specjax.io.gguf_io import load_gguf

        config, params, _ = load_gguf(path, dtype="float32")
    return config, jax.tree.map(np.asarray, params)


def copy_top_level(params: Params, source: Params) -> tuple[Params, list[str]]:
    """`params` with its top-level (non-block) tensors replaced by `source`'s of equal shape;
    returns the names copied."""
    out, copied = dict(params), []
    for k, v in params.items():
        if k in _BLOCK_KEYS or k not in source:
            continue
        if tuple(np.shape(source[k])) == tuple(v.shape):
            out[k] = jnp.asarray(source[k], v.dtype)
            copied.append(k)
    return out, copied


def init_state(
    config: AnyModelConfig, optimizer: optax.GradientTransformation, seed: int
) -> TrainState:
    config = dataclasses.replace(config, dtype="float32")

    @jax.jit
    def init(key: Array) -> TrainState:
        params = model_init_params(config, key)
        with jax.numpy_dtype_promotion("standard"):
            opt_state = optimizer.init(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)

    return init(jax.random.key(seed))


def make_train_step(
    cfg: TrainConfig,
    optimizer: optax.GradientTransformation,
    teacher_config: AnyModelConfig | None = None,
) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
    """jit(step(state, batch [B, T+1] int32, teacher_params | None, total_steps [] int32)
    -> (state, metrics)); the state is donated."""
    compute = cfg.train.compute_dtype
    model_cfg = dataclasses.replace(cfg.model, dtype=compute)
    alpha, tau = cfg.distill.alpha, cfg.distill.temperature
    teacher_cfg = dataclasses.replace(teacher_config, dtype=compute) if teacher_config else None

    def loss_fn(params: Params, batch_BT1: Array, teacher: Params | None) -> tuple[Array, Any]:
        inputs, targets = batch_BT1[:, :-1], batch_BT1[:, 1:]
        logits = model_logits(model_cfg, _cast(params, compute), inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        if teacher is None or teacher_cfg is None:
            return ce, {"ce": ce}
        t_logits = jax.lax.stop_gradient(model_logits(teacher_cfg, teacher, inputs))
        t_logp = jax.nn.log_softmax(t_logits / tau, axis=-1)
        s_logp = jax.nn.log_softmax(logits / tau, axis=-1)
        kl = jnp.mean(jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1)) * (tau * tau)
        return alpha * kl + (1.0 - alpha) * ce, {"ce": ce, "kl": kl}

    @partial(jax.jit, donate_argnums=(0,))
    def step(
        state: TrainState, batch_BT1: Array, teacher: Params | None, total_steps: Array
    ) -> tuple[TrainState, Any]:
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch_BT1, teacher
        )
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 scalars
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        lr = learning_rate(cfg.optim, state.step, total_steps)
        params = jax.tree.map(lambda p, u: p - lr * u, state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr, **aux}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def make_eval_fn(
    config: AnyModelConfig, compute_dtype: str = "float32"
) -> Callable[..., tuple[Array, Array]]:
    """jit(eval(params, windows [W, T+1], mask [W, T], bytes [V]) -> (sum nats, sum bytes))."""
    model_cfg = dataclasses.replace(config, dtype=compute_dtype)

    @jax.jit
    def ev(params: Params, windows: Array, mask: Array, nbytes_V: Array) -> tuple[Array, Array]:
        inputs, targets = windows[:, :-1], windows[:, 1:]
        logp = jax.nn.log_softmax(model_logits(model_cfg, _cast(params, compute_dtype), inputs), -1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask), jnp.sum(nbytes_V[targets] * mask)

    return ev


def bits_per_byte(
    config: AnyModelConfig,
    params: Params,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    nbytes_V: np.ndarray,
    compute_dtype: str = "float32",
    eval_fn: Callable[..., tuple[Array, Array]] | None = None,
) -> dict[str, float]:
    """Validation bits per byte (and nats per token) over every target of `tokens`."""
    ev = eval_fn or make_eval_fn(config, compute_dtype)
    windows, mask = eval_windows(tokens, seq_len)
    W = windows.shape[0]
    pad = (-W) % batch_size
    if pad:
        windows = np.concatenate([windows, np.zeros((pad, seq_len + 1), np.int32)])
        mask = np.concatenate([mask, np.zeros((pad, seq_len), np.float32)])
    nats, nbytes = 0.0, 0.0
    bytes_dev = jnp.asarray(nbytes_V, jnp.float32)
    for i in range(0, windows.shape[0], batch_size):
        n, b = ev(
            params,
            jnp.asarray(windows[i : i + batch_size]),
            jnp.asarray(mask[i : i + batch_size]),
            bytes_dev,
        )
        nats += float(n)
        nbytes += float(b)
    n_targets = float(mask.sum())
    return {
        "bpb": nats / math.log(2) / max(nbytes, 1.0),
        "nats_per_token": nats / max(n_targets, 1.0),
        "tokens": n_targets,
        "bytes": nbytes,
    }


def top1_agreement(
    draft: tuple[AnyModelConfig, Params],
    target: tuple[AnyModelConfig, Params],
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int = 8,
) -> dict[str, float]:
    """Teacher-forced greedy agreement: the fraction of positions where
    argmax(draft) == argmax(target)."""
    (dcfg, dparams), (tcfg, tparams) = draft, target

    @jax.jit
    def agree(dp: Params, tp: Params, windows: Array, mask: Array) -> Array:
        inputs = windows[:, :-1]
        a = jnp.argmax(model_logits(dcfg, dp, inputs), -1)
        b = jnp.argmax(model_logits(tcfg, tp, inputs), -1)
        return jnp.sum((a == b).astype(jnp.float32) * mask)

    windows, mask = eval_windows(tokens, seq_len)
    pad = (-windows.shape[0]) % batch_size
    if pad:
        windows = np.concatenate([windows, np.zeros((pad, seq_len + 1), np.int32)])
        mask = np.concatenate([mask, np.zeros((pad, seq_len), np.float32)])
    dp, tp = jax.tree.map(jnp.asarray, dparams), jax.tree.map(jnp.asarray, tparams)
    hits = 0.0
    for i in range(0, windows.shape[0], batch_size):
        hits += float(
            agree(
                dp,
                tp,
                jnp.asarray(windows[i : i + batch_size]),
                jnp.asarray(mask[i : i + batch_size]),
            )
        )
    n = float(mask.sum())
    return {"agreement": hits / max(n, 1.0), "positions": n}


# ---------------------------------------------------------------------------------------------
# Checkpoints (orbax CheckpointManager, StandardSave / StandardRestore)


def _state_tree(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def _checkpoint_manager(run_dir: Path, keep: int) -> Any:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=max(1, keep), create=True)
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)


def _save(mngr: Any, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    step = int(state.step)
    if step in mngr.all_steps():
        return
    mngr.save(step, args=ocp.args.StandardSave(_state_tree(state)), force=True)


def _restore(mngr: Any, step: int, like: TrainState) -> TrainState:
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state_tree(like))
    tree = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    # Put the restored leaves back into the exact tree structure of `like` (optax namedtuples).
    leaves = jax.tree.leaves(tree)
    treedef = jax.tree.structure(_state_tree(like))
    restored = jax.tree.unflatten(treedef, leaves)
    return TrainState(
        step=restored["step"], params=restored["params"], opt_state=restored["opt_state"]
    )


# ---------------------------------------------------------------------------------------------
# The loop


def _read_log(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """The log's records up to `upto_step` (the checkpoint being resumed).

    A run killed while appending leaves a partial last line: it is dropped (the resumed run
    writes that record again). A malformed line anywhere else is an error naming it.
    """
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not a JSON record ({err})") from err
    return [r for r in rows if r["step"] <= upto_step]


def _plan_steps(
    cfg: TrainConfig,
    step_fn: Callable[..., Any],
    state: TrainState,
    sampler: TokenSampler,
    teacher: Any,
) -> tuple[int, float]:
    """Time the jitted step (after compiling) and return steps fitting auto_steps_seconds."""
    probe = jax.tree.map(jnp.copy, state)
    total = jnp.asarray(1000, jnp.int32)
    probe, m = step_fn(probe, jnp.asarray(sampler.batch(0)), teacher, total)  # compile
    jax.block_until_ready(m)
    n, t0 = 0, time.perf_counter()
    while n < 10 or (time.perf_counter() - t0 < 3.0 and n < 500):
        probe, m = step_fn(probe, jnp.asarray(sampler.batch(n + 1)), teacher, total)
        n += 1
        if n % 10 == 0:
            jax.block_until_ready(m)
    jax.block_until_ready(m)
    per_step = (time.perf_counter() - t0) / n
    del probe
    return max(1, int(cfg.train.auto_steps_seconds / per_step)), per_step


def train(
    config: TrainConfig | dict[str, Any],
    on_validate: Callable[[int, Params, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train (or resume) per `config`; returns the summary also written to run_dir/summary.json.

    `on_validate(step, params, result)` runs after each in-loop validation (e.g. to export an
    intermediate model file)."""
    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    cfg = config
    loop = cfg.train
    t_start = time.perf_counter()
    run_dir = Path(loop.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    timings: dict[str, float] = {}

    def mark(name: str) -> None:
        timings[name] = round(time.perf_counter() - t_start, 2)

    train_tokens, val_tokens = resolve_data(cfg.data)
    if int(train_tokens.max()) >= cfg.model.vocab_size:
        raise ValueError(f"token id {int(train_tokens.max())} >= vocab_size {cfg.model.vocab_size}")
    T, B = cfg.data.seq_len, cfg.data.batch_size
    sampler = TokenSampler(train_tokens, T, B, loop.seed)
    if val_tokens is not None and cfg.data.val_max_tokens:
        val_tokens = val_tokens[: cfg.data.val_max_tokens]
    nbytes_V = byte_lengths(cfg.data, cfg.model.vocab_size)

    teacher_cfg, teacher = None, None
    if cfg.distill.teacher:
        teacher_cfg, tparams = load_any_params(cfg.distill.teacher)
        if teacher_cfg.vocab_size != cfg.model.vocab_size:
            raise ValueError("teacher and student vocabularies differ")
        teacher = jax.tree.map(lambda x: jnp.asarray(x, loop.compute_dtype), tparams)

    plan_path = run_dir / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
    steps = int(plan["steps"]) if plan else loop.steps
    mngr = (
        _checkpoint_manager(run_dir, loop.keep_checkpoints) if loop.checkpoint_every > 0 else None
    )
    latest = mngr.latest_step() if mngr is not None else None

    mark("data_loaded")
    optimizer = make_optimizer(cfg.optim)
    step_fn = make_train_step(cfg, optimizer, teacher_cfg)
    eval_fn = make_eval_fn(cfg.model, loop.compute_dtype)
    state = init_state(cfg.model, optimizer, loop.seed)
    planned_per_step = None
    if plan is None and loop.auto_steps_seconds > 0 and latest is None:
        mark("state_initialised")
        steps, planned_per_step = _plan_steps(cfg, step_fn, state, sampler, teacher)
        mark("steps_planned")
    if plan is None:
        plan = {"steps": steps, "measured_seconds_per_step": planned_per_step}
        plan_path.write_text(json.dumps(plan))
    total_steps = jnp.asarray(steps, jnp.int32)
    copied: list[str] = []
    if loop.init_from and latest is None:
        state_params, copied = copy_top_level(state.params, load_any_params(loop.init_from)[1])
        if not copied:
            raise ValueError(f"train.init_from {loop.init_from}: no tensor of matching shape")
        state = TrainState(step=state.step, params=state_params, opt_state=state.opt_state)
    if mngr is not None and latest is not None:
        state = _restore(mngr, latest, state)
    elif mngr is not None:
        _save(mngr, state)  # step 0: proves the checkpoint path works before spending compute
    mark("checkpoint_ready")
    start = int(state.step)
    log_path = run_dir / "log.jsonl"
    log = _read_log(log_path, start)
    log_path.write_text("".join(json.dumps(r) + "\n" for r in log))

    def validate(step: int) -> dict[str, float] | None:
        if val_tokens is None:
            return None
        r = bits_per_byte(
            cfg.model, state.params, val_tokens, T, B, nbytes_V, loop.compute_dtype, eval_fn
        )
        rec = {"step": step, "val_bpb": r["bpb"], "val_nats_per_token": r["nats_per_token"]}
        log.append(rec)
        with log_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        return r

    from tqdm.auto import tqdm

    bar = tqdm(
        total=steps,
        initial=start,
        disable=not loop.progress,
        mininterval=loop.progress_interval,
        dynamic_ncols=True,
        unit="step",
    )
    t_loop = None
    steps_timed = 0
    stopped = "done"
    pending: list[tuple[int, Any]] = []
    step = start
    while step < steps:
        batch = jnp.asarray(sampler.batch(step))
        state, metrics = step_fn(state, batch, teacher, total_steps)
        step += 1
        if t_loop is None:
            jax.block_until_ready(metrics)
            t_loop = time.perf_counter()  # first step compiles; time the rest
            mark("first_step_done")
        else:
            steps_timed += 1
        pending.append((step, metrics))
        bar.update(1)
        if step % loop.log_every == 0 or step == steps:
            for s, m in pending:
                rec = {"step": s, **{k: float(v) for k, v in m.items()}}
                if s % loop.log_every == 0 or s == steps:
                    log.append(rec)
                    with log_path.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
            last = pending[-1][1]
            pending = []
            rate = steps_timed * B * T / max(time.perf_counter() - t_loop, 1e-9)
            bar.set_postfix(loss=f"{float(last['loss']):.4f}", tok_s=f"{rate:,.0f}", refresh=False)
        if loop.eval_every and step % loop.eval_every == 0 and step < steps:
            r = validate(step)
            if r is not None:
                bar.write(f"step {step}: val bpb {r['bpb']:.4f}")
                if on_validate is not None:
                    on_validate(step, state.params, r)
        if mngr is not None and step % loop.checkpoint_every == 0 and step < steps:
            _save(mngr, state)
        if loop.stop_at_step and step >= loop.stop_at_step and step < steps:
            stopped = "stop_at_step"
            break
        if loop.max_seconds and time.perf_counter() - t_start > loop.max_seconds:
            stopped = "max_seconds"
            break
    bar.close()
    mark("loop_done")
    if mngr is not None:
        _save(mngr, state)
        mngr.wait_until_finished()
        mngr.close()

    elapsed = time.perf_counter() - t_start
    loop_s = time.perf_counter() - t_loop if t_loop else 0.0
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "stopped": stopped,
        "step": step,
        "planned_steps": steps,
        "measured_seconds_per_step": plan.get("measured_seconds_per_step"),
        "tokens_seen": step * B * T,
        "seconds_this_run": elapsed,
        "tokens_per_second": steps_timed * B * T / loop_s if loop_s > 0 else None,
        "num_params": cfg.model.num_params(),
        "device": str(jax.devices()[0].device_kind),
        "train_loss": None,
        "timings": timings,
        "init_from": {"path": loop.init_from, "tensors": copied} if loop.init_from else None,
    }
    train_rows = [r for r in log if "loss" in r]
    if train_rows:
        summary["train_loss"] = train_rows[-1]["loss"]
        summary["train_ce"] = train_rows[-1]["ce"]
    if stopped == "stop_at_step":
        return summary
    r = validate(step)
    if r is not None:
        summary["val"] = r
    mark("final_validation_done")
    save_params_npz(run_dir / "params.npz", cfg.model, state.params, "float32")
    if loop.export_float16:
        save_params_npz(run_dir / "params-f16.npz", cfg.model, state.params, "float16")
    mark("exported")
    summary["log"] = log
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# ---------------------------------------------------------------------------------------------
# Command line


def train_main(argv: Sequence[str] | None = None) -> int:
    """`specjax train --config FILE [--set section.key=value ...]`."""
    p = argparse.ArgumentParser(prog="specjax train", description="train a specjax model")
    p.add_argument("--config", required=True, help="recipe YAML (configs/train/*.yaml)")
    add_overrides_arg(p)
    args = p.parse_args(argv)
    summary = train(load_config(args.config, args.overrides))
    brief = {k: v for k, v in summary.items() if k != "log"}
    print(json.dumps(brief, indent=1))
    return 0


def eval_main(argv: Sequence[str] | None = None) -> int:
    """`python -m specjax.train.target eval --tokens val.npy --target t.npz [--draft d.npz ...]`."""
    p = argparse.ArgumentParser(prog="specjax.train.target eval")
    p.add_argument("--tokens", required=True, help="validation token array (.npy)")
    p.add_argument("--tokenizer", default="models/tokenizer/tokenizer.json")
    p.add_argument("--target", required=True, help="params .npz")
    p.add_argument("--draft", action="append", default=[], help="params .npz (repeatable)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=0, help="use a prefix of the array (0 = all)")
    args = p.parse_args(argv)
    tokens = load_tokens(args.tokens)
    if args.max_tokens:
        tokens = tokens[: args.max_tokens]
    data = DataConfig(tokenizer=args.tokenizer or None)
    out: dict[str, Any] = {}
    tcfg, tparams = load_params_npz(args.target, dtype="float32")
    nbytes = byte_lengths(data, tcfg.vocab_size)
    out["target"] = {
        "path": args.target,
        **bits_per_byte(tcfg, tparams, tokens, args.seq_len, args.batch_size, nbytes),
    }
    for d in args.draft:
        dcfg, dparams = load_params_npz(d, dtype="float32")
        res = bits_per_byte(dcfg, dparams, tokens, args.seq_len, args.batch_size, nbytes)
        res.update(
            top1_agreement((dcfg, dparams), (tcfg, tparams), tokens, args.seq_len, args.batch_size)
        )
        out[d] = res
    print(json.dumps(out, indent=1))
    return 0


def export_gguf(
    params_npz: str | Path,
    out: str | Path,
    tokenizer: str | Path = "models/tokenizer",
    dtype: str = "f16",
) -> None:
    """Write a params .npz (from `train`) as a GGUF file with the tokenizer (needs `gguf`)."""
    from specjax.io.gguf_io import save_gguf
    from specjax.io.tokenizer import Tokenizer

    config, params = load_params_npz(params_npz, dtype="float32")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if isinstance(config, qwen35.Qwen35Config):
        from specjax.io.gguf_qwen35 import save_qwen35_gguf

        save_qwen35_gguf(out, config, params, Tokenizer.from_file(tokenizer), dtype=dtype)
        return
    save_gguf(out, config, params, Tokenizer.from_file(tokenizer), dtype=dtype)


def export_main(argv: Sequence[str] | None = None) -> int:
    """`python -m specjax.train.target export --params P.npz --out M.gguf [--dtype f16]`."""
    p = argparse.ArgumentParser(prog="specjax.train.target export")
    p.add_argument("--params", required=True, help="params .npz written by train")
    p.add_argument("--out", required=True, help="output .gguf")
    p.add_argument("--tokenizer", default="models/tokenizer", help="tokenizer.json or its folder")
    p.add_argument("--dtype", default="f16", help="f32, f16, bf16 or q8_0 (2-D weights)")
    args = p.parse_args(argv)
    export_gguf(args.params, args.out, args.tokenizer, args.dtype)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] == "eval":
        raise SystemExit(eval_main(argv[1:]))
    if argv and argv[0] == "export":
        raise SystemExit(export_main(argv[1:]))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(train_main(argv))
