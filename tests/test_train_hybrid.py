"""Training a qwen35 hybrid target (specjax.train.hybrid on specjax.train.target's loop): the training
forward is the decode forward, a short run lowers the loss and exports a GGUF that loads back
and forwards, and train.init_from copies exactly the top-level tensors of equal shape."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.models import qwen35 as q
from specjax.train.hybrid import train_hybrid
from specjax.train.target import (
    TrainConfig,
    copy_top_level,
    load_params_npz,
    model_logits,
    save_params_npz,
)

ROOT = Path(__file__).resolve().parents[1]

MODEL = dict(
    arch="qwen35",
    vocab_size=2048,  # the shipped tokenizer's, so the GGUF embeds it
    dim=32,
    n_layers=3,
    full_attention_interval=3,  # layers 0, 1 delta-net, layer 2 attention
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    rope_dim=8,
    rope_theta=100.0,
    ffn_dim=32,
    ssm_state_size=8,
    ssm_k_heads=2,
    ssm_v_heads=4,
    n_nextn=1,
    max_position=64,
)


def test_training_forward_is_the_token_by_token_decode() -> None:
    """model_logits (the training forward: chunked scan over a fresh state, 80 tokens = two
    delta-net chunks) == one-token recurrent forwards with the state carried, per row."""
    cfg = q.Qwen35Config(**{**MODEL, "vocab_size": 64})
    params = q.init_params(cfg, jax.random.PRNGKey(1), std=0.3)
    B, T = 2, 80
    assert T > q.CHUNK
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, cfg.V)
    train_logits = np.asarray(jax.jit(lambda p, t: model_logits(cfg, p, t))(params, tokens))

    step = jax.jit(lambda t, pos, s: q.forward(cfg, params, t, pos, s, mode="recurrent"))
    state = q.new_state(cfg, B, T)
    want = []
    for i in range(T):
        out = step(tokens[:, i : i + 1], jnp.full((B, 1), i, jnp.int32), state)
        state = out.state
        want.append(np.asarray(out.logits[:, 0]))
    np.testing.assert_allclose(train_logits, np.stack(want, axis=1), rtol=2e-4, atol=2e-4)


def _counting(n: int, seed: int, vocab: int = 32) -> np.ndarray:
    """A learnable stream: next token is mostly current + 1 (mod `vocab`)."""
    rng = np.random.default_rng(seed)
    steps = np.where(rng.random(n) < 0.9, 1, rng.integers(2, vocab, n))
    return (np.cumsum(steps) % vocab).astype(np.uint16)


@pytest.mark.slow  # ~50 s on 2 cores; the training forward test stays in the default suite
def test_short_hybrid_run_lowers_loss_and_exports_a_loadable_gguf(tmp_path: Path) -> None:
    np.save(tmp_path / "train.npy", _counting(4000, 0))
    np.save(tmp_path / "val.npy", _counting(300, 1))
    cfg = TrainConfig.from_dict(
        {
            "model": MODEL,
            "data": {
                "tokenizer": str(ROOT / "models" / "tokenizer" / "tokenizer.json"),
                "tokens_path": str(tmp_path / "train.npy"),
                "val_tokens_path": str(tmp_path / "val.npy"),
                "seq_len": 32,
                "batch_size": 4,
            },
            "optim": {"lr": 3e-2, "warmup_steps": 0},
            "train": {
                "run_dir": str(tmp_path / "run"),
                "steps": 3,
                "log_every": 1,
                "eval_every": 2,
                "checkpoint_every": 0,
                "progress": False,
            },
        }
    )
    out = tmp_path / "hybrid-f16.gguf"
    summary = train_hybrid(cfg, out, ROOT / "models" / "tokenizer")
    losses = [r["loss"] for r in summary["log"] if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses
    assert summary["gguf"] == str(out) and (tmp_path / "run" / "snapshot-f16.gguf").exists()

    config, params = load_params_npz(tmp_path / "run" / "params.npz", dtype="float32")
    assert config == q.Qwen35Config(**MODEL) and len(params["nextn"]) == 1
    model = specjax.load(str(out), dtype="float32")
    assert model.config == q.Qwen35Config(**{**MODEL, "dtype": "float32"})
    ids = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    ours = model_logits(config, params, ids)
    theirs = model_logits(model.config, model.params, ids)
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), atol=0.05)  # F16 weights


def test_init_from_copies_only_top_level_tensors_of_equal_shape(tmp_path: Path) -> None:
    cfg = q.Qwen35Config(**MODEL)
    params = q.init_params(cfg, jax.random.PRNGKey(0))
    source = q.init_params(cfg, jax.random.PRNGKey(1))
    source = {**source, "lm_head": source["lm_head"][:, :16]}  # wrong shape: not copied
    save_params_npz(tmp_path / "src.npz", cfg, source)  # the .npz path of init_from
    _, loaded = load_params_npz(tmp_path / "src.npz")
    out, copied = copy_top_level(params, loaded)
    assert sorted(copied) == ["embed", "final_norm"]
    np.testing.assert_array_equal(np.asarray(out["embed"]), np.asarray(source["embed"]))
    np.testing.assert_array_equal(np.asarray(out["lm_head"]), np.asarray(params["lm_head"]))
    assert out["layers"] is params["layers"] and out["nextn"] is params["nextn"]


def test_train_hybrid_refuses_a_llama_config() -> None:
    llama = {"vocab_size": 64, "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1}
    cfg = TrainConfig.from_dict({"model": {**llama, "ffn_dim": 32}})
    with pytest.raises(ValueError, match=r"model\.arch: qwen35, got 'llama'"):
        train_hybrid(cfg)
