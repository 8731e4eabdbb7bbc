"""Llama-family decoder (llama / qwen2 / qwen3) as a pure function of (params, tokens, positions, cache).

Invariants:
* `positions[b, t] == -1` marks padding: its K/V are not written and its logits are garbage
  (finite, never NaN) and must be ignored by the caller.
* The cache is written before attention, so a token attends to itself, to earlier tokens of
  the same call and to cached cells, all decided by positions (see specjax.cache).
* Compute runs in the parameter dtype; norms, softmax and logits accumulate in float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.cache import KVCache, write_layer, write_positions
from specjax.models.config import ModelConfig, rope_frequencies
from specjax.types import Array, Params

_MASKED = -1e30  # finite: a query that sees no key (padding) gets a uniform row, not NaN


class ForwardOutput(NamedTuple):
    logits: Array  # [B, T, V] float32
    cache: KVCache
    hidden: tuple[Array, ...]  # one [B, T, D] per requested layer (see `forward_fn`)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + weight.shape)
    return (y * w).astype(x.dtype)


def rope_angles(positions_BT: Array, inv_freq: Array) -> tuple[Array, Array]:
    angle = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, E/2]
    return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x_BTNE: Array, cos_BTe: Array, sin_BTe: Array) -> Array:
    """Rotate-half RoPE on [B, T, heads, E]."""
    half = x_BTNE.shape[-1] // 2
    x32 = x_BTNE.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos_BTe[:, :, None, :], sin_BTe[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_BTNE.dtype)


def attention_mask(q_pos_BT: Array, k_pos_BS: Array, window: int) -> Array:
    """[B, T, S] visibility from positions only."""
    q = q_pos_BT[:, :, None]
    k = k_pos_BS[:, None, :]
    visible = (k >= 0) & (k <= q) & (q >= 0)
    if window > 0:
        visible = visible & (q - k < window)
    return visible


def _attention(
    config: ModelConfig,
    q_BTHE: Array,
    k_BSGE: Array,
    v_BSGE: Array,
    mask_BTS: Array,
    k_BTGE: Array,
    v_BTGE: Array,
    mask_BTT: Array,
) -> Array:
    """Attention over the cached cells (read-only) and the new tokens, one softmax over both."""
    B, T, H, E = q_BTHE.shape
    G = config.G
    scale = 1.0 / math.sqrt(E)
    q_BTGRE = q_BTHE.reshape(B, T, G, H // G, E)
    s_cache = jnp.einsum("btgre,bsge->bgrts", q_BTGRE, k_BSGE, preferred_element_type=jnp.float32)
    s_new = jnp.einsum("btgre,buge->bgrtu", q_BTGRE, k_BTGE, preferred_element_type=jnp.float32)
    scores = jnp.concatenate(
        [
            jnp.where(mask_BTS[:, None, None, :, :], s_cache * scale, _MASKED),
            jnp.where(mask_BTT[:, None, None, :, :], s_new * scale, _MASKED),
        ],
        axis=-1,
    )
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGE.dtype)
    S = k_BSGE.shape[1]
    out = jnp.einsum("bgrts,bsge->btgre", probs[..., :S], v_BSGE)
    out = out + jnp.einsum("bgrtu,buge->btgre", probs[..., S:], v_BTGE.astype(v_BSGE.dtype))
    return out.reshape(B, T, H * E)


class ForwardCompute(NamedTuple):
    logits: Array  # [B, T, V] float32
    k: tuple[Array, ...]  # per layer [B, T, G, E], rotated at the token positions
    v: tuple[Array, ...]  # per layer [B, T, G, E]
    hidden: tuple[Array, ...]


def forward_compute(
    config: ModelConfig,
    params: Params,
    tokens_BT: Array,
    positions_BT: Array,
    cache: KVCache,
    hidden_layers: tuple[int, ...] = (),
) -> ForwardCompute:
    """The forward with the cache read-only: returns logits and the new tokens' K/V.

    New tokens attend to the cached cells and to each other (by position), exactly as if
    they had been written first; `commit_kv` writes them afterwards. Keeping the cache
    read-only lets callers branch (`lax.switch` over verify widths) without XLA copying
    the whole cache into and out of every branch.
    """
    E, H, G = config.E, config.H, config.G
    inv_freq = jnp.asarray(rope_frequencies(config), jnp.float32)
    cos, sin = rope_angles(positions_BT, inv_freq)
    masks: dict[int, tuple[Array, Array]] = {}

    x = params["embed"][tokens_BT]
    B, T, _ = x.shape
    hidden: dict[int, Array] = {}
    new_k, new_v = [], []
    for i, layer in enumerate(params["layers"]):
        if i in hidden_layers:
            hidden[i] = x
        h = rms_norm(x, layer["attn_norm"], config.norm_eps)
        qkv = jnp.einsum("btd,od->bto", h, layer["wqkv"])
        if config.qkv_bias:
            qkv = qkv + layer["bqkv"][None, None, :]
        q = qkv[..., : H * E].reshape(B, T, H, E)
        k = qkv[..., H * E : (H + G) * E].reshape(B, T, G, E)
        v = qkv[..., (H + G) * E :].reshape(B, T, G, E)
        if config.qk_norm:
            q = rms_norm(q, layer["q_norm"], config.norm_eps)
            k = rms_norm(k, layer["k_norm"], config.norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin).astype(cache.k[i].dtype)
        v = v.astype(cache.v[i].dtype)
        new_k.append(k)
        new_v.append(v)
        window = config.layer_window(i)
        if window not in masks:
            masks[window] = (
                attention_mask(positions_BT, cache.pos, window),
                attention_mask(positions_BT, positions_BT, window),
            )
        mask_cache, mask_new = masks[window]
        attn = _attention(config, q, cache.k[i], cache.v[i], mask_cache, k, v, mask_new)
        x = x + jnp.einsum("bti,oi->bto", attn, layer["wo"])
        h = rms_norm(x, layer["ffn_norm"], config.norm_eps)
        gate_up = jnp.einsum("btd,od->bto", h, layer["w_gate_up"])
        gate, up = gate_up[..., : config.F], gate_up[..., config.F :]
        x = x + jnp.einsum("btf,of->bto", jax.nn.silu(gate) * up, layer["w_down"])
    if config.L in hidden_layers:
        hidden[config.L] = x
    x = rms_norm(x, params["final_norm"], config.norm_eps)
    head = params["embed"] if config.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)
    return ForwardCompute(
        logits, tuple(new_k), tuple(new_v), tuple(hidden[i] for i in hidden_layers)
    )


def commit_kv(
    cache: KVCache, positions_BT: Array, k: tuple[Array, ...], v: tuple[Array, ...]
) -> KVCache:
    """Write new tokens' K/V into the lowest free cells (padding, position -1, is skipped)."""
    cache, slot_BT = write_positions(cache, positions_BT)
    return KVCache(
        k=tuple(write_layer(c, slot_BT, x) for c, x in zip(cache.k, k)),
        v=tuple(write_layer(c, slot_BT, x) for c, x in zip(cache.v, v)),
        pos=cache.pos,
        overflow=cache.overflow,
        inv_freq=cache.inv_freq,
    )


def forward_fn(
    config: ModelConfig,
    params: Params,
    tokens_BT: Array,
    positions_BT: Array,
    cache: KVCache,
    hidden_layers: tuple[int, ...] = (),
) -> ForwardOutput:
    """One forward over new tokens; returns logits, the updated cache and requested hiddens.

    `hidden_layers` (static) lists layer indices i in [0, L]: entry i is the residual stream
    *entering* layer i (i == L: leaving the last layer, before the final norm). EAGLE-3 and
    MTP drafters read these.
    """
    out = forward_compute(config, params, tokens_BT, positions_BT, cache, hidden_layers)
    cache = commit_kv(cache, positions_BT, out.k, out.v)
    return ForwardOutput(out.logits, cache, out.hidden)


def new_cache(config: ModelConfig, batch: int, capacity: int) -> KVCache:
    """An empty cache. The optimization barrier keeps XLA from constant-folding attention over
    an all-empty cache created inside a jitted function (prefill, training), which made
    compilation take minutes."""
    cache = KVCache.init(
        batch=batch,
        capacity=capacity,
        n_layers=config.L,
        n_kv_heads=config.G,
        head_dim=config.E,
        inv_freq=tuple(rope_frequencies(config)),
        dtype=config.dtype,
    )
    return jax.lax.optimization_barrier(cache)


def init_params(config: ModelConfig, key: Array) -> Params:
    """Random initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L)."""
    dtype = jnp.dtype(config.dtype)
    E, D, F, H, G, V = config.E, config.D, config.F, config.H, config.G, config.V
    std = 0.02
    out_std = std / math.sqrt(2 * config.L)

    def normal(k: Array, shape: tuple[int, ...], s: float) -> Array:
        return (jax.random.normal(k, shape, jnp.float32) * s).astype(dtype)

    keys = iter(jax.random.split(key, 4 + 4 * config.L))
    layers = []
    for _ in range(config.L):
        layer = {
            "attn_norm": jnp.ones((D,), dtype),
            "wqkv": normal(next(keys), ((H + 2 * G) * E, D), std),
            "wo": normal(next(keys), (D, H * E), out_std),
            "ffn_norm": jnp.ones((D,), dtype),
            "w_gate_up": normal(next(keys), (2 * F, D), std),
            "w_down": normal(next(keys), (D, F), out_std),
        }
        if config.qkv_bias:
            layer["bqkv"] = jnp.zeros(((H + 2 * G) * E,), dtype)
        if config.qk_norm:
            layer["q_norm"] = jnp.ones((E,), dtype)
            layer["k_norm"] = jnp.ones((E,), dtype)
        layers.append(layer)
    params: Params = {
        "embed": normal(next(keys), (V, D), std),
        "layers": tuple(layers),
        "final_norm": jnp.ones((D,), dtype),
    }
    if not config.tie_embeddings:
        params["lm_head"] = normal(next(keys), (V, D), std)
    return params
