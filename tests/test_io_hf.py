"""specjax.io.hf_io: Hugging Face directory round trips, config.json parsing, shards, errors,
and load_model_files dispatch."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from specjax.errors import ModelFileError
from specjax.io import load_hf, load_model_files, save_hf
from specjax.io.hf_io import config_from_hf, config_to_hf
from specjax.io.tokenizer import Tokenizer
from specjax.models import ModelConfig, RopeScaling, init_params
from specjax.testing import jittered_params, leaves_equal, row_logits

WORDS = "the cat sat on a mat über café 東京 😀 12345 don't hello world draft".split()  # noqa: SIM905
BASE = dict(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
CONFIGS = {
    "llama_llama3": ModelConfig(
        arch="llama",
        rope_theta=500000.0,
        max_position=1024,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=256
        ),
        **BASE,
    ),
    "llama_tied_bias": ModelConfig(arch="llama", tie_embeddings=True, qkv_bias=True, **BASE),
    "qwen2_swa": ModelConfig(
        arch="qwen2",
        qkv_bias=True,
        sliding_window=8,
        swa_layers=(False, True),
        norm_eps=1e-6,
        **BASE,
    ),
    "qwen3_bf16": ModelConfig(
        arch="qwen3", qk_norm=True, head_dim=32, tie_embeddings=True, dtype="bfloat16", **BASE
    ),
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(200)]
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=290,
            special_tokens=["<|endoftext|>", "<|im_end|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return Tokenizer(hf, bos_id=0, eos_id=0, pad_id=0, add_bos=True)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_round_trip_is_exact(tok, tmp_path, name):
    config = CONFIGS[name]
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    assert sorted(os.listdir(tmp_path)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config2, params2, tok2 = load_hf(tmp_path)
    assert config2 == config
    assert leaves_equal(params2, params)
    text = "the cat 東京 😀<|im_end|>"
    assert tok2.encode(text, add_bos=tok2.add_bos) == tok.encode(text, add_bos=True)
    assert (tok2.bos_id, tok2.eos_id, tok2.pad_id, tok2.eog_ids) == (0, 0, 0, {0, 1})
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == config.arch
    assert hf["torch_dtype"] == config.dtype
    names = set(safetensors.numpy.load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in names) is (not config.tie_embeddings)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 1]


def test_hf_logits_unchanged(tok, tmp_path):
    config = CONFIGS["qwen2_swa"]
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    config2, params2, _ = load_model_files(tmp_path)
    ids = [5, 77, 123, 299, 0, 42, 8, 9, 10, 11]
    np.testing.assert_array_equal(
        row_logits(config2, params2, ids), row_logits(config, params, ids)
    )


def test_hf_tensor_names_and_layout(tok, tmp_path):
    """HF q/k/v rows are the specjax rows (no RoPE permutation), split at H*E and (H+G)*E."""
    config = CONFIGS["llama_llama3"]
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    t = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    E, H, G, F = config.E, config.H, config.G, config.F
    wqkv = np.asarray(params["layers"][1]["wqkv"])
    np.testing.assert_array_equal(t["model.layers.1.self_attn.q_proj.weight"], wqkv[: H * E])
    np.testing.assert_array_equal(
        t["model.layers.1.self_attn.k_proj.weight"], wqkv[H * E : (H + G) * E]
    )
    np.testing.assert_array_equal(t["model.layers.1.self_attn.v_proj.weight"], wqkv[(H + G) * E :])
    gate_up = np.asarray(params["layers"][1]["w_gate_up"])
    np.testing.assert_array_equal(t["model.layers.1.mlp.gate_proj.weight"], gate_up[:F])
    np.testing.assert_array_equal(t["model.layers.1.mlp.up_proj.weight"], gate_up[F:])
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert hf["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }


def test_sharded_checkpoint(tok, tmp_path):
    config = CONFIGS["llama_llama3"]
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    os.remove(tmp_path / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in shards.items():
        safetensors.numpy.save_file(
            {k: tensors[k] for k in keys}, tmp_path / file, metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config2, params2, _ = load_hf(tmp_path)
    assert config2 == config and leaves_equal(params2, params)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(
        ModelFileError, match=r"model-00002-of-00002.safetensors: weight shard listed"
    ):
        load_hf(tmp_path)


# ------------------------------------------------------------------ config.json parsing
def test_config_from_transformers_style_json():
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 300,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": True,
        "sliding_window": 32,
        "max_window_layers": 3,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
    }
    config = config_from_hf(hf)
    assert config.arch == "qwen2" and config.qkv_bias and not config.qk_norm
    assert config.sliding_window == 32
    assert config.swa_layers == (False, False, False, True)
    assert config.dtype == "bfloat16" and config.tie_embeddings and config.head_dim == 0
    assert config_from_hf({**hf, "use_sliding_window": False}).sliding_window == 0
    # transformers >= 4.5x writes layer_types, and rope_parameters instead of rope_theta
    newer = {
        **hf,
        "layer_types": ["sliding_attention"] * 4,
        "rope_theta": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
    }
    del newer["rope_theta"]
    config = config_from_hf(newer, dtype="float32")
    assert config.swa_layers == () and config.sliding_window == 32 and config.rope_theta == 5e5
    assert config.dtype == "float32"
    llama = {
        **hf,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": 32,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "original_max_position_embeddings": 8192,
        },
    }
    config = config_from_hf(llama)
    assert config.arch == "llama" and config.head_dim == 32 and not config.qkv_bias
    assert config.rope_scaling == RopeScaling(factor=32.0)
    assert config.sliding_window == 0
    assert config_from_hf(config_to_hf(config)) == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            "unsupported architecture.*GPT2LMHeadModel",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling type 'yarn'"),
        ({"mlp_bias": True}, "mlp_bias"),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            r"quantized checkpoint \(quant_method 'gptq'\) is not supported",
        ),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window=0"),
        ({"hidden_size": None}, "missing hidden_size"),
        (
            {"num_key_value_heads": 3},
            r"^config\.json: invalid model hyper-parameters: n_heads \(4\) must be a multiple "
            r"of n_kv_heads \(3\)",
        ),
    ],
)
def test_config_errors(change, message):
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    }
    with pytest.raises(ModelFileError, match=message):
        config_from_hf({**hf, **change})


# ------------------------------------------------------------------ file errors
def test_file_errors(tok, tmp_path):
    config = CONFIGS["llama_tied_bias"]
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    weights = tmp_path / "model.safetensors"
    good = weights.read_bytes()
    tensors = safetensors.numpy.load_file(weights)

    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelFileError, match=r"model.safetensors: truncated or corrupted"):
        load_hf(tmp_path)
    weights.write_bytes(os.urandom(1000))
    with pytest.raises(ModelFileError, match=r"truncated or corrupted"):
        load_hf(tmp_path)

    def write(changed: dict) -> None:
        safetensors.numpy.save_file(changed, weights, metadata={"format": "pt"})

    write({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(
        ModelFileError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_hf(tmp_path)
    write({**tensors, "model.layers.0.mlp.down_proj.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(
        ModelFileError, match=r"down_proj\.weight has shape \(64, 64\), expected \(64, 128\)"
    ):
        load_hf(tmp_path)
    write({**tensors, "model.layers.0.mlp.down_proj.bias": np.zeros((64,), np.float32)})
    with pytest.raises(ModelFileError, match=r"no slot for: model.layers.0.mlp.down_proj.bias"):
        load_hf(tmp_path)
    write({**tensors, "model.layers.0.self_attn.o_proj.bias": np.ones((64,), np.float32)})
    with pytest.raises(ModelFileError, match=r"o_proj.bias is non-zero"):
        load_hf(tmp_path)
    write({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones((8,), np.float32)})
    assert load_hf(tmp_path)[0] == config  # old checkpoints carry this buffer; it is ignored

    os.remove(tmp_path / "config.json")
    with pytest.raises(ModelFileError, match=r"no config.json"):
        load_hf(tmp_path)


def test_rope_factors_save_as_llama3_scaling_when_one_gives_them(tok, tmp_path):
    """A config holding a GGUF's factors saves as the llama3 rope_scaling that reproduces
    them; factors no llama3 scaling gives are refused by name (config.json cannot say them)."""
    from specjax.io.gguf_io import llama3_factors

    scaled = CONFIGS["llama_llama3"]
    factors = tuple(llama3_factors(scaled).tolist())
    config = dataclasses.replace(scaled, rope_scaling=None, rope_factors=factors)
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    config2, params2, _ = load_hf(tmp_path)
    assert config2.rope_scaling is not None and config2.rope_scaling.factor == 8.0
    np.testing.assert_allclose(
        row_logits(config2, params2, [5, 77, 123, 8]),
        row_logits(config, params, [5, 77, 123, 8]),
        rtol=0,
        atol=1e-5,
    )
    odd = dataclasses.replace(config, rope_factors=(1.0, 3.0) * (config.E // 4))
    with pytest.raises(ValueError, match=r"cannot express the RoPE factors \[1\.0, 3\.0"):
        config_to_hf(odd)


def test_mistral_folders_load_as_llama(tok, tmp_path):
    """MistralForCausalLM is a llama whose sliding_window (when not null) covers every layer;
    a llama windowed on every layer saves as Mistral and reloads equal."""
    config = ModelConfig(arch="llama", sliding_window=8, rope_theta=1e6, **BASE)
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["architectures"], hf["model_type"], hf["sliding_window"]) == (
        ["MistralForCausalLM"],
        "mistral",
        8,
    )
    config2, params2, _ = load_hf(tmp_path)
    assert config2 == config
    assert leaves_equal(params2, params)
    hf["sliding_window"] = None  # recent Mistral configs: full attention
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert load_hf(tmp_path)[0] == dataclasses.replace(config, sliding_window=0)
    del hf["architectures"]  # the model_type alone names it
    assert config_from_hf(hf) == dataclasses.replace(config, sliding_window=0)


def test_save_validation_and_atomic_files(tok, tmp_path):
    config = CONFIGS["llama_llama3"]
    params = jittered_params(config)
    with pytest.raises(ValueError, match=r"parameter layers.0.w_down has shape"):
        bad = dict(params["layers"][0], w_down=jnp.zeros((64, 64)))
        save_hf(tmp_path, config, dict(params, layers=(bad, params["layers"][1])), tok)
    swa_llama = ModelConfig(arch="llama", sliding_window=4, swa_layers=(True, False), **BASE)
    with pytest.raises(ValueError, match=r"slides every layer"):
        save_hf(tmp_path, swa_llama, init_params(swa_llama, jax.random.PRNGKey(0)), tok)
    assert os.listdir(tmp_path) == []
    qwen2 = ModelConfig(arch="qwen2", **BASE)  # transformers' Qwen2 always has q/k/v biases
    qparams = jittered_params(qwen2)
    save_hf(tmp_path, qwen2, qparams, tok)
    config2, params2, _ = load_hf(tmp_path)
    assert config2 == ModelConfig(arch="qwen2", qkv_bias=True, **BASE)
    assert not np.any(np.asarray(params2["layers"][0]["bqkv"]))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_load_model_files_dispatch(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelFileError, match=r"neither a .gguf file nor a Hugging Face"):
        load_model_files(tmp_path / "notes.txt")
    with pytest.raises(ModelFileError, match=r"no such file or directory"):
        load_model_files(tmp_path / "absent")
    with pytest.raises(ModelFileError, match=r"no config.json"):
        load_model_files(tmp_path)


# ------------------------------------------------------------------ transformers itself
@pytest.mark.peers
@pytest.mark.parametrize("name", ["llama_llama3", "qwen2_swa", "qwen3_bf16"])
def test_transformers_logits_match(tok, tmp_path, name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = ModelConfig.from_dict({**CONFIGS[name].to_dict(), "dtype": "float32"})
    params = jittered_params(config)
    save_hf(tmp_path, config, params, tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    ids = [5, 77, 123, 299, 0, 42, 8, 9, 10, 11, 12, 13]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(row_logits(config, params, ids), want, rtol=0, atol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "the cat 東京 😀"
    assert hf_tok(text)["input_ids"] == tok.encode(text, add_bos=True)
