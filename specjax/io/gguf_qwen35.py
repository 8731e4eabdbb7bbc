"""GGUF files of llama.cpp's `qwen35` architecture <-> (Qwen35Config, params, Tokenizer).

Tensor names and metadata keys are those llama.cpp's `llama_model_qwen35::load_arch_hparams`
and `load_arch_tensors` read (gguf-py's MODEL_ARCH.QWEN35 names):

* trunk layer i: ``blk.i.attn_norm``, ``blk.i.post_attention_norm``, ``ffn_gate/up/down``;
  attention layers ``attn_q`` (per head [q, gate]), ``attn_k``, ``attn_v``, ``attn_q_norm``,
  ``attn_k_norm``, ``attn_output``; delta-net layers ``attn_qkv``, ``attn_gate`` (z),
  ``ssm_conv1d`` (always F32, as the converter writes it), ``ssm_dt.bias``, ``ssm_a`` (no suffix;
  the stored value is a = -exp(A_log)), ``ssm_beta``, ``ssm_alpha``, ``ssm_norm``, ``ssm_out``.
* NextN/MTP block n is ``blk.{n_layers + n}``: an attention block plus ``nextn.eh_proj``,
  ``nextn.enorm``, ``nextn.hnorm`` and the optional ``nextn.embed_tokens``,
  ``nextn.shared_head_head``, ``nextn.shared_head_norm``; ``block_count`` counts it and
  ``nextn_predict_layers`` says how many there are.
* Keys: ``qwen35.{context_length, embedding_length, block_count, feed_forward_length,
  attention.head_count, attention.head_count_kv, attention.key_length, attention.value_length,
  attention.layer_norm_rms_epsilon, rope.dimension_count, rope.dimension_sections,
  rope.freq_base, ssm.conv_kernel, ssm.inner_size, ssm.state_size, ssm.time_step_rank,
  ssm.group_count, full_attention_interval, nextn_predict_layers}``. A file whose
  ``attention.recurrent_layers`` does not follow the interval pattern is refused.
* As in specjax.io.gguf_io: numpy order is specjax's [out, in], every tensor is consumed, saves
  are atomic (temp file + os.replace), 1-D tensors are F32.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import jax.numpy as jnp

from specjax.io.gguf_file import GGUFFile
from specjax.io.gguf_io import TensorAdder, _f32, gguf_saver, write_hparams
from specjax.io.tokenizer import Tokenizer
from specjax.models.qwen35 import Qwen35Config, check_params
from specjax.types import Params

ARCH = "qwen35"

#: specjax parameter name -> GGUF tensor name suffix (after "blk.N.").
COMMON = {
    "attn_norm": "attn_norm.weight",
    "post_norm": "post_attention_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
ATTENTION = {
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "wo": "attn_output.weight",
}
RECURRENT = {
    "w_qkv": "attn_qkv.weight",
    "w_z": "attn_gate.weight",
    "conv": "ssm_conv1d.weight",
    "dt_bias": "ssm_dt.bias",
    "a": "ssm_a",
    "w_beta": "ssm_beta.weight",
    "w_alpha": "ssm_alpha.weight",
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
}
NEXTN = {
    "eh_proj": "nextn.eh_proj.weight",
    "enorm": "nextn.enorm.weight",
    "hnorm": "nextn.hnorm.weight",
    "embed_tokens": "nextn.embed_tokens.weight",
    "shared_head_head": "nextn.shared_head_head.weight",
    "shared_head_norm": "nextn.shared_head_norm.weight",
}
_ALWAYS_F32 = ("conv",)


def layer_names(config: Qwen35Config, layer: int) -> dict[str, str]:
    names = dict(COMMON)
    names.update(RECURRENT if config.is_recurrent(layer) else ATTENTION)
    return names


def _write_qwen35(
    w: gguf.GGUFWriter, add: TensorAdder, config: Qwen35Config, params: Params
) -> None:
    """Write a qwen35 GGUF llama.cpp loads; `dtype` (SAVE_DTYPES) applies to 2-D weights."""
    write_hparams(w, config, "specjax", config.L + config.n_nextn, config.n_rot)
    w.add_rope_dimension_sections(list(config.sections))
    w.add_ssm_conv_kernel(config.ssm_conv_kernel)
    w.add_ssm_inner_size(config.value_dim)
    w.add_ssm_state_size(config.S)
    w.add_ssm_time_step_rank(config.Hv)
    w.add_ssm_group_count(config.Hk)
    w.add_full_attention_interval(config.full_attention_interval)
    if config.n_nextn:
        w.add_nextn_predict_layers(config.n_nextn)
    w.add_vocab_size(config.V)

    add("token_embd.weight", params["embed"])
    add("output_norm.weight", params["final_norm"])
    if not config.tie_embeddings:
        add("output.weight", params["lm_head"])
    for i, layer in enumerate(params["layers"]):
        for ours, theirs in layer_names(config, i).items():
            add(f"blk.{i}.{theirs}", layer[ours], ours in _ALWAYS_F32)
    for n, block in enumerate(params.get("nextn", ())):
        names = {**COMMON, **ATTENTION, **NEXTN}
        for ours, theirs in names.items():
            if ours in block:
                add(f"blk.{config.L + n}.{theirs}", block[ours])


save_qwen35_gguf = gguf_saver(ARCH, _write_qwen35, check_params, "the model vocabulary", "f32")


def load_qwen35_gguf(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[Qwen35Config, Params, Tokenizer]:
    """Read a qwen35 GGUF into (config, params, tokenizer); `dtype` as gguf_io.load_gguf."""
    f = GGUFFile(path, ARCH)
    fields, tensors = f.fields, f.tensors

    def key(name: str, default: Any = ..., cast: Any = int) -> Any:
        return f.key(name, default, cast, per_layer=True)

    if "token_embd.weight" not in tensors:
        raise f.error("missing tensor token_embd.weight")
    n_all = key("block_count")
    n_nextn = key("nextn_predict_layers", 0)
    embed_type = gguf.GGMLQuantizationType(int(tensors["token_embd.weight"].tensor_type))
    file_dtype = {"F16": "float16", "BF16": "bfloat16"}.get(embed_type.name, "float32")
    config = f.hparams(
        lambda: Qwen35Config(
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            dim=key("embedding_length"),
            n_layers=n_all - n_nextn,
            n_heads=key("attention.head_count"),
            n_kv_heads=key("attention.head_count_kv"),
            head_dim=key("attention.key_length"),
            ffn_dim=key("feed_forward_length"),
            rope_theta=key("rope.freq_base", 10000.0, _f32),
            rope_dim=key("rope.dimension_count"),
            rope_sections=tuple(int(x) for x in key("rope.dimension_sections", cast=list)[:4]),
            norm_eps=key("attention.layer_norm_rms_epsilon", cast=_f32),
            tie_embeddings="output.weight" not in tensors,
            full_attention_interval=key("full_attention_interval", 4),
            ssm_conv_kernel=key("ssm.conv_kernel"),
            ssm_state_size=key("ssm.state_size"),
            ssm_k_heads=key("ssm.group_count"),
            ssm_v_heads=key("ssm.time_step_rank"),
            n_nextn=n_nextn,
            max_position=key("context_length"),
            dtype=dtype or file_dtype,
        ),
        "qwen35",
    )
    if key("ssm.inner_size") != config.value_dim:
        raise f.error(
            f"ssm.inner_size {key('ssm.inner_size')} != ssm.state_size * "
            f"ssm.time_step_rank = {config.value_dim}"
        )
    v_len = key("attention.value_length", config.E)
    if v_len != config.E:
        raise f.error(f"value_length {v_len} != key_length {config.E}")
    recurrent = fields.get(f"{ARCH}.attention.recurrent_layers")
    if recurrent is not None:
        want = [config.is_recurrent(i) for i in range(config.L)]
        if [bool(x) for x in list(recurrent)[: config.L]] != want:
            raise f.error(
                f"attention.recurrent_layers {list(recurrent)} does not follow "
                f"full_attention_interval={config.full_attention_interval}; not supported"
            )

    np_dtype = jnp.dtype(config.dtype)

    def get(name: str) -> jnp.ndarray:
        return jnp.asarray(f.get(name), np_dtype)

    layers = tuple(
        {ours: get(f"blk.{i}.{theirs}") for ours, theirs in layer_names(config, i).items()}
        for i in range(config.L)
    )
    params: Params = {
        "embed": get("token_embd.weight"),
        "layers": layers,
        "final_norm": get("output_norm.weight"),
    }
    if not config.tie_embeddings:
        params["lm_head"] = get("output.weight")
    optional = ("embed_tokens", "shared_head_head", "shared_head_norm")
    blocks = []
    for n in range(n_nextn):
        p = f"blk.{config.L + n}."
        names = {**COMMON, **ATTENTION, **NEXTN}
        blocks.append(
            {
                ours: get(p + theirs)
                for ours, theirs in names.items()
                if ours not in optional or p + theirs in tensors
            }
        )
    if blocks:
        params["nextn"] = tuple(blocks)
    f.refuse_unused("specjax's qwen35 model", sep=", ")
    try:
        check_params(config, params)
    except ValueError as e:
        raise f.error(str(e)) from e
    return config, params, f.tokenizer()
