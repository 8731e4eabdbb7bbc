"""Plain-Python (float64 NumPy) transcription of llama.cpp's draft-dflash / draft-dspark
(spec 5.4: `common_speculative_impl_draft_dflash` in common/speculative.cpp, the graphs of
src/models/dflash.cpp), no JAX.

The draft memory of a sequence is a dict `pos -> (K per layer, V per layer)`, as the KV
cells llama.cpp writes for the embedding batch of `process` (KV injection). `draft` builds
the noise block exactly as upstream (block size from the clamped `params.n_max`), runs the
token-batch graph with non-causal attention over the sequence's cells and the block, adds
the DSpark Markov bias / confidence, and reads the draft with upstream's host loop. The
block's own cells are removed by the caller right after (`seq_rm(draft, pos_max + 1, -1)`),
so they are never stored here.
"""

from __future__ import annotations

import numpy as np


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """NeoX RoPE of one row [heads, E]: pairs (i, i + E/2)."""
    E = x.shape[-1]
    half = E // 2
    inv = theta ** (-np.arange(0, E, 2, dtype=np.float64) / E)
    ang = pos * inv
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + np.exp(-x))


class DFlashRef:
    def __init__(self, cfg, params, shared, n_seq: int, dspark: bool, n_max: int, n_min: int):
        self.cfg = cfg
        self.p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "layers"}
        self.layers = [
            {k: np.asarray(v, np.float64) for k, v in lay.items()} for lay in params["layers"]
        ]
        self.embed = np.asarray(params["embed"] if cfg.own_embed else shared["embed"], np.float64)
        self.head = np.asarray(
            params["lm_head"] if cfg.own_lm_head else shared["lm_head"], np.float64
        )
        self.d2t = np.asarray(params["d2t"]) if "d2t" in params else None
        self.mem: list[dict[int, tuple[list[np.ndarray], list[np.ndarray]]]] = [
            {} for _ in range(n_seq)
        ]
        self.is_dspark = dspark
        self.sample_from_anchor = cfg.sample_from_anchor
        # the constructor's clamp
        n_draft_max = cfg.block_size if dspark and self.sample_from_anchor else cfg.block_size - 1
        self.warned = n_max > n_draft_max or n_min > n_draft_max
        self.n_max = min(n_max, n_draft_max)
        self.n_min = min(n_min, n_draft_max)
        self.last_logits: dict[int, np.ndarray] = {}
        self.last_conf: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ memory
    def seq_rm(self, seq: int, p0: int) -> None:
        self.mem[seq] = {p: c for p, c in self.mem[seq].items() if p < p0}

    # ----------------------------------------------------------------- process
    def process(self, rows: list[tuple[int, int, int, np.ndarray]]) -> None:
        """`rows`: the target batch as (token, pos, seq, features interleaved per layer)."""
        cfg = self.cfg
        H, G, E = cfg.H, cfg.G, cfg.E
        for _tok, pos, seq, f in rows:
            x = self.p["fc"] @ np.asarray(f, np.float64)
            if "fc_scale" in self.p:
                x = x * self.p["fc_scale"][0]
            g = _rms(x, self.p["enc_norm"], cfg.norm_eps)
            ks, vs = [], []
            for lay in self.layers:
                w = lay["wqkv"]
                k = (w[H * E : (H + G) * E] @ g).reshape(G, E)
                v = (w[(H + G) * E :] @ g).reshape(G, E)
                k = _rms(k, lay["k_norm"], cfg.norm_eps)
                ks.append(_rope_neox(k, pos, cfg.rope_theta))
                vs.append(v)
            self.mem[seq][pos] = (ks, vs)

    # ------------------------------------------------------------------- graph
    def _block(self, seq: int, tokens: list[int], n_past: int) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        H, G, E = cfg.H, cfg.G, cfg.E
        W = len(tokens)
        x = self.embed[tokens]
        ctx = sorted(self.mem[seq].items())
        for li, lay in enumerate(self.layers):
            h = _rms(x, lay["attn_norm"], cfg.norm_eps)
            out = np.zeros((W, H * E))
            qs, ks, vs = [], [], []
            for j in range(W):
                qkv = lay["wqkv"] @ h[j]
                q = _rms(qkv[: H * E].reshape(H, E), lay["q_norm"], cfg.norm_eps)
                k = _rms(qkv[H * E : (H + G) * E].reshape(G, E), lay["k_norm"], cfg.norm_eps)
                qs.append(_rope_neox(q, n_past + j, cfg.rope_theta))
                ks.append(_rope_neox(k, n_past + j, cfg.rope_theta))
                vs.append(qkv[(H + G) * E :].reshape(G, E))
            keys = [c[0][li] for _, c in ctx] + ks  # no causal mask: every key is visible
            vals = [c[1][li] for _, c in ctx] + vs
            for j in range(W):
                for hh in range(H):
                    gi = hh // (H // G)
                    s = np.array([qs[j][hh] @ k[gi] for k in keys]) / np.sqrt(E)
                    pr = np.exp(s - s.max())
                    pr /= pr.sum()
                    out[j, hh * E : (hh + 1) * E] = sum(p * v[gi] for p, v in zip(pr, vals))
            x = x + out @ lay["wo"].T
            h = _rms(x, lay["ffn_norm"], cfg.norm_eps)
            gu = h @ lay["w_gate_up"].T
            gate, up = gu[:, : cfg.F], gu[:, cfg.F :]
            x = x + (gate / (1 + np.exp(-gate)) * up) @ lay["w_down"].T
        hn = _rms(x, self.p["final_norm"], cfg.norm_eps)
        logits = hn @ self.head.T
        if self.d2t is not None:
            full = np.full((W, cfg.V), -np.inf)
            full[:, self.d2t] = logits
            logits = full
        conf = np.zeros(W)
        if "markov_w1" in self.p:  # build_dspark_markov_head
            w1, w2 = self.p["markov_w1"], self.p["markov_w2"]
            beg = 0 if self.sample_from_anchor else 1
            prev = tokens[0]
            for i in range(beg, W):
                w1_prev = w1[prev]
                bias = w2 @ w1_prev
                if "markov_w2_scale" in self.p:
                    bias = bias * self.p["markov_w2_scale"][0]
                if self.d2t is not None:
                    full = np.zeros(cfg.V)
                    full[self.d2t] = bias
                    bias = full
                logits[i] = logits[i] + bias
                if "conf_proj" in self.p:
                    feat = np.concatenate([hn[i], w1_prev])
                    conf[i] = _sigmoid(self.p["conf_proj"][0] @ feat + self.p["conf_proj_b"][0])
                if i + 1 < W:
                    prev = int(np.argmax(logits[i]))
        return logits, conf

    # ------------------------------------------------------------------- draft
    @staticmethod
    def _top(logits_row: np.ndarray) -> tuple[int, float]:
        """top-k 10 sampler at T=1: the top candidate and its probability."""
        idx = np.argsort(-logits_row, kind="stable")[:10]
        vals = logits_row[idx]
        pr = np.exp(vals - vals.max())
        pr /= pr.sum()
        return int(idx[0]), float(pr[0])

    def draft(self, seq: int, id_last: int, n_past: int, p_min: float, mask: int) -> list[int]:
        n_block = self.n_max + (0 if self.is_dspark and self.sample_from_anchor else 1)
        tokens = [id_last if i == 0 else mask for i in range(n_block)]
        logits, conf = self._block(seq, tokens, n_past)
        self.last_logits[seq], self.last_conf[seq] = logits, conf
        result: list[int] = []
        if self.is_dspark:
            beg = 0 if self.sample_from_anchor else 1
            for i in range(beg, n_block):
                if p_min > 0.0 and conf[i] < p_min:
                    break
                tok, _ = self._top(logits[i])
                result.append(tok)
        else:
            for i in range(1, n_block):
                tok, p = self._top(logits[i])
                if p < p_min:
                    break
                result.append(tok)
        if len(result) < self.n_min:
            result = []
        return result
