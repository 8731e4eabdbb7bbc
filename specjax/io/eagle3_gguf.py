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

import jax.numpy as jnp
import numpy as np
from gguf import GGUFWriter

from specjax.io.gguf_file import GGUFFile
from specjax.io.gguf_io import (
    TensorAdder,
    _on_device,
    add_d2t,
    gguf_saver,
    permute_qk,
    read_architecture,
    unpermute_qk,
    write_hparams,
)
from specjax.io.tokenizer import Tokenizer
from specjax.models.eagle3 import Eagle3Config, check_params
from specjax.types import Params

ARCH = "eagle3"


def gguf_architecture(path: str | os.PathLike[str]) -> str | None:
    """`general.architecture` of a GGUF file (None when absent), read from its header."""
    return read_architecture(path)


def _write_eagle3(w: GGUFWriter, add: TensorAdder, config: Eagle3Config, params: Params) -> None:
    """Write an EAGLE-3 head llama.cpp loads (`-md` with `--spec-type draft-eagle3`)."""
    write_hparams(w, config, "specjax-eagle3", block_count=1, rope_dims=config.E)
    w.add_vocab_size(config.V)
    w.add_array(f"{ARCH}.target_layers", [int(i) for i in config.target_layers])
    w.add_uint32(f"{ARCH}.target_hidden_size", config.target_hidden)
    w.add_bool(f"{ARCH}.norm_before_residual", config.norm_before_residual)
    w.add_bool(f"{ARCH}.norm_before_fc", config.norm_before_fc)
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
        add_d2t(w, params["d2t"])


save_eagle3_gguf = gguf_saver(ARCH, _write_eagle3, check_params, "the head's vocabulary", "f16")


def load_eagle3_gguf(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[Eagle3Config, Params, Tokenizer]:
    """Read an `eagle3` GGUF into (config, params, tokenizer); d2t becomes int32.
    `dtype` is the config's and the weights' dtype (None: the file's, as `load_gguf`)."""
    f = GGUFFile(path, ARCH)
    key, tensors = f.key, f.tensors
    layers = f.fields.get(f"{ARCH}.target_layers")
    if layers is None:
        raise f.error("EAGLE3 model requires 'extract_layers' in GGUF metadata")
    if not isinstance(layers, list) or len(layers) != 3:
        raise f.error("EAGLE3 requires exactly 3 entries in 'extract_layers'")
    if key("block_count") != 1:
        raise f.error(f"EAGLE3 has one decoder layer, got {key('block_count')}")
    D, H, G, _ = f.attention_dims()
    V = int(f.fields.get(f"{ARCH}.vocab_size", f.vocab_size()))
    Vd = int(tensors["d2t"].shape[0]) if "d2t" in tensors else V
    config = f.hparams(
        lambda: Eagle3Config(
            **f.head_fields(V, Vd, dtype),
            target_hidden=key("target_hidden_size"),
            target_layers=tuple(int(i) for i in layers),
            norm_before_residual=bool(key("norm_before_residual", False, bool)),
            norm_before_fc=bool(key("norm_before_fc", False, bool)),
            own_embed="token_embd.weight" in tensors,
            own_lm_head="output.weight" in tensors,
        ),
        "EAGLE-3",
    )
    get = f.get
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
    config = dataclasses.replace(config, rope_factors=f.rope_factors(config.E // 2))
    np_dtype = jnp.dtype(config.dtype)
    params: Params = {n: _on_device(a, np_dtype) for n, a in raw.items()}
    d2t = f.d2t(Vd, V)
    if d2t is not None:
        params["d2t"] = d2t
    f.refuse_unused("the eagle3 head")
    return config, params, f.tokenizer()
