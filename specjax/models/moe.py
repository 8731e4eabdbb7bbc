"""Mixture-of-experts feed-forward (Qwen3-MoE: transformers' Qwen3MoeSparseMoeBlock, llama.cpp's
`build_moe_ffn` with softmax gating) as a pure function of a layer's parameters.

A MoE layer's parameters (see specjax.models.config; X experts, F' = expert_ffn_dim):

    "router":          [X, D]        router linear ([out, in]), no bias
    "experts_gate_up": [X, D, 2F']   per expert [in, out]: F' gate columns, then F' up columns
    "experts_down":    [X, F', D]    per expert [in, out]

The experts are stored input-major (transposed from GGUF's and transformers' [out, in]; the
loaders transpose): XLA TPU's grouped matmul (`lax.ragged_dot`) takes the experts with the
contracted dimension before the output one, and given [out, in] it copied the whole expert
tensor every call (a Qwen3-30B-A3B layer in bfloat16: 768 MiB of temporaries and 2.4 GB
accessed for 72 token-expert pairs on a v5e, against 0.1 MiB and 0.8 GB input-major;
benchmarks/moe_dispatch.py --aot); XLA CPU's products of one row read [in, out] faster too
(`llama.InputMajor`).

Per token: router logits in float32 -> softmax over the X experts -> the top k
(`n_experts_used`; ties to the lower index) -> with `norm_topk_prob` the k probabilities
divided by their sum -> cast to the compute dtype; the output is sum_j w_j *
down_j(silu(gate_j x) * up_j x). Qwen3-MoE has no shared expert (Qwen2-MoE's
`shared_expert` is not modelled).

Invariants:
* Each token's output depends on that token alone, whatever the dispatch: a verify batch
  routes every token as a 1-token step would.
* Three dispatches compute the same function (`DISPATCHES`); `specjax.control.moe_dispatch`
  picks one per backend and per number of token-expert pairs, at trace time:
  - "pairs": a loop over the M * k token-expert pairs, each a product of one token with its
    expert's matrices read in place: only the experts the tokens use are read, so a
    1-token step reads k of X experts and a T-token verify T * k (repeats read again);
  - "dense": every expert over every token, the unused ones weighted 0 (one product per
    matrix; X / k times the needed arithmetic);
  - "ragged": the token-expert pairs sorted by expert and `jax.lax.ragged_dot` over the
    groups (a grouped matmul on TPU; XLA CPU and GPU expand it to a masked dense product).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from specjax.control import moe_dispatch
from specjax.models.config import ModelConfig
from specjax.types import Array

#: The dispatches `moe_ffn` implements.
DISPATCHES = ("pairs", "dense", "ragged")


def route(config: ModelConfig, router_XD: Array, h_MD: Array) -> tuple[Array, Array]:
    """(weights [M, k] in h's dtype, experts [M, k] int32) of each token's top-k experts."""
    logits = jnp.einsum("md,xd->mx", h_MD, router_XD, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = jax.lax.top_k(probs, config.n_experts_used)
    if config.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(h_MD.dtype), experts.astype(jnp.int32)


def _pairs(layer: dict[str, Any], h_MD: Array, experts_MK: Array, weights_MK: Array) -> Array:
    """A loop over the M * k token-expert pairs: each reads its expert's matrices in place
    (dynamic slices of the stacked experts) and adds its weighted output to its token's row."""
    M, K = experts_MK.shape
    F = layer["experts_down"].shape[1]

    def pair(p: Array, out_MD: Array) -> Array:
        m, expert = p // K, experts_MK[p // K, p % K]
        w_gu = jax.lax.dynamic_index_in_dim(layer["experts_gate_up"], expert, 0, keepdims=False)
        w_down = jax.lax.dynamic_index_in_dim(layer["experts_down"], expert, 0, keepdims=False)
        x = jax.lax.dynamic_index_in_dim(h_MD, m, 0)  # [1, D]
        gate_up = x @ w_gu
        y = (jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:]) @ w_down
        row = jax.lax.dynamic_index_in_dim(out_MD, m, 0) + weights_MK[m, p % K] * y
        return jax.lax.dynamic_update_index_in_dim(out_MD, row.astype(out_MD.dtype), m, 0)

    return jax.lax.fori_loop(0, M * K, pair, jnp.zeros_like(h_MD))


def _dense(layer: dict[str, Any], h_MD: Array, experts_MK: Array, weights_MK: Array) -> Array:
    X, F, _ = layer["experts_down"].shape
    # batched over the experts (the tokens broadcast): as "md,xdf->mxf", XLA GPU copied the
    # whole expert tensor into one GEMM's layout every call (768 MiB for a Qwen3-30B-A3B
    # layer); batched, 6 MiB at 9 tokens, and XLA CPU ran it 1.2-4x faster
    h_XMD = jnp.broadcast_to(h_MD[None], (X, *h_MD.shape))
    gate_up = jnp.einsum("xmd,xdf->xmf", h_XMD, layer["experts_gate_up"])
    act = jax.nn.silu(gate_up[..., :F]) * gate_up[..., F:]
    out = jnp.einsum("xmf,xfd->xmd", act, layer["experts_down"])
    # [M, X]: each token's weight of each expert, 0 for the experts it does not use
    combine = jnp.einsum("mk,mkx->mx", weights_MK, jax.nn.one_hot(experts_MK, X, dtype=h_MD.dtype))
    return jnp.einsum("mx,xmd->md", combine, out)


def _ragged(layer: dict[str, Any], h_MD: Array, experts_MK: Array, weights_MK: Array) -> Array:
    X, F, D = layer["experts_down"].shape
    M, K = experts_MK.shape
    flat = experts_MK.reshape(-1)  # pair p = token p // K, its (p % K)-th expert
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((X,), jnp.int32).at[flat].add(1)
    x_PD = h_MD[order // K]
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    gate_up = jax.lax.ragged_dot_general(x_PD, layer["experts_gate_up"], sizes, numbers)
    act = jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:]
    out_PD = jax.lax.ragged_dot_general(act, layer["experts_down"], sizes, numbers)
    out = jnp.zeros_like(out_PD).at[order].set(out_PD).reshape(M, K, D)
    return jnp.einsum("mk,mkd->md", weights_MK, out)


_IMPLEMENTATIONS = {"pairs": _pairs, "dense": _dense, "ragged": _ragged}


def moe_ffn(
    config: ModelConfig, layer: dict[str, Any], h_BTD: Array, dispatch: str | None = None
) -> Array:
    """The MoE FFN's output [B, T, D] for the normed hidden states `h_BTD`. `dispatch`: one
    of DISPATCHES (None: `control.moe_dispatch`'s choice for this backend and size)."""
    B, T, D = h_BTD.shape
    h_MD = h_BTD.reshape(B * T, D)
    weights_MK, experts_MK = route(config, layer["router"], h_MD)
    if dispatch is None:
        dispatch = moe_dispatch(B * T * config.n_experts_used, config.n_experts)
    if dispatch not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown MoE dispatch {dispatch!r}; one of {', '.join(DISPATCHES)}")
    out = _IMPLEMENTATIONS[dispatch](layer, h_MD, experts_MK, weights_MK)
    return out.astype(h_BTD.dtype).reshape(B, T, D)


def init_moe_layer(config: ModelConfig, key: Array, std: float, out_std: float) -> dict[str, Array]:
    """A MoE layer's random FFN parameters (`llama.init_params`'s scheme: N(0, std), the down
    projections N(0, out_std))."""
    dtype = jnp.dtype(config.dtype)
    X, D, F = config.n_experts, config.D, config.expert_ffn_dim
    k_router, k_gu, k_down = jax.random.split(key, 3)

    def normal(k: Array, shape: tuple[int, ...], s: float) -> Array:
        return (jax.random.normal(k, shape, jnp.float32) * s).astype(dtype)

    return {
        # a wider router spread than N(0, 0.02) so random tiny models route unevenly
        "router": normal(k_router, (X, D), 1.0 / math.sqrt(D)),
        "experts_gate_up": normal(k_gu, (X, D, 2 * F), std),
        "experts_down": normal(k_down, (X, F, D), out_std),
    }
