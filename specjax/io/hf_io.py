"""Hugging Face checkpoint directories <-> specjax (ModelConfig, params, Tokenizer).

A directory holds config.json (LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM / Qwen3MoeForCausalLM, or, read only, Gemma3ForCausalLM /
Gemma3ForConditionalGeneration's text part; Qwen3_5ForCausalLM folders are read by
specjax.io.hf_qwen35), model.safetensors (or shards listed in model.safetensors.index.json)
and tokenizer.json.

Invariants:
* HF projections are ``[out, in]`` in the rotate-half RoPE layout already: q/k/v rows are
  concatenated into ``wqkv`` and gate/up into ``w_gate_up`` with no permutation.
* Every tensor in the checkpoint is consumed (``rotary_emb.inv_freq`` buffers excepted); an
  o_proj / MLP bias with non-zero values is an error, never silently dropped.
* Qwen3-MoE experts load from the hub's per-expert tensors (``mlp.experts.{e}.gate_proj``...)
  or transformers' fused ones (``mlp.experts.gate_up_proj`` [X, 2F', D], ``down_proj``);
  saving writes the per-expert form (what llama.cpp's converter and transformers both read).
* qwen2 always has q/k/v biases in transformers, so a qwen2 model saved without them is
  written with zero biases and reloads with ``qkv_bias=True``.
* ``head_dim`` is normalised: 0 in the returned config when it equals dim // n_heads.
* Mistral loads as ``llama``: its ``sliding_window`` (when not null) is ``ModelConfig.
  sliding_window`` on every layer, as transformers masks every layer; a llama config with a
  window on every layer is saved as MistralForCausalLM.
* Saving writes each file to a temp name in the directory and ``os.replace``s it, so a failed
  save never leaves a half-written file under a real name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from specjax.errors import ModelFileError, file_error
from specjax.io.gguf_io import check_params, split_layer
from specjax.io.tokenizer import Tokenizer
from specjax.models.config import ModelConfig, RopeScaling
from specjax.types import Params

_ARCH_OF_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # Llama with an optional all-layer sliding window
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
_ARCH_OF_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
}
_CLASS_OF_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
#: transformers' model_type of each architecture, where it is not the architecture's name
_MODEL_TYPE = {"qwen3moe": "qwen3_moe"}
#: transformers classes / model types of the Qwen3.5 dense text model (specjax.io.hf_qwen35)
QWEN35_CLASSES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
QWEN35_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


def is_qwen35_config(hf: Mapping[str, Any]) -> bool:
    """Whether a config.json dictionary is a Qwen3.5 (hybrid) text model hf_qwen35 reads."""
    archs = hf.get("architectures") or []
    return any(a in QWEN35_CLASSES for a in archs) or (
        not archs and hf.get("model_type") in QWEN35_MODEL_TYPES
    )


_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "half": "float16",
    "float": "float32",
}


def _read_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ModelFileError(f"{folder}: no config.json (not a Hugging Face model directory)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot parse JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


def _rope_scaling(path: str, hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type") else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ModelFileError(f"{path}: RoPE scaling type {kind!r} is not supported (only 'llama3')")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
    )


#: Gemma architectures specjax reads (the multimodal one: its text part only).
GEMMA3_CLASSES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def _gemma_class(hf: Mapping[str, Any]) -> str | None:
    """The checkpoint's Gemma class name (any Gemma), else None."""
    archs = hf.get("architectures") or []
    named = [a for a in archs if a.startswith("Gemma") or a.startswith("EmbeddingGemma")]
    if named:
        return str(named[0])
    if str(hf.get("model_type", "")).startswith("gemma"):
        return str(hf["model_type"])
    return None


def _gemma3_config(hf: Mapping[str, Any], dtype: str | None, source: str) -> ModelConfig:
    """ModelConfig (arch gemma3) from a Gemma3ForCausalLM config (or the text_config of a
    Gemma3ForConditionalGeneration): transformers' Gemma3TextConfig defaults where a key is
    absent; a variant specjax does not run is a ModelFileError naming it."""
    if hf.get("use_bidirectional_attention"):
        raise ModelFileError(f"{source}: bidirectional Gemma 3 (embedding models) is not supported")
    if hf.get("attn_logit_softcapping") is not None:
        raise ModelFileError(
            f"{source}: attn_logit_softcapping is not supported (Gemma 3 has none; llama.cpp's "
            "converter refuses it too)"
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelFileError(f"{source}: Gemma 3 hidden_activation {act!r} is not supported")
    if hf.get("attention_bias"):
        raise ModelFileError(f"{source}: attention_bias=true is not supported for Gemma 3")
    D, H = int(hf.get("hidden_size", 2304)), int(hf.get("num_attention_heads", 8))
    L = int(hf.get("num_hidden_layers", 26))
    E = int(hf.get("head_dim") or 256)
    layer_types = hf.get("layer_types")
    if not layer_types:
        n = int(hf.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(L)]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != L:
        raise ModelFileError(
            f"{source}: layer_types must name {L} layers 'sliding_attention' / "
            f"'full_attention', got {list(layer_types)[:8]}"
        )
    flags = tuple(t == "sliding_attention" for t in layer_types)
    window = int(hf.get("sliding_window") or 0) if any(flags) else 0
    if any(flags) and window <= 0:
        raise ModelFileError(f"{source}: sliding layers but sliding_window={window}")

    # RoPE: new-style rope_parameters per layer type, or rope_theta / rope_local_base_freq /
    # rope_scaling (transformers' Gemma3TextConfig.convert_rope_params_to_dict)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(hf.get("rope_scaling") or {})
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ModelFileError(
            f"{source}: Gemma 3 RoPE scaling {kind!r} is not supported (default, linear)"
        )
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise ModelFileError(
            f"{source}: RoPE scaling {local_kind!r} on sliding layers is not supported"
        )
    raw_dtype = dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if raw_dtype not in _DTYPES:
        raise ModelFileError(f"{source}: unsupported dtype {raw_dtype!r}")
    scalar = float(hf.get("query_pre_attn_scalar", 256))
    cap = hf.get("final_logit_softcapping")
    factor = float(full.get("factor", 1.0)) if kind == "linear" else 1.0
    with file_error(source, "invalid model hyper-parameters"):
        return ModelConfig(
            arch="gemma3",
            vocab_size=int(hf.get("vocab_size", 262_208)),
            dim=D,
            n_layers=L,
            n_heads=H,
            n_kv_heads=int(hf.get("num_key_value_heads") or 4),
            ffn_dim=int(hf.get("intermediate_size", 9216)),
            head_dim=0 if (D % H == 0 and E == D // H) else E,
            rope_theta=float(full.get("rope_theta", 1_000_000.0)),
            rope_theta_swa=float(local.get("rope_theta", 10_000.0)),
            # linear scaling: every pair's frequency divided by the factor
            rope_factors=(factor,) * (E // 2) if factor != 1.0 else (),
            attn_scale=0.0 if scalar == E else scalar**-0.5,
            final_logit_softcap=float(cap) if cap else 0.0,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qk_norm=True,
            sliding_window=window,
            swa_layers=() if all(flags) else flags,
            max_position=int(hf.get("max_position_embeddings", 131_072)),
            dtype=_DTYPES[raw_dtype],
        )


def refuse_quantized(hf: Mapping[str, Any], source: str) -> None:
    """ModelFileError for a checkpoint quantised by transformers' quantizers (GPTQ, AWQ, FP8,
    compressed-tensors, bitsandbytes...): their packed tensors have no specjax reading."""
    q = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if q:
        method = q.get("quant_method", "?") if isinstance(q, Mapping) else "?"
        raise ModelFileError(
            f"{source}: quantized checkpoint (quant_method {method!r}) is not supported; load "
            "the unquantized folder, or a GGUF (quantized GGUF types load)"
        )


def config_from_hf(
    hf: Mapping[str, Any], *, dtype: str | None = None, source: str = "config.json"
) -> ModelConfig:
    """ModelConfig from a transformers config.json dictionary."""
    gemma = _gemma_class(hf)
    if gemma is not None:
        if gemma not in GEMMA3_CLASSES and gemma not in ("gemma3", "gemma3_text"):
            raise ModelFileError(
                f"{source}: Gemma variant {gemma!r} is not supported; supported: "
                f"{', '.join(GEMMA3_CLASSES)} (its text part)"
            )
        refuse_quantized(hf, source)
        text = hf.get("text_config")
        if isinstance(text, Mapping):  # (the multimodal config: dtype keys on its top level)
            text = {**{k: hf[k] for k in ("torch_dtype", "dtype") if k in hf}, **text}
        return _gemma3_config(text if isinstance(text, Mapping) else hf, dtype, source)
    archs = hf.get("architectures") or []
    arch = next((_ARCH_OF_CLASS[a] for a in archs if a in _ARCH_OF_CLASS), None)
    if arch is None and hf.get("model_type") in _ARCH_OF_MODEL_TYPE:
        arch = _ARCH_OF_MODEL_TYPE[hf["model_type"]]
    mistral = "MistralForCausalLM" in archs or (not archs and hf.get("model_type") == "mistral")
    if arch is None:
        if is_qwen35_config(hf):
            raise ModelFileError(
                f"{source}: {archs or hf.get('model_type')} is the hybrid (qwen35) model: load "
                "it with specjax.load / specjax.io.load_model_files (specjax.io.hf_qwen35)"
            )
        raise ModelFileError(
            f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; supported: "
            f"{', '.join([*_ARCH_OF_CLASS, *QWEN35_CLASSES])}"
        )
    refuse_quantized(hf, source)
    if hf.get("mlp_bias"):
        raise ModelFileError(f"{source}: mlp_bias=true is not supported")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelFileError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported")

    def need(name: str) -> int:
        if hf.get(name) is None:
            raise ModelFileError(f"{source}: missing {name}")
        return int(hf[name])

    D, H, L = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    G = int(hf.get("num_key_value_heads") or H)
    E = int(hf.get("head_dim") or (D // H))
    theta, scaling = _rope_scaling(source, hf)

    window, swa = 0, ()
    if mistral and hf.get("sliding_window") is not None:
        # transformers' Mistral masks every layer to the window when sliding_window is set
        # (k > q - window); null (recent configs) is full attention.
        window = int(hf["sliding_window"])
        if window <= 0:
            raise ModelFileError(f"{source}: sliding_window={window} must be positive or null")
    if arch in ("qwen2", "qwen3"):
        layer_types = hf.get("layer_types")
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        if layer_types:
            flags = tuple(t == "sliding_attention" for t in layer_types)
        elif sliding:
            first = int(hf.get("max_window_layers", L))
            flags = tuple(i >= first for i in range(L))
        else:
            flags = ()
        if any(flags):
            window = int(hf.get("sliding_window") or 0)
            if window <= 0:
                raise ModelFileError(f"{source}: sliding layers but sliding_window={window}")
            swa = () if all(flags) else flags
    moe = _moe_fields(hf, L, source) if arch == "qwen3moe" else {}
    if arch == "qwen3moe" and hf.get("use_sliding_window") and hf.get("sliding_window"):
        window = int(hf["sliding_window"])  # every layer (transformers' Qwen3MoeAttention)

    raw_dtype = dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if raw_dtype not in _DTYPES:
        raise ModelFileError(f"{source}: unsupported dtype {raw_dtype!r}")
    with file_error(source, "invalid model hyper-parameters"):
        return ModelConfig(
            arch=arch,
            vocab_size=need("vocab_size"),
            dim=D,
            n_layers=L,
            n_heads=H,
            n_kv_heads=G,
            ffn_dim=need("intermediate_size"),
            head_dim=0 if (D % H == 0 and E == D // H) else E,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3moe"),
            sliding_window=window,
            swa_layers=swa,
            max_position=int(hf.get("max_position_embeddings", 4096)),
            dtype=_DTYPES[raw_dtype],
            **moe,
        )


def _moe_fields(hf: Mapping[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """The ModelConfig expert fields of a Qwen3-MoE config.json (which layers are MoE:
    transformers' rule, not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0)."""
    if hf.get("shared_expert_intermediate_size"):
        raise ModelFileError(f"{source}: a shared expert (Qwen2-MoE style) is not supported")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
    flags = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    n_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if n_experts <= 0 or not any(flags):
        raise ModelFileError(f"{source}: Qwen3MoeForCausalLM with no expert layers")
    return dict(
        n_experts=n_experts,
        n_experts_used=int(hf.get("num_experts_per_tok") or 0),
        expert_ffn_dim=int(hf.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=() if all(flags) else flags,
    )


def _moe_weights(w: _Weights, config: ModelConfig, prefix: str) -> dict[str, np.ndarray]:
    """A MoE layer's router and experts (`prefix`: "model.layers.N.mlp.") from the hub's
    per-expert tensors or transformers' fused ones."""
    X, D, F = config.n_experts, config.D, config.expert_ffn_dim
    e = prefix + "experts."
    out = {"router": w.get(prefix + "gate.weight", (X, D))}
    if e + "gate_up_proj" in w:
        gate_up = w.get(e + "gate_up_proj", (X, 2 * F, D))
        down = w.get(e + "down_proj", (X, D, F))
    else:
        gate_up = np.stack(
            [
                np.concatenate(
                    [
                        w.get(f"{e}{j}.gate_proj.weight", (F, D)),
                        w.get(f"{e}{j}.up_proj.weight", (F, D)),
                    ]
                )
                for j in range(X)
            ]
        )
        down = np.stack([w.get(f"{e}{j}.down_proj.weight", (D, F)) for j in range(X)])
    # specjax's experts are input-major (specjax.models.moe)
    out["experts_gate_up"] = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
    out["experts_down"] = np.ascontiguousarray(down.transpose(0, 2, 1))
    return out


class _Weights:
    """Lazy access to the checkpoint's tensors across shards, tracking which were read."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ModelFileError(f"{index}: invalid safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            if not files:
                raise ModelFileError(f"{folder}: no *.safetensors weights found")
        self.location: dict[str, str] = {}
        self.handles: dict[str, Any] = {}
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise ModelFileError(f"{path}: weight shard listed in the index is missing")
            try:
                handle = safetensors.safe_open(path, framework="np")
                keys = list(handle.keys())
            except Exception as e:  # SafetensorError is not a stable public type
                raise ModelFileError(
                    f"{path}: truncated or corrupted safetensors file ({e})"
                ) from e
            self.handles[name] = handle
            for k in keys:
                self.location[k] = name
        self.used: set[str] = set()
        #: name the loader asks for -> name in the file (see `rename_prefix`)
        self.alias: dict[str, str] = {}

    def rename_prefix(self, old: str, new: str) -> None:
        """Serve every tensor named `old`... under `new`... instead."""
        for k in [k for k in self.location if k.startswith(old)]:
            self.location[new + k[len(old) :]] = self.location.pop(k)
            self.alias[new + k[len(old) :]] = k

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.location:
            raise ModelFileError(f"{self.folder}: missing tensor {name}")
        self.used.add(name)
        file = self.location[name]
        try:
            arr = self.handles[file].get_tensor(self.alias.get(name, name))
        except Exception as e:
            raise ModelFileError(f"{self.folder}/{file}: cannot read tensor {name} ({e})") from e
        if tuple(arr.shape) != shape:
            raise ModelFileError(
                f"{self.folder}/{file}: tensor {name} has shape {tuple(arr.shape)}, "
                f"expected {shape}"
            )
        return arr

    def unused(self) -> list[str]:
        return sorted(
            k for k in set(self.location) - self.used if not k.endswith("rotary_emb.inv_freq")
        )


def load_hf(
    folder: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[ModelConfig, Params, Tokenizer]:
    """Read a transformers Llama/Qwen2/Qwen3 directory into (config, params, tokenizer).

    `dtype` overrides config.json's torch_dtype for the returned parameters."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ModelFileError(f"{folder}: not a directory")
    config = config_from_hf(
        _read_config(folder), dtype=dtype, source=os.path.join(folder, "config.json")
    )
    w = _Weights(folder)
    if config.arch == "gemma3":
        gemma = _gemma3_params(folder, config, w)
        return config, gemma, Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    E, D, F, H, G, V = config.E, config.D, config.F, config.H, config.G, config.V
    dt = jnp.dtype(config.dtype)

    def arr(x: np.ndarray) -> Any:
        return jnp.asarray(np.asarray(x, np.float32) if x.dtype != dt else x, dt)

    layers = []
    for i in range(config.L):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = {
            "attn_norm": w.get(p + "input_layernorm.weight", (D,)),
            "wqkv": np.concatenate(
                [
                    w.get(a + "q_proj.weight", (H * E, D)),
                    w.get(a + "k_proj.weight", (G * E, D)),
                    w.get(a + "v_proj.weight", (G * E, D)),
                ]
            ),
            "wo": w.get(a + "o_proj.weight", (D, H * E)),
            "ffn_norm": w.get(p + "post_attention_layernorm.weight", (D,)),
        }
        if config.is_moe_layer(i):
            layer.update(_moe_weights(w, config, p + "mlp."))
        else:
            layer["w_gate_up"] = np.concatenate(
                [w.get(p + "mlp.gate_proj.weight", (F, D)), w.get(p + "mlp.up_proj.weight", (F, D))]
            )
            layer["w_down"] = w.get(p + "mlp.down_proj.weight", (D, F))
        if config.qkv_bias:
            layer["bqkv"] = np.concatenate(
                [
                    w.get(a + "q_proj.bias", (H * E,)),
                    w.get(a + "k_proj.bias", (G * E,)),
                    w.get(a + "v_proj.bias", (G * E,)),
                ]
            )
        if a + "o_proj.bias" in w:
            o_bias = w.get(a + "o_proj.bias", (D,))
            if np.any(np.asarray(o_bias, np.float32) != 0):
                raise ModelFileError(
                    f"{folder}: {a}o_proj.bias is non-zero; specjax has no output-projection bias"
                )
        if config.qk_norm:
            layer["q_norm"] = w.get(a + "q_norm.weight", (E,))
            layer["k_norm"] = w.get(a + "k_norm.weight", (E,))
        layers.append({k: arr(v) for k, v in layer.items()})
    params: Params = {
        "embed": arr(w.get("model.embed_tokens.weight", (V, D))),
        "layers": tuple(layers),
        "final_norm": arr(w.get("model.norm.weight", (D,))),
    }
    if config.tie_embeddings:
        if "lm_head.weight" in w:
            w.used.add("lm_head.weight")  # transformers ties it to the embedding anyway
    else:
        params["lm_head"] = arr(w.get("lm_head.weight", (V, D)))
    unused = w.unused()
    if unused:
        raise ModelFileError(
            f"{folder}: tensors specjax's {config.arch} model has no slot for: "
            f"{', '.join(unused[:8])}" + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        )
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return config, params, tokenizer


def _gemma3_params(folder: str, config: ModelConfig, w: _Weights) -> Params:
    """A gemma3 checkpoint's parameters: Gemma3ForCausalLM's `model.*` tensors, or the
    language model of a Gemma3ForConditionalGeneration (`model.language_model.*` or the
    older `language_model.model.*`; its vision tower and projector are left out). Norm
    weights get their 1 added (Gemma3RMSNorm's (1 + w), in float32), as llama.cpp's
    converter stores them."""
    E, D, F, H, G, V = config.E, config.D, config.F, config.H, config.G, config.V
    dt = jnp.dtype(config.dtype)
    prefix, head = "model.", "lm_head.weight"
    if "model.language_model.embed_tokens.weight" in w:
        prefix = "model.language_model."
    elif "language_model.model.embed_tokens.weight" in w:
        prefix, head = "language_model.model.", "language_model.lm_head.weight"
    if prefix != "model.":  # the multimodal checkpoint: its text part only
        for name in w.location:
            if not name.startswith(prefix) and name != head:
                w.used.add(name)

    def arr(x: np.ndarray) -> Any:
        return jnp.asarray(np.asarray(x, np.float32) if x.dtype != dt else x, dt)

    def norm(name: str, n: int) -> Any:
        return jnp.asarray(np.asarray(w.get(name, (n,)), np.float32) + 1.0, dt)

    layers = []
    for i in range(config.L):
        p = f"{prefix}layers.{i}."
        a = p + "self_attn."
        wqkv = np.concatenate(
            [
                w.get(a + "q_proj.weight", (H * E, D)),
                w.get(a + "k_proj.weight", (G * E, D)),
                w.get(a + "v_proj.weight", (G * E, D)),
            ]
        )
        w_gate_up = np.concatenate(
            [w.get(p + "mlp.gate_proj.weight", (F, D)), w.get(p + "mlp.up_proj.weight", (F, D))]
        )
        layers.append(
            {
                "attn_norm": norm(p + "input_layernorm.weight", D),
                "wqkv": arr(wqkv),
                "q_norm": norm(a + "q_norm.weight", E),
                "k_norm": norm(a + "k_norm.weight", E),
                "wo": arr(w.get(a + "o_proj.weight", (D, H * E))),
                "post_attn_norm": norm(p + "post_attention_layernorm.weight", D),
                "ffn_norm": norm(p + "pre_feedforward_layernorm.weight", D),
                "w_gate_up": arr(w_gate_up),
                "w_down": arr(w.get(p + "mlp.down_proj.weight", (D, F))),
                "post_ffn_norm": norm(p + "post_feedforward_layernorm.weight", D),
            }
        )
    params: Params = {
        "embed": arr(w.get(prefix + "embed_tokens.weight", (V, D))),
        "layers": tuple(layers),
        "final_norm": norm(prefix + "norm.weight", D),
    }
    if config.tie_embeddings:
        if head in w:
            w.used.add(head)  # transformers ties it to the embedding anyway
    else:
        params["lm_head"] = arr(w.get(head, (V, D)))
    unused = w.unused()
    if unused:
        raise ModelFileError(
            f"{folder}: tensors specjax's gemma3 model has no slot for: "
            f"{', '.join(unused[:8])}" + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        )
    return params


def config_to_hf(config: ModelConfig, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """transformers config.json for `config` (ValueError if transformers cannot express it)."""
    if config.arch == "gemma3":
        raise ValueError("saving a gemma3 model as a Hugging Face folder is not supported")
    if config.arch in ("qwen3", "qwen3moe") and not config.qk_norm:
        raise ValueError("transformers' Qwen3 always has q/k norm; set qk_norm=True")
    if config.arch not in ("qwen3", "qwen3moe") and config.qk_norm:
        raise ValueError(f"transformers' {_CLASS_OF_ARCH[config.arch]} has no q/k norm")
    # a llama with a sliding window on every layer is transformers' Mistral
    mistral = config.arch == "llama" and config.sliding_window > 0
    if mistral and (config.swa_layers and not all(config.swa_layers)):
        raise ValueError(
            "transformers' MistralForCausalLM slides every layer; per-layer windows "
            f"{config.swa_layers} have no Llama-family class"
        )
    if mistral and config.qkv_bias:
        raise ValueError("transformers' MistralForCausalLM has no attention biases")
    out: dict[str, Any] = {
        "architectures": ["MistralForCausalLM" if mistral else _CLASS_OF_ARCH[config.arch]],
        "model_type": "mistral" if mistral else _MODEL_TYPE.get(config.arch, config.arch),
        "vocab_size": config.V,
        "hidden_size": config.D,
        "num_hidden_layers": config.L,
        "num_attention_heads": config.H,
        "num_key_value_heads": config.G,
        "head_dim": config.E,
        "intermediate_size": config.F,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": config.dtype,
    }
    scaling = config.rope_scaling
    if config.rope_factors:
        from specjax.io.gguf_io import fit_llama3_scaling

        scaling = fit_llama3_scaling(config, np.asarray(config.rope_factors, np.float64))
        if scaling is None:
            raise ValueError(
                f"transformers' config.json cannot express the RoPE factors "
                f"{[round(f, 4) for f in config.rope_factors]} (no llama3 rope_scaling gives them)"
            )
    if scaling is not None:
        s = scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    if mistral:
        out["sliding_window"] = config.sliding_window
    elif config.arch == "llama":
        out.update(attention_bias=config.qkv_bias, mlp_bias=False, pretraining_tp=1)
    elif config.arch in ("qwen3", "qwen3moe"):
        out["attention_bias"] = config.qkv_bias
    if config.arch == "qwen3moe":
        if config.sliding_window and config.swa_layers and not all(config.swa_layers):
            raise ValueError("transformers' Qwen3-MoE slides the window in every layer or none")
        out.update(
            num_experts=config.n_experts,
            num_experts_per_tok=config.n_experts_used,
            moe_intermediate_size=config.expert_ffn_dim,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(config.L) if not config.is_moe_layer(i)],
            use_sliding_window=config.sliding_window > 0,
            sliding_window=config.sliding_window or None,
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    if config.arch in ("qwen2", "qwen3"):
        flags = [config.layer_window(i) > 0 for i in range(config.L)]
        out["use_sliding_window"] = any(flags)
        out["sliding_window"] = config.sliding_window if any(flags) else None
        first_sliding = flags.index(True) if any(flags) else config.L
        out["max_window_layers"] = first_sliding
        out["layer_types"] = ["sliding_attention" if f else "full_attention" for f in flags]
    if tokenizer is not None:
        out["bos_token_id"] = tokenizer.bos_id
        out["eos_token_id"] = tokenizer.eos_id
        if tokenizer.pad_id is not None:
            out["pad_token_id"] = tokenizer.pad_id
    return out


def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def save_hf(
    folder: str | os.PathLike[str], config: ModelConfig, params: Params, tokenizer: Tokenizer
) -> None:
    """Write a directory transformers' AutoModelForCausalLM / AutoTokenizer load."""
    folder = os.fspath(folder)
    check_params(config, params)
    if tokenizer.vocab_size > config.V:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model vocabulary is {config.V}"
        )
    hf_config = config_to_hf(config, tokenizer)
    os.makedirs(folder, exist_ok=True)
    dt = np.dtype(jnp.dtype(config.dtype))
    E, H, G = config.E, config.H, config.G

    def np_(x: Any) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x).astype(dt))

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": np_(params["embed"])}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        parts = split_layer(config, layer)
        tensors[p + "input_layernorm.weight"] = np_(layer["attn_norm"])
        tensors[a + "q_proj.weight"] = np_(parts["q"])
        tensors[a + "k_proj.weight"] = np_(parts["k"])
        tensors[a + "v_proj.weight"] = np_(parts["v"])
        if config.qkv_bias:
            tensors[a + "q_proj.bias"] = np_(parts["q_bias"])
            tensors[a + "k_proj.bias"] = np_(parts["k_bias"])
            tensors[a + "v_proj.bias"] = np_(parts["v_bias"])
        elif config.arch == "qwen2":  # transformers' Qwen2 always has q/k/v biases
            tensors[a + "q_proj.bias"] = np.zeros((H * E,), dt)
            tensors[a + "k_proj.bias"] = np.zeros((G * E,), dt)
            tensors[a + "v_proj.bias"] = np.zeros((G * E,), dt)
        # attention_bias covers o_proj
        if config.qkv_bias and config.arch in ("llama", "qwen3", "qwen3moe"):
            tensors[a + "o_proj.bias"] = np.zeros((config.D,), dt)
        if config.qk_norm:
            tensors[a + "q_norm.weight"] = np_(layer["q_norm"])
            tensors[a + "k_norm.weight"] = np_(layer["k_norm"])
        tensors[a + "o_proj.weight"] = np_(layer["wo"])
        tensors[p + "post_attention_layernorm.weight"] = np_(layer["ffn_norm"])
        if config.is_moe_layer(i):
            F = config.expert_ffn_dim
            tensors[p + "mlp.gate.weight"] = np_(layer["router"])
            gate_up, down = np.asarray(layer["experts_gate_up"]), np.asarray(layer["experts_down"])
            for j in range(config.n_experts):  # [out, in] per expert, as transformers'
                tensors[f"{p}mlp.experts.{j}.gate_proj.weight"] = np_(gate_up[j, :, :F].T)
                tensors[f"{p}mlp.experts.{j}.up_proj.weight"] = np_(gate_up[j, :, F:].T)
                tensors[f"{p}mlp.experts.{j}.down_proj.weight"] = np_(down[j].T)
        else:
            tensors[p + "mlp.gate_proj.weight"] = np_(parts["gate"])
            tensors[p + "mlp.up_proj.weight"] = np_(parts["up"])
            tensors[p + "mlp.down_proj.weight"] = np_(layer["w_down"])
    tensors["model.norm.weight"] = np_(params["final_norm"])
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = np_(params["lm_head"])

    weights = os.path.join(folder, "model.safetensors")
    tmp = weights + ".tmp"
    try:
        safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, weights)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _write_json(os.path.join(folder, "config.json"), hf_config)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    gen: dict[str, Any] = {}
    if tokenizer.bos_id is not None:
        gen["bos_token_id"] = tokenizer.bos_id
    eog = sorted(tokenizer.eog_ids)
    if tokenizer.eos_id is not None and eog == [tokenizer.eos_id]:
        gen["eos_token_id"] = tokenizer.eos_id
    elif eog:
        first = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        gen["eos_token_id"] = first + [i for i in eog if i not in first]
    if tokenizer.pad_id is not None:
        gen["pad_token_id"] = tokenizer.pad_id
    _write_json(os.path.join(folder, "generation_config.json"), gen)
