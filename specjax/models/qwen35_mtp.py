"""The qwen35 NextN/MTP block as llama.cpp's `graph_mtp` computes it (src/models/qwen35.cpp).

Inputs per row: a token x and a hidden row h (the target's `h_nextn`: its last layer's output
after the final norm, `qwen35.forward(..., return_hidden=True)`; or, while drafting, the
block's own previous output h). With block n = `params["nextn"][n]`:

    e   = rms_norm(embed(x), enorm)        embed = block embed_tokens, else the trunk's embed
    hn  = rms_norm(h, hnorm)
    y   = eh_proj @ concat(e, hn)          eh_proj [D, 2D]: e first, then hn
    y  += gated_attention(rms_norm(y, attn_norm))      one full-attention layer of the trunk's
                                                       kind (q/k norms, IMROPE, sigmoid gate)
                                                       over the block's OWN KV cache
    y  += swiglu(rms_norm(y, post_norm))
    h'  = rms_norm(y, shared_head_norm)    block shared_head_norm, else the trunk's final norm
    logits = head @ h'                     block shared_head_head, else the trunk's LM head

`h'` is what llama.cpp exports as the MTP context's `h_nextn` (the next draft step's h).

Invariants: the block's KV cache is a specjax `KVCache` whose layer j belongs to nextn block j
(chain-heads mode keeps one layer per head; all heads share the cell positions); padding
(`positions == -1`) writes nothing. Pure function of (params, inputs, cache).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.memory.kv import KVCache
from specjax.models import qwen35
from specjax.models.feature_head import cache_chunks
from specjax.models.llama import ExtraKV, rms_norm
from specjax.types import Array, Params


class NextnOutput(NamedTuple):
    logits: Array  # [B, T, V] float32
    hidden: Array  # [B, T, D] the block's h_nextn (after shared_head_norm)
    k: Array  # [B, T, G, E] new keys of cache layer `block` (for commit_kv)
    v: Array  # [B, T, G, E]


def shared_weights(config: qwen35.Qwen35Config, params: Params, block: int) -> Params:
    """The weights block `block` reads: its own or the trunk's embed / head norm / LM head."""
    b = params["nextn"][block]
    trunk_head = params["embed"] if config.tie_embeddings else params["lm_head"]
    return {
        "embed": b.get("embed_tokens", params["embed"]),
        "head_norm": b.get("shared_head_norm", params["final_norm"]),
        "head": b.get("shared_head_head", trunk_head),
    }


def new_nextn_cache(
    config: qwen35.Qwen35Config, batch: int, capacity: int, n_heads: int | None = None
) -> KVCache:
    """An empty KV cache for the nextn blocks (one layer per block), in the model's dtype."""
    return KVCache.init(
        batch=batch,
        capacity=capacity,
        n_layers=config.n_nextn if n_heads is None else n_heads,
        n_kv_heads=config.G,
        head_dim=config.E,
        inv_freq=(0.0,) * (config.E // 2),
        dtype=config.dtype,
        v_dtype=config.dtype,
    )


def nextn_forward(
    config: qwen35.Qwen35Config,
    params: Params,
    block: int,
    tokens_BT: Array,
    h_BTD: Array,
    positions_BT: Array,
    cache: KVCache,
    *,
    extra: ExtraKV | None = None,
    cache_empty: bool = False,
) -> NextnOutput:
    """One MTP block (static index `block`, reading cache layer `block`) over T rows.

    `extra`: scratch cells attended besides the cache (a drafter's drafted rows; its layer
    `block` is read). The new K/V are returned, not written (the caller commits every block's K/V at once)."""
    if not 0 <= block < config.n_nextn:
        raise ValueError(f"nextn block {block} out of range: the config has {config.n_nextn}")
    b = params["nextn"][block]
    shared = shared_weights(config, params, block)
    eps = config.norm_eps
    dtype = shared["embed"].dtype
    e = rms_norm(shared["embed"][tokens_BT], b["enorm"], eps)
    hn = rms_norm(h_BTD.astype(dtype), b["hnorm"], eps)
    y = jnp.einsum("btc,dc->btd", jnp.concatenate([e, hn], axis=-1), b["eh_proj"])
    freqs = jnp.asarray(qwen35.rope_pair_frequencies(config), jnp.float32)
    n_chunks = None
    if not cache_empty:
        n_chunks = cache_chunks(cache)[0]
    attn_in = rms_norm(y, b["attn_norm"], eps)
    out, k, v = qwen35._attention_layer(
        config, b, attn_in, positions_BT, freqs, cache, block, n_chunks, extra
    )
    y = y + out
    f = rms_norm(y, b["post_norm"], eps)
    gate = jnp.einsum("btd,fd->btf", f, b["w_gate"])
    up = jnp.einsum("btd,fd->btf", f, b["w_up"])
    y = y + jnp.einsum("btf,df->btd", jax.nn.silu(gate) * up, b["w_down"])
    hidden = rms_norm(y, shared["head_norm"], eps)
    logits = jnp.einsum("btd,vd->btv", hidden, shared["head"], preferred_element_type=jnp.float32)
    return NextnOutput(logits=logits, hidden=hidden, k=k, v=v)
