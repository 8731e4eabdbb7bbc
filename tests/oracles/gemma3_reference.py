"""Float64 NumPy statement of transformers' Gemma3ForCausalLM forward (modeling_gemma3.py),
no JAX: from a config.json dictionary and the checkpoint's tensors by their Hugging Face
names, in Hugging Face's own conventions (RMSNorm by (1 + w), q/k/v/o and gate/up/down
projections `[out, in]`, rotate-half RoPE).

One sequence at positions 0..T-1, causal, every layer over the whole sequence: a
`sliding_attention` layer sees keys at q - sliding_window < k <= q (transformers'
`sliding_window_overlay`), with `rope_local_base_freq` (or rope_parameters'
sliding_attention theta) and no scaling; a `full_attention` layer uses `rope_theta` with its
rope scaling (`linear`: positions / factor). Scores are scaled by query_pre_attn_scalar**-0.5,
the MLP is gelu(tanh approximation)(gate) * up, logits soft-capped by final_logit_softcapping
when set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _rope(x: np.ndarray, positions: np.ndarray, theta: float, factor: float) -> np.ndarray:
    """x [T, heads, E] rotated at `positions` (rotate half; inverse frequencies / factor)."""
    E = x.shape[-1]
    inv = theta ** (-np.arange(0, E, 2, dtype=np.float64) / E) / factor
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # [T, E/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : E // 2], x[..., E // 2 :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def layer_types(hf: Mapping[str, Any]) -> list[str]:
    L = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    n = int(hf.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(L)]


def _rope_params(hf: Mapping[str, Any]) -> tuple[float, float, float]:
    """(global theta, global linear factor, local theta)."""
    rp = hf.get("rope_parameters") or {}
    if "full_attention" in rp:
        full, local = rp["full_attention"], rp.get("sliding_attention", {})
        factor = float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0
        return float(full["rope_theta"]), factor, float(local.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or {}
    factor = float(scaling.get("factor", 1.0)) if scaling.get("rope_type") == "linear" else 1.0
    return (
        float(hf.get("rope_theta", 1e6)),
        factor,
        float(hf.get("rope_local_base_freq", 10000.0)),
    )


def forward(hf: Mapping[str, Any], tensors: Mapping[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits [T, V] (float64) of `ids` at positions 0..T-1."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    D, H = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    G = int(hf.get("num_key_value_heads", H))
    E = int(hf.get("head_dim", D // H))
    eps = float(hf.get("rms_norm_eps", 1e-6))
    window = int(hf.get("sliding_window") or 0)
    scale = float(hf.get("query_pre_attn_scalar", E)) ** -0.5
    theta, factor, theta_local = _rope_params(hf)
    kinds = layer_types(hf)
    T = len(ids)
    pos = np.arange(T)
    x = t["model.embed_tokens.weight"][ids] * math.sqrt(D)
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = _rms(x, t[p + "input_layernorm.weight"], eps)
        q = (h @ t[a + "q_proj.weight"].T).reshape(T, H, E)
        k = (h @ t[a + "k_proj.weight"].T).reshape(T, G, E)
        v = (h @ t[a + "v_proj.weight"].T).reshape(T, G, E)
        q = _rms(q, t[a + "q_norm.weight"], eps)
        k = _rms(k, t[a + "k_norm.weight"], eps)
        sliding = kind == "sliding_attention"
        th, f = (theta_local, 1.0) if sliding else (theta, factor)
        q, k = _rope(q, pos, th, f), _rope(k, pos, th, f)
        visible = pos[None, :] <= pos[:, None]
        if sliding and window:
            visible &= pos[:, None] - pos[None, :] < window
        out = np.zeros((T, H, E))
        for head in range(H):
            g = head // (H // G)
            s = (q[:, head] @ k[:, g].T) * scale
            s = np.where(visible, s, -np.inf)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, head] = (w / w.sum(axis=-1, keepdims=True)) @ v[:, g]
        o = out.reshape(T, H * E) @ t[a + "o_proj.weight"].T
        x = x + _rms(o, t[p + "post_attention_layernorm.weight"], eps)
        h = _rms(x, t[p + "pre_feedforward_layernorm.weight"], eps)
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        up = h @ t[p + "mlp.up_proj.weight"].T
        m = (_gelu_tanh(gate) * up) @ t[p + "mlp.down_proj.weight"].T
        x = x + _rms(m, t[p + "post_feedforward_layernorm.weight"], eps)
    x = _rms(x, t["model.norm.weight"], eps)
    head_w = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    logits = x @ head_w.T
    cap = hf.get("final_logit_softcapping")
    if cap:
        logits = cap * np.tanh(logits / cap)
    return logits
