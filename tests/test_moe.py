"""Qwen3-MoE targets (arch qwen3moe): the forward against a float64 NumPy transcription of
transformers' Qwen3MoeSparseMoeBlock (`oracles.moe_reference`) in every dispatch, lossless greedy
speculation with draft-simple and an n-gram drafter, config checks, and HF folder / GGUF round
trips (F32 exact, Q8_0 bounded) with llama.cpp's tensor names and layouts."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import moe_reference

from specjax.api import generate
from specjax.config import SpecConfig
from specjax.io import load_gguf, load_hf, save_gguf, save_hf
from specjax.io.tokenizer import Tokenizer
from specjax.models import ModelConfig, forward_fn, moe, new_cache
from specjax.testing import (
    jittered_params,
    leaves_equal,
    noisy_copy,
    row_logits,
    tiny_model,
    tiny_tokenizer,
)

MOE = dict(arch="qwen3moe", qk_norm=True, n_experts=8, n_experts_used=2, expert_ffn_dim=16)
BASE = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
CONFIGS = {
    "all_moe_norm": ModelConfig(**BASE, **MOE, norm_topk_prob=True),
    "mixed_unnormed": ModelConfig(**BASE, **MOE, moe_layers=(False, True)),
    "top4_of_4": ModelConfig(**BASE, **{**MOE, "n_experts": 4, "n_experts_used": 4}),
}
TOKENS = [5, 77, 12, 90, 0, 42, 8, 9, 33]


def _sharp(config: ModelConfig, seed: int = 0) -> dict:
    """Weights with unit-scale activations (so routing and attention are far from ties)."""
    params = jittered_params(config, seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 7), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys):
        name = str(path[-1].key)
        if name.endswith("norm") or leaf.ndim == 1:
            out.append(leaf)
            continue
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        scale = 1.0 if name in ("embed", "lm_head") else 1.0 / np.sqrt(leaf.shape[-1])
        out.append((noise * scale).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("dispatch", moe.DISPATCHES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_float64_reference(name, dispatch, monkeypatch):
    config = CONFIGS[name]
    params = _sharp(config)
    monkeypatch.setattr(moe, "moe_dispatch", lambda pairs, n_experts: dispatch)
    got = forward_fn(
        config,
        params,
        jnp.asarray([TOKENS], jnp.int32),
        jnp.arange(len(TOKENS), dtype=jnp.int32)[None],
        new_cache(config, 1, 16),
    ).logits[0]
    want = moe_reference.forward(config, params, TOKENS, list(range(len(TOKENS))))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-4 * np.abs(want).max())
    # the routing must matter: dropping the experts' weights changes the logits
    layer = params["layers"][-1]
    zeroed = dict(layer, experts_down=jnp.zeros_like(layer["experts_down"]))
    other = moe_reference.forward(
        config, {**params, "layers": (*params["layers"][:-1], zeroed)}, TOKENS, range(9)
    )
    assert np.abs(other - want).max() > 100 * 2e-4 * np.abs(want).max()


def test_dispatches_agree_on_padding_rows_and_repeats():
    """Every dispatch: same output for a token whatever shares its call (repeats included)."""
    config = CONFIGS["all_moe_norm"]
    layer = _sharp(config)["layers"][0]
    h = jax.random.normal(jax.random.PRNGKey(1), (2, 5, config.D))
    h = h.at[1, 3].set(h[0, 0])  # the same token twice in one call
    outs = {d: np.asarray(moe.moe_ffn(config, layer, h, d)) for d in moe.DISPATCHES}
    alone = np.asarray(moe.moe_ffn(config, layer, h[:1, :1], "pairs"))
    for d, out in outs.items():
        np.testing.assert_allclose(out, outs["pairs"], atol=1e-5, err_msg=d)
        np.testing.assert_allclose(out[1, 3], alone[0, 0], atol=1e-5, err_msg=d)
    with pytest.raises(ValueError, match="unknown MoE dispatch 'gathered'"):
        moe.moe_ffn(config, layer, h, "gathered")


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(arch="qwen3"), "qwen3moe has experts"),
        (dict(n_experts=0), "qwen3moe has experts"),
        (dict(n_experts_used=9), r"n_experts_used must be in 1..n_experts \(8\), got 9"),
        (dict(expert_ffn_dim=0), "expert_ffn_dim must be positive, got 0"),
        (dict(moe_layers=(True,)), "moe_layers has 1 entries for 2 layers"),
        (dict(qk_norm=False), "qk_norm=True"),
    ],
)
def test_config_errors_name_the_numbers(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BASE, **MOE, **change})


def test_config_counts_and_dict_round_trip():
    config = CONFIGS["mixed_unnormed"]
    assert [config.is_moe_layer(i) for i in range(2)] == [False, True]
    assert ModelConfig.from_dict(config.to_dict()) == config
    params = jittered_params(config)
    assert config.num_params() == sum(x.size for x in jax.tree.leaves(params))


# ------------------------------------------------------------------ speculation on an MoE target
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [20, 21, 22, 20, 21, 22, 20], [30, 31, 32]]
MAX_NEW = [24, 24, 16]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, **MOE, norm_topk_prob=True)


@pytest.fixture(scope="module")
def plain(target):
    return generate(target, PROMPTS, max_new_tokens=MAX_NEW)


def test_draft_simple_greedy_is_lossless(target, plain):
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=3)
    out = generate(
        target, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, draft=noisy_copy(target, 0.6)
    )
    assert out.tokens == plain.tokens
    stats = out.stats.to_dict()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_ngram_greedy_is_lossless(target, plain):
    # prompts made of the model's own continuation (so n-grams repeat), plus a row whose end
    # matches an earlier n-gram the model does not continue with (so drafts get rejected)
    own = generate(target, PROMPTS, max_new_tokens=16).tokens
    prompts = [p + o for p, o in zip(PROMPTS, own)]
    prompts.append([50, 51, 52, 53, 60, 61, 62, 63, 64, 65, 70, 71, 50, 51, 52, 53])
    max_new = [*MAX_NEW, 16]
    ref = generate(target, prompts, max_new_tokens=max_new)
    spec = SpecConfig(
        types=("ngram-simple",), adaptive=False, ngram_simple_size_n=1, ngram_simple_size_m=4
    )
    out = generate(target, prompts, max_new_tokens=max_new, spec=spec)
    assert out.tokens == ref.tokens
    stats = out.stats.to_dict()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


# ------------------------------------------------------------------ files
@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer(280)  # type: ignore[return-value]


FILE_CONFIG = ModelConfig(**{**BASE, "vocab_size": 300}, **MOE, norm_topk_prob=True)


def test_gguf_round_trip_and_llama_cpp_layout(tok, tmp_path):
    params = jittered_params(FILE_CONFIG)
    path = tmp_path / "m.gguf"
    save_gguf(path, FILE_CONFIG, params, tok)
    config, params2, _ = load_gguf(path)
    assert config == FILE_CONFIG
    assert leaves_equal(params2, params)
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "qwen3moe"
    assert fields["qwen3moe.expert_count"] == 8 and fields["qwen3moe.expert_used_count"] == 2
    assert fields["qwen3moe.expert_feed_forward_length"] == 16
    # ggml dims (ne) as llama.cpp's qwen3moe loader creates them: {D, X}, {D, F', X}, {F', D, X}
    ne = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert ne["blk.1.ffn_gate_inp.weight"] == [32, 8]
    assert ne["blk.1.ffn_gate_exps.weight"] == [32, 16, 8] == ne["blk.1.ffn_up_exps.weight"]
    assert ne["blk.1.ffn_down_exps.weight"] == [16, 32, 8]
    # expert 3's gate rows [F', D] are the first F' columns of its input-major gate/up matrix
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    np.testing.assert_array_equal(
        np.asarray(gate.data)[3], np.asarray(params["layers"][0]["experts_gate_up"])[3, :, :16].T
    )


def test_gguf_q8_0_round_trip_is_bounded(tok, tmp_path):
    params = jittered_params(FILE_CONFIG)
    save_gguf(tmp_path / "q.gguf", FILE_CONFIG, params, tok, dtype="q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.F16  # F' = 16 rows
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32  # router
    config, params2, _ = load_gguf(tmp_path / "q.gguf")
    got = row_logits(config, params2, TOKENS)
    want = row_logits(FILE_CONFIG, params, TOKENS)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def test_gguf_save_refuses_what_llama_cpp_cannot_express(tok, tmp_path):
    for config, message in [
        (CONFIGS["mixed_unnormed"], "renormalises"),
        (ModelConfig(**BASE, **MOE, norm_topk_prob=True, moe_layers=(True, False)), "every layer"),
    ]:
        with pytest.raises(ValueError, match=message):
            save_gguf(tmp_path / "x.gguf", config, jittered_params(config), tok)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("config", [FILE_CONFIG, CONFIGS["mixed_unnormed"]], ids=["all", "mixed"])
def test_hf_round_trip_is_exact(tok, tmp_path, config):
    config = ModelConfig.from_dict({**config.to_dict(), "vocab_size": 300})
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    config2, params2, _ = load_hf(tmp_path)
    assert config2 == config
    assert leaves_equal(params2, params)
    import json

    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["model_type"] == "qwen3_moe"
    assert hf["mlp_only_layers"] == [i for i in range(2) if not config.is_moe_layer(i)]


def test_hf_fused_expert_tensors_load(tok, tmp_path):
    """transformers' own fused layout (mlp.experts.gate_up_proj [X, 2F', D], down_proj)."""
    import safetensors.numpy

    params = jittered_params(FILE_CONFIG)
    save_hf(tmp_path, FILE_CONFIG, params, tok)
    weights = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    fused = {k: v for k, v in weights.items() if ".experts." not in k}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}.mlp.experts."
        # transformers' [X, 2F', D] and [X, D, F'] ([out, in] per expert)
        fused[p + "gate_up_proj"] = np.asarray(layer["experts_gate_up"]).transpose(0, 2, 1).copy()
        fused[p + "down_proj"] = np.asarray(layer["experts_down"]).transpose(0, 2, 1).copy()
    safetensors.numpy.save_file(fused, tmp_path / "model.safetensors")
    _, params2, _ = load_hf(tmp_path)
    assert leaves_equal(params2, params)
