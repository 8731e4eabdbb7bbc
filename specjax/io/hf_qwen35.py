"""Hugging Face Qwen3.5 folders -> (Qwen35Config, params, Tokenizer).

Two layouts: `Qwen3_5ForCausalLM` (the text model: config.json flat, tensors model.*) and
`Qwen3_5ForConditionalGeneration` (the released checkpoints: the text model's config under
text_config, its tensors under model.language_model.*, a vision tower under model.visual.*
that specjax, text only, does not load; as llama.cpp's converter, which writes the tower to a
separate mmproj file).

The params are the layout of specjax.models.qwen35 (llama.cpp's qwen35 tensors, as
specjax.io.gguf_qwen35 reads them), so a folder and llama.cpp's conversion of it load to the
same pytree. The mapping follows transformers' modeling_qwen3_5.py and llama.cpp's
conversion/qwen.py (Qwen3NextModel / _LinearAttentionVReorderBase / _QwenMtpMixin):

* Zero-centred RMS norms (input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm,
  and the MTP block's norms) are stored as w and applied as 1 + w: loaded as 1 + w. The gated
  delta-net's ``linear_attn.norm`` is a plain weight and loads as stored.
* ``A_log`` loads as a = -exp(A_log); ``conv1d.weight`` [C, 1, K] as [C, K]; ``dt_bias`` as is.
* Delta-net v heads: transformers groups them by k head ([k0: v0..v(r-1)], [k1: ...]), llama.cpp
  (and specjax: v head h reads k head h % Hk) tiles them; the v rows of in_proj_qkv, the rows of
  in_proj_z / in_proj_a / in_proj_b, A_log, dt_bias, the v channels of conv1d and the columns of
  out_proj are permuted from grouped to tiled order.
* Attention ``q_proj`` rows are per head [q (E), gate (E)], as specjax's ``wq``.
* ``mtp.*`` (released checkpoints carry one MTP block; transformers ignores it) becomes
  ``params["nextn"]``: ``mtp.fc`` -> eh_proj (input concat(embedding, hidden)),
  ``mtp.pre_fc_norm_embedding`` -> enorm, ``mtp.pre_fc_norm_hidden`` -> hnorm, ``mtp.norm`` ->
  shared_head_norm, ``mtp.layers.0.*`` -> the block's attention layer. A folder without mtp.*
  tensors loads with n_nextn = 0.
* ``layer_types`` must follow a full-attention interval (layer i is attention iff
  (i + 1) % interval == 0); text-only positions make Qwen3.5's multimodal RoPE plain partial
  RoPE over the first head_dim * partial_rotary_factor dimensions.
* Every tensor is consumed (``rotary_emb.inv_freq`` buffers excepted) or the load fails.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.errors import ModelFileError, file_error
from specjax.io.hf_io import (
    _DTYPES,
    _read_config,
    _Weights,
    is_qwen35_config,
    refuse_quantized,
)
from specjax.io.tokenizer import Tokenizer
from specjax.models.qwen35 import Qwen35Config, check_params, default_rope_sections
from specjax.types import Params


def is_qwen35_folder(path: str | os.PathLike[str]) -> bool:
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    try:
        return is_qwen35_config(_read_config(path))
    except ModelFileError:
        return False


def _interval(source: str, hf: Mapping[str, Any], n_layers: int) -> int:
    layer_types = hf.get("layer_types")
    if not layer_types:
        return int(hf.get("full_attention_interval", 4))
    if len(layer_types) != n_layers:
        raise ModelFileError(
            f"{source}: layer_types has {len(layer_types)} entries for {n_layers} layers"
        )
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ModelFileError(f"{source}: unknown layer_types {unknown}")
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    interval = full[0] + 1 if full else n_layers + 1
    want = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ]
    if list(layer_types) != want:
        raise ModelFileError(
            f"{source}: layer_types {list(layer_types)} do not follow a full-attention interval "
            "(layer i is attention iff (i + 1) % interval == 0); not supported"
        )
    return interval


def qwen35_config_from_hf(
    hf: Mapping[str, Any],
    *,
    n_nextn: int = 0,
    dtype: str | None = None,
    source: str = "config.json",
) -> Qwen35Config:
    """Qwen35Config from a transformers Qwen3.5 text config.json dictionary."""
    if not is_qwen35_config(hf):
        raise ModelFileError(f"{source}: not a Qwen3.5 text model ({hf.get('architectures')})")
    refuse_quantized(hf, source)
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelFileError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported")
    if hf.get("attention_bias"):
        raise ModelFileError(f"{source}: attention_bias=true is not supported")

    def need(name: str) -> int:
        if hf.get(name) is None:
            raise ModelFileError(f"{source}: missing {name}")
        return int(hf[name])

    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ModelFileError(f"{source}: RoPE type {kind!r} is not supported for Qwen3.5")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000_000.0)))
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    D, H, L = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    E = int(hf.get("head_dim") or D // H)
    rope_dim = int(E * partial)
    sections = rope.get("mrope_section")
    rope_sections = (
        tuple(int(x) for x in sections) + (0,) * (4 - len(sections))
        if sections
        else default_rope_sections(rope_dim)
    )
    if sum(rope_sections[:3]) != rope_dim // 2:
        raise ModelFileError(
            f"{source}: mrope_section {list(sections or [])} covers {sum(rope_sections[:3])} "
            f"of the {rope_dim // 2} rotated pairs"
        )
    S = need("linear_key_head_dim")
    if need("linear_value_head_dim") != S:
        raise ModelFileError(
            f"{source}: linear_value_head_dim {hf['linear_value_head_dim']} != "
            f"linear_key_head_dim {S}; specjax's delta-net has one head size"
        )
    raw_dtype = dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if raw_dtype not in _DTYPES:
        raise ModelFileError(f"{source}: unsupported dtype {raw_dtype!r}")
    with file_error(source, "invalid Qwen3.5 hyper-parameters"):
        return Qwen35Config(
            vocab_size=need("vocab_size"),
            dim=D,
            n_layers=L,
            n_heads=H,
            n_kv_heads=int(hf.get("num_key_value_heads") or H),
            head_dim=E,
            ffn_dim=need("intermediate_size"),
            rope_theta=theta,
            rope_dim=rope_dim,
            rope_sections=rope_sections,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            full_attention_interval=_interval(source, hf, L),
            ssm_conv_kernel=need("linear_conv_kernel_dim"),
            ssm_state_size=S,
            ssm_k_heads=need("linear_num_key_heads"),
            ssm_v_heads=need("linear_num_value_heads"),
            n_nextn=n_nextn,
            max_position=int(hf.get("max_position_embeddings", 4096)),
            dtype=_DTYPES[raw_dtype],
        )


def grouped_to_tiled(x: np.ndarray, axis: int, n_k: int, n_v: int, block: int) -> np.ndarray:
    """Reorder `axis` (n_v blocks of `block`) from transformers' grouping by k head
    ([k0: v0..v(r-1)], [k1: ...]) to llama.cpp's tiling ([v0 of k0, v0 of k1, ..., v1 of k0, ...])."""
    r = n_v // n_k
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(n_k, r, block, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))
    return np.moveaxis(x.reshape(n_v * block, *rest), 0, axis)


def load_qwen35_hf(
    folder: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[Qwen35Config, Params, Tokenizer]:
    """Read a transformers Qwen3_5ForCausalLM folder (with its MTP block, when it has one)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ModelFileError(f"{folder}: not a directory")
    source = os.path.join(folder, "config.json")
    hf = _read_config(folder)
    w = _Weights(folder)
    w.rename_prefix("model.mtp.", "mtp.")  # some exports nest the MTP block (the converter too)
    if isinstance(hf.get("text_config"), dict):  # Qwen3_5ForConditionalGeneration
        hf = {**hf, **hf["text_config"], "architectures": hf.get("architectures")}
        w.rename_prefix("model.language_model.", "model.")
        w.used.update(k for k in w.location if k.startswith("model.visual."))
    mtp_layers = sorted({int(k.split(".")[2]) for k in w.location if k.startswith("mtp.layers.")})
    if mtp_layers != list(range(len(mtp_layers))):
        raise ModelFileError(f"{folder}: MTP layers {mtp_layers} are not numbered 0..n-1")
    if len(mtp_layers) > 1:
        raise ModelFileError(
            f"{folder}: {len(mtp_layers)} MTP layers; specjax (as llama.cpp's conversion, which "
            "maps mtp.fc / mtp.pre_fc_norm_* to the first) reads one"
        )
    declared = hf.get("mtp_num_hidden_layers")
    if mtp_layers and declared is not None and int(declared) != len(mtp_layers):
        raise ModelFileError(
            f"{source}: mtp_num_hidden_layers={declared} but the weights hold "
            f"{len(mtp_layers)} MTP layers"
        )
    config = qwen35_config_from_hf(hf, n_nextn=len(mtp_layers), dtype=dtype, source=source)
    D, F, V, E, H, G = config.D, config.F, config.V, config.E, config.H, config.G
    Hk, Hv, S, K = config.Hk, config.Hv, config.S, config.ssm_conv_kernel
    key_dim, value_dim, conv_dim = config.key_dim, config.value_dim, config.conv_dim
    dt = jnp.dtype(config.dtype)

    def f32(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32)

    def arr(x: np.ndarray) -> Any:
        return jnp.asarray(x if x.dtype == dt else f32(x), dt)

    def offset_norm(name: str, size: int) -> np.ndarray:
        return f32(w.get(name, (size,))) + np.float32(1.0)

    def mlp(p: str) -> dict[str, np.ndarray]:
        return {
            "w_gate": w.get(p + "mlp.gate_proj.weight", (F, D)),
            "w_up": w.get(p + "mlp.up_proj.weight", (F, D)),
            "w_down": w.get(p + "mlp.down_proj.weight", (D, F)),
        }

    def attention(p: str) -> dict[str, np.ndarray]:
        a = p + "self_attn."
        if a + "o_proj.bias" in w or a + "q_proj.bias" in w:
            raise ModelFileError(f"{folder}: {a}*_proj.bias: attention biases are not supported")
        return {
            "attn_norm": offset_norm(p + "input_layernorm.weight", D),
            "post_norm": offset_norm(p + "post_attention_layernorm.weight", D),
            "wq": w.get(a + "q_proj.weight", (2 * H * E, D)),
            "wk": w.get(a + "k_proj.weight", (G * E, D)),
            "wv": w.get(a + "v_proj.weight", (G * E, D)),
            "q_norm": offset_norm(a + "q_norm.weight", E),
            "k_norm": offset_norm(a + "k_norm.weight", E),
            "wo": w.get(a + "o_proj.weight", (D, H * E)),
            **mlp(p),
        }

    def tile(x: np.ndarray, axis: int, block: int) -> np.ndarray:
        return grouped_to_tiled(x, axis, Hk, Hv, block)

    def delta_net(p: str) -> dict[str, np.ndarray]:
        a = p + "linear_attn."
        qkv = w.get(a + "in_proj_qkv.weight", (conv_dim, D))
        conv = w.get(a + "conv1d.weight", (conv_dim, 1, K)).reshape(conv_dim, K)
        if a + "conv1d.bias" in w:
            raise ModelFileError(f"{folder}: {a}conv1d.bias is not supported")
        qk = 2 * key_dim
        return {
            "attn_norm": offset_norm(p + "input_layernorm.weight", D),
            "post_norm": offset_norm(p + "post_attention_layernorm.weight", D),
            "w_qkv": np.concatenate([qkv[:qk], tile(qkv[qk:], 0, S)]),
            "w_z": tile(w.get(a + "in_proj_z.weight", (value_dim, D)), 0, S),
            "conv": np.concatenate([conv[:qk], tile(conv[qk:], 0, S)]),
            "dt_bias": tile(w.get(a + "dt_bias", (Hv,)), 0, 1),
            "a": -np.exp(f32(tile(w.get(a + "A_log", (Hv,)), 0, 1))),
            "w_beta": tile(w.get(a + "in_proj_b.weight", (Hv, D)), 0, 1),
            "w_alpha": tile(w.get(a + "in_proj_a.weight", (Hv, D)), 0, 1),
            "ssm_norm": w.get(a + "norm.weight", (S,)),
            "ssm_out": tile(w.get(a + "out_proj.weight", (D, value_dim)), 1, S),
            **mlp(p),
        }

    layers = []
    for i in range(config.L):
        p = f"model.layers.{i}."
        raw = delta_net(p) if config.is_recurrent(i) else attention(p)
        layers.append({k: arr(v) for k, v in raw.items()})
    params: Params = {
        "embed": arr(w.get("model.embed_tokens.weight", (V, D))),
        "layers": tuple(layers),
        "final_norm": arr(offset_norm("model.norm.weight", D)),
    }
    if config.tie_embeddings:
        if "lm_head.weight" in w:
            w.used.add("lm_head.weight")  # transformers ties it to the embedding anyway
    else:
        params["lm_head"] = arr(w.get("lm_head.weight", (V, D)))
    blocks = []
    for n in mtp_layers:
        block = attention(f"mtp.layers.{n}.")
        block.update(
            eh_proj=w.get("mtp.fc.weight", (D, 2 * D)),
            enorm=offset_norm("mtp.pre_fc_norm_embedding.weight", D),
            hnorm=offset_norm("mtp.pre_fc_norm_hidden.weight", D),
        )
        if "mtp.norm.weight" in w:
            block["shared_head_norm"] = offset_norm("mtp.norm.weight", D)
        blocks.append({k: arr(v) for k, v in block.items()})
    if blocks:
        params["nextn"] = tuple(blocks)
    unused = w.unused()
    if unused:
        raise ModelFileError(
            f"{folder}: tensors specjax's qwen35 model has no slot for: "
            f"{', '.join(unused[:8])}" + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        )
    try:
        check_params(config, params)
    except ValueError as e:
        raise ModelFileError(f"{folder}: {e}") from e
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return config, params, tokenizer
