"""Draft distillation on an acceptance objective: `specjax train-draft --objective {ce,tv,nla,kl,lk}`.

Fine-tunes a draft model (a GGUF file or a params .npz of `specjax.train.target`) against a target
model on the training corpus of `specjax.train.data` with one of `specjax.train.objectives.OBJECTIVES`,
then exports the result as an F16 GGUF that `specjax generate -md` loads.

    specjax train-draft --config configs/train/distill-code-draft.yaml --objective tv \
        [--set train.max_seconds=120 ...]

Recipe YAML sections: top-level ``draft`` / ``target`` (model files), ``objective``,
``temperatures`` (verification temperatures the acceptance objectives average over),
``target_top_k`` / ``target_top_p`` / ``target_min_p`` (the verifier's truncation), ``draft_top_k``
(draft-simple's q: 10), ``kl_weight`` (the lk hybrid), ``data`` / ``optim`` / ``train`` as in
`specjax.train.target` (`DataConfig`, `OptimConfig`, `LoopConfig`; ``train.run_dir`` may contain
``{objective}``), ``export_gguf`` (output path, may contain ``{objective}``; null = none),
``generated`` (optional, `GeneratedData`: train on the target's own continuations instead of
corpus windows).

Invariants:
* Every objective starts from the same draft parameters and sees the same batches: batch ``s``
  is `specjax.train.target.TokenSampler`'s pure function of ``(seed, s)``; the step count and schedule
  come from the config alone (``train.max_seconds`` only cuts a run short, and the summary says
  so), so objectives differ only in their loss.
* The target's logits are computed in the same jitted step under `stop_gradient`.
* With ``generated``, the rows are the target's own samples (`generated_rows`): a pure
  function of the target, the token arrays and the section, cached on disk under a hash of
  all three, so every objective trains on the same rows; the loss covers the real tokens of
  each row (the generated ones only unless ``prompt_loss``), never its padding.
* Objectives, truncation and the acceptance definitions are `specjax.train.objectives`'; the summary
  reports held-out alpha (probabilistic draft) and p(argmax q) (greedy draft) per temperature
  before and after training, on the validation split.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from specjax.models.config import ModelConfig
from specjax.pytree import check_known_keys
from specjax.train import objectives as obj
from specjax.train.target import (
    DataConfig,
    LoopConfig,
    OptimConfig,
    TokenSampler,
    _from_dict,
    add_overrides_arg,
    apply_overrides,
    eval_windows,
    learning_rate,
    load_params_npz,
    make_optimizer,
    model_logits,
    resolve_data,
    save_params_npz,
)
from specjax.types import Array, Params


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneratedData:
    """On-policy rows: the target's own continuations, sampled at `temperature`, of prompts
    cut from the start of each training document: the contexts a draft meets when it drafts
    for that target (target-generated distillation data, as in DistillSpec, arXiv 2310.08461).
    The validation split's documents give held-out rows the same way (`eval_prompts`)."""

    temperature: float = 0.7
    prompt_tokens: int = 96
    new_tokens: int = 128
    #: at most this many training prompts (0 = one per training document long enough)
    max_prompts: int = 0
    #: continuations sampled per training prompt (each with its own seed)
    samples: int = 1
    #: rows generated per `specjax.generate` call
    batch: int = 64
    seed: int = 0
    #: held-out rows from the validation split (0 = none)
    eval_prompts: int = 16
    #: also train on the prompt's tokens (else only on the generated ones)
    prompt_loss: bool = False

    def validate(self) -> None:
        for name in ("prompt_tokens", "new_tokens", "batch", "samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"generated.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0 or self.max_prompts < 0 or self.eval_prompts < 0:
            raise ValueError(
                "generated.temperature, max_prompts and eval_prompts must be >= 0, got "
                f"{self.temperature}, {self.max_prompts}, {self.eval_prompts}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillRecipe:
    draft: str
    target: str
    objective: str = "kl"
    temperatures: tuple[float, ...] = (0.7,)
    target_top_k: int = 0
    target_top_p: float = 1.0
    target_min_p: float = 0.0
    draft_top_k: int = obj.DRAFT_TOP_K
    kl_weight: float = 1.0
    #: held-out evaluation: this many validation windows of data.seq_len tokens
    eval_windows: int = 16
    export_gguf: str | None = "runs/distill/{objective}/draft-f16.gguf"
    tokenizer_dir: str = "models/tokenizer"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    generated: GeneratedData | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DistillRecipe:
        raw = dict(raw)
        sections = {
            "data": _from_dict(DataConfig, raw.pop("data", None), "data"),
            "optim": _from_dict(OptimConfig, raw.pop("optim", None), "optim"),
            "train": _from_dict(LoopConfig, raw.pop("train", None), "train"),
        }
        generated = raw.pop("generated", None)
        if generated is not None:
            sections["generated"] = _from_dict(GeneratedData, generated, "generated")
        check_known_keys(cls, raw, "unknown keys in the distillation recipe", exclude=sections)
        for key in ("draft", "target"):
            if not raw.get(key):
                raise ValueError(f"the distillation recipe needs {key!r} (a .gguf or params .npz)")
        if "temperatures" in raw:
            raw["temperatures"] = tuple(float(t) for t in raw["temperatures"])
        recipe = cls(**raw, **sections)
        recipe.validate()
        return recipe

    def validate(self) -> None:
        if self.objective not in obj.OBJECTIVES:
            raise ValueError(
                f"unknown objective {self.objective!r}; expected one of {', '.join(obj.OBJECTIVES)}"
            )
        if not self.temperatures or any(t <= 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be > 0, got {list(self.temperatures)}")
        if self.draft_top_k < 1:
            raise ValueError(f"draft_top_k must be >= 1, got {self.draft_top_k}")
        if self.generated is not None:
            self.generated.validate()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["temperatures"] = list(self.temperatures)
        return out


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> DistillRecipe:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    return DistillRecipe.from_dict(apply_overrides(raw, overrides))


def load_model(path: str) -> tuple[ModelConfig, Params]:
    """(config, float32 params) from a GGUF file / HF directory or a `specjax.train.target` .npz."""
    if path.endswith(".npz"):
        config, params = load_params_npz(path, dtype="float32")
    else:
        import specjax

        model = specjax.load(path, dtype="float32")
        config, params = model.config, model.params
    if not isinstance(config, ModelConfig):
        raise ValueError(f"{path}: train_draft needs a llama-family model, got {config.arch!r}")
    config = dataclasses.replace(config, dtype="float32")
    return config, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def _as_model(path: str) -> Any:
    """A `specjax.Model` to generate with (a .npz of `specjax.train.target` has no tokenizer)."""
    import specjax

    if path.endswith(".npz"):
        config, params = load_params_npz(path)
        if not isinstance(config, ModelConfig):
            raise ValueError(f"{path}: generated rows need a llama-family target")
        return specjax.Model(config=config, params=params, eog=())
    return specjax.load(path)


def document_prompts(
    tokens: np.ndarray, prompt_tokens: int, bos: int | None, limit: int = 0
) -> np.ndarray:
    """[N, prompt_tokens] prompts: the first tokens of each document of `tokens` (documents
    start at `bos`; without one, consecutive windows of 2 * prompt_tokens stand for them),
    documents shorter than a prompt skipped; `limit` > 0 keeps that many, evenly spaced."""
    if bos is not None:
        starts = np.flatnonzero(tokens == bos)
        ends = np.append(starts[1:], tokens.size)
    else:
        starts = np.arange(0, tokens.size, 2 * prompt_tokens)
        ends = np.minimum(starts + 2 * prompt_tokens, tokens.size)
    starts = starts[ends - starts > prompt_tokens]
    if limit and starts.size > limit:
        starts = starts[np.linspace(0, starts.size - 1, limit).round().astype(np.int64)]
    idx = starts[:, None] + np.arange(prompt_tokens)[None, :]
    return tokens[idx].astype(np.int32)


def sample_continuations(
    model: Any, prompts: np.ndarray, cfg: GeneratedData, seed_base: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows [N, prompt + new] (the prompt, then the target's sampled continuation, 0-padded
    after an end of generation) and their lengths [N]. Row i samples with seed
    `seed_base + i`; calls take `cfg.batch` rows (the last one padded), one compiled shape."""
    from specjax import api

    n, p = prompts.shape
    rows = np.zeros((n, p + cfg.new_tokens), np.int32)
    lengths = np.zeros((n,), np.int32)
    for i in range(0, n, cfg.batch):
        chunk = [prompts[min(j, n - 1)].tolist() for j in range(i, i + cfg.batch)]
        out = api.generate(
            model,
            chunk,
            max_new_tokens=cfg.new_tokens,
            temperature=cfg.temperature,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=[seed_base + j for j in range(i, i + cfg.batch)],
        )
        for j, gen in enumerate(out.tokens[: n - i]):
            rows[i + j, :p] = prompts[i + j]
            rows[i + j, p : p + len(gen)] = gen
            lengths[i + j] = p + len(gen)
    return rows, lengths


def generated_rows(
    recipe: DistillRecipe, train_tokens: np.ndarray, val_tokens: np.ndarray | None
) -> dict[str, np.ndarray]:
    """The recipe's on-policy rows: ``train`` / ``train_len`` and (with validation tokens and
    eval_prompts > 0) ``val`` / ``val_len``; loaded from `data.cache_dir` when a run with the
    same target, token arrays and `generated` section made them before."""
    assert recipe.generated is not None
    return target_rows(
        recipe.generated, recipe.target, recipe.data.cache_dir, train_tokens, val_tokens
    )


def target_rows(
    cfg: GeneratedData,
    target: str,
    cache_dir: str,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """`generated_rows` for any recipe with a `generated` section (the draft models' and the
    block heads' trainers share the rows and their cache)."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())
    h.update(Path(target).read_bytes())
    for arr in (train_tokens, val_tokens):
        h.update(b"-" if arr is None else np.ascontiguousarray(arr).tobytes())
    path = Path(cache_dir) / "generated" / f"{h.hexdigest()[:16]}.npz"
    if path.exists():
        with np.load(path) as cached:
            return dict(cached)
    model = _as_model(target)
    bos = None
    if model.tokenizer is not None:
        first = model.encode("")
        bos = first[0] if first else None
    out: dict[str, np.ndarray] = {}
    prompts = document_prompts(train_tokens, cfg.prompt_tokens, bos, cfg.max_prompts)
    prompts = np.repeat(prompts, cfg.samples, axis=0)
    out["train"], out["train_len"] = sample_continuations(model, prompts, cfg, cfg.seed << 20)
    if val_tokens is not None and cfg.eval_prompts:
        prompts = document_prompts(val_tokens, cfg.prompt_tokens, bos, cfg.eval_prompts)
        out["val"], out["val_len"] = sample_continuations(
            model, prompts, cfg, (cfg.seed << 20) + (1 << 19)
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **out)  # type: ignore[arg-type]  # (numpy's stub reads **out as allow_pickle)
    tmp.replace(path)
    return out


def row_mask(lengths: np.ndarray, width: int, first: int) -> np.ndarray:
    """[N, width - 1] float mask of the next-token targets to score: the targets at indices
    first .. length - 1 of each row (a row of `width` tokens has width - 1 targets)."""
    target_index = np.arange(1, width)[None, :]
    return ((target_index >= first) & (target_index < lengths[:, None])).astype(np.float32)


class RowSampler:
    """Batches of whole rows; batch ``s`` is a pure function of ``(seed, s)``: epoch ``e``
    visits the rows in the permutation ``np.random.default_rng([seed, e])`` draws."""

    def __init__(self, n_rows: int, batch_size: int, seed: int) -> None:
        if n_rows < 1:
            raise ValueError("no generated rows to train on")
        self.n, self.B, self.seed = n_rows, batch_size, seed

    @lru_cache(maxsize=2)  # noqa: B019 - a sampler lives as long as its run
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def indices(self, step: int) -> np.ndarray:
        i = step * self.B + np.arange(self.B)
        return np.asarray([self._permutation(int(e))[r] for e, r in zip(i // self.n, i % self.n)])


def _target_params(recipe: DistillRecipe, temperature: float) -> Any:
    return obj.sampling_params(
        temperature=temperature,
        top_k=recipe.target_top_k,
        top_p=recipe.target_top_p,
        min_p=recipe.target_min_p,
    )


def make_loss(recipe: DistillRecipe, draft_cfg: ModelConfig, target_cfg: ModelConfig) -> Any:
    """loss(draft_params, target_params, batch [B, T+1], mask [B, T]) -> (loss, metrics): the
    objective's mean over the targets `mask` selects."""

    def loss_fn(
        dparams: Params, tparams: Params, batch: Array, mask: Array
    ) -> tuple[Array, dict[str, Array]]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        d_logits = model_logits(draft_cfg, dparams, inputs)
        t_logits = jax.lax.stop_gradient(model_logits(target_cfg, tparams, inputs))
        total = jnp.float32(0.0)
        metrics: dict[str, Array] = {}
        count = jnp.maximum(jnp.sum(mask), 1.0)

        def mean(x: Array) -> Array:
            return jnp.sum(x * mask) / count

        for temp in recipe.temperatures:
            terms = obj.objective_terms(
                recipe.objective,
                t_logits,
                d_logits,
                targets,
                _target_params(recipe, temp),
                obj.draft_params(temp, recipe.draft_top_k),
                kl_weight=recipe.kl_weight,
            )
            total = total + mean(terms.loss)
            metrics[f"alpha@{temp:g}"] = mean(terms.alpha)
            metrics[f"greedy_alpha@{temp:g}"] = mean(terms.greedy_alpha)
            metrics["kl"] = mean(terms.kl)
        return total / len(recipe.temperatures), metrics

    return loss_fn


def make_evaluator(recipe: DistillRecipe, draft_cfg: ModelConfig, target_cfg: ModelConfig) -> Any:
    """evaluate(draft_params, target_params, windows, mask) -> held-out means (teacher forced):
    alpha (probabilistic draft) and p(argmax q) (greedy draft) per temperature, argmax
    agreement and KL(p || q). One jitted function, compiled once per run."""

    @jax.jit
    def stats(dp: Params, tp: Params, w: Array, m: Array) -> dict[str, Array]:
        inputs = w[:, :-1]
        d_logits = model_logits(draft_cfg, dp, inputs)
        t_logits = model_logits(target_cfg, tp, inputs)
        out = {"agreement": obj.argmax_agreement(t_logits, d_logits)}
        for temp in (*recipe.temperatures, 1.0):
            tpar = _target_params(recipe, temp)
            dpar = obj.draft_params(temp, recipe.draft_top_k)
            out[f"alpha@{temp:g}"] = obj.acceptance_rate(t_logits, d_logits, tpar, dpar)
            out[f"greedy_alpha@{temp:g}"] = obj.greedy_acceptance_rate(t_logits, d_logits, tpar)
        logp = jax.nn.log_softmax(t_logits, -1)
        logq = jax.nn.log_softmax(d_logits, -1)
        out["kl"] = obj.kl_divergence(logp, logq)
        return {k: jnp.sum(v * m) for k, v in out.items()}

    def evaluate(
        dparams: Params, tparams: Params, windows: np.ndarray, mask: np.ndarray
    ) -> dict[str, float]:
        sums: dict[str, float] = {}
        for i in range(0, windows.shape[0], 8):
            w, m = jnp.asarray(windows[i : i + 8]), jnp.asarray(mask[i : i + 8])
            for k, v in stats(dparams, tparams, w, m).items():
                sums[k] = sums.get(k, 0.0) + float(v)
        n = float(mask.sum())
        return {k: v / n for k, v in sorted(sums.items())}

    return evaluate


def train_draft(recipe: DistillRecipe) -> dict[str, Any]:
    """Run the recipe; returns the summary also written to run_dir/summary.json."""
    t_start = time.perf_counter()
    loop = recipe.train
    run_dir = Path(loop.run_dir.format(objective=recipe.objective))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    draft_cfg, dparams = load_model(recipe.draft)
    target_cfg, tparams = load_model(recipe.target)
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"draft vocabulary {draft_cfg.vocab_size} != target vocabulary {target_cfg.vocab_size}"
        )
    train_tokens, val_tokens = resolve_data(recipe.data)
    T, B = recipe.data.seq_len, recipe.data.batch_size

    ev_windows = ev_mask = None
    if val_tokens is not None and recipe.eval_windows > 0:
        ev_windows, ev_mask = eval_windows(val_tokens[: recipe.eval_windows * T + 1], T)

    gen_rows: dict[str, np.ndarray] = {}
    gen_eval: tuple[np.ndarray, np.ndarray] | None = None
    if recipe.generated is not None:
        gen = recipe.generated
        gen_rows = generated_rows(recipe, train_tokens, val_tokens)
        rows = gen_rows["train"]
        train_mask = row_mask(
            gen_rows["train_len"], rows.shape[1], 1 if gen.prompt_loss else gen.prompt_tokens
        )
        row_sampler = RowSampler(rows.shape[0], B, loop.seed)
        if "val" in gen_rows:  # scored on the generated tokens, as the engine meets them
            val_rows = gen_rows["val"]
            gen_eval = (
                val_rows,
                row_mask(gen_rows["val_len"], val_rows.shape[1], gen.prompt_tokens),
            )

        def next_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
            idx = row_sampler.indices(step)
            return rows[idx], train_mask[idx]

    else:
        sampler = TokenSampler(train_tokens, T, B, loop.seed)
        every_target = np.ones((B, T), np.float32)

        def next_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
            return sampler.batch(step), every_target

    optimizer = make_optimizer(recipe.optim)
    loss_fn = make_loss(recipe, draft_cfg, target_cfg)
    evaluate = make_evaluator(recipe, draft_cfg, target_cfg)
    steps = loop.steps
    total_steps = jnp.asarray(steps, jnp.int32)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step_fn(
        params: Params, opt_state: Any, step: Array, batch: Array, mask: Array, tp: Params
    ) -> tuple[Params, Any, dict[str, Array]]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, metrics), grads = grad_fn(params, tp, batch, mask)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        lr = learning_rate(recipe.optim, step, total_steps)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, {"loss": loss, "lr": lr, **metrics}

    summary: dict[str, Any] = {
        "objective": recipe.objective,
        "run_dir": str(run_dir),
        "draft_init": recipe.draft,
        "target": recipe.target,
        "planned_steps": steps,
        "tokens_per_step": B * T,
    }
    if gen_rows:
        summary["tokens_per_step"] = B * (gen_rows["train"].shape[1] - 1)
        summary["generated"] = {
            "rows": int(gen_rows["train"].shape[0]),
            "tokens": int(gen_rows["train_len"].sum()),
            "trained_targets": int(train_mask.sum()),
        }
    if ev_windows is not None and ev_mask is not None:
        summary["eval_before"] = evaluate(dparams, tparams, ev_windows, ev_mask)
    if gen_eval is not None:
        summary["eval_generated_before"] = evaluate(dparams, tparams, *gen_eval)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(dparams)
    params = jax.tree.map(jnp.copy, dparams)
    log: list[dict[str, float]] = []
    stopped, step, t_loop = "done", 0, time.perf_counter()
    while step < steps:
        batch, mask = next_batch(step)
        params, opt_state, metrics = step_fn(
            params, opt_state, jnp.int32(step), jnp.asarray(batch), jnp.asarray(mask), tparams
        )
        step += 1
        if step % loop.log_every == 0 or step == steps:
            rec = {"step": step, **{k: float(v) for k, v in metrics.items()}}
            log.append(rec)
            if loop.progress:
                print(json.dumps(rec), file=sys.stderr, flush=True)
        if loop.max_seconds and time.perf_counter() - t_start > loop.max_seconds:
            stopped = "max_seconds"
            break
    jax.block_until_ready(params)
    summary.update(
        stopped=stopped,
        steps=step,
        tokens_seen=step * summary["tokens_per_step"],
        train_seconds=round(time.perf_counter() - t_loop, 1),
        log=log,
    )
    if ev_windows is not None and ev_mask is not None:
        summary["eval_after"] = evaluate(params, tparams, ev_windows, ev_mask)
    if gen_eval is not None:
        summary["eval_generated_after"] = evaluate(params, tparams, *gen_eval)
    npz = run_dir / "params.npz"
    save_params_npz(npz, draft_cfg, params, "float32")
    summary["params"] = str(npz)
    if recipe.export_gguf:
        from specjax.train.target import export_gguf

        out = Path(recipe.export_gguf.format(objective=recipe.objective))
        export_gguf(npz, out, recipe.tokenizer_dir, "f16")
        summary["gguf"] = str(out)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def train_draft_main(argv: Sequence[str] | None = None) -> int:
    """`specjax train-draft --config FILE [--objective NAME] [--set section.key=value ...]`."""
    p = argparse.ArgumentParser(
        prog="specjax train-draft",
        description="distil a draft model on an acceptance objective (specjax.train.objectives)",
    )
    p.add_argument("--config", required=True, help="recipe YAML (configs/train/distill-*.yaml)")
    p.add_argument("--objective", choices=obj.OBJECTIVES, help="overrides the recipe's objective")
    add_overrides_arg(p, "KEY=VALUE", "recipe")
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    if args.objective:
        overrides.append(f"objective={args.objective}")
    summary = train_draft(load_recipe(args.config, overrides))
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(train_draft_main(sys.argv[1:]))
