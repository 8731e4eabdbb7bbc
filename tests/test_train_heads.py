"""specjax.train.heads: the one loop of the head trainers (EAGLE-3, DFlash / DSpark, MTP).

* `run_loop` + `make_head_step` against a plain-NumPy transcription of Adam at a constant
  learning rate on a quadratic loss (the params, the log's rows, the saves);
* each trainer's `train` (a few steps on a tiny target GGUF): the run's saved head loads back
  as the params the loop ended with, its log is the loop's, and the EAGLE-3 / DFlash export
  writes a GGUF that loads back to the same head (f32).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.train import heads
from specjax.train.target import OptimConfig


class _Loop:
    run_dir = ""
    steps = 7
    max_seconds = 0.0
    log_every = 3
    eval_every = 2
    save_every = 4


def _numpy_adam(w: np.ndarray, targets: list[np.ndarray], lr: float) -> list[np.ndarray]:
    """Adam (b1 0.9, b2 0.95, eps 1e-8) on mean((w - t)^2), one target per step."""
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    out = []
    for t, target in enumerate(targets, start=1):
        g = 2.0 * (w - target) / w.size
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        m_hat = m / (1 - 0.9**t)
        v_hat = v / (1 - 0.95**t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + 1e-8)
        out.append(w)
    return out


def test_run_loop_is_adam_on_the_callers_loss(tmp_path: Path) -> None:
    loop = _Loop()
    loop.run_dir = str(tmp_path / "run")
    # constant rate: no warm-up, cosine from lr to lr; no clip, no decay on a vector
    optim = OptimConfig(lr=0.05, warmup_steps=0, min_lr_ratio=1.0, clip_norm=0.0)

    def loss_fn(params, batch):
        d = params["w"] - batch
        return jnp.mean(d * d), {"d0": d[0]}

    optimizer, opt_state = heads.init_optimizer(optim, {"w": jnp.zeros(3)})
    step, evaluate = heads.make_head_step(loss_fn, optim, optimizer)
    targets = [np.asarray([i, -i, 0.5 * i], np.float32) for i in range(loop.steps)]
    saves: dict[int, np.ndarray] = {}

    summary = heads.run_loop(
        loop,
        {"w": jnp.zeros(3)},
        opt_state,
        step,
        lambda i: jnp.asarray(targets[i]),
        lambda p, n: saves.__setitem__(n, np.asarray(p["w"])),
        evaluate,
        jnp.asarray([1.0, 1.0, 1.0]),
        eval_first=True,
    )

    want = _numpy_adam(np.zeros(3), targets, 0.05)
    assert sorted(saves) == [4, 7]  # every save_every steps, and at the end
    np.testing.assert_allclose(saves[4], want[3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saves[7], want[6], rtol=1e-5, atol=1e-6)
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    rows = [(r.get("step"), "val" in r) for r in log if "summary" not in r]
    # eval before the first step, then train rows at 0, 3, 6 (last) and val after 2, 4, 6
    assert rows == [(-1, True), (0, False), (1, True), (3, False), (3, True), (5, True), (6, False)]
    first = next(r for r in log if r.get("step") == 0 and "loss" in r)
    assert first["loss"] == pytest.approx(float(np.mean(targets[0] ** 2)), abs=1e-4)
    assert first["lr"] == pytest.approx(0.05)
    assert summary["steps"] == 7
    assert summary["val"]["d0"] == pytest.approx(want[6][0] - 1.0, abs=1e-4)


def test_max_seconds_stops_and_saves(tmp_path: Path) -> None:
    loop = _Loop()
    loop.run_dir = str(tmp_path / "run")
    loop.max_seconds = 1e-9  # spent after the first step
    optim = OptimConfig(lr=0.05, warmup_steps=0)
    optimizer, opt_state = heads.init_optimizer(optim, {"w": jnp.zeros(2)})
    step, _ = heads.make_head_step(lambda p, b: (jnp.sum((p["w"] - b) ** 2), {}), optim, optimizer)
    saves: list[int] = []
    summary = heads.run_loop(
        loop, {"w": jnp.zeros(2)}, opt_state, step, lambda i: jnp.ones(2),
        lambda p, n: saves.append(n),
    )  # fmt: skip
    assert summary["steps"] == 1 and saves == [1]


# ------------------------------------------------------------------------------- trainers
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny llama target GGUF and qwen35 (with a nextn block) GGUF, and token arrays."""
    from specjax.io.gguf_io import save_gguf
    from specjax.io.gguf_qwen35 import save_qwen35_gguf
    from specjax.models import qwen35
    from specjax.testing import tiny_model_with_tokenizer, tiny_qwen35_config, tiny_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    model = tiny_model_with_tokenizer()
    save_gguf(root / "target.gguf", model.config, model.params, model.tokenizer)
    tok = tiny_tokenizer()
    qcfg = tiny_qwen35_config(vocab_size=tok.vocab_size, n_nextn=1)  # type: ignore[attr-defined]
    qparams = qwen35.init_params(qcfg, jax.random.PRNGKey(0))
    save_qwen35_gguf(root / "hybrid.gguf", qcfg, qparams, tok)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    V = min(model.config.V, qcfg.V)
    np.save(root / "train.npy", rng.integers(0, V, 4000).astype(np.uint16))
    np.save(root / "val.npy", rng.integers(0, V, 400).astype(np.uint16))
    return {k: str(root / f) for k, f in
            [("target", "target.gguf"), ("hybrid", "hybrid.gguf"), ("train", "train.npy"),
             ("val", "val.npy"), ("root", "")]}  # fmt: skip


def _recipe(corpus: dict[str, str], tmp: Path, target: str, train: dict, head: dict | None) -> Path:
    raw = {
        "target": corpus[target],
        "data": {
            "tokenizer": None,
            "tokens_path": corpus["train"],
            "val_tokens_path": corpus["val"],
            "seq_len": 16,
            "batch_size": 2,
        },
        "optim": {"lr": 0.01, "warmup_steps": 1},
        "train": {"run_dir": str(tmp / "run"), "steps": 3, "log_every": 1, "eval_every": 2,
                  "save_every": 2, "eval_windows": 2, **train},
    }  # fmt: skip
    if head is not None:
        raw["head"] = head
    path = tmp / "recipe.yaml"
    import yaml

    path.write_text(yaml.safe_dump(raw))
    return path


def _log(run: Path) -> list[dict]:
    return json.loads((run / "train_log.json").read_text())


def test_eagle3_trainer_saves_loads_and_exports(corpus, tmp_path: Path) -> None:
    from specjax.io.eagle3_gguf import load_eagle3_gguf
    from specjax.train import eagle3 as tr

    head = {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "target_layers": [0, 1, 2]}
    recipe = _recipe(corpus, tmp_path, "target", {"ttt_steps": 2}, head)
    cfg = tr.load_config(recipe, ["train.steps=3"])
    summary = tr.train(cfg)
    log = _log(tmp_path / "run")
    assert summary["steps"] == 3 and set(summary["val"]) >= {"ce0", "ce1", "acc0"}
    assert [r["step"] for r in log if "loss" in r] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in log if "loss" in r)
    hcfg, params = tr.load_head(tmp_path / "run")
    tr.export_gguf(str(tmp_path / "run"), str(tmp_path / "h.gguf"), corpus["target"], "f32")
    cfg2, params2, _ = load_eagle3_gguf(tmp_path / "h.gguf")
    assert cfg2.to_dict() == hcfg.to_dict()
    for k, v in params.items():
        np.testing.assert_allclose(np.asarray(params2[k]), np.asarray(v), atol=1e-6, err_msg=k)


@pytest.mark.parametrize("dspark", [False, True])
def test_dflash_trainer_saves_loads_and_exports(corpus, tmp_path: Path, dspark: bool) -> None:
    from specjax.io.dflash_gguf import load_dflash_gguf
    from specjax.train import dflash as tr

    head = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48,
            "target_layers": [0, 2], "block_size": 4, "mask_token_id": 2,
            "markov_rank": 4 if dspark else 0, "own_lm_head": True}  # fmt: skip
    recipe = _recipe(corpus, tmp_path, "target", {"anchors": 2}, head)
    summary = tr.train(tr.load_config(recipe))
    assert summary["steps"] == 3 and ("tv" in summary["val"]) == dspark
    hcfg, params = tr.load_head(tmp_path / "run")
    assert len(params["layers"]) == 1
    tr.export_gguf(str(tmp_path / "run"), str(tmp_path / "h.gguf"), corpus["target"], "f32")
    cfg2, params2, _ = load_dflash_gguf(tmp_path / "h.gguf")
    assert cfg2.to_dict() == hcfg.to_dict()
    np.testing.assert_allclose(
        np.asarray(params2["layers"][0]["wqkv"]), np.asarray(params["layers"][0]["wqkv"]),
        atol=1e-6,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(params2["fc"]), np.asarray(params["fc"]), atol=1e-6)


def test_mtp_trainer_evaluates_first_and_saves_the_blocks(corpus, tmp_path: Path) -> None:
    from specjax.train import mtp as tr

    recipe = _recipe(corpus, tmp_path, "hybrid", {}, None)
    summary = tr.train(tr.load_config(recipe))
    log = _log(tmp_path / "run")
    assert log[0]["step"] == -1 and "val" in log[0]  # the GGUF's block, before training
    assert summary["steps"] == 3
    blocks = tr.load_run(tmp_path / "run")
    assert len(blocks) == 1 and "eh_proj" in blocks[0]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"step": 3}
