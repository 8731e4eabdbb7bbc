"""A float64 NumPy transcription of a Qwen3-MoE decoder (transformers' Qwen3MoeForCausalLM), one
row at explicit positions, written independently of specjax's model code.

The MoE block follows transformers' Qwen3MoeSparseMoeBlock statement by statement: router
logits, softmax, the top k by a full sort (ties to the lower index, as `torch.topk` and
`lax.top_k` break them), optional renormalisation, then a loop over the experts that the
tokens hit, each expert's output scaled by its token's weight and added to that token's row.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def moe_block(config: Any, layer: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """The MoE FFN of `h` [T, D] (float64)."""
    logits = h @ layer["router"].T  # [T, X]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k = config.n_experts_used
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, k]
    weights = np.take_along_axis(probs, chosen, -1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    F = config.expert_ffn_dim
    out = np.zeros_like(h)
    for expert in range(config.n_experts):
        rows, slots = np.nonzero(chosen == expert)
        if rows.size == 0:
            continue
        # specjax's experts are input-major: [D, 2F'] and [F', D]
        gate_up = h[rows] @ layer["experts_gate_up"][expert]
        y = (_silu(gate_up[:, :F]) * gate_up[:, F:]) @ layer["experts_down"][expert]
        out[rows] += y * weights[rows, slots][:, None]
    return out


def forward(config: Any, params: Any, tokens: list[int], positions: list[int]) -> np.ndarray:
    """[T] tokens at [T] positions (causal by position) -> [T, V] float64 logits."""
    import jax

    from specjax.models.config import rope_frequencies

    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tok = np.asarray(tokens)
    pos = np.asarray(positions, np.float64)
    E, H, G, eps = config.E, config.H, config.G, config.norm_eps
    inv = np.asarray(rope_frequencies(config))

    def rope(x: np.ndarray) -> np.ndarray:  # [T, heads, E], rotate-half
        angle = pos[:, None, None] * inv[None, None, :]
        x1, x2 = x[..., : E // 2], x[..., E // 2 :]
        c, s = np.cos(angle), np.sin(angle)
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    T = len(tok)
    x = P["embed"][tok]
    mask = pos[None, :] <= pos[:, None]
    for i, layer in enumerate(P["layers"]):
        h = _norm(x, layer["attn_norm"], eps)
        qkv = h @ layer["wqkv"].T
        q = _norm(qkv[:, : H * E].reshape(T, H, E), layer["q_norm"], eps)
        k = _norm(qkv[:, H * E : (H + G) * E].reshape(T, G, E), layer["k_norm"], eps)
        v = qkv[:, (H + G) * E :].reshape(T, G, E)
        q, k = rope(q), rope(k)
        heads = []
        for hd in range(H):
            g = hd // (H // G)
            scores = np.where(mask, q[:, hd] @ k[:, g].T / math.sqrt(E), -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ v[:, g])
        x = x + np.concatenate(heads, -1) @ layer["wo"].T
        h = _norm(x, layer["ffn_norm"], eps)
        if config.is_moe_layer(i):
            x = x + moe_block(config, layer, h)
        else:
            gu = h @ layer["w_gate_up"].T
            x = x + (_silu(gu[:, : config.F]) * gu[:, config.F :]) @ layer["w_down"].T
    head = P["embed"] if config.tie_embeddings else P["lm_head"]
    return _norm(x, P["final_norm"], eps) @ head.T
