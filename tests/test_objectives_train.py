"""`specjax train-draft`: each objective raises held-out acceptance from one shared start."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax.cli import command as cli
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params
from specjax.train import draft as td
from specjax.train import objectives as obj
from specjax.train.draft import DistillRecipe, document_prompts, train_draft
from specjax.train.target import load_params_npz, load_tokens, model_logits, save_params_npz

VOCAB = 32


def _tokens(n: int, seed: int) -> np.ndarray:
    """Noisy counting mod VOCAB: the next token is mostly current + 1."""
    rng = np.random.default_rng(seed)
    out = np.empty((n,), np.uint16)
    t = 0
    for i in range(n):
        t = (t + 1) % VOCAB if rng.random() < 0.8 else int(rng.integers(VOCAB))
        out[i] = t
    return out


def _setup(tmp_path: Path) -> dict[str, str]:
    def cfg(dim: int, layers: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=VOCAB, dim=dim, n_layers=layers, n_heads=2, n_kv_heads=1,
            ffn_dim=64, max_position=32,
        )  # fmt: skip

    # the target: a random model made peaked (scaled embeddings) so it has something to copy
    tcfg = cfg(32, 1)
    tparams = init_params(tcfg, jax.random.PRNGKey(0))
    tparams = {**tparams, "lm_head": tparams["lm_head"] * 6.0}
    save_params_npz(tmp_path / "target.npz", tcfg, tparams)
    save_params_npz(
        tmp_path / "draft.npz", cfg(16, 1), init_params(cfg(16, 1), jax.random.PRNGKey(1))
    )
    np.save(tmp_path / "train.npy", _tokens(4000, 0))
    np.save(tmp_path / "val.npy", _tokens(600, 1))
    return {k: str(tmp_path / f"{k}.npz") for k in ("target", "draft")} | {
        "train": str(tmp_path / "train.npy"),
        "val": str(tmp_path / "val.npy"),
    }


def _recipe(files: dict[str, str], tmp_path: Path, objective: str) -> DistillRecipe:
    return DistillRecipe.from_dict(
        {
            "draft": files["draft"],
            "target": files["target"],
            "objective": objective,
            "temperatures": [0.7],
            "eval_windows": 8,
            "export_gguf": None,
            "data": {
                "tokenizer": None,
                "tokens_path": files["train"],
                "val_tokens_path": files["val"],
                "seq_len": 16,
                "batch_size": 8,
            },
            "optim": {"lr": 3e-2, "warmup_steps": 2, "weight_decay": 0.0},
            "train": {
                "run_dir": str(tmp_path / "runs" / "{objective}"),
                "steps": 30,
                "log_every": 10,
                "progress": False,
            },
        }
    )


def _raise_alpha(tmp_path: Path, objectives: tuple[str, ...]) -> dict[str, str]:
    files = _setup(tmp_path)
    before = None
    for objective in objectives:
        s = train_draft(_recipe(files, tmp_path, objective))
        # same initial parameters for every objective
        before = before or s["eval_before"]
        assert s["eval_before"] == before
        assert s["steps"] == 30 and s["stopped"] == "done"
        gain = s["eval_after"]["alpha@0.7"] - s["eval_before"]["alpha@0.7"]
        assert gain > 0.05, (objective, s["eval_before"], s["eval_after"])
    return files


@pytest.mark.slow
def test_every_objective_raises_heldout_alpha_from_one_start(tmp_path: Path) -> None:
    _raise_alpha(tmp_path, ("nla", "lk", "kl"))


@pytest.mark.slow  # suite time: test_training_on_the_targets_own_rows trains tv by default
def test_tv_raises_heldout_alpha_and_reports_objectives_alpha(tmp_path: Path) -> None:
    files = _raise_alpha(tmp_path, ("tv",))

    # the summary's held-out alpha is objectives.acceptance_rate of the saved parameters
    summary = json.loads((tmp_path / "runs" / "tv" / "summary.json").read_text())
    dcfg, dparams = load_params_npz(tmp_path / "runs" / "tv" / "params.npz")
    tcfg, tparams = load_params_npz(files["target"])
    val = np.load(files["val"])[: 8 * 16 + 1].astype(np.int32)
    windows = np.stack([val[i * 16 : i * 16 + 16] for i in range(8)])
    alpha = obj.acceptance_rate(
        model_logits(tcfg, tparams, windows),
        model_logits(dcfg, dparams, windows),
        obj.sampling_params(0.7),
    )
    assert float(np.mean(alpha)) == pytest.approx(summary["eval_after"]["alpha@0.7"], abs=1e-5)


def test_recipe_errors_name_the_values(tmp_path: Path) -> None:
    files = _setup(tmp_path)
    with pytest.raises(ValueError, match="unknown objective 'mse'"):
        _recipe(files, tmp_path, "mse")
    with pytest.raises(ValueError, match=r"temperatures must be > 0, got \[0.0\]"):
        DistillRecipe.from_dict({"draft": "d", "target": "t", "temperatures": [0]})
    with pytest.raises(ValueError, match="unknown keys in the distillation recipe: lr"):
        DistillRecipe.from_dict({"draft": "d", "target": "t", "lr": 1})
    with pytest.raises(ValueError, match="needs 'target'"):
        DistillRecipe.from_dict({"draft": "d"})
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses the choice
        cli.main(["train-draft", "--config", "x.yaml", "--objective", "mse"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match=r"generated\.new_tokens must be >= 1, got 0"):
        DistillRecipe.from_dict({"draft": "d", "target": "t", "generated": {"new_tokens": 0}})
    with pytest.raises(ValueError, match="unknown keys in config section 'generated': temp"):
        DistillRecipe.from_dict({"draft": "d", "target": "t", "generated": {"temp": 1}})


def test_document_prompts_are_the_starts_of_long_enough_documents() -> None:
    bos = 0
    docs = [[bos, 5, 6, 7, 8], [bos, 9], [bos, 10, 11, 12], [bos, 13, 14, 15, 16, 17]]
    tokens = np.asarray([t for d in docs for t in d], np.uint16)
    got = document_prompts(tokens, 3, bos)
    np.testing.assert_array_equal(got, [[bos, 5, 6], [bos, 10, 11], [bos, 13, 14]])
    np.testing.assert_array_equal(document_prompts(tokens, 3, bos, limit=2), got[[0, 2]])
    # no BOS: consecutive windows of twice the prompt length stand for documents
    np.testing.assert_array_equal(document_prompts(np.arange(14), 3, None), [[0, 1, 2], [6, 7, 8]])


def test_training_on_the_targets_own_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`generated`: rows are the target's continuations (at temperature 0 each generated token
    is the argmax of the target's logits over the row: the teacher-forced oracle), made once
    and cached; training on their generated tokens raises alpha on held-out generated rows."""
    files = _setup(tmp_path)
    raw = _recipe(files, tmp_path, "tv").to_dict()
    raw["generated"] = {
        "temperature": 0.0, "prompt_tokens": 6, "new_tokens": 10, "max_prompts": 24,
        "samples": 2, "batch": 16, "eval_prompts": 8,
    }  # fmt: skip
    raw["data"]["cache_dir"] = str(tmp_path / "cache")
    raw["eval_windows"] = 0  # held out: the generated rows only (one compiled shape fewer)
    recipe = DistillRecipe.from_dict(raw)
    summary = train_draft(recipe)
    assert summary["generated"]["rows"] == 48
    assert summary["generated"]["trained_targets"] == int(summary["generated"]["tokens"]) - 48 * 6
    gain = (
        summary["eval_generated_after"]["alpha@0.7"] - summary["eval_generated_before"]["alpha@0.7"]
    )
    assert gain > 0.05, summary["eval_generated_after"]

    (cached,) = (tmp_path / "cache" / "generated").glob("*.npz")
    rows = np.load(cached)
    tcfg, tparams = load_params_npz(files["target"])
    logits = jax.jit(model_logits, static_argnums=0)  # compiled, not op by op (suite time)
    for name in ("train", "val"):
        tokens, lengths = rows[name], rows[f"{name}_len"]
        assert tokens.shape[1] == 16 and np.all(lengths == 16)  # no end of generation here
        want = np.asarray(jax.numpy.argmax(logits(tcfg, tparams, tokens), -1))
        np.testing.assert_array_equal(tokens[:, 6:], want[:, 5:-1])
    # the summary's held-out alpha is objectives.acceptance_rate of the saved parameters
    dcfg, dparams = load_params_npz(tmp_path / "runs" / "tv" / "params.npz")
    val, mask = rows["val"], td.row_mask(rows["val_len"], 16, 6)
    alpha = jax.jit(obj.acceptance_rate)(
        logits(tcfg, tparams, val[:, :-1]),
        logits(dcfg, dparams, val[:, :-1]),
        obj.sampling_params(0.7),
    )
    assert float(np.sum(alpha * mask) / np.sum(mask)) == pytest.approx(
        summary["eval_generated_after"]["alpha@0.7"], abs=1e-5
    )
    train_tokens, val_tokens = load_tokens(files["train"]), load_tokens(files["val"])
    np.testing.assert_array_equal(rows["train"][0, :6], train_tokens[:6])
    # two samples per prompt, side by side (at temperature 0 the same continuation)
    np.testing.assert_array_equal(rows["train"][0::2], rows["train"][1::2])
    assert len({tuple(r) for r in rows["train"][:, :6].tolist()}) == 24

    # a second run reads the cache instead of generating again
    def refuse(*_args: object) -> None:
        raise AssertionError("generated again")

    monkeypatch.setattr(td, "sample_continuations", refuse)
    again = td.generated_rows(recipe, train_tokens, val_tokens)
    assert sorted(again) == sorted(rows.files)
    for key in again:
        np.testing.assert_array_equal(again[key], rows[key])


def test_shipped_distillation_recipes_parse() -> None:
    root = Path(__file__).resolve().parent.parent / "configs" / "train"
    recipes = {p.name: td.load_recipe(p) for p in sorted(root.glob("distill-*.yaml"))}
    assert recipes["distill-code-draft.yaml"].generated is None
    generated = recipes["distill-code-draft-generated.yaml"].generated
    assert generated is not None and generated.samples == 4 and generated.temperature == 0.7


def test_row_sampler_visits_every_row_once_per_epoch_and_replays() -> None:
    sampler = td.RowSampler(5, 4, seed=7)
    order = np.concatenate([sampler.indices(s) for s in range(5)])  # 20 draws = 4 epochs
    for epoch in range(4):
        assert sorted(order[5 * epoch : 5 * epoch + 5].tolist()) == [0, 1, 2, 3, 4]
    assert not np.array_equal(order[:5], order[5:10])  # a new permutation each epoch
    np.testing.assert_array_equal(td.RowSampler(5, 4, seed=7).indices(3), order[12:16])
    np.testing.assert_array_equal(
        td.row_mask(np.asarray([4, 6]), 6, 2), [[0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    )
