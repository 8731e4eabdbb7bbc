"""The KV cache through the model: cached decoding equals an uncached forward, also after edits.

The reference is a dense float64 NumPy forward of one row over explicit positions (causal and
sliding-window masks from positions), written independently of specjax's cache code. Weights
are drawn large enough that attention is sharp, so a key at the wrong position or a missing
cell changes the logits far beyond the tolerance.

Compiled shapes (per config): a [2, 4] chunk and a [2, 1] decode step on a capacity-16 cache.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.memory import ops as memory
from specjax.memory.kv import KVCache
from specjax.models import ModelConfig, RopeScaling, forward_fn, init_params, new_cache
from specjax.models.config import rope_frequencies
from specjax.types import Params

B, S, CHUNK = 2, 16, 4
BASE = {"vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64}
CONFIGS = {
    "llama": ModelConfig(**BASE),
    "qwen2": ModelConfig(arch="qwen2", qkv_bias=True, **BASE),
    "qwen3": ModelConfig(arch="qwen3", qk_norm=True, **BASE),
    "swa": ModelConfig(sliding_window=4, swa_layers=(True, False), **BASE),
    "llama3_rope": ModelConfig(
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64
        ),
        **BASE,
    ),
    "bf16": ModelConfig(dtype="bfloat16", **BASE),
}
TOL = {"float32": 1e-5, "bfloat16": 0.1}

fwd = jax.jit(forward_fn, static_argnums=0)
seq_rm = jax.jit(memory.seq_rm)  # traced ids and ranges: one compile per cache shape
seq_add = jax.jit(memory.seq_add)


@functools.cache
def model(name: str) -> tuple[ModelConfig, Params]:
    """Random weights with unit-scale activations and sharp attention."""
    config = CONFIGS[name]
    params = init_params(config, jax.random.PRNGKey(0))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys):
        name_ = str(path[-1].key)
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        if name_.endswith("norm"):
            value = 1.0 + 0.3 * noise
        elif name_ == "bqkv":
            value = 0.5 * noise
        elif name_ in ("embed", "lm_head"):
            value = noise
        elif name_ == "wqkv":
            value = noise * (2.0 / math.sqrt(leaf.shape[1]))
        else:
            value = noise / math.sqrt(leaf.shape[1])
        out.append(value.astype(leaf.dtype))
    return config, jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------- NumPy reference


def reference_logits(config: ModelConfig, params: Params, tokens, positions) -> np.ndarray:
    """Dense float64 forward of one row: [T] tokens at [T] positions -> [T, V] logits."""
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tok = np.asarray(tokens)
    pos = np.asarray(positions, np.float64)
    E, H, G, eps = config.E, config.H, config.G, config.norm_eps
    inv = np.asarray(rope_frequencies(config))

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rope(x):  # [T, heads, E]
        angle = pos[:, None, None] * inv[None, None, :]
        x1, x2 = x[..., : E // 2], x[..., E // 2 :]
        return np.concatenate(
            [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1
        )

    T = len(tok)
    x = P["embed"][tok]
    for i, layer in enumerate(P["layers"]):
        mask = pos[None, :] <= pos[:, None]  # [query, key]
        window = config.layer_window(i)
        if window:
            mask &= pos[:, None] - pos[None, :] < window
        h = norm(x, layer["attn_norm"])
        qkv = h @ layer["wqkv"].T + (layer["bqkv"] if config.qkv_bias else 0.0)
        q = qkv[:, : H * E].reshape(T, H, E)
        k = qkv[:, H * E : (H + G) * E].reshape(T, G, E)
        v = qkv[:, (H + G) * E :].reshape(T, G, E)
        if config.qk_norm:
            q, k = norm(q, layer["q_norm"]), norm(k, layer["k_norm"])
        q, k = rope(q), rope(k)
        heads = []
        for hd in range(H):
            g = hd // (H // G)
            scores = q[:, hd] @ k[:, g].T / math.sqrt(E)
            scores = np.where(mask, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ v[:, g])
        x = x + np.concatenate(heads, -1) @ layer["wo"].T
        h = norm(x, layer["ffn_norm"])
        gu = h @ layer["w_gate_up"].T
        gate, up = gu[:, : config.F], gu[:, config.F :]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ layer["w_down"].T
    head = P["embed"] if config.tie_embeddings else P["lm_head"]
    return norm(x, P["final_norm"]) @ head.T


# ----------------------------------------------------------------------------- helpers


class Runner:
    """Feeds [B, T] chunks (position -1 = padding) and records each row's valid logits."""

    def __init__(self, name: str) -> None:
        self.config, self.params = model(name)
        self.cache: KVCache = new_cache(self.config, B, S)

    def step(self, tokens, positions) -> np.ndarray:
        out = fwd(
            self.config,
            self.params,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            self.cache,
        )
        self.cache = out.cache
        logits = np.asarray(out.logits)
        assert np.isfinite(logits).all()
        return logits

    def feed(self, rows: list[list[tuple[int, int]]]) -> list[list[np.ndarray]]:
        """rows[b] = [(token, position), ...]: fed in chunks of 4 then steps of 1 (same shapes
        as decoding); returns each row's logits in order."""
        got: list[list[np.ndarray]] = [[] for _ in range(B)]
        longest = max(len(r) for r in rows)
        start = 0
        while start < longest:
            width = CHUNK if longest - start >= CHUNK else 1
            tokens = np.zeros((B, width), np.int32)
            positions = np.full((B, width), -1, np.int32)
            for b, r in enumerate(rows):
                for t, (tok, p) in enumerate(r[start : start + width]):
                    tokens[b, t], positions[b, t] = tok, p
            logits = self.step(tokens, positions)
            for b in range(B):
                for t in range(width):
                    if positions[b, t] >= 0:
                        got[b].append(logits[b, t])
            start += width
        return got

    def cell_positions(self, row: int) -> list[int]:
        return np.asarray(self.cache.pos[row]).tolist()


def assert_close(runner: Runner, got, tokens, positions) -> None:
    """`got` (the logits of the last len(got) tokens) equals the reference of the whole row."""
    want = reference_logits(runner.config, runner.params, list(tokens), list(positions))
    want = want[len(want) - len(got) :]
    tol = TOL[runner.config.dtype]
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.stack(got), want, rtol=tol, atol=tol * scale)


def random_tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], n).tolist()


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stepwise_cached_logits_equal_uncached_forward(name: str) -> None:
    r = Runner(name)
    a, b = random_tokens(1, 9), random_tokens(2, 6)  # rows of different lengths
    got = r.feed([list(zip(a, range(9))), list(zip(b, range(6)))])
    assert_close(r, got[0], a, range(9))
    assert_close(r, got[1], b, range(6))
    assert r.cell_positions(1) == list(range(6)) + [-1] * (S - 6)  # padding never written


def test_one_call_forward_equals_stepwise() -> None:
    config, params = model("llama")
    tokens = np.array([random_tokens(3, 8), random_tokens(4, 8)], np.int32)
    positions = np.array([range(8), [0, 1, 2, 3, 4, -1, -1, -1]], np.int32)
    full = fwd(config, params, tokens, positions, new_cache(config, B, S))
    r = Runner("llama")
    got = r.feed([list(zip(tokens[0], range(8))), list(zip(tokens[1], range(5)))])
    np.testing.assert_allclose(np.asarray(full.logits[0]), np.stack(got[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(full.logits[1, :5]), np.stack(got[1]), rtol=1e-5, atol=1e-5
    )


def test_tail_removal_then_new_tokens() -> None:
    r = Runner("llama")
    a, b = random_tokens(5, 8), random_tokens(6, 8)
    r.feed([list(zip(a, range(8))), list(zip(b, range(8)))])
    r.cache, ok = seq_rm(r.cache, 0, 5, -1)
    assert bool(ok)
    assert r.cell_positions(0)[:8] == [0, 1, 2, 3, 4, -1, -1, -1]
    new = random_tokens(7, 4)
    got = r.feed([list(zip(new, range(5, 9))), [(b[0], 8)]])
    assert_close(r, got[0], a[:5] + new, range(9))
    assert_close(r, got[1], [*b, b[0]], range(9))  # the untouched row decodes on


def test_mid_range_hole_refilled() -> None:
    r = Runner("llama")
    a = random_tokens(8, 8)
    r.feed([list(zip(a, range(8))), list(zip(a, range(8)))])
    r.cache, _ = seq_rm(r.cache, -1, 2, 5)  # both rows
    new = random_tokens(9, 3)
    # Row 0 refills the hole with new tokens, row 1 with the original ones.
    got = r.feed([list(zip(new, range(2, 5))), list(zip(a[2:5], range(2, 5)))])
    assert r.cell_positions(0)[:8] == list(range(8))  # the refill landed in the hole's cells
    # Queries at 2..4 must see positions 0, 1 and the refill, never the old cells at 5..7.
    assert_close(r, got[0], a[:2] + new, range(5))
    assert_close(r, got[1], a[:5], range(5))
    # Row 1 again holds exactly the original sequence: its next token sees all of it.
    nxt = random_tokens(10, 1)
    got = r.feed([[], [(nxt[0], 8)]])
    assert_close(r, got[1], a + nxt, range(9))


def test_holes_filled_out_of_position_order() -> None:
    r = Runner("llama")
    a, n = random_tokens(11, 8), random_tokens(12, 2)
    r.feed([list(zip(a, range(8))), []])
    r.cache, _ = seq_rm(r.cache, 0, 1, 3)  # free cells 1, 2
    # One chunk refills positions 1, 2 with the same tokens and appends 8, 9. Tokens take free
    # cells in batch order, so position 8 lands in cell 1 and position 2 in cell 8.
    got = r.feed([[(n[0], 8), (a[1], 1), (a[2], 2), (n[1], 9)], []])
    assert r.cell_positions(0)[:10] == [0, 8, 1, 3, 4, 5, 6, 7, 2, 9]
    tokens = [a[0], *a[3:], n[0], a[1], a[2], n[1]]
    assert_close(r, got[0], tokens, [0, 3, 4, 5, 6, 7, 8, 1, 2, 9])


@pytest.mark.parametrize("name", ["llama", "llama3_rope"])
def test_seq_add_shift_rerotates_keys(name: str) -> None:
    r = Runner(name)
    a, b = random_tokens(13, 8), random_tokens(14, 8)
    r.feed([list(zip(a, range(8))), list(zip(b, range(8)))])
    r.cache = seq_add(r.cache, 0, -1, -1, 5)  # whole row 0: positions 5..12
    assert r.cell_positions(0)[:8] == list(range(5, 13))
    nxt = random_tokens(15, 2)
    got = r.feed([[(nxt[0], 13)], [(nxt[1], 8)]])
    assert_close(r, got[0], [*a, nxt[0]], range(5, 14))
    assert_close(r, got[1], [*b, nxt[1]], range(9))
    # Without the re-rotation the shifted row would differ well beyond the tolerance.
    stale = reference_logits(r.config, r.params, [*a, nxt[0]], [*range(8), 13])[-1]
    assert np.abs(stale - got[0][0]).max() > 100 * TOL["float32"] * np.abs(stale).max()
    # Shift back down: the row is the original sequence again.
    r.cache = seq_add(r.cache, 0, 5, -1, -5)
    got = r.feed([[(nxt[1], 9)], []])
    assert_close(r, got[0], [*a, nxt[0], nxt[1]], range(10))


def test_padding_is_finite_and_never_written() -> None:
    r = Runner("llama")
    a = random_tokens(16, 4)
    # Left padding in row 0, an all-padding row 1.
    logits = r.step(
        np.array([[5, 6, a[0], a[1]], [7, 8, 9, 10]]), np.array([[-1, -1, 0, 1], [-1] * 4])
    )
    assert np.isfinite(logits).all()
    assert r.cell_positions(0) == [0, 1] + [-1] * (S - 2)
    assert r.cell_positions(1) == [-1] * S
    assert not np.asarray(r.cache.k[0][1]).any() and not np.asarray(r.cache.v[1][1]).any()
    assert not np.asarray(r.cache.k[1][0, :, 2:]).any()
    assert_close(r, list(logits[0, 2:]), a[:2], range(2))
    # A padding step after data: row 0 unchanged, still finite.
    logits = r.step(np.array([[3], [4]]), np.array([[-1], [-1]]))
    assert np.isfinite(logits).all()
    assert r.cell_positions(0) == [0, 1] + [-1] * (S - 2)


def test_assign_slots_takes_the_lowest_free_cells_with_and_without_holes() -> None:
    """Against a plain-Python transcription: the k-th valid new token of a row goes to the
    row's k-th lowest free cell (S when none is left). Covers compact rows (occupied cells
    form a prefix: the fast path) and rows with holes (the general search), in one batch and
    alone, since the fast path is taken only when every row is compact."""
    from specjax.memory.kv import assign_slots

    S, T = 12, 5
    rng = np.random.default_rng(7)

    def reference(pos_row: list[int], new_row: list[int]) -> list[int]:
        free = [c for c in range(S) if pos_row[c] < 0]
        out, k = [], 0
        for p in new_row:
            if p < 0:
                out.append(S)
            else:
                out.append(free[k] if k < len(free) else S)
                k += 1
        return out

    rows = []
    for n in (0, 3, 9, 12):  # compact prefixes, including empty and full
        rows.append([10 + i if i < n else -1 for i in range(S)])
    for _ in range(4):  # random holes
        rows.append([int(p) if rng.random() < 0.6 else -1 for p in rng.integers(0, 50, S)])
    new = [[int(p) if rng.random() < 0.7 else -1 for p in rng.integers(0, 50, T)] for _ in rows]
    for batch in (list(range(4)), list(range(len(rows)))):  # all compact / mixed
        pos = jnp.asarray([rows[b] for b in batch], jnp.int32)
        positions = jnp.asarray([new[b] for b in batch], jnp.int32)
        slot, overflow = assign_slots(pos, positions)
        want = [reference(rows[b], new[b]) for b in batch]
        np.testing.assert_array_equal(np.asarray(slot), want)
        np.testing.assert_array_equal(
            np.asarray(overflow),
            [
                any(w == S and p >= 0 for w, p in zip(want_row, new[b]))
                for want_row, b in zip(want, batch)
            ],
        )
