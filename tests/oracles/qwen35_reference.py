"""float64 NumPy transcription of llama.cpp's qwen35 forward, one token at a time.

Written from llama.cpp's src/models/qwen35.cpp, delta-net-base.cpp and the CPU gated-delta-net
and rope ops (ggml-cpu/ops.cpp), loop by loop, independent of specjax's JAX code: the conv is
an explicit ring of the last d_conv - 1 inputs, the delta rule runs per head with the state
stored as ggml stores it (s[h][j][i], j = value index, i = key index), and attention keeps a
plain list of past keys/values. One sequence at a time.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.exp(x))


def _rope_theta(cfg: Any, pos: int) -> np.ndarray:
    """ggml_mrope_cache_init for IMROPE with text positions (t = h = w = pos, e = 0)."""
    n_dims = cfg.n_rot
    sections = cfg.sections
    sect_dims = sum(sections)
    theta_scale = cfg.rope_theta ** (-2.0 / n_dims)
    theta_t = theta_h = theta_w = float(pos)
    theta_e = 0.0
    out = []
    for i0 in range(0, n_dims, 2):
        sector = (i0 // 2) % sect_dims
        if sector % 3 == 1 and sector < 3 * sections[1]:
            theta = theta_h
        elif sector % 3 == 2 and sector < 3 * sections[2]:
            theta = theta_w
        elif sector % 3 == 0 and sector < 3 * sections[0]:
            theta = theta_t
        else:
            theta = theta_e
        out.append(theta)
        theta_t *= theta_scale
        theta_h *= theta_scale
        theta_w *= theta_scale
        theta_e *= theta_scale
    return np.asarray(out)


def _rope(x: np.ndarray, cfg: Any, pos: int) -> np.ndarray:
    """rotate_pairs(n_dims, n_dims / 2): element i pairs with i + n_dims / 2."""
    out = x.copy()
    theta = _rope_theta(cfg, pos)
    half = cfg.n_rot // 2
    for i in range(half):
        c, s = math.cos(theta[i]), math.sin(theta[i])
        x0, x1 = x[..., i], x[..., i + half]
        out[..., i] = x0 * c - x1 * s
        out[..., i + half] = x0 * s + x1 * c
    return out


class Reference:
    """Feeds one sequence token by token; `step` returns that token's logits."""

    def __init__(self, cfg: Any, params: Any):
        self.cfg = cfg
        f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
        self.p = {k: f64(v) for k, v in params.items() if k not in ("layers", "nextn")}
        self.layers = [{k: f64(v) for k, v in layer.items()} for layer in params["layers"]]
        C = cfg.conv_dim
        self.conv = {i: np.zeros((cfg.ssm_conv_kernel - 1, C)) for i in cfg.recurrent_layers}
        self.state = {i: np.zeros((cfg.Hv, cfg.S, cfg.S)) for i in cfg.recurrent_layers}
        self.keys: dict[int, list[np.ndarray]] = {i: [] for i in cfg.attention_layers}
        self.values: dict[int, list[np.ndarray]] = {i: [] for i in cfg.attention_layers}

    def _delta(self, i: int, layer: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        S, Hk, Hv, eps = cfg.S, cfg.Hk, cfg.Hv, cfg.norm_eps
        qkv = layer["w_qkv"] @ h
        z = layer["w_z"] @ h
        beta = _sigmoid(layer["w_beta"] @ h)
        g = _softplus(layer["w_alpha"] @ h + layer["dt_bias"]) * layer["a"]
        window = np.concatenate([self.conv[i], qkv[None, :]], axis=0)  # [d_conv, C]
        conv = np.einsum("kc,ck->c", window, layer["conv"])
        self.conv[i] = window[1:]
        conv = _silu(conv)
        kd = Hk * S
        q = conv[:kd].reshape(Hk, S)
        k = conv[kd : 2 * kd].reshape(Hk, S)
        v = conv[2 * kd :].reshape(Hv, S)
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + eps)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + eps)
        out = np.zeros((Hv, S))
        s = self.state[i]
        for hv in range(Hv):
            qh, kh = q[hv % Hk], k[hv % Hk]
            st = s[hv] * math.exp(g[hv])  # st[j, i]
            delta = (v[hv] - st @ kh) * beta[hv]
            st = st + np.outer(delta, kh)
            s[hv] = st
            out[hv] = (st @ qh) / math.sqrt(S)
        normed = _rms(out, layer["ssm_norm"], eps) * _silu(z.reshape(Hv, S))
        return layer["ssm_out"] @ normed.reshape(-1)

    def _attn(self, i: int, layer: dict[str, np.ndarray], h: np.ndarray, pos: int) -> np.ndarray:
        cfg = self.cfg
        H, G, E, eps = cfg.H, cfg.G, cfg.E, cfg.norm_eps
        qg = (layer["wq"] @ h).reshape(H, 2 * E)
        q, gate = qg[:, :E], qg[:, E:].reshape(-1)
        k = (layer["wk"] @ h).reshape(G, E)
        v = (layer["wv"] @ h).reshape(G, E)
        q = _rope(_rms(q, layer["q_norm"], eps), cfg, pos)
        k = _rope(_rms(k, layer["k_norm"], eps), cfg, pos)
        self.keys[i].append(k)
        self.values[i].append(v)
        K = np.stack(self.keys[i])  # [n, G, E]
        Vv = np.stack(self.values[i])
        out = np.zeros((H, E))
        for hh in range(H):
            gi = hh // (H // G)
            scores = K[:, gi, :] @ q[hh] / math.sqrt(E)
            w = np.exp(scores - scores.max())
            w /= w.sum()
            out[hh] = w @ Vv[:, gi, :]
        out = out.reshape(-1) * _sigmoid(gate)
        return layer["wo"] @ out

    def step(self, token: int, pos: int) -> np.ndarray:
        cfg = self.cfg
        x = self.p["embed"][token].copy()
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer["attn_norm"], cfg.norm_eps)
            if cfg.is_recurrent(i):
                x = x + self._delta(i, layer, h)
            else:
                x = x + self._attn(i, layer, h, pos)
            h = _rms(x, layer["post_norm"], cfg.norm_eps)
            ff = _silu(layer["w_gate"] @ h) * (layer["w_up"] @ h)
            x = x + layer["w_down"] @ ff
        x = _rms(x, self.p["final_norm"], cfg.norm_eps)
        self.h_nextn = x  # llama.cpp's t_h_nextn: the final-normed hidden (MTP input)
        head = self.p["embed"] if cfg.tie_embeddings else self.p["lm_head"]
        return head @ x
