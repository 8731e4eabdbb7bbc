"""GGUF model files (llama.cpp's format) <-> specjax (ModelConfig, params, Tokenizer).

Invariants:
* Architectures: ``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``, and ``gemma3`` (loading only:
  llama.cpp's converter stores its norms with Gemma3RMSNorm's 1 added, as specjax does)
  (``general.architecture``); anything else is a `ModelFileError`.
* ``qwen3moe`` experts are llama.cpp's 3-D tensors: ``ffn_gate_inp`` (ggml ne {D, X}, numpy
  [X, D]: the router), ``ffn_gate_exps`` / ``ffn_up_exps`` ({D, F', X}: [X, F', D]) and
  ``ffn_down_exps`` ({F', D, X}: [X, D, F']), each expert transposed to specjax's input-major
  experts (specjax.models.moe) on load and back on save; every layer is MoE and the top-k weights are
  renormalised (llama.cpp's qwen3moe graph, whatever norm_topk_prob was), so a config that
  differs cannot be saved. The router is saved F32 (llama.cpp's quantizer keeps it so).
* GGUF stores weights with ggml dims ``[in, out]``, which numpy (and GGUFReader) sees as
  ``[out, in]``: the specjax layout, so no transposes are needed.
* ``llama`` files store Q/K rows permuted for interleaved RoPE (convert_hf_to_gguf.py's
  ``permute``); loading undoes it, saving redoes it. qwen2/qwen3 use NeoX RoPE: no permutation.
* Every tensor in the file is consumed; an unknown tensor (e.g. an output bias specjax's
  forward has no slot for) is an error, never silently dropped.
* Loading dequantises with ``gguf.quants.dequantize`` (F32, F16, BF16 and every quantised type
  gguf-py implements: Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K, IQ*, TQ*, MXFP4...).
* Saving writes 1-D tensors (norms, biases, rope factors) as F32 like llama.cpp, and 2-D
  weights as F32 / F16 / BF16 / Q8_0. Q8_0 needs rows divisible by 32; other rows fall back to F16.
* A save never clobbers an existing file with a partial one: it writes a temp file in the
  target's directory and ``os.replace``s it at the end. Every GGUF format's save (``save_gguf``,
  ``save_qwen35_gguf``, ``save_eagle3_gguf``, ``save_dflash_gguf``) is made by `gguf_saver`,
  which refuses a bad dtype, parameters or tokenizer before anything is written.
* RoPE frequency factors are stored as llama.cpp does, a ``rope_freqs.weight`` tensor of per-
  pair divisors (from `ModelConfig.rope_factors`, or computed from a llama3 `RopeScaling`, then
  with ``specjax.rope_scaling.*`` keys, ignored by llama.cpp, that let a reload recover the
  exact `RopeScaling`). A file without those keys loads its factors as they are stored
  (`rope_factors`), whatever wrote them: llama.cpp uses the tensor, not a parameter fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QT

from specjax.errors import ModelFileError, file_error
from specjax.io.tokenizer import Tokenizer
from specjax.models.config import (
    ARCHS,
    ModelConfig,
    RopeScaling,
    rope_frequencies,
    rope_pair_factors,
)
from specjax.types import Array, Params

SAVE_DTYPES = ("f32", "f16", "bf16", "q8_0")
_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
_INT_TYPES = (QT.I8, QT.I16, QT.I32, QT.I64, QT.F64)
_SPECJAX_ROPE = "specjax.rope_scaling."


def _f32(value: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-5, not 9.99e-6)."""
    return float(str(np.float32(value)))


# --------------------------------------------------------------------------- layout helpers
def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rotate-half rows -> llama.cpp interleaved rows (convert_hf_to_gguf.py `permute`)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_qk`."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter, keyed "embed", "lm_head", "final_norm", "layers.N.name"."""
    E, D, F, H, G, V = config.E, config.D, config.F, config.H, config.G, config.V
    out: dict[str, tuple[int, ...]] = {"embed": (V, D), "final_norm": (D,)}
    if not config.tie_embeddings:
        out["lm_head"] = (V, D)
    for i in range(config.L):
        p = f"layers.{i}."
        out[p + "attn_norm"] = (D,)
        out[p + "wqkv"] = ((H + 2 * G) * E, D)
        if config.qkv_bias:
            out[p + "bqkv"] = ((H + 2 * G) * E,)
        if config.qk_norm:
            out[p + "q_norm"] = (E,)
            out[p + "k_norm"] = (E,)
        out[p + "wo"] = (D, H * E)
        out[p + "ffn_norm"] = (D,)
        if config.is_moe_layer(i):
            X, F_x = config.n_experts, config.expert_ffn_dim
            out[p + "router"] = (X, D)
            out[p + "experts_gate_up"] = (X, D, 2 * F_x)
            out[p + "experts_down"] = (X, F_x, D)
        else:
            out[p + "w_gate_up"] = (2 * F, D)
            out[p + "w_down"] = (D, F)
        if config.arch == "gemma3":
            out[p + "post_attn_norm"] = (D,)
            out[p + "post_ffn_norm"] = (D,)
    return out


def check_params(config: ModelConfig, params: Params) -> None:
    """ValueError naming the first parameter that is missing, extra or mis-shaped."""
    want = expected_shapes(config)
    have: dict[str, tuple[int, ...]] = {}
    for key, value in params.items():
        if key == "layers":
            if len(value) != config.L:
                raise ValueError(f"params has {len(value)} layers, config.n_layers={config.L}")
            for i, layer in enumerate(value):
                for name, arr in layer.items():
                    have[f"layers.{i}.{name}"] = tuple(arr.shape)
        else:
            have[key] = tuple(value.shape)
    for name in want:
        if name not in have:
            raise ValueError(f"parameter {name} is missing (required by the config)")
        if have[name] != want[name]:
            raise ValueError(f"parameter {name} has shape {have[name]}, expected {want[name]}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ValueError(f"parameters not used by the config: {', '.join(extra)}")


def split_layer(config: ModelConfig, layer: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Fused specjax layer -> separate q/k/v, gate/up numpy arrays (rotate-half layout)."""
    E, H, G, F = config.E, config.H, config.G, config.F
    w = np.asarray(layer["wqkv"])
    out = {"q": w[: H * E], "k": w[H * E : (H + G) * E], "v": w[(H + G) * E :]}
    if "w_gate_up" in layer:  # (a MoE layer has experts instead)
        out["gate"] = np.asarray(layer["w_gate_up"])[:F]
        out["up"] = np.asarray(layer["w_gate_up"])[F:]
    if "bqkv" in layer:
        b = np.asarray(layer["bqkv"])
        out["q_bias"], out["k_bias"], out["v_bias"] = (
            b[: H * E],
            b[H * E : (H + G) * E],
            b[(H + G) * E :],
        )
    return out


def llama3_factors(config: ModelConfig) -> np.ndarray:
    """llama.cpp's rope_freqs tensor: unscaled / scaled inverse frequency per dimension pair."""
    return np.asarray(rope_pair_factors(config), np.float32)


def rope_factors_from_tensor(path: str, factors: np.ndarray) -> tuple[float, ...]:
    """A rope_freqs tensor as a config's `rope_factors`: as stored, () when all 1."""
    factors = np.asarray(factors, np.float32).reshape(-1)
    if not np.all(np.isfinite(factors) & (factors > 0)):
        raise ModelFileError(
            f"{path}: rope_freqs.weight factors {np.round(factors, 4).tolist()} are not all "
            "finite and positive"
        )
    return () if np.all(factors == 1.0) else tuple(float(f) for f in factors)


def _replace_scaling(config: ModelConfig, scaling: RopeScaling | None) -> ModelConfig:
    """`config` with `scaling` as its only RoPE frequency scaling (rope_factors cleared)."""
    data = config.to_dict()
    data["rope_scaling"] = None if scaling is None else scaling.__dict__.copy()
    data["rope_factors"] = ()
    return ModelConfig.from_dict(data)


def _factors_match(config: ModelConfig, factors: np.ndarray) -> bool:
    got = llama3_factors(config).astype(np.float64)
    return bool(np.all(np.abs(got - factors) <= 1e-4 * np.maximum(1.0, np.abs(factors))))


def fit_llama3_scaling(
    config: ModelConfig, factors: np.ndarray, hint: RopeScaling | None = None
) -> RopeScaling | None:
    """A `RopeScaling` reproducing llama.cpp rope factors, or None when none is found.

    Only the ratios original_max_position / low_freq_factor and / high_freq_factor matter, so
    a fit fixes low_freq_factor = 1 unless a candidate (the hint, llama 3.x presets) matches."""
    factors = np.asarray(factors, np.float64)
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    candidates = [hint] if hint is not None else []
    candidates += [RopeScaling(factor=f) for f in (8.0, 32.0, 16.0, 4.0, 2.0)]
    for cand in candidates:
        if _factors_match(_replace_scaling(config, cand), factors):
            return cand
    factor = float(factors.max())
    plain = np.asarray(rope_frequencies(_replace_scaling(config, None)), np.float64)
    wavelen = 2 * math.pi / plain
    tol = 1e-4 * factor
    smooth = (factors > 1.0 + tol) & (factors < factor - tol)
    ones = factors <= 1.0 + tol
    if smooth.sum() >= 2:
        s = (1.0 / factors[smooth] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(plain[smooth], s, 1)
        if b >= 0 or a <= 0:
            return None
        k = -1.0 / b
        cand = RopeScaling(
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=1.0 + k,
            original_max_position=round(2 * math.pi * a * k),
        )
        # omp was rounded to an int: rescale the two factors to keep the fitted ratios exact.
        scale = cand.original_max_position / (2 * math.pi * a * k)
        cand = RopeScaling(
            factor=factor,
            low_freq_factor=scale,
            high_freq_factor=(1.0 + k) * scale,
            original_max_position=cand.original_max_position,
        )
    elif smooth.sum() == 1 and ones.any() and (factors >= factor - tol).any():
        # one pair in the band: any band edges around it with its smooth value reproduce the
        # factors; put the low edge close above it and solve for the high edge
        w_s = float(wavelen[smooth][0])
        f_s = float(factors[smooth][0])
        s_val = (1.0 / f_s - 1.0 / factor) / (1.0 - 1.0 / factor)
        shorter = float(wavelen[wavelen < w_s].max())
        longer = float(wavelen[wavelen > w_s].min())
        omp = 8192
        for t in (0.5, 0.25, 0.1, 0.01):
            low_w = w_s * (longer / w_s) ** t
            high_w = 1.0 / (1.0 / low_w + (1.0 / w_s - 1.0 / low_w) / s_val)
            if shorter < high_w < w_s:
                cand = RopeScaling(
                    factor=factor,
                    low_freq_factor=omp / low_w,
                    high_freq_factor=omp / high_w,
                    original_max_position=omp,
                )
                if _factors_match(_replace_scaling(config, cand), factors):
                    return cand
        return None
    elif smooth.sum() == 0 and ones.any() and (~ones).any():
        hi_w = float(wavelen[ones].max())  # longest unscaled wavelength
        lo_w = float(wavelen[~ones].min())  # shortest fully scaled wavelength
        omp = 8192
        high_w = hi_w * (lo_w / hi_w) ** (1 / 3)
        low_w = hi_w * (lo_w / hi_w) ** (2 / 3)
        cand = RopeScaling(
            factor=factor,
            low_freq_factor=omp / low_w,
            high_freq_factor=omp / high_w,
            original_max_position=omp,
        )
    else:
        return None
    return cand if _factors_match(_replace_scaling(config, cand), factors) else None


# --------------------------------------------------------------------------- loading
def _field_values(reader: gguf.GGUFReader) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = field.contents()
    return out


#: GGUF value type ids of a string and of the unsigned 32-bit header fields (gguf spec).
_GGUF_STRING = 8


def read_architecture(path: str | os.PathLike[str]) -> str | None:
    """`general.architecture` from the GGUF header without parsing the file.

    Writers put it first (llama.cpp's and gguf-py's); when the first key is something else
    the whole file is parsed. None when the key is absent; ModelFileError for a non-GGUF.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4 + 4 + 8 + 8 + 8 + 64)
    except OSError as e:
        raise ModelFileError(f"{path}: {e.strerror or e}") from e
    if head[:4] == b"GGUF" and len(head) >= 32:
        key_len = int.from_bytes(head[24:32], "little")
        key_end = 32 + key_len
        if head[32:key_end] == b"general.architecture" and len(head) >= key_end + 12:
            value_type = int.from_bytes(head[key_end : key_end + 4], "little")
            if value_type == _GGUF_STRING:
                n = int.from_bytes(head[key_end + 4 : key_end + 12], "little")
                with open(path, "rb") as f:
                    f.seek(key_end + 12)
                    raw = f.read(n)
                if len(raw) == n:
                    return raw.decode("utf-8", errors="replace")
    field = _open_reader(path).fields.get("general.architecture")
    return None if field is None else str(field.contents())


def _on_device(a: Any, dtype: Any) -> Array:
    """A host array converted on the host, then placed: `jnp.asarray(a, dtype)` would convert
    eagerly on the device, compiling one conversion per tensor shape at every load."""
    return jax.device_put(np.asarray(a, dtype))


def _open_reader(path: str) -> gguf.GGUFReader:
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: file not found")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(
            f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF'; {size} bytes)"
        )
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError/IndexError/struct errors on bad bytes
        raise ModelFileError(
            f"{path}: truncated or corrupted GGUF file ({size} bytes): {type(e).__name__}: {e}"
        ) from e
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise ModelFileError(
                f"{path}: truncated GGUF file: tensor {t.name} ends at byte {end} "
                f"but the file has {size} bytes"
            )
    return reader


def _tensor_to_numpy(path: str, t: Any, *, keep_f16: bool = False) -> np.ndarray:
    """The tensor's values in numpy order as float32, or as the stored float16 values when
    `keep_f16` and the tensor is F16 (no round trip through float32 for float16 params)."""
    qtype = QT(int(t.tensor_type))
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if qtype in _INT_TYPES:
        raise ModelFileError(
            f"{path}: tensor {t.name} has unsupported tensor type {qtype.name} "
            "(integer tensors are not model weights specjax can load)"
        )
    try:
        if qtype == QT.F32:
            arr = np.array(t.data, np.float32)
        elif qtype == QT.F16 and keep_f16:
            return np.array(t.data, np.float16).reshape(shape)
        elif qtype == QT.F16:
            arr = np.asarray(t.data).astype(np.float32)
        else:
            arr = gguf.quants.dequantize(np.asarray(t.data), qtype)
    except NotImplementedError as e:
        raise ModelFileError(
            f"{path}: tensor {t.name} has unsupported tensor type {qtype.name} "
            f"(gguf-py cannot dequantize it)"
        ) from e
    except (ValueError, IndexError) as e:
        raise ModelFileError(f"{path}: corrupted data for tensor {t.name}: {e}") from e
    return np.asarray(arr, np.float32).reshape(shape)


def _gemma3_keys(
    path: str, key: Any, scaling_type: str, D: int, H: int, L: int, E: int
) -> dict[str, Any]:
    """The gemma3 `ModelConfig` fields from a GGUF's metadata, as llama.cpp's gemma3 loader
    reads them: `rope.freq_base_swa` (10000 when absent) for the sliding layers, linear
    `rope.scaling` for the others, `final_logit_softcapping`, and the query scale
    1/sqrt(head_dim), or 1/sqrt(dim / n_heads) for the 62-layer (27B) model."""
    factor = 1.0
    if scaling_type == "linear":
        factor = key("rope.scaling.factor", 0.0, _f32) or key("rope.scale_linear", 0.0, _f32)
        factor = factor or 1.0
    elif scaling_type not in ("none", ""):
        raise ModelFileError(
            f"{path}: gemma3 RoPE scaling type {scaling_type!r} is not supported (none, linear)"
        )
    scale = 1.0 / math.sqrt(D / H) if L == 62 else 0.0
    return dict(
        rope_theta_swa=key("rope.freq_base_swa", 10000.0, _f32),
        rope_factors=(factor,) * (E // 2) if factor != 1.0 else (),
        attn_scale=0.0 if scale and abs(scale - 1.0 / math.sqrt(E)) < 1e-12 else scale,
        final_logit_softcap=key("final_logit_softcapping", 0.0, _f32),
    )


def _config_dtype(tensors: Mapping[str, Any]) -> str:
    t = tensors.get("blk.0.attn_q.weight") or tensors.get("token_embd.weight")
    if t is None:
        return "float32"
    qtype = QT(int(t.tensor_type))
    return {QT.F16: "float16", QT.BF16: "bfloat16"}.get(qtype, "float32")


def load_gguf(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[ModelConfig, Params, Tokenizer]:
    """Read a llama / qwen2 / qwen3 / gemma3 GGUF file into (config, params, tokenizer).

    `dtype` ("float32" / "float16" / "bfloat16") is the parameter dtype; default: the file's
    float type (F16 -> float16, BF16 -> bfloat16, F32 and quantised types -> float32)."""
    path = os.fspath(path)
    reader = _open_reader(path)
    fields = _field_values(reader)
    arch = fields.get("general.architecture")
    if arch not in ARCHS:
        raise ModelFileError(
            f"{path}: unsupported architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(ARCHS)}"
        )
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = ..., cast: Any = int) -> Any:
        full = f"{arch}.{name}"
        if full not in fields:
            if default is ...:
                raise ModelFileError(f"{path}: missing metadata key {full}")
            return default
        value = fields[full]
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise ModelFileError(
                    f"{path}: per-layer values for {full} ({value[:8]}...) are not supported"
                )
            value = value[0]
        return cast(value)

    if "token_embd.weight" not in tensors:
        raise ModelFileError(f"{path}: missing tensor token_embd.weight")
    D = key("embedding_length")
    V = int(tensors["token_embd.weight"].shape[1])
    H = key("attention.head_count")
    G = key("attention.head_count_kv", H)
    L = key("block_count")
    E = key("attention.key_length", D // H if H else 0)
    E_v = key("attention.value_length", E)
    if E_v != E:
        raise ModelFileError(f"{path}: key_length {E} != value_length {E_v} is not supported")
    n_rot = key("rope.dimension_count", E)
    if n_rot != E:
        raise ModelFileError(
            f"{path}: partial RoPE (rope.dimension_count={n_rot}, head dim {E}) is not supported"
        )
    scaling_type = fields.get(f"{arch}.rope.scaling.type", "none")
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        gemma = _gemma3_keys(path, key, scaling_type, D, H, L, E)
    elif scaling_type not in ("none", ""):
        raise ModelFileError(
            f"{path}: RoPE scaling type {scaling_type!r} is not supported (only llama3 rope_freqs)"
        )
    window = key("attention.sliding_window", 0)
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern")
    if arch == "gemma3" and pattern is None:
        pattern = 6  # llama.cpp's gemma3 default (`load_swa_pattern(ml, 6)`)
    swa_layers: tuple[bool, ...] = ()
    if window and isinstance(pattern, list):
        swa_layers = tuple(bool(x) for x in pattern[:L])
    elif window and pattern:
        n_pattern = int(pattern)
        swa_layers = tuple(i % n_pattern < n_pattern - 1 for i in range(L))

    has = tensors.__contains__
    qkv_bias = has("blk.0.attn_q.bias") or has("blk.0.attn_qkv.bias")
    qk_norm = has("blk.0.attn_q_norm.weight")
    tie = not has("output.weight")
    moe: dict[str, Any] = {}
    if arch == "qwen3moe":
        moe = dict(
            n_experts=key("expert_count"),
            n_experts_used=key("expert_used_count"),
            expert_ffn_dim=key("expert_feed_forward_length"),
            norm_topk_prob=True,  # llama.cpp's qwen3moe graph always renormalises
        )
    with file_error(path, "invalid model hyper-parameters"):
        config = ModelConfig(
            arch=arch,
            vocab_size=V,
            dim=D,
            n_layers=L,
            n_heads=H,
            n_kv_heads=G,
            ffn_dim=key("feed_forward_length", moe.get("expert_ffn_dim", ...)),
            head_dim=0 if (H and D % H == 0 and E == D // H) else E,
            rope_theta=key("rope.freq_base", 10000.0, _f32),
            norm_eps=key("attention.layer_norm_rms_epsilon", cast=_f32),
            tie_embeddings=tie,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            sliding_window=window,
            swa_layers=swa_layers,
            max_position=key("context_length"),
            dtype=dtype or _config_dtype(tensors),
            **gemma,
            **moe,
        )

    used: set[str] = set()
    half_params = False

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ModelFileError(f"{path}: missing tensor {name}")
        used.add(name)
        arr = _tensor_to_numpy(path, tensors[name], keep_f16=half_params)
        if arr.shape != shape:
            raise ModelFileError(
                f"{path}: tensor {name} has shape {arr.shape} (numpy order), expected {shape}"
            )
        return arr

    if "rope_freqs.weight" in tensors:
        factors = get("rope_freqs.weight", (E // 2,))
        hint = None
        if f"{_SPECJAX_ROPE}factor" in fields:
            hint = RopeScaling(
                factor=_f32(fields[f"{_SPECJAX_ROPE}factor"]),
                low_freq_factor=_f32(fields[f"{_SPECJAX_ROPE}low_freq_factor"]),
                high_freq_factor=_f32(fields[f"{_SPECJAX_ROPE}high_freq_factor"]),
                original_max_position=int(fields[f"{_SPECJAX_ROPE}original_max_position"]),
            )
        if hint is not None and _factors_match(_replace_scaling(config, hint), factors):
            config = _replace_scaling(config, hint)  # a specjax-written llama3 scaling
        else:
            config = dataclasses.replace(
                config, rope_factors=rope_factors_from_tensor(path, factors)
            )

    np_dtype = jnp.dtype(config.dtype)
    half_params = np_dtype == np.float16  # from here on, F16 tensors stay as stored
    H_E, G_E = H * E, G * E
    permute = arch == "llama"
    layers = []
    for i in range(L):
        p = f"blk.{i}."
        if has(p + "attn_qkv.weight"):
            qkv = get(p + "attn_qkv.weight", (H_E + 2 * G_E, D))
            q, k, v = qkv[:H_E], qkv[H_E : H_E + G_E], qkv[H_E + G_E :]
        else:
            q = get(p + "attn_q.weight", (H_E, D))
            k = get(p + "attn_k.weight", (G_E, D))
            v = get(p + "attn_v.weight", (G_E, D))
        if permute:
            q, k = unpermute_qk(q, H), unpermute_qk(k, G)
        layer = {
            "attn_norm": get(p + "attn_norm.weight", (D,)),
            "wqkv": np.concatenate([q, k, v], axis=0),
            "wo": get(p + "attn_output.weight", (D, H_E)),
            "ffn_norm": get(p + "ffn_norm.weight", (D,)),
        }
        if config.is_moe_layer(i):
            X, F_x = config.n_experts, config.expert_ffn_dim
            layer["router"] = get(p + "ffn_gate_inp.weight", (X, D))
            gate_up = np.concatenate(
                [
                    get(p + "ffn_gate_exps.weight", (X, F_x, D)),
                    get(p + "ffn_up_exps.weight", (X, F_x, D)),
                ],
                axis=1,
            )  # [X, 2F', D], then input-major
            layer["experts_gate_up"] = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
            down = get(p + "ffn_down_exps.weight", (X, D, F_x))
            layer["experts_down"] = np.ascontiguousarray(down.transpose(0, 2, 1))
        else:
            layer["w_gate_up"] = np.concatenate(
                [get(p + "ffn_gate.weight", (config.F, D)), get(p + "ffn_up.weight", (config.F, D))]
            )
            layer["w_down"] = get(p + "ffn_down.weight", (D, config.F))
        if qkv_bias:
            if has(p + "attn_qkv.bias"):
                b = get(p + "attn_qkv.bias", (H_E + 2 * G_E,))
                bq, bk, bv = b[:H_E], b[H_E : H_E + G_E], b[H_E + G_E :]
            else:
                bq = get(p + "attn_q.bias", (H_E,))
                bk = get(p + "attn_k.bias", (G_E,))
                bv = get(p + "attn_v.bias", (G_E,))
            if permute:
                bq, bk = unpermute_qk(bq, H), unpermute_qk(bk, G)
            layer["bqkv"] = np.concatenate([bq, bk, bv])
        if qk_norm:
            layer["q_norm"] = get(p + "attn_q_norm.weight", (E,))
            layer["k_norm"] = get(p + "attn_k_norm.weight", (E,))
        if arch == "gemma3":  # (norms stored with Gemma3RMSNorm's 1 added, as specjax's)
            layer["post_attn_norm"] = get(p + "post_attention_norm.weight", (D,))
            layer["post_ffn_norm"] = get(p + "post_ffw_norm.weight", (D,))
        layers.append({n: _on_device(a, np_dtype) for n, a in layer.items()})

    params: Params = {
        "embed": _on_device(get("token_embd.weight", (V, D)), np_dtype),
        "layers": tuple(layers),
        "final_norm": _on_device(get("output_norm.weight", (D,)), np_dtype),
    }
    if not tie:
        params["lm_head"] = _on_device(get("output.weight", (V, D)), np_dtype)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ModelFileError(
            f"{path}: tensors specjax's {arch} model has no slot for: {', '.join(unused[:8])}"
            + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        )
    with file_error(path, "invalid tokenizer metadata"):
        tokenizer = Tokenizer.from_gguf_fields(fields, source=path)
    return config, params, tokenizer


# --------------------------------------------------------------------------- saving
def _validate_for_gguf(config: ModelConfig) -> None:
    if config.arch == "gemma3":
        raise ValueError("saving a gemma3 model as GGUF is not supported (only loading)")
    if config.arch == "llama" and config.qk_norm:
        raise ValueError("llama.cpp's llama architecture has no q/k norm; use arch='qwen3'")
    if config.arch == "qwen2":
        if config.qk_norm:
            raise ValueError("llama.cpp's qwen2 architecture has no q/k norm; use arch='qwen3'")
        if config.H * config.E != config.D:
            raise ValueError(
                f"llama.cpp's qwen2 needs n_heads * head_dim == dim, got {config.H} * "
                f"{config.E} != {config.D}"
            )
    if config.arch in ("qwen3", "qwen3moe") and not config.qk_norm:
        raise ValueError(f"llama.cpp's {config.arch} architecture requires q/k norm (qk_norm=True)")
    if config.arch == "qwen3moe":
        if not config.norm_topk_prob:
            raise ValueError(
                "llama.cpp's qwen3moe always renormalises the top-k router weights; "
                "norm_topk_prob=False cannot be stored"
            )
        if config.moe_layers and not all(config.moe_layers):
            raise ValueError("llama.cpp's qwen3moe has experts in every layer (moe_layers)")
    if (config.rope_scaling is not None or config.rope_factors) and config.arch != "llama":
        raise ValueError(
            f"RoPE frequency factors can only be stored for arch 'llama' in GGUF (llama.cpp's "
            f"{config.arch} reads no rope_freqs), not {config.arch!r}"
        )


def _encode_tensor(arr: np.ndarray, dtype: str) -> tuple[np.ndarray, QT | None]:
    arr = np.asarray(arr, np.float32)
    if arr.ndim == 1 or dtype == "f32":
        return arr, None
    if dtype == "q8_0" and arr.shape[-1] % 32 == 0:
        return gguf.quants.quantize(arr, QT.Q8_0), QT.Q8_0
    if dtype == "bf16":
        return gguf.quants.quantize(arr, QT.BF16), QT.BF16
    return arr.astype(np.float16), None


_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama_ftype


@contextlib.contextmanager
def atomic_gguf_writer(path: str | os.PathLike[str], arch: str) -> Iterator[gguf.GGUFWriter]:
    """A GGUFWriter on a temp file beside `path`: after the `with` body adds metadata and
    tensors, the file is written, closed and `os.replace`d onto `path` (mode 0644); on any
    error the temp file is removed and an existing `path` is left untouched."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
        os.chmod(path, 0o644)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class TensorAdder(Protocol):
    """`add(name, arr, f32=False)`: writes `arr` in the save dtype (1-D and `f32`: F32)."""

    def __call__(self, name: str, arr: Any, f32: bool = False) -> None: ...


def tensor_adder(w: gguf.GGUFWriter, dtype: str) -> TensorAdder:
    """The `TensorAdder` of a file saved in `dtype` (one of SAVE_DTYPES)."""

    def add(name: str, arr: Any, f32: bool = False) -> None:
        data, raw = _encode_tensor(np.asarray(arr, np.float32), "f32" if f32 else dtype)
        w.add_tensor(name, data, raw_dtype=raw)

    return add


def write_hparams(
    w: gguf.GGUFWriter, config: Any, name: str, block_count: int, rope_dims: int
) -> None:
    """The keys every architecture here writes (`config`: a model or head config with
    `max_position`, `rope_theta`, `norm_eps` and the dimension keys D, F, H, G, E): name,
    context, widths, block count, head counts and dims, RoPE dimension count and base, RMS-norm
    epsilon."""
    w.add_name(name)
    w.add_context_length(config.max_position)
    w.add_embedding_length(config.D)
    w.add_block_count(block_count)
    w.add_feed_forward_length(config.F)
    w.add_head_count(config.H)
    w.add_head_count_kv(config.G)
    w.add_key_length(config.E)
    w.add_value_length(config.E)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.norm_eps)


def add_d2t(w: gguf.GGUFWriter, d2t: Array) -> None:
    """The draft-to-target id table as llama.cpp reads it (I64 absolute target ids)."""
    w.add_tensor("d2t", np.asarray(d2t, np.int64), raw_dtype=QT.I64)


class _SavedConfig(Protocol):
    @property
    def V(self) -> int: ...


ConfigT = TypeVar("ConfigT", bound=_SavedConfig)
ConfigT_contra = TypeVar("ConfigT_contra", bound=_SavedConfig, contravariant=True)


class GGUFSave(Protocol[ConfigT_contra]):
    """`save(path, config, params, tokenizer, dtype)`: a format's save function (`gguf_saver`)."""

    def __call__(
        self,
        path: str | os.PathLike[str],
        config: ConfigT_contra,
        params: Params,
        tokenizer: Tokenizer,
        dtype: str = ...,
    ) -> None: ...


def gguf_saver(
    arch: str | Callable[[ConfigT], str],
    write: Callable[[gguf.GGUFWriter, TensorAdder, ConfigT, Params], None],
    check: Callable[[ConfigT, Params], None],
    vocabulary: str,
    dtype: str,
) -> GGUFSave[ConfigT]:
    """The save function of a GGUF format, `save(path, config, params, tokenizer, dtype)` with
    `write`'s docstring, `dtype` its default.

    Before anything is written it raises ValueError for a dtype not in SAVE_DTYPES, parameters
    `check` refuses, or a tokenizer larger than the vocabulary `vocabulary` names ("the model
    vocabulary"). It then writes `path` atomically (`atomic_gguf_writer`) as architecture
    `arch` (a function of the config for a format of several): the file type, what
    `write(w, add, config, params)` adds (`add`: a `TensorAdder` in the save dtype), and the
    tokenizer's metadata for a vocabulary of `config.V`."""
    default_dtype = dtype

    def save(
        path: str | os.PathLike[str],
        config: ConfigT,
        params: Params,
        tokenizer: Tokenizer,
        dtype: str = default_dtype,
    ) -> None:
        if dtype not in SAVE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
        check(config, params)
        if tokenizer.vocab_size > config.V:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens but {vocabulary} is {config.V}"
            )
        with atomic_gguf_writer(path, arch if isinstance(arch, str) else arch(config)) as w:
            w.add_file_type(_FILE_TYPE[dtype])
            write(w, tensor_adder(w, dtype), config, params)
            tokenizer.write_gguf_metadata(w, config.V)

    save.__doc__, save.__module__ = write.__doc__, write.__module__
    return save


def _check_savable(config: ModelConfig, params: Params) -> None:
    """ValueError for a config llama.cpp's architecture cannot hold or params it does not
    describe."""
    _validate_for_gguf(config)
    check_params(config, params)


def _write_model(w: gguf.GGUFWriter, add: TensorAdder, config: ModelConfig, params: Params) -> None:
    """Write a GGUF file llama.cpp loads; `dtype` (see SAVE_DTYPES) applies to 2-D weights."""
    write_hparams(w, config, "specjax", config.L, config.E)
    w.add_vocab_size(config.V)
    if config.n_experts:
        w.add_expert_count(config.n_experts)
        w.add_expert_used_count(config.n_experts_used)
        w.add_expert_feed_forward_length(config.expert_ffn_dim)
    if config.sliding_window > 0:
        w.add_sliding_window(config.sliding_window)
        if config.swa_layers:
            w.add_sliding_window_pattern([bool(x) for x in config.swa_layers])
    if config.rope_scaling is not None:
        s = config.rope_scaling
        w.add_float32(_SPECJAX_ROPE + "factor", s.factor)
        w.add_float32(_SPECJAX_ROPE + "low_freq_factor", s.low_freq_factor)
        w.add_float32(_SPECJAX_ROPE + "high_freq_factor", s.high_freq_factor)
        w.add_uint32(_SPECJAX_ROPE + "original_max_position", s.original_max_position)

    add("token_embd.weight", params["embed"])
    add("output_norm.weight", params["final_norm"])
    if not config.tie_embeddings:
        add("output.weight", params["lm_head"])
    if config.rope_scaling is not None or config.rope_factors:
        add("rope_freqs.weight", llama3_factors(config))
    permute = config.arch == "llama"
    for i, layer in enumerate(params["layers"]):
        p = f"blk.{i}."
        parts = split_layer(config, layer)
        q, k = parts["q"], parts["k"]
        if permute:
            q, k = permute_qk(np.asarray(q), config.H), permute_qk(np.asarray(k), config.G)
        add(p + "attn_norm.weight", layer["attn_norm"])
        add(p + "attn_q.weight", q)
        add(p + "attn_k.weight", k)
        add(p + "attn_v.weight", parts["v"])
        if config.qkv_bias:
            bq, bk = parts["q_bias"], parts["k_bias"]
            if permute:
                bq, bk = (
                    permute_qk(np.asarray(bq), config.H),
                    permute_qk(np.asarray(bk), config.G),
                )
            add(p + "attn_q.bias", bq)
            add(p + "attn_k.bias", bk)
            add(p + "attn_v.bias", parts["v_bias"])
        if config.qk_norm:
            add(p + "attn_q_norm.weight", layer["q_norm"])
            add(p + "attn_k_norm.weight", layer["k_norm"])
        add(p + "attn_output.weight", layer["wo"])
        add(p + "ffn_norm.weight", layer["ffn_norm"])
        if config.is_moe_layer(i):
            gate_up, F_x = np.asarray(layer["experts_gate_up"]), config.expert_ffn_dim
            add(p + "ffn_gate_inp.weight", layer["router"], f32=True)
            gate_up = gate_up.transpose(0, 2, 1)  # [X, 2F', D] as GGUF stores them
            add(p + "ffn_gate_exps.weight", gate_up[:, :F_x])
            add(p + "ffn_up_exps.weight", gate_up[:, F_x:])
            add(p + "ffn_down_exps.weight", np.asarray(layer["experts_down"]).transpose(0, 2, 1))
            continue
        add(p + "ffn_gate.weight", parts["gate"])
        add(p + "ffn_up.weight", parts["up"])
        add(p + "ffn_down.weight", layer["w_down"])


save_gguf = gguf_saver(
    operator.attrgetter("arch"), _write_model, _check_savable, "the model vocabulary", "f32"
)
