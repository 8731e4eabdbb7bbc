"""float64 NumPy transcription of llama.cpp's qwen35 `graph_mtp` (src/models/qwen35.cpp), one
row at a time, and of upstream's draft-mtp drafting loop (common/speculative.cpp), independent
of specjax's JAX code.

    e = rms(embed(x), enorm); hn = rms(h, hnorm); cur = eh_proj @ [e; hn]
    cur += wo @ (attention(rms(cur, attn_norm)) * sigmoid(gate))   (own key/value list)
    cur += w_down @ (silu(w_gate @ f) * (w_up @ f)),  f = rms(cur, post_norm)
    h' = rms(cur, shared_head_norm or output_norm); logits = (shared_head_head or output) @ h'
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from oracles.qwen35_reference import _rms, _rope, _sigmoid, _silu


class MtpReference:
    """One nextn block with its own keys/values (a plain list per position)."""

    def __init__(self, cfg: Any, params: Any, block: int = 0):
        f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
        self.cfg = cfg
        b = {k: f64(v) for k, v in params["nextn"][block].items()}
        self.b = b
        self.embed = b.get("embed_tokens", f64(params["embed"]))
        self.head_norm = b.get("shared_head_norm", f64(params["final_norm"]))
        trunk_head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
        self.head = b.get("shared_head_head", f64(trunk_head))
        self.cells: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # pos -> (k [G, E], v)

    def truncate(self, keep: int) -> None:
        """seq_rm(keep, -1): drop cells at positions >= keep."""
        self.cells = {p: kv for p, kv in self.cells.items() if p < keep}

    def step(self, token: int, h: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """Row (token, h) at pos: its cell is stored; returns (logits, h')."""
        cfg, b = self.cfg, self.b
        H, G, E, eps = cfg.H, cfg.G, cfg.E, cfg.norm_eps
        e = _rms(self.embed[token], b["enorm"], eps)
        hn = _rms(np.asarray(h, np.float64), b["hnorm"], eps)
        cur = b["eh_proj"] @ np.concatenate([e, hn])
        a = _rms(cur, b["attn_norm"], eps)
        qg = (b["wq"] @ a).reshape(H, 2 * E)
        q, gate = qg[:, :E], qg[:, E:].reshape(-1)
        k = _rope(_rms((b["wk"] @ a).reshape(G, E), b["k_norm"], eps), cfg, pos)
        v = (b["wv"] @ a).reshape(G, E)
        q = _rope(_rms(q, b["q_norm"], eps), cfg, pos)
        self.cells[pos] = (k, v)
        ps = sorted(p for p in self.cells if p <= pos)
        K = np.stack([self.cells[p][0] for p in ps])
        V = np.stack([self.cells[p][1] for p in ps])
        out = np.zeros((H, E))
        for hh in range(H):
            g = hh // (H // G)
            s = K[:, g, :] @ q[hh] / math.sqrt(E)
            w = np.exp(s - s.max())
            out[hh] = (w / w.sum()) @ V[:, g, :]
        cur = cur + b["wo"] @ (out.reshape(-1) * _sigmoid(gate))
        f = _rms(cur, b["post_norm"], eps)
        cur = cur + b["w_down"] @ (_silu(b["w_gate"] @ f) * (b["w_up"] @ f))
        h_out = _rms(cur, self.head_norm, eps)
        return self.head @ h_out, h_out


def _top1(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # argmax of the top-10 softmax == argmax of the logits


def draft_standard(
    block: MtpReference, id_last: int, pending_h: np.ndarray, pos0: int, n_max: int
) -> list[int]:
    """Upstream's standard-mode draft(): (id_last, pending_h) at pos0, then (r_i, h'_i) at
    pos0 + i; greedy, p_min 0. The drafted cells are removed afterwards (seq_rm(pos0))."""
    out, tok, h = [], id_last, pending_h
    for i in range(n_max):
        logits, h = block.step(tok, h, pos0 + i)
        tok = _top1(logits)
        out.append(tok)
    block.truncate(pos0)
    return out


def draft_chain(
    blocks: list[MtpReference], id_last: int, pending_h: np.ndarray, pos0: int, n_max: int
) -> list[int]:
    """Upstream's chain-heads draft(): step i runs head i over the whole prefix
    [id_last, r_1..r_i] at pos0 + t with rows [pending_h, h'_1..h'_i]; n_max <= heads."""
    toks, hs, out = [id_last], [pending_h], []
    for i in range(min(n_max, len(blocks))):
        blocks[i].truncate(pos0)
        for t in range(i + 1):
            logits, h = blocks[i].step(toks[t], hs[t], pos0 + t)
        tok = _top1(logits)
        out.append(tok)
        toks.append(tok)
        hs.append(h)
        blocks[i].truncate(pos0)
    return out


def random_norms(params: Any, seed: int = 11) -> Any:
    """The params with every norm weight drawn from U(0.5, 1.5) instead of 1 (float32): a
    norm applied twice or skipped (e.g. h_nextn taken before the final norm) then shows."""
    rng = np.random.RandomState(seed)

    def fix(name: str, a: Any) -> Any:
        if "norm" in name and np.ndim(a) == 1:
            return rng.uniform(0.5, 1.5, np.shape(a)).astype(np.float32)
        return a

    out = {k: fix(k, v) for k, v in params.items() if k not in ("layers", "nextn")}
    for group in ("layers", "nextn"):
        if group in params:
            out[group] = tuple({k: fix(k, v) for k, v in b.items()} for b in params[group])
    return out
