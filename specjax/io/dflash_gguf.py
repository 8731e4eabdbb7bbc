"""GGUF files of llama.cpp's `dflash` architecture (DFlash and DSpark heads) <->
(DFlashConfig, params, Tokenizer).

Layout, as llama.cpp's loader (src/models/dflash.cpp) and converter (conversion/qwen.py,
`DFlashModel` / `DSparkModel`):

    metadata  dflash.{context_length, embedding_length, block_count, feed_forward_length,
              attention.head_count, attention.head_count_kv, attention.key_length,
              attention.value_length, rope.dimension_count, rope.freq_base,
              attention.layer_norm_rms_epsilon}
              dflash.target_layers        int32[n >= 1]  (ids of the target layers whose
                                          INPUT is captured; specjax's hidden ids)
              dflash.block_size           uint32 (absent: 16)
              dflash.sample_from_anchor   bool   (DSpark; absent: true)
              dflash.has_confidence_head  bool   (DSpark; absent: true)
              tokenizer.ggml.*            the target's tokenizer, plus
              tokenizer.ggml.mask_token_id  the block's MASK token (llama_vocab_mask)
    tensors   fc.weight [n Dt -> D], fc.scale [1] (optional), enc.output_norm.weight,
              output_norm.weight, output.weight (optional: else the target's; with only
              token_embd.weight present llama.cpp ties the head to it), token_embd.weight
              (optional: else the target's), d2t (I64 absolute target ids, optional),
              blk.i.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm,
              attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight,
              DSpark: markov_w1.weight [V, R], markov_w2.weight [Vd, R], markov_w2.scale
              (optional), conf_proj.weight [1, D + R] and conf_proj.bias [1] (optional),
              rope_freqs.weight [E/2] (optional, one for every layer as llama.cpp reads it:
              per-pair RoPE divisors; the config's rope_factors)

Invariants: RoPE type NEOX (the dflash architecture), so Q/K rows are stored as specjax
computes them (rotate-half), no permutation; 2-D weights are written as F32/F16/BF16/Q8_0
like `save_gguf`, 1-D as F32; every tensor in a file is consumed or the load fails; a save
replaces the file atomically.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGUFWriter

from specjax.io.gguf_file import GGUFFile
from specjax.io.gguf_io import TensorAdder, add_d2t, gguf_saver, write_hparams
from specjax.io.tokenizer import Tokenizer
from specjax.models.dflash import DEFAULT_BLOCK_SIZE, DFlashConfig, check_params
from specjax.types import Params

ARCH = "dflash"


def _check_savable(config: DFlashConfig, params: Params) -> None:
    """ValueError for params the config does not describe or a head with no GGUF form."""
    check_params(config, params)
    if config.own_embed and not config.own_lm_head:
        raise ValueError(
            "a DFlash head with its own token embeddings but the target's LM head has no GGUF "
            "form: llama.cpp ties output to token_embd when output.weight is absent"
        )


def _write_dflash(w: GGUFWriter, add: TensorAdder, config: DFlashConfig, params: Params) -> None:
    """Write a DFlash / DSpark head llama.cpp loads (`-md` with `--spec-type draft-dflash` or
    `draft-dspark`)."""
    name = "specjax-dspark" if config.is_dspark else "specjax-dflash"
    write_hparams(w, config, name, block_count=config.L, rope_dims=config.E)
    w.add_uint32(f"{ARCH}.block_size", config.block_size)
    w.add_array(f"{ARCH}.target_layers", [int(i) for i in config.target_layers])
    if config.is_dspark:
        w.add_bool(f"{ARCH}.sample_from_anchor", config.sample_from_anchor)
        w.add_bool(f"{ARCH}.has_confidence_head", config.has_confidence)
    w.add_mask_token_id(config.mask_token_id)

    H, G, E, F = config.H, config.G, config.E, config.F
    if config.own_embed:
        add("token_embd.weight", params["embed"])
    add("fc.weight", params["fc"])
    if config.fc_scale:
        add("fc.scale", params["fc_scale"], f32=True)
    add("enc.output_norm.weight", params["enc_norm"])
    add("output_norm.weight", params["final_norm"])
    if config.own_lm_head:
        add("output.weight", params["lm_head"])
    if config.rope_factors:
        add("rope_freqs.weight", config.rope_factors, f32=True)
    for i, layer in enumerate(params["layers"]):
        p = f"blk.{i}."
        wqkv = np.asarray(layer["wqkv"], np.float32)
        gate_up = np.asarray(layer["w_gate_up"], np.float32)
        add(p + "attn_norm.weight", layer["attn_norm"])
        add(p + "attn_q.weight", wqkv[: H * E])
        add(p + "attn_k.weight", wqkv[H * E : (H + G) * E])
        add(p + "attn_v.weight", wqkv[(H + G) * E :])
        add(p + "attn_output.weight", layer["wo"])
        add(p + "attn_q_norm.weight", layer["q_norm"])
        add(p + "attn_k_norm.weight", layer["k_norm"])
        add(p + "ffn_norm.weight", layer["ffn_norm"])
        add(p + "ffn_gate.weight", gate_up[:F])
        add(p + "ffn_up.weight", gate_up[F:])
        add(p + "ffn_down.weight", layer["w_down"])
    if config.is_dspark:
        add("markov_w1.weight", params["markov_w1"])
        add("markov_w2.weight", params["markov_w2"])
        if config.markov_w2_scale:
            add("markov_w2.scale", params["markov_w2_scale"], f32=True)
        if config.has_confidence:
            add("conf_proj.weight", params["conf_proj"])
            add("conf_proj.bias", params["conf_proj_b"], f32=True)
    if config.has_d2t:
        add_d2t(w, params["d2t"])


save_dflash_gguf = gguf_saver(ARCH, _write_dflash, _check_savable, "the head's vocabulary", "f16")


def _as_bool(value: Any) -> bool:
    """A GGUF bool, or upstream's string test (`== "true"`) for a string value."""
    if isinstance(value, str):
        return value == "true"
    return bool(value)


def load_dflash_gguf(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[DFlashConfig, Params, Tokenizer]:
    """Read a `dflash` GGUF into (config, params, tokenizer); d2t becomes int32.
    `dtype` is the config's and the weights' dtype (None: the file's, as `load_gguf`)."""
    f = GGUFFile(path, ARCH)
    fields, tensors, key = f.fields, f.tensors, f.key
    layers = fields.get(f"{ARCH}.target_layers")
    if not isinstance(layers, list) or not layers:
        raise f.error("DFlash model requires 'target_layers' in GGUF metadata")
    unsupported = [
        k
        for k in (
            "embedding_scale",
            "attention.scale",
            "attention.value_scale",
            "attention.sliding_window",
            "hyper_connection_count",
            "selector_rank",
            "conv_kernel_size",
            "logit_scale",
            "final_logit_softcapping",
        )
        if f"{ARCH}.{k}" in fields
    ]
    if unsupported:
        raise f.error(f"DFlash features not supported by specjax: {unsupported}")
    if _as_bool(fields.get(f"{ARCH}.attention.causal", False)):
        raise f.error("causal DFlash drafts are not supported by specjax")
    if "tokenizer.ggml.mask_token_id" not in fields:
        raise f.error("DFlash needs a mask token (tokenizer.ggml.mask_token_id)")
    D, H, G, E = f.attention_dims()
    V = f.vocab_size()
    Vd = int(tensors["d2t"].shape[0]) if "d2t" in tensors else V
    R = 0
    if "markov_w1.weight" in tensors:
        R = int(tensors["markov_w1.weight"].shape[0])  # ggml ne[0]
    own_embed = "token_embd.weight" in tensors
    tied = own_embed and "output.weight" not in tensors
    n_layers = key("block_count")
    Dt_total = int(tensors["fc.weight"].shape[0]) if "fc.weight" in tensors else 0
    if Dt_total % len(layers):
        raise f.error(f"fc input width {Dt_total} is not a multiple of {len(layers)} target layers")
    config = f.hparams(
        lambda: DFlashConfig(
            **f.head_fields(V, Vd, dtype),
            n_layers=n_layers,
            target_hidden=Dt_total // len(layers),
            target_layers=tuple(int(i) for i in layers),
            block_size=key("block_size", DEFAULT_BLOCK_SIZE),
            mask_token_id=int(fields["tokenizer.ggml.mask_token_id"]),
            markov_rank=R,
            has_confidence=R == 0 or "conf_proj.weight" in tensors,
            sample_from_anchor=_as_bool(key("sample_from_anchor", True, lambda x: x)),
            fc_scale="fc.scale" in tensors,
            markov_w2_scale="markov_w2.scale" in tensors,
            own_embed=own_embed,
            own_lm_head=own_embed or "output.weight" in tensors,
        ),
        "DFlash",
    )
    get = f.get

    shapes = config.param_shapes()
    E, F = config.E, config.F
    raw: dict[str, Any] = {
        "fc": get("fc.weight", shapes["fc"]),
        "enc_norm": get("enc.output_norm.weight", (D,)),
        "final_norm": get("output_norm.weight", (D,)),
    }
    if config.fc_scale:
        raw["fc_scale"] = get("fc.scale", (1,))
    if own_embed:
        raw["embed"] = get("token_embd.weight", (V, D))
    if tied:
        if Vd != V:
            raise f.error("a reduced-vocabulary head needs its own output.weight")
        raw["lm_head"] = raw["embed"]
    elif config.own_lm_head:
        raw["lm_head"] = get("output.weight", shapes["lm_head"])
    if config.is_dspark:
        raw["markov_w1"] = get("markov_w1.weight", shapes["markov_w1"])
        raw["markov_w2"] = get("markov_w2.weight", shapes["markov_w2"])
        if config.markov_w2_scale:
            raw["markov_w2_scale"] = get("markov_w2.scale", (1,))
        if config.has_confidence:
            raw["conf_proj"] = get("conf_proj.weight", shapes["conf_proj"])
            if "conf_proj.bias" in tensors:
                raw["conf_proj_b"] = get("conf_proj.bias", (1,))
            else:
                raw["conf_proj_b"] = np.zeros((1,), np.float32)
    layer_list = []
    for i in range(n_layers):
        p = f"blk.{i}."
        q = get(p + "attn_q.weight", (H * E, D))
        k = get(p + "attn_k.weight", (G * E, D))
        v = get(p + "attn_v.weight", (G * E, D))
        layer_list.append(
            {
                "attn_norm": get(p + "attn_norm.weight", (D,)),
                "wqkv": np.concatenate([q, k, v], axis=0),
                "q_norm": get(p + "attn_q_norm.weight", (E,)),
                "k_norm": get(p + "attn_k_norm.weight", (E,)),
                "wo": get(p + "attn_output.weight", (D, H * E)),
                "ffn_norm": get(p + "ffn_norm.weight", (D,)),
                "w_gate_up": np.concatenate(
                    [get(p + "ffn_gate.weight", (F, D)), get(p + "ffn_up.weight", (F, D))]
                ),
                "w_down": get(p + "ffn_down.weight", (D, F)),
            }
        )
    # one tensor for every layer (llama.cpp reads the same rope_freqs in each)
    config = dataclasses.replace(config, rope_factors=f.rope_factors(E // 2))
    np_dtype = jnp.dtype(config.dtype)
    params: Params = {n: jnp.asarray(a, np_dtype) for n, a in raw.items()}
    params["layers"] = tuple(
        {n: jnp.asarray(a, np_dtype) for n, a in lay.items()} for lay in layer_list
    )
    d2t = f.d2t(Vd, V)
    if d2t is not None:
        params["d2t"] = d2t
    f.refuse_unused("the dflash head")
    return config, params, f.tokenizer()
