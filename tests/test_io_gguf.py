"""specjax.io.gguf_io: GGUF round trips (F32 exact, F16/BF16/Q8_0 bounded), llama.cpp layout
conventions (interleaved-RoPE row permutation, rope_freqs), quantised loads and file errors."""

from __future__ import annotations

import dataclasses
import math
import os
import random

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from gguf import GGMLQuantizationType as QT
from tokenizers import decoders, models, pre_tokenizers, trainers

from specjax.errors import ModelFileError
from specjax.io import gguf_io, load_gguf, load_model_files, save_gguf
from specjax.io.tokenizer import Tokenizer
from specjax.models import ModelConfig, RopeScaling, forward_fn, init_params, new_cache
from specjax.models.config import rope_frequencies
from specjax.testing import jittered_params, leaves_equal, row_logits

WORDS = "the cat sat on a mat über café 東京 😀 12345 don't hello world draft".split()  # noqa: SIM905


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
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return Tokenizer(hf, bos_id=0, eos_id=0)


BASE = dict(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
CONFIGS = {
    "llama": ModelConfig(arch="llama", **BASE),
    "llama_tied_llama3": ModelConfig(
        arch="llama",
        tie_embeddings=True,
        rope_theta=500000.0,
        max_position=1024,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=8.0, original_max_position=256
        ),
        **BASE,
    ),
    "qwen2_bias": ModelConfig(arch="qwen2", qkv_bias=True, norm_eps=1e-6, rope_theta=1e6, **BASE),
    "qwen3_qknorm": ModelConfig(
        arch="qwen3", qk_norm=True, head_dim=32, tie_embeddings=True, **BASE
    ),
}


IDS = [5, 77, 123, 299, 0, 42, 8, 9]


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("name", list(CONFIGS))
def test_f32_round_trip_is_exact(tok, tmp_path, name):
    config = CONFIGS[name]
    params = jittered_params(config)
    path = tmp_path / "m.gguf"
    save_gguf(path, config, params, tok)
    config2, params2, tok2 = load_gguf(path)
    assert config2 == config
    assert leaves_equal(params2, params)
    np.testing.assert_array_equal(
        row_logits(config2, params2, IDS), row_logits(config, params, IDS)
    )
    assert tok2.encode("the cat 東京 😀") == tok.encode("the cat 東京 😀")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in names) is (not config.tie_embeddings)
    assert ("blk.0.attn_q.bias" in names) is config.qkv_bias
    assert ("blk.1.attn_k_norm.weight" in names) is config.qk_norm


def test_llama_rows_are_permuted_for_interleaved_rope(tok, tmp_path):
    """llama.cpp's llama rotates adjacent pairs (2i, 2i+1); specjax rotates (i, i + E/2)."""
    config = CONFIGS["llama"]
    params = jittered_params(config)
    save_gguf(tmp_path / "m.gguf", config, params, tok)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    E, H, G = config.E, config.H, config.G
    wqkv = np.asarray(params["layers"][0]["wqkv"])
    for name, rows, heads in (
        ("attn_q", wqkv[: H * E], H),
        ("attn_k", wqkv[H * E : (H + G) * E], G),
    ):
        stored = np.asarray(tensors[f"blk.0.{name}.weight"].data).reshape(heads, E, -1)
        ours = rows.reshape(heads, E, -1)
        np.testing.assert_array_equal(stored[:, 0::2], ours[:, : E // 2])
        np.testing.assert_array_equal(stored[:, 1::2], ours[:, E // 2 :])
    v = np.asarray(tensors["blk.0.attn_v.weight"].data)
    np.testing.assert_array_equal(v, wqkv[(H + G) * E :])  # V is never permuted
    # qwen archs use NeoX RoPE: rows are stored as they are
    qwen = CONFIGS["qwen2_bias"]
    qparams = jittered_params(qwen)
    save_gguf(tmp_path / "q.gguf", qwen, qparams, tok)
    stored = next(
        t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors if t.name == "blk.0.attn_q.weight"
    )
    np.testing.assert_array_equal(
        np.asarray(stored.data), np.asarray(qparams["layers"][0]["wqkv"])[: H * E]
    )


def test_rope_freqs_tensor_matches_llama_cpp_formula(tok, tmp_path, monkeypatch):
    config = CONFIGS["llama_tied_llama3"]
    params = jittered_params(config)
    save_gguf(tmp_path / "m.gguf", config, params, tok)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    # convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), written out independently
    s, E = config.rope_scaling, config.E
    expected = []
    for i in range(0, E, 2):
        freq = 1.0 / (config.rope_theta ** (i / E))
        wavelen = 2 * math.pi / freq
        if wavelen < s.original_max_position / s.high_freq_factor:
            expected.append(1.0)
        elif wavelen > s.original_max_position / s.low_freq_factor:
            expected.append(s.factor)
        else:
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            expected.append(1 / ((1 - smooth) / s.factor + smooth))
    np.testing.assert_allclose(np.asarray(tensors["rope_freqs.weight"].data), expected, rtol=1e-6)
    # A file as llama.cpp's converter writes it (no specjax.* keys): the stored factors are used
    # as they are, exactly as llama.cpp uses them.
    monkeypatch.setattr(gguf_io, "_SPECJAX_ROPE", "absent.")
    config2, params2, _ = load_gguf(tmp_path / "m.gguf")
    assert config2.rope_scaling is None
    assert config2.rope_factors == tuple(
        float(x) for x in np.asarray(tensors["rope_freqs.weight"].data, np.float32)
    )
    np.testing.assert_allclose(rope_frequencies(config2), rope_frequencies(config), rtol=1e-6)
    np.testing.assert_allclose(
        row_logits(config2, params2, IDS), row_logits(config, params, IDS), rtol=0, atol=1e-5
    )


def test_any_rope_factors_load_and_round_trip(tok, tmp_path):
    """Factors no llama3 scaling produces (one pair inside the band, as llama.cpp's converter
    writes for factor 8 / original context 64 at theta 5e5) are stored per pair: the model
    turns pair i at theta^(-2i/E) / factor_i, and a save writes the same rope_freqs back."""
    factors = (1.0, 2.4422595500946045, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0)
    config = ModelConfig(arch="llama", rope_theta=500000.0, rope_factors=factors, **BASE)
    E = config.E
    want = [1.0 / (500000.0 ** (2 * i / E)) / f for i, f in enumerate(factors)]
    np.testing.assert_allclose(rope_frequencies(config), want, rtol=1e-12)
    params = jittered_params(config)
    save_gguf(tmp_path / "m.gguf", config, params, tok)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    np.testing.assert_array_equal(
        np.asarray(tensors["rope_freqs.weight"].data), np.asarray(factors, np.float32)
    )
    config2, params2, _ = load_gguf(tmp_path / "m.gguf")
    assert config2 == config
    np.testing.assert_array_equal(
        row_logits(config2, params2, IDS), row_logits(config, params, IDS)
    )
    plain = dataclasses.replace(config, rope_factors=())
    assert not np.allclose(row_logits(plain, params, IDS), row_logits(config, params, IDS))
    with pytest.raises(ValueError, match=r"rope_factors has 3 entries; head_dim 16 has 8"):
        ModelConfig(arch="llama", rope_factors=(1.0, 2.0, 3.0), **BASE)
    with pytest.raises(ValueError, match=r"not both"):
        dataclasses.replace(config, rope_scaling=RopeScaling())
    with pytest.raises(ValueError, match=r"finite and positive"):
        ModelConfig(arch="llama", rope_factors=(1.0,) * 7 + (0.0,), **BASE)


def test_fit_llama3_scaling_without_smooth_band():
    config = ModelConfig(arch="llama", **BASE)  # E=16, theta 1e4: wavelengths 6.3 .. 19869
    factors = np.asarray([1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0])
    fitted = gguf_io.fit_llama3_scaling(config, factors)
    assert fitted is not None and fitted.factor == 4.0
    got = gguf_io.llama3_factors(ModelConfig(arch="llama", rope_scaling=fitted, **BASE))
    np.testing.assert_allclose(got, factors, rtol=1e-6)
    assert gguf_io.fit_llama3_scaling(config, np.ones(8)) is None
    assert gguf_io.fit_llama3_scaling(config, np.asarray([1, 3, 1, 3, 1, 3, 1, 3.0])) is None


# Per-element bounds: F16 keeps 11 significant bits (|err| <= |x| * 2^-11); BF16 keeps 8;
# Q8_0 stores q = round(x / d), d = max|block| / 127 rounded to fp16: |err| <= d/2 + 127 d 2^-11.
# Logit bound: max|delta logit| <= rel * max|logit|, rel ~ 3x the worst seen over archs and seeds
# (f16 6e-4, bf16 4.2e-3, q8_0 9.3e-3) with the forward run in float32.
@pytest.mark.parametrize(
    ("dtype", "name", "rel"),
    [("f16", "qwen3_qknorm", 2e-3), ("bf16", "qwen2_bias", 1.5e-2), ("q8_0", "llama", 3e-2)],
)
def test_lossy_round_trip_is_bounded(tok, tmp_path, dtype, name, rel):
    config = CONFIGS[name]
    params = jittered_params(config)
    save_gguf(tmp_path / "m.gguf", config, params, tok, dtype=dtype)
    config2, params2, _ = load_gguf(tmp_path / "m.gguf")
    assert config2.dtype == {"f16": "float16", "bf16": "bfloat16", "q8_0": "float32"}[dtype]
    config2 = ModelConfig.from_dict({**config2.to_dict(), "dtype": "float32"})
    params2 = jax.tree.map(lambda x: x.astype(jnp.float32), params2)
    assert config2 == config
    types = {t.name: QT(int(t.tensor_type)) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.attn_norm.weight"] == QT.F32  # 1-D tensors stay F32, as in llama.cpp
    assert (
        types["blk.0.ffn_down.weight"] == {"f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}[dtype]
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if dtype == "q8_0" and a.ndim == 1:
            np.testing.assert_array_equal(a, b)  # F32 in the file, float32 params
        elif dtype == "q8_0":
            blocks = np.abs(a.reshape(a.shape[0], -1, 32)).max(axis=-1, keepdims=True)
            bound = np.broadcast_to(blocks / 127 * (0.5 + 127 * 2**-11), (*blocks.shape[:2], 32))
            assert np.all(np.abs(a - b) <= bound.reshape(a.shape))
        else:  # 2-D stored as F16/BF16; 1-D stored F32 but loaded into float16/bfloat16 params
            bits = 11 if dtype == "f16" else 8
            assert np.all(
                np.abs(a - b) <= np.abs(a) * 2.0**-bits + 2.0**-25
            )  # + fp16 subnormal step
    got = row_logits(config2, params2, IDS)
    want = row_logits(config, params, IDS)
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * np.abs(want).max())


def _random_kquant(rng: np.random.Generator, rows: int, cols: int, qtype: QT) -> np.ndarray:
    """Random K-quant blocks with small finite fp16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    if qtype == QT.Q4_K:  # d, dmin (fp16) lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d (fp16) ends the block
        raw[..., size - 2 : size] = scale
    return raw.reshape(rows, -1)


def test_quantised_types_load(tok, tmp_path, monkeypatch):
    """Q4_0 (bounded error) and raw Q4_K / Q6_K blocks (exactly gguf-py's dequantisation)."""
    config = ModelConfig(
        arch="llama", vocab_size=300, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=256
    )
    params = jittered_params(config)
    rng = np.random.default_rng(0)
    raw = {
        "blk.0.attn_k.weight": (_random_kquant(rng, 128, 256, QT.Q4_K), QT.Q4_K),
        "blk.0.attn_output.weight": (_random_kquant(rng, 256, 256, QT.Q6_K), QT.Q6_K),
    }
    real_add = gguf.GGUFWriter.add_tensor

    def add(self, name, tensor, raw_shape=None, raw_dtype=None):
        if name in raw:
            return real_add(self, name, raw[name][0], raw_dtype=raw[name][1])
        if tensor.ndim == 2:
            return real_add(self, name, gguf.quants.quantize(tensor, QT.Q4_0), raw_dtype=QT.Q4_0)
        return real_add(self, name, tensor, raw_shape, raw_dtype)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add)
    save_gguf(tmp_path / "m.gguf", config, params, tok)
    types = {t.name: QT(int(t.tensor_type)) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["token_embd.weight"] == QT.Q4_0
    assert types["blk.0.attn_k.weight"] == QT.Q4_K
    assert types["blk.0.attn_output.weight"] == QT.Q6_K
    config2, params2, _ = load_gguf(tmp_path / "m.gguf")
    assert config2 == config
    layer = params2["layers"][0]
    E, H, G = config.E, config.H, config.G
    k = gguf_io.unpermute_qk(gguf.quants.dequantize(raw["blk.0.attn_k.weight"][0], QT.Q4_K), G)
    np.testing.assert_array_equal(np.asarray(layer["wqkv"])[H * E : (H + G) * E], k)
    wo = gguf.quants.dequantize(raw["blk.0.attn_output.weight"][0], QT.Q6_K)
    np.testing.assert_array_equal(np.asarray(layer["wo"]), wo)
    # Q4_0: d = max|block| / 8 (fp16), levels -8..7: |err| <= d + 8 d 2^-11
    a = np.asarray(params["embed"], np.float64).reshape(300, -1, 32)
    b = np.asarray(params2["embed"], np.float64).reshape(300, -1, 32)
    bound = np.abs(a).max(-1, keepdims=True) / 8 * (1 + 8 * 2**-11)
    assert np.all(np.abs(a - b) <= bound)


# ------------------------------------------------------------------ errors
def write_minimal_gguf(path, arch: str, tensor: np.ndarray | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor(
        "token_embd.weight", np.zeros((8, 4), np.float32) if tensor is None else tensor
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_architecture(tmp_path):
    write_minimal_gguf(tmp_path / "m.gguf", "gpt99")
    with pytest.raises(ModelFileError, match=r"m\.gguf: unsupported architecture 'gpt99'.*llama"):
        load_gguf(tmp_path / "m.gguf")


def test_truncated_and_garbage_files(tok, tmp_path):
    config = CONFIGS["llama"]
    save_gguf(tmp_path / "m.gguf", config, jittered_params(config), tok)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "half.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match=r"half\.gguf: truncated"):
        load_gguf(tmp_path / "half.gguf")
    (tmp_path / "tail.gguf").write_bytes(data[:-100])
    with pytest.raises(ModelFileError, match=r"tail\.gguf: truncated"):
        load_gguf(tmp_path / "tail.gguf")
    (tmp_path / "garbage.gguf").write_bytes(os.urandom(4096))
    with pytest.raises(ModelFileError, match=r"garbage\.gguf: not a GGUF file"):
        load_gguf(tmp_path / "garbage.gguf")
    (tmp_path / "bad_header.gguf").write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelFileError, match=r"bad_header\.gguf: truncated or corrupted"):
        load_gguf(tmp_path / "bad_header.gguf")
    with pytest.raises(ModelFileError, match=r"file not found"):
        load_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize(
    ("qtype", "data"),
    [
        (QT.I32, np.zeros((128, 64), np.int32)),
        (QT.Q8_1, np.zeros((128, 64 // 32 * 40), np.uint8)),  # gguf-py cannot dequantize Q8_1
    ],
)
def test_unsupported_tensor_type(tok, tmp_path, monkeypatch, qtype, data):
    config = CONFIGS["llama"]
    real_add = gguf.GGUFWriter.add_tensor

    def add(self, name, tensor, raw_shape=None, raw_dtype=None):
        if name == "blk.0.ffn_gate.weight":
            return real_add(self, name, data, raw_dtype=None if qtype == QT.I32 else qtype)
        return real_add(self, name, tensor, raw_shape, raw_dtype)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add)
    save_gguf(tmp_path / "m.gguf", config, jittered_params(config), tok)
    with pytest.raises(
        ModelFileError,
        match=rf"m\.gguf: tensor blk\.0\.ffn_gate\.weight has unsupported tensor type {qtype.name}",
    ):
        load_gguf(tmp_path / "m.gguf")


def test_missing_extra_and_misshaped_tensors(tok, tmp_path, monkeypatch):
    config = CONFIGS["qwen2_bias"]
    params = jittered_params(config)
    real_add = gguf.GGUFWriter.add_tensor

    def dropping(self, name, *args, **kwargs):
        if name != "blk.1.attn_v.bias":
            real_add(self, name, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_tensor", dropping)
        save_gguf(tmp_path / "a.gguf", config, params, tok)
    with pytest.raises(ModelFileError, match=r"a\.gguf: missing tensor blk\.1\.attn_v\.bias"):
        load_gguf(tmp_path / "a.gguf")

    def extra(self, name, *args, **kwargs):
        real_add(self, name, *args, **kwargs)
        if name == "output.weight":
            real_add(self, "output.bias", np.zeros(300, np.float32))

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_tensor", extra)
        save_gguf(tmp_path / "b.gguf", config, params, tok)
    with pytest.raises(ModelFileError, match=r"no slot for: output.bias"):
        load_gguf(tmp_path / "b.gguf")

    with monkeypatch.context() as m:
        m.setattr(
            gguf.GGUFWriter,
            "add_feed_forward_length",
            lambda self, n: self.add_uint32("qwen2.feed_forward_length", n // 2),
        )
        save_gguf(tmp_path / "c.gguf", config, params, tok)
    with pytest.raises(
        ModelFileError, match=r"blk\.0\.ffn_gate\.weight has shape \(128, 64\).*expected \(64, 64\)"
    ):
        load_gguf(tmp_path / "c.gguf")


def test_failed_save_keeps_existing_file(tok, tmp_path, monkeypatch):
    config = CONFIGS["llama"]
    target = tmp_path / "m.gguf"
    target.write_bytes(b"precious")
    original = gguf_io._encode_tensor
    calls = []

    def failing(arr, dtype):
        calls.append(arr.shape)
        if len(calls) == 10:
            raise RuntimeError("disk full")
        return original(arr, dtype)

    monkeypatch.setattr(gguf_io, "_encode_tensor", failing)
    with pytest.raises(RuntimeError, match=r"disk full"):
        save_gguf(target, config, jittered_params(config), tok)
    assert target.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]  # no temp file left behind


def test_save_validation(tok, tmp_path):
    config = CONFIGS["llama"]
    params = jittered_params(config)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        save_gguf(tmp_path / "m.gguf", config, params, tok, dtype="q4_k")
    bad = dict(params, layers=(params["layers"][0],))
    with pytest.raises(ValueError, match=r"params has 1 layers, config.n_layers=2"):
        save_gguf(tmp_path / "m.gguf", config, bad, tok)
    wrong = ModelConfig(arch="llama", qk_norm=True, **BASE)
    with pytest.raises(ValueError, match=r"no q/k norm"):
        save_gguf(tmp_path / "m.gguf", wrong, init_params(wrong, jax.random.PRNGKey(0)), tok)
    small = ModelConfig(arch="llama", **{**BASE, "vocab_size": 100})
    with pytest.raises(ValueError, match=r"290 tokens but the model vocabulary is 100"):
        save_gguf(tmp_path / "m.gguf", small, init_params(small, jax.random.PRNGKey(0)), tok)
    assert not (tmp_path / "m.gguf").exists()


def test_load_model_files_dispatches_gguf(tok, tmp_path):
    config = CONFIGS["qwen3_qknorm"]
    params = jittered_params(config)
    save_gguf(tmp_path / "m.gguf", config, params, tok)
    config2, params2, _ = load_model_files(tmp_path / "m.gguf")
    assert config2 == config and leaves_equal(params2, params)
    os.replace(tmp_path / "m.gguf", tmp_path / "model.bin")  # sniffed by magic, not by name
    assert load_model_files(tmp_path / "model.bin")[0] == config


# ------------------------------------------------------------------ llama.cpp itself
@pytest.mark.peers
def test_llama_cpp_greedy_tokens_match(tok, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    config = ModelConfig(arch="llama", **BASE)
    params = jittered_params(config)
    params["embed"] = params["embed"] * 50  # make greedy choices far from ties
    params["lm_head"] = params["lm_head"] * 50
    save_gguf(tmp_path / "m.gguf", config, params, tok)
    prompt = tok.encode("the cat sat on")
    n_new = 64
    # specjax greedy decoding with the KV cache
    cache = new_cache(config, 1, len(prompt) + n_new)
    out = forward_fn(
        config,
        params,
        jnp.asarray([prompt], jnp.int32),
        jnp.arange(len(prompt), dtype=jnp.int32)[None],
        cache,
    )
    ours, cache = [], out.cache
    nxt = int(jnp.argmax(out.logits[0, -1]))
    for step in range(n_new):
        ours.append(nxt)
        pos = len(prompt) + step
        out = forward_fn(
            config, params, jnp.asarray([[nxt]], jnp.int32), jnp.asarray([[pos]], jnp.int32), cache
        )
        cache = out.cache
        nxt = int(jnp.argmax(out.logits[0, -1]))
    llm = llama_cpp.Llama(
        model_path=str(tmp_path / "m.gguf"), n_ctx=256, n_threads=2, verbose=False
    )
    theirs = []
    for t in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        theirs.append(t)
        if len(theirs) == n_new:
            break
    assert theirs == ours


def _gguf_with_keys(path, keys: list[tuple[str, str]]) -> None:
    """A tensor-free GGUF v3 whose string keys are written in the given order (gguf spec)."""

    def s(x: str) -> bytes:
        b = x.encode()
        return len(b).to_bytes(8, "little") + b

    body = b"".join(s(k) + (8).to_bytes(4, "little") + s(v) for k, v in keys)
    head = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
    path.write_bytes(head + len(keys).to_bytes(8, "little") + body)


def test_read_architecture_from_the_header_agrees_with_a_full_parse(tmp_path):
    first = tmp_path / "first.gguf"
    _gguf_with_keys(first, [("general.architecture", "qwen35"), ("general.name", "x")])
    later = tmp_path / "later.gguf"  # not first: the whole file is parsed
    _gguf_with_keys(
        later, [("general.name", "general.architecture"), ("general.architecture", "dflash")]
    )
    none = tmp_path / "none.gguf"
    _gguf_with_keys(none, [("general.name", "x")])
    for path, want in ((first, "qwen35"), (later, "dflash"), (none, None)):
        assert gguf_io.read_architecture(path) == want
        field = gguf.GGUFReader(path).fields.get("general.architecture")
        assert (None if field is None else field.contents()) == want
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ModelFileError, match="not a GGUF"):
        gguf_io.read_architecture(garbage)
