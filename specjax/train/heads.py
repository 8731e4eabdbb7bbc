"""The one training loop of the draft heads on a frozen target: EAGLE-3
(`specjax.train.eagle3`), DFlash / DSpark (`specjax.train.dflash`) and the qwen35 MTP block
(`specjax.train.mtp`). Each head module brings its own loss (`loss_fn(params, *args) ->
(loss, metrics)`); what they share is here:

* the recipe: one YAML with sections ``target``, ``data``, ``optim`` (`specjax.train.target`),
  ``train`` (the head's `LoopConfig`, a `HeadLoop`) and the head's own extra sections
  (`read_recipe`, `recipe_sections`, `HeadRecipe`), the head config completed from the target
  (`head_config_for`), the corpus (`corpus`) and the optimiser (`init_optimizer`);
* the frozen target's outputs over a window (`target_outputs`) and the soft cross-entropy
  against its distribution (`soft_cross_entropy`);
* the optimiser step (`make_head_step`: value_and_grad, optax update, the schedule's learning
  rate), the validation windows (`validation_batch`), the loop with its log, evaluation,
  checkpoints and wall-time stop (`run_loop`), the run's summary (`finish_head_run`), the
  feature heads' whole driver (`train_feature_head`), the checkpoint files (`save_npz`,
  `load_npz`), the export (`export_head_gguf`) and the command line (`head_cli`, with
  `specjax.train.target.add_overrides_arg`).

Invariants: the batch at step s is a pure function of (seed, s) (the caller's `batches`); the
loop saves every `save_every` steps and at the end, and logs step 0, every `log_every` steps
and the last step; the params at a step depend only on the recipe (no host state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Collection, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from specjax.models.config import ModelConfig
from specjax.models.llama import forward_compute, new_cache
from specjax.train.target import (
    DataConfig,
    OptimConfig,
    TokenSampler,
    _from_dict,
    add_overrides_arg,
    apply_overrides,
    learning_rate,
    make_optimizer,
    resolve_data,
)
from specjax.types import Array, Params

#: The sections every head recipe has.
RECIPE_SECTIONS = ("target", "data", "optim", "train")


# ------------------------------------------------------------------------------- the recipe
@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadLoop:
    """The `train` section fields every head trainer has (what `run_loop` reads); each
    trainer's `LoopConfig` adds its loss's and sets its own `run_dir`."""

    run_dir: str = "runs/head"
    seed: int = 0
    steps: int = 1000
    max_seconds: float = 0.0  # > 0: stop (and save) after this much wall time
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 16
    save_every: int = 100
    #: a run directory whose saved head starts this run (fresh optimiser state); "" = init
    init_from: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadRecipe:
    """The sections every head recipe has (`recipe_sections`)."""

    target: str
    data: DataConfig
    optim: OptimConfig
    train: HeadLoop


def read_recipe(
    path: str | Path, overrides: Sequence[str] = (), extra: Collection[str] = ()
) -> dict[str, Any]:
    """The recipe YAML with `overrides` (`section.key=value`) applied; ValueError naming
    sections other than `RECIPE_SECTIONS` and `extra`."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw = apply_overrides(raw, overrides)
    unknown = sorted(set(raw) - {*RECIPE_SECTIONS, *extra})
    if unknown:
        raise ValueError(f"unknown config sections: {', '.join(unknown)}")
    return raw


def recipe_sections(raw: dict[str, Any], loop_cls: type) -> dict[str, Any]:
    """`target`, `data`, `optim` and `train` (a `loop_cls`) of a read recipe."""
    return {
        "target": str(raw["target"]),
        "data": _from_dict(DataConfig, raw.get("data"), "data"),
        "optim": _from_dict(OptimConfig, raw.get("optim"), "optim"),
        "train": _from_dict(loop_cls, raw.get("train"), "train"),
    }


def head_config_for(cls: Any, head: dict[str, Any], target: ModelConfig) -> Any:
    """A feature head's config (`cls.from_dict`): the recipe's fields plus what the target
    fixes unless given (vocabulary, feature width, context, RoPE base, norm epsilon);
    ValueError for a target layer id past the target's layers."""
    data = dict(head)
    data.setdefault("vocab_size", target.V)
    data.setdefault("target_hidden", target.D)
    data.setdefault("max_position", target.max_position)
    data.setdefault("rope_theta", target.rope_theta)
    data.setdefault("norm_eps", target.norm_eps)
    cfg = cls.from_dict(data)
    if max(cfg.target_layers) > target.L:
        raise ValueError(
            f"target layer ids {list(cfg.target_layers)} exceed the target's {target.L} layers"
        )
    return cfg


def corpus(data: DataConfig, seed: int) -> tuple[TokenSampler, np.ndarray, np.ndarray | None]:
    """The recipe's training windows (a `TokenSampler` seeded with `seed`) and its
    training / validation tokens."""
    train_tokens, val_tokens = resolve_data(data)
    sampler = TokenSampler(train_tokens, data.seq_len, data.batch_size, seed)
    return sampler, train_tokens, val_tokens


def init_optimizer(optim: OptimConfig, params: Any) -> tuple[optax.GradientTransformation, Any]:
    """The recipe's optimiser and its state for `params`."""
    optimizer = make_optimizer(optim)
    with jax.numpy_dtype_promotion("standard"):
        return optimizer, optimizer.init(params)


def export_head_gguf(
    load_head: Callable[[str], tuple[Any, Params]],
    save_gguf: Callable[..., None],
    run_dir: str,
    out: str,
    target_path: str,
    dtype: str = "f16",
) -> None:
    """Write a trained head (`load_head(run_dir)`) with `save_gguf`, the tokenizer metadata
    from the target at `target_path`."""
    from specjax.api import load

    cfg, params = load_head(run_dir)
    target = load(target_path, dtype="float32")
    save_gguf(out, cfg, params, target.tokenizer, dtype=dtype)


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


def soft_cross_entropy(t_prob: Array, logq: Array) -> Array:
    """-sum_v p(v) log q(v) over the last axis (terms with p = 0 are 0, whatever log q)."""
    return -jnp.sum(t_prob * jnp.where(t_prob > 0, logq, 0.0), axis=-1)


# ------------------------------------------------------------------------------- the loop
def make_head_step(
    loss_fn: Callable[..., tuple[Array, dict[str, Array]]],
    optim: OptimConfig,
    optimizer: optax.GradientTransformation,
    step_args: Callable[..., tuple[Any, ...]] | None = None,
    eval_args: Callable[..., tuple[Any, ...]] | None = None,
) -> tuple[Any, Any]:
    """Jitted `step(params, opt_state, i, total, *args) -> (params, opt_state, metrics)` (the
    params and optimiser state donated; metrics: the loss's, `loss` and `lr`) and
    `evaluate(params, *args) -> (loss, metrics)`. `step_args(i, *args)` / `eval_args(*args)`
    turn the arguments into `loss_fn`'s, inside the jit (e.g. anchors drawn from the step)."""

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, i: Array, total: Array, *args: Any) -> Any:
        if step_args is not None:
            args = step_args(i, *args)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *args)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        lr = learning_rate(optim, i, total)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, {"loss": loss, "lr": lr, **aux}

    @jax.jit
    def evaluate(params: Any, *args: Any) -> Any:
        if eval_args is not None:
            args = eval_args(*args)
        return loss_fn(params, *args)

    return step, evaluate


def validation_batch(val_tokens: np.ndarray | None, seq_len: int, n_windows: int) -> Array | None:
    """Up to `n_windows` windows of `seq_len + 1` tokens spread evenly over the validation
    tokens ([n, seq_len + 1] int32), None without validation tokens."""
    if val_tokens is None:
        return None
    T = seq_len
    n = min(n_windows, (val_tokens.size - 1) // T)
    starts = np.arange(n) * ((val_tokens.size - T - 1) // max(n, 1))
    return jnp.asarray(np.stack([val_tokens[s : s + T + 1] for s in starts]).astype(np.int32))


def _rounded(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: round(float(v), 4) for k, v in metrics.items()}


def _emit(log: list[dict[str, Any]], row: dict[str, Any]) -> None:
    log.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)


def run_loop(
    loop: HeadLoop,
    params: Any,
    opt_state: Any,
    step: Callable[[Any, Any, Array, Array, Any], tuple[Any, Any, dict[str, Array]]],
    batches: Callable[[int], Any],
    save: Callable[[Any, int], None],
    evaluate: Callable[[Any, Array], tuple[Array, dict[str, Array]]] | None = None,
    val_batch: Array | None = None,
    eval_first: bool = False,
) -> dict[str, Any]:
    """`loop.steps` optimiser steps: `step(params, opt_state, i,
    total, batches(i))`, logged, evaluated on `val_batch` (also before the first step with
    `eval_first`), saved (`save(params, n_steps)`) and summarised (`finish_head_run`)."""
    run_dir = Path(loop.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log: list[dict[str, Any]] = []
    do_eval = evaluate is not None and val_batch is not None
    if do_eval and eval_first:
        assert evaluate is not None and val_batch is not None
        _emit(log, {"step": -1, "val": _rounded(evaluate(params, val_batch)[1])})
    total = jnp.asarray(loop.steps, jnp.int32)
    t0 = time.time()
    i = 0
    for i in range(loop.steps):
        params, opt_state, m = step(params, opt_state, jnp.asarray(i, jnp.int32), total, batches(i))
        elapsed = time.time() - t0
        if i % loop.log_every == 0 or i == loop.steps - 1:
            _emit(log, {"step": i, "seconds": round(elapsed, 1), **_rounded(m)})
        if do_eval and (i + 1) % loop.eval_every == 0:
            assert evaluate is not None and val_batch is not None
            _emit(log, {"step": i, "val": _rounded(evaluate(params, val_batch)[1])})
        if (i + 1) % loop.save_every == 0:
            save(params, i + 1)
            (run_dir / "train_log.json").write_text(json.dumps(log))
        if loop.max_seconds > 0 and elapsed > loop.max_seconds:
            break
    save(params, i + 1)
    val = None
    if do_eval:
        assert evaluate is not None and val_batch is not None
        val = evaluate(params, val_batch)[1]
    return finish_head_run(run_dir, log, i + 1, t0, val)


def finish_head_run(
    run_dir: Path, log: list[Any], steps: int, t0: float, val: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run's summary (steps, seconds, the final validation metrics `val` when given),
    appended to the log, written to `train_log.json` and printed; returned."""
    summary: dict[str, Any] = {"steps": steps, "seconds": round(time.time() - t0, 1)}
    if val is not None:
        summary["val"] = _rounded(val)
    log.append({"summary": summary})
    (run_dir / "train_log.json").write_text(json.dumps(log, indent=0))
    print(json.dumps(summary), file=sys.stderr)
    return summary


def train_feature_head(
    config: Any,
    head_config: Callable[[dict[str, Any], ModelConfig], Any],
    head_module: Any,
    make_step: Callable[..., tuple[Any, Any]],
    save_head: Callable[[Path, Any, Params, int], None],
    load_head: Callable[[str], tuple[Any, Params]],
    batches_for: Callable[[TokenSampler, np.ndarray, np.ndarray | None], Any] | None = None,
) -> dict[str, Any]:
    """Train a feature head (EAGLE-3, DFlash / DSpark) on its recipe `config` (sections
    `head`, `target`, `data`, `optim`, `train`): the frozen target loaded in float32, the
    head's config (`head_config`), its borrowed weights and fresh params (`head_module`'s
    `shared_weights`, `init_params`; `train.init_from`: a run's head instead), `make_step`'s
    step over `batches_for(sampler, train_tokens, val_tokens)(i)` (a tuple of the step's batch
    arguments; default: the sampler's windows) in `run_loop`, saved with `save_head`."""
    from specjax.api import load

    loop = config.train
    target = load(config.target, dtype="float32")
    cfg = head_config(config.head, target.config)
    shared = head_module.shared_weights(cfg, target.params, target.config.tie_embeddings)
    sampler, train_tokens, val_tokens = corpus(config.data, loop.seed)
    if batches_for is None:
        batches = lambda i: (jnp.asarray(sampler.batch(i)),)  # noqa: E731
    else:
        batches = batches_for(sampler, train_tokens, val_tokens)
    params = head_module.init_params(cfg, jax.random.key(loop.seed))
    if loop.init_from:
        init_cfg, params = load_head(loop.init_from)
        if init_cfg != cfg:
            raise ValueError(f"{loop.init_from}: head config differs from the recipe's")
    optimizer, opt_state = init_optimizer(config.optim, params)
    step_fn, eval_fn = make_step(cfg, target.config, loop, config.optim, optimizer)
    layers = list(cfg.target_layers)
    print(f"{cfg.describe()}: {cfg.num_params():,} params, target layers {layers}", file=sys.stderr)
    return run_loop(
        loop,
        params,
        opt_state,
        lambda p, s, i, total, batch: step_fn(p, s, i, total, shared, target.params, *batch),
        batches,
        lambda p, n: save_head(Path(loop.run_dir), cfg, p, n),
        lambda p, batch: eval_fn(p, shared, target.params, batch),
        validation_batch(val_tokens, config.data.seq_len, loop.eval_windows),
    )


# ------------------------------------------------------------------------------- checkpoints
def save_npz(run_dir: Path, name: str, flat: dict[str, Any], meta: dict[str, Any]) -> None:
    """`run_dir/name` (written through a temporary file) and `run_dir/config.json` (`meta`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / name.replace(".npz", ".tmp.npz")
    np.savez(tmp, **{k: np.asarray(v) for k, v in flat.items()})  # type: ignore[arg-type]
    tmp.replace(run_dir / name)
    (run_dir / "config.json").write_text(json.dumps(meta))


def load_npz(path: Path) -> dict[str, Array]:
    """Every array of an .npz file, on device."""
    with np.load(path) as z:
        return {k: jnp.asarray(z[k]) for k in z.files}


# ------------------------------------------------------------------------------- command line
def head_cli(
    prog: str, argv: Sequence[str] | None, train_fn: Any, load_config_fn: Any, export_fn: Any
) -> int:
    """`python -m PROG train --config C [--set k=v]` / `export --run R --out O`, shared by
    the head trainers."""
    ap = argparse.ArgumentParser(prog=prog)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--config", required=True)
    add_overrides_arg(t)
    x = sub.add_parser("export")
    x.add_argument("--run", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--target", default="models/code-target/code-target-f16.gguf")
    x.add_argument("--dtype", default="f16")
    args = ap.parse_args(argv)
    if args.cmd == "train":
        train_fn(load_config_fn(args.config, args.overrides))
    else:
        export_fn(args.run, args.out, args.target, args.dtype)
    return 0
