"""`specjax train-draft`: each objective raises held-out acceptance from one shared start."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax import cli
from specjax import objectives as obj
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params
from specjax.train import load_params_npz, model_logits, save_params_npz
from specjax.train_draft import DistillRecipe, train_draft

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
