"""GGUF files of llama.cpp's `eagle3` architecture <-> (Eagle3Config, params, Tokenizer).

Layout, as llama.cpp's loader (src/models/eagle3.cpp) and converter (conversion/llama.py):

    metadata  eagle3.{context_length, embedding_length, block_count = 1,
              feed_forward_length, attention.head_count, attention.head_count_kv,
              attention.key_length, attention.value_length, rope.dimension_count,
              rope.freq_base, attention.layer_norm_rms_epsilon, vocab_size}
              eagle3.target_layers        int32[3]  (the converter's `extract_layers`)
              eagle3.target_hidden_size   uint32
              eagle3.norm_before_residual bool, eagle3.norm_before_fc bool (optional, false)
              tokenizer.ggml.*            the target's tokenizer (llama.cpp loads a vocab)
    tensors   fc.weight [3 Dt -> D], enc.output_norm.weight (norm_before_fc only),
              output_norm.weight, output.weight (optional: else the target's),
              token_embd.weight (optional: else the target's), d2t (I64 absolute target ids,
              optional), blk.0.{attn_norm, attn_norm_2, attn_q, attn_k, attn_v, attn_output,
              ffn_norm, ffn_gate, ffn_up, ffn_down}.weight, rope_freqs.weight [E/2]
              (optional: per-pair RoPE divisors, a llama3-scaled target's; the config's
              rope_factors)

Invariants: RoPE type NORM (interleaved) as the `llama` architecture, so Q/K rows are stored
permuted and un-permuted on load (specjax computes rotate-half); 2-D weights are written as
F32/F16/BF16/Q8_0 like `save_gguf`, 1-D as F32; every tensor in a file is consumed or the
load fails; a save replaces the file atomically.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QT

from specjax.errors import ModelFileError
from specjax.io.gguf_io import (
    _FILE_TYPE,
    SAVE_DTYPES,
    _config_dtype,
    _encode_tensor,
    _f32,
    _field_values,
    _on_device,
    _open_reader,
    _tensor_to_numpy,
    atomic_gguf_writer,
    permute_qk,
    read_architecture,
    rope_factors_from_tensor,
    unpermute_qk,
)
from specjax.io.tokenizer import Tokenizer
from specjax.models.eagle3 import Eagle3Config, check_params
from specjax.types import Params

ARCH = "eagle3"


def gguf_architecture(path: str | os.PathLike[str]) -> str | None:
    """`general.architecture` of a GGUF file (None when absent), read from its header."""
    return read_architecture(path)


def save_eagle3_gguf(
    path: str | os.PathLike[str],
    config: Eagle3Config,
    params: Params,
    tokenizer: Tokenizer,
    dtype: str = "f16",
) -> None:
    """Write an EAGLE-3 head llama.cpp loads (`-md` with `--spec-type draft-eagle3`)."""
    path = os.fspath(path)
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    check_params(config, params)
    if tokenizer.vocab_size > config.V:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the head's vocabulary is {config.V}"
        )
    with atomic_gguf_writer(path, ARCH) as w:
        w.add_name("specjax-eagle3")
        w.add_file_type(_FILE_TYPE[dtype])
        w.add_context_length(config.max_position)
        w.add_embedding_length(config.D)
        w.add_block_count(1)
        w.add_feed_forward_length(config.F)
        w.add_head_count(config.H)
        w.add_head_count_kv(config.G)
        w.add_key_length(config.E)
        w.add_value_length(config.E)
        w.add_rope_dimension_count(config.E)
        w.add_rope_freq_base(config.rope_theta)
        w.add_layer_norm_rms_eps(config.norm_eps)
        w.add_vocab_size(config.V)
        w.add_array(f"{ARCH}.target_layers", [int(i) for i in config.target_layers])
        w.add_uint32(f"{ARCH}.target_hidden_size", config.target_hidden)
        w.add_bool(f"{ARCH}.norm_before_residual", config.norm_before_residual)
        w.add_bool(f"{ARCH}.norm_before_fc", config.norm_before_fc)
        tokenizer.write_gguf_metadata(w, config.V)

        def add(name: str, arr: Any) -> None:
            data, raw = _encode_tensor(np.asarray(arr, np.float32), dtype)
            w.add_tensor(name, data, raw_dtype=raw)

        H, G, E = config.H, config.G, config.E
        wqkv = np.asarray(params["wqkv"], np.float32)
        q, k, v = wqkv[: H * E], wqkv[H * E : (H + G) * E], wqkv[(H + G) * E :]
        gate_up = np.asarray(params["w_gate_up"], np.float32)
        if config.own_embed:
            add("token_embd.weight", params["embed"])
        add("fc.weight", params["fc"])
        if config.norm_before_fc:
            add("enc.output_norm.weight", params["enc_norm"])
        add("output_norm.weight", params["final_norm"])
        if config.own_lm_head:
            add("output.weight", params["lm_head"])
        p = "blk.0."
        add(p + "attn_norm.weight", params["attn_norm"])
        add(p + "attn_norm_2.weight", params["hidden_norm"])
        add(p + "attn_q.weight", permute_qk(q, H))
        add(p + "attn_k.weight", permute_qk(k, G))
        add(p + "attn_v.weight", v)
        add(p + "attn_output.weight", params["wo"])
        add(p + "ffn_norm.weight", params["ffn_norm"])
        add(p + "ffn_gate.weight", gate_up[: config.F])
        add(p + "ffn_up.weight", gate_up[config.F :])
        add(p + "ffn_down.weight", params["w_down"])
        if config.rope_factors:
            w.add_tensor("rope_freqs.weight", np.asarray(config.rope_factors, np.float32))
        if config.has_d2t:
            w.add_tensor("d2t", np.asarray(params["d2t"], np.int64), raw_dtype=QT.I64)


def load_eagle3_gguf(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[Eagle3Config, Params, Tokenizer]:
    """Read an `eagle3` GGUF into (config, params, tokenizer); d2t becomes int32."""
    path = os.fspath(path)
    reader = _open_reader(path)
    fields = _field_values(reader)
    arch = fields.get("general.architecture")
    if arch != ARCH:
        raise ModelFileError(f"{path}: architecture {arch!r} is not {ARCH!r}")
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = ..., cast: Any = int) -> Any:
        full = f"{ARCH}.{name}"
        if full not in fields:
            if default is ...:
                raise ModelFileError(f"{path}: missing metadata key {full}")
            return default
        return cast(fields[full])

    layers = fields.get(f"{ARCH}.target_layers")
    if layers is None:
        raise ModelFileError(f"{path}: EAGLE3 model requires 'extract_layers' in GGUF metadata")
    if not isinstance(layers, list) or len(layers) != 3:
        raise ModelFileError(f"{path}: EAGLE3 requires exactly 3 entries in 'extract_layers'")
    if key("block_count") != 1:
        raise ModelFileError(f"{path}: EAGLE3 has one decoder layer, got {key('block_count')}")
    D = key("embedding_length")
    H = key("attention.head_count")
    G = key("attention.head_count_kv", H)
    E = key("attention.key_length", D // H if H else 0)
    if key("attention.value_length", E) != E:
        raise ModelFileError(f"{path}: key_length != value_length is not supported")
    if "tokenizer.ggml.tokens" in fields:
        V = len(fields["tokenizer.ggml.tokens"])
    else:
        V = key("vocab_size")
    V = int(fields.get(f"{ARCH}.vocab_size", V))
    Vd = int(tensors["d2t"].shape[0]) if "d2t" in tensors else V
    try:
        config = Eagle3Config(
            vocab_size=V,
            draft_vocab=0 if Vd == V else Vd,
            dim=D,
            n_heads=H,
            n_kv_heads=G,
            ffn_dim=key("feed_forward_length"),
            head_dim=0 if (D % H == 0 and E == D // H) else E,
            rope_theta=key("rope.freq_base", 10000.0, _f32),
            norm_eps=key("attention.layer_norm_rms_epsilon", cast=_f32),
            target_hidden=key("target_hidden_size"),
            target_layers=tuple(int(i) for i in layers),
            norm_before_residual=bool(key("norm_before_residual", False, bool)),
            norm_before_fc=bool(key("norm_before_fc", False, bool)),
            own_embed="token_embd.weight" in tensors,
            own_lm_head="output.weight" in tensors,
            max_position=key("context_length", 4096),
            dtype=dtype or _config_dtype(tensors),
        )
    except ValueError as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"{path}: invalid EAGLE-3 hyper-parameters: {e}") from e

    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ModelFileError(f"{path}: missing tensor {name}")
        used.add(name)
        arr = _tensor_to_numpy(path, tensors[name])
        if arr.shape != shape:
            raise ModelFileError(
                f"{path}: tensor {name} has shape {arr.shape} (numpy order), expected {shape}"
            )
        return arr

    shapes = config.param_shapes()
    Ecat = config.n_embd_enc
    p = "blk.0."
    q = unpermute_qk(get(p + "attn_q.weight", (H * config.E, 2 * D)), H)
    k = unpermute_qk(get(p + "attn_k.weight", (G * config.E, 2 * D)), G)
    v = get(p + "attn_v.weight", (G * config.E, 2 * D))
    F = config.F
    raw: dict[str, np.ndarray] = {
        "fc": get("fc.weight", (D, Ecat)),
        "attn_norm": get(p + "attn_norm.weight", (D,)),
        "hidden_norm": get(p + "attn_norm_2.weight", (D,)),
        "wqkv": np.concatenate([q, k, v], axis=0),
        "wo": get(p + "attn_output.weight", (D, H * config.E)),
        "ffn_norm": get(p + "ffn_norm.weight", (D,)),
        "w_gate_up": np.concatenate(
            [get(p + "ffn_gate.weight", (F, D)), get(p + "ffn_up.weight", (F, D))]
        ),
        "w_down": get(p + "ffn_down.weight", (D, F)),
        "final_norm": get("output_norm.weight", (D,)),
    }
    if config.norm_before_fc:
        raw["enc_norm"] = get("enc.output_norm.weight", (Ecat,))
    if config.own_embed:
        raw["embed"] = get("token_embd.weight", shapes["embed"])
    if config.own_lm_head:
        raw["lm_head"] = get("output.weight", shapes["lm_head"])
    if "rope_freqs.weight" in tensors:
        config = dataclasses.replace(
            config,
            rope_factors=rope_factors_from_tensor(path, get("rope_freqs.weight", (config.E // 2,))),
        )
    np_dtype = jnp.dtype(config.dtype)
    params: Params = {n: _on_device(a, np_dtype) for n, a in raw.items()}
    if "d2t" in tensors:
        used.add("d2t")
        d2t = np.asarray(tensors["d2t"].data).reshape(-1).astype(np.int64)
        if d2t.shape != (Vd,) or np.any((d2t < 0) | (d2t >= V)):
            raise ModelFileError(f"{path}: d2t target ids out of range for vocabulary {V}")
        params["d2t"] = jnp.asarray(d2t.astype(np.int32))
    unused = sorted(set(tensors) - used)
    if unused:
        raise ModelFileError(f"{path}: tensors the eagle3 head has no slot for: {unused[:8]}")
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields, source=path)
    except ValueError as e:
        raise ModelFileError(f"{path}: invalid tokenizer metadata: {e}") from e
    return config, params, tokenizer
