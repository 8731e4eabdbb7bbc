"""Qwen3.5 hybrid decoder (llama.cpp's `qwen35`) as a pure function of (params, tokens, positions, state).

Computed as llama.cpp's `src/models/qwen35.cpp` + `delta-net-base.cpp` compute it:

* Layer i is a gated delta-net (linear attention) layer unless (i + 1) % full_attention_interval
  == 0, then it is a gated full-attention layer. Every layer: x += mixer(rms_norm(x, attn_norm));
  x += SwiGLU(rms_norm(x, post_norm)).
* Delta-net layer: qkv = w_qkv h, z = w_z h, beta = sigmoid(w_beta h), g = softplus(w_alpha h +
  dt_bias) * a (a = -exp(A_log), stored as is); a causal depthwise conv1d of width d_conv over
  (conv state ++ qkv) then SiLU; q, k L2-normalised (x / sqrt(sum x^2 + eps)); k heads tiled to
  the v heads (v head h reads k head h % Hk, as ggml_repeat / the fused op do); per v head the
  state M [S_v, S_k] follows M <- exp(g) M; d = beta (v - M k); M <- M + d k^T; o = M q / sqrt(S);
  out = ssm_out(rms_norm_per_head(o, ssm_norm) * silu(z)).
* Full-attention layer: w_q gives per head [q (E), gate (E)]; q/k RMS-normed per head; RoPE
  (llama.cpp IMROPE) on the first `rope_dim` dims of each head in NeoX pairing (i, i + rope_dim/2);
  a pair whose interleaved section is the 4th ("e") is rotated by position 0, as text tokens
  carry position 0 there; softmax attention (scale 1/sqrt(E)) through specjax's KV cache; output
  * sigmoid(gate), then w_o.
* NextN/MTP blocks (`params["nextn"]`) are not run by this forward (see `qwen35_mtp`);
  `return_hidden=True` also returns the hidden state they read: llama.cpp's `h_nextn`, the
  last layer's output after the final norm, for every row (the plain path never computes it
  separately: it is the LM head's input).

State invariants (`Qwen35State`):
* `kv` is a specjax KVCache holding the attention layers only (entry j = j-th attention layer).
* `conv[j]` [B, d_conv - 1, C] and `ssm[j]` [B, Hv, S, S] (float32; ssm[b, h, value, key]) belong
  to the j-th delta-net layer and summarise every token the row has consumed.
* Padding (`positions == -1`) must be a suffix of each row: valid tokens first. A padding token
  leaves the recurrent state unchanged (its decay is 1 and its beta 0) and its logits are garbage.
* The chunked scan (prefill, multi-token batches) and the one-token recurrence compute the same
  function; `per_position=True` also returns the recurrent state after every token (the verify
  forward's n_rs_seq planes), computed by the token-by-token scan.
* `memory.seq_add` / `seq_div` are not supported on the attention cache of this model yet
  (partial RoPE re-rotation); recurrent state cannot be rolled back by position.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.control import unroll_stacking_scans
from specjax.memory.kv import KVCache, used_cells
from specjax.models.config import DecoderDims
from specjax.models.llama import CACHE_CHUNK, ExtraKV, _attend, _attend_prompt, commit_kv, rms_norm
from specjax.pytree import check_known_keys, pytree_dataclass
from specjax.types import Array, Params, alias

DTYPES = ("float32", "float16", "bfloat16")

#: Tokens per chunk of the chunked delta-net scan (llama.cpp's CS for gated delta-net).
CHUNK = 64


def default_rope_sections(rope_dim: int) -> tuple[int, int, int, int]:
    """Qwen3.5's split of the rotated pairs into t/h/w sections (64 dims -> 11, 11, 10, 0)."""
    n = rope_dim // 2
    return (n // 3 + (n % 3 > 0), n // 3 + (n % 3 > 1), n // 3, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35Config(DecoderDims):
    """Everything static about a qwen35 model. Hashable: usable as a jit static arg.
    Dimension keys: `DecoderDims`' (E = head_dim), L, and the delta-net layers' S, Hk, Hv."""

    arch: str = "qwen35"
    vocab_size: int
    dim: int
    n_layers: int  # trunk layers (llama.cpp's n_layer(); block_count minus nextn layers)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10_000_000.0
    rope_dim: int = 0  # 0 -> head_dim
    rope_sections: tuple[int, ...] = (0, 0, 0, 0)  # all 0 -> default_rope_sections
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    full_attention_interval: int = 4
    ssm_conv_kernel: int = 4
    ssm_state_size: int = 128  # head dim of k and v in delta-net layers (S)
    ssm_k_heads: int = 16  # llama.cpp ssm.group_count
    ssm_v_heads: int = 32  # llama.cpp ssm.time_step_rank
    n_nextn: int = 0
    max_position: int = 4096
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.arch != "qwen35":
            raise ValueError(f"Qwen35Config.arch must be 'qwen35', got {self.arch!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
            "full_attention_interval",
            "ssm_conv_kernel",
            "ssm_state_size",
            "ssm_k_heads",
            "ssm_v_heads",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.ssm_v_heads % self.ssm_k_heads:
            raise ValueError(
                f"ssm_v_heads ({self.ssm_v_heads}) must be a multiple of ssm_k_heads "
                f"({self.ssm_k_heads})"
            )
        if not any(self.rope_sections):  # normalise: equal configs compare equal
            object.__setattr__(self, "rope_sections", default_rope_sections(self.n_rot))
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError(f"rope_dim must be even and <= head_dim, got {self.n_rot}")
        if len(self.sections) != 4 or sum(self.sections[:3]) <= 0:
            raise ValueError(f"rope_sections needs 4 entries, t/h/w not all 0: {self.sections}")
        if self.n_nextn < 0:
            raise ValueError(f"n_nextn must be >= 0, got {self.n_nextn}")

    L = alias("n_layers")

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def sections(self) -> tuple[int, int, int, int]:
        return tuple(self.rope_sections)  # type: ignore[return-value]

    S = alias("ssm_state_size")
    Hk = alias("ssm_k_heads")
    Hv = alias("ssm_v_heads")

    @property
    def key_dim(self) -> int:
        return self.Hk * self.S

    @property
    def value_dim(self) -> int:
        return self.Hv * self.S

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.L) if not self.is_recurrent(i))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.L) if self.is_recurrent(i))

    def num_params(self) -> int:
        """Trunk parameters (embeddings, layers, final norm, LM head; no nextn blocks)."""
        total = self.V * self.D * (1 if self.tie_embeddings else 2) + self.D
        for i in range(self.L):
            total += sum(math.prod(shape) for shape in layer_shapes(self, i).values())
        return total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Qwen35Config:
        data = dict(data)
        if "rope_sections" in data:
            data["rope_sections"] = tuple(int(x) for x in data["rope_sections"])
        check_known_keys(cls, data, "unknown qwen35 config keys")
        return cls(**data)


def rope_pair_frequencies(config: Qwen35Config) -> list[float]:
    """Per rotated pair p < rope_dim/2: base^(-2p/rope_dim), or 0 for a pair llama.cpp's IMROPE
    assigns to the 4th section (text tokens have position 0 there). Host-side."""
    n_rot = config.n_rot
    s = config.sections
    sect_dims = sum(s)
    out = []
    for p in range(n_rot // 2):
        sector = p % sect_dims
        uses_pos = (
            (sector % 3 == 1 and sector < 3 * s[1])
            or (sector % 3 == 2 and sector < 3 * s[2])
            or (sector % 3 == 0 and sector < 3 * s[0])
        )
        out.append(config.rope_theta ** (-2.0 * p / n_rot) if uses_pos else 0.0)
    return out


# --------------------------------------------------------------------------------- state
@pytree_dataclass
class Qwen35State:
    kv: KVCache  # attention layers only
    conv: tuple[Array, ...]  # per delta-net layer [B, d_conv - 1, C] float32
    ssm: tuple[Array, ...]  # per delta-net layer [B, Hv, S(value), S(key)] float32

    batch = alias("kv.batch")
    capacity = alias("kv.capacity")


def new_state(
    config: Qwen35Config,
    batch: int,
    capacity: int,
    dtype: str | None = None,
    v_dtype: str | None = None,
) -> Qwen35State:
    """An empty state: no cached attention cells, zero conv and recurrent states."""
    k_dtype = dtype or config.dtype
    kv = KVCache.init(
        batch=batch,
        capacity=capacity,
        n_layers=len(config.attention_layers),
        n_kv_heads=config.G,
        head_dim=config.E,
        inv_freq=(0.0,) * (config.E // 2),  # see module docstring: no seq_add re-rotation
        dtype=k_dtype,
        v_dtype=v_dtype or k_dtype,
    )
    n_rec = len(config.recurrent_layers)
    conv = tuple(
        jnp.zeros((batch, config.ssm_conv_kernel - 1, config.conv_dim), jnp.float32)
        for _ in range(n_rec)
    )
    ssm = tuple(
        jnp.zeros((batch, config.Hv, config.S, config.S), jnp.float32) for _ in range(n_rec)
    )
    return jax.lax.optimization_barrier(Qwen35State(kv=kv, conv=conv, ssm=ssm))


class Qwen35Output(NamedTuple):
    logits: Array  # [B, T, V] float32
    state: Qwen35State
    #: Per delta-net layer, each token's conv input [B, T, C] (what the conv state keeps the
    #: last d_conv - 1 of).
    conv_inputs: tuple[Array, ...]
    #: With per_position=True: per delta-net layer, the SSM state after each token
    #: [B, T, Hv, S, S]; else an empty tuple.
    ssm_steps: tuple[Array, ...]
    #: With return_hidden=True: h_nextn [B, T, D] (final-normed hidden, model dtype); else None.
    hidden: Array | None = None


# --------------------------------------------------------------------------------- delta net
def l2_norm(x: Array, eps: float) -> Array:
    """llama.cpp's build_gdn_l2_norm: x / sqrt(sum(x^2) + eps) over the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_step(
    M_BHJI: Array, q_BHI: Array, k_BHI: Array, v_BHJ: Array, g_BH: Array, beta_BH: Array
) -> tuple[Array, Array]:
    """One token of the gated delta rule (q already scaled). Returns (new state, output)."""
    M = M_BHJI * jnp.exp(g_BH)[..., None, None]
    sk = jnp.einsum("bhji,bhi->bhj", M, k_BHI)
    d = (v_BHJ - sk) * beta_BH[..., None]
    M = M + d[..., :, None] * k_BHI[..., None, :]
    return M, jnp.einsum("bhji,bhi->bhj", M, q_BHI)


def delta_recurrent(
    M_BHJI: Array, q: Array, k: Array, v: Array, g: Array, beta: Array, keep_steps: bool = False
) -> tuple[Array, Array, Array | None]:
    """Token-by-token scan. q, k [B, T, H, S], v [B, T, H, S], g, beta [B, T, H].

    Returns (final state, outputs [B, T, H, S], per-token states [B, T, H, S, S] or None)."""

    def step(M: Array, xs: tuple[Array, ...]) -> tuple[Array, tuple[Array, Array | None]]:
        M, o = delta_step(M, *xs)
        return M, (o, M if keep_steps else None)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    # kept steps on a GPU: unrolled, so no loop writes them at its counter
    # (`control.unroll_stacking_scans`)
    unroll = q.shape[1] if keep_steps and unroll_stacking_scans() else 1
    M, (o, steps) = jax.lax.scan(step, M_BHJI, xs, unroll=max(unroll, 1))
    o = jnp.moveaxis(o, 0, 1)
    return M, o, None if steps is None else jnp.moveaxis(steps, 0, 1)


def unit_lower_inverse(L: Array) -> Array:
    """Inverse of unit lower-triangular matrices [..., C, C] by blocked inversion: diagonal
    blocks of size s -> 2s via [[A, 0], [X, B]]^-1 = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]
    (log2 C rounds of batched matmuls; C is padded to a power of two with the identity)."""
    C = L.shape[-1]
    P = 1 << (C - 1).bit_length()
    batch = L.shape[:-2]
    if P != C:
        pad = [(0, 0)] * len(batch) + [(0, P - C), (0, P - C)]
        eye = jnp.diag((jnp.arange(P) >= C).astype(L.dtype))
        L = jnp.pad(L, pad) + eye.reshape((1,) * len(batch) + (P, P))
    inv = jnp.ones(batch + (P, 1, 1), L.dtype)  # the 1 x 1 diagonal blocks' inverses
    s = 1
    while s < P:
        nb = P // (2 * s)
        blocks = L.reshape(batch + (nb, 2 * s, nb, 2 * s))
        diag = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [.., nb, 2s, 2s]
        X = diag[..., s:, :s]
        pairs = inv.reshape(batch + (nb, 2, s, s))
        a_inv, b_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        low = -jnp.matmul(b_inv, jnp.matmul(X, a_inv))
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([low, b_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv.reshape(batch + (P, P))[..., :C, :C]


def delta_chunked(
    M_BHJI: Array, q: Array, k: Array, v: Array, g: Array, beta: Array, chunk: int = CHUNK
) -> tuple[Array, Array]:
    """The same recurrence, `chunk` tokens at a time (WY form: a unit lower-triangular solve per
    chunk, then one state update per chunk). Shapes as `delta_recurrent`; returns (state, out)."""
    B, T, H, S = q.shape
    C = min(chunk, T)
    pad = (-T) % C
    N = (T + pad) // C

    def prep(a: Array) -> Array:  # [B, T, H, ...] -> [B, H, N, C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(B, N, C, H, *a.shape[3:])
        return jnp.moveaxis(a, 3, 1)

    q_c, k_c, v_c, g_c, b_c = (prep(a) for a in (q, k, v, g, beta))
    G = jnp.cumsum(g_c, axis=-1)  # [B, H, N, C] inclusive log-decay
    diff = G[..., :, None] - G[..., None, :]  # [.., t, s] = G_t - G_s
    strict = jnp.tril(jnp.ones((C, C), bool), -1)[None, None, None]
    incl = jnp.tril(jnp.ones((C, C), bool))[None, None, None]
    kk = jnp.einsum("bhnti,bhnsi->bhnts", k_c, k_c)
    A = jnp.where(strict, b_c[..., None] * jnp.exp(jnp.where(strict, diff, 0.0)) * kk, 0.0)
    lhs = A + jnp.eye(C, dtype=A.dtype)[None, None, None]
    # (I + A)^-1 by blocked inversion (batched matmuls), not LAPACK trsm: on CPU jax's trsm
    # custom call fans out over XLA's intra-op pool and blocks a pool thread while it waits;
    # two such calls at once (the backward pass has them) held both threads of a 2-core pool
    # and the training step deadlocked.
    inv = unit_lower_inverse(lhs)
    rhs = jnp.concatenate([b_c[..., None] * v_c, b_c[..., None] * jnp.exp(G)[..., None] * k_c], -1)
    WK = jnp.einsum("bhnts,bhnsj->bhntj", inv, rhs)
    W, Kd = WK[..., :S], WK[..., S:]
    qk = jnp.einsum("bhnti,bhnsi->bhnts", q_c, k_c)
    P = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)) * qk, 0.0)  # [B, H, N, t, s]
    qg = q_c * jnp.exp(G)[..., None]
    G_last = G[..., -1]  # [B, H, N]
    kdec = k_c * jnp.exp(G_last[..., None] - G)[..., None]

    def step(M: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        W_n, Kd_n, P_n, qg_n, kdec_n, gl_n = xs
        U = W_n - jnp.einsum("bhci,bhji->bhcj", Kd_n, M)
        o = jnp.einsum("bhci,bhji->bhcj", qg_n, M) + jnp.einsum("bhts,bhsj->bhtj", P_n, U)
        M = M * jnp.exp(gl_n)[..., None, None] + jnp.einsum("bhcj,bhci->bhji", U, kdec_n)
        return M, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (W, Kd, P, qg, kdec, G_last))
    M, o = jax.lax.scan(step, M_BHJI, xs)  # o [N, B, H, C, S]
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, N * C, S)[:, :, :T]
    return M, jnp.moveaxis(o, 1, 2)


def _delta_layer(
    config: Qwen35Config,
    layer: Params,
    h_BTD: Array,
    valid_BT: Array,
    conv_state: Array,
    ssm_state: Array,
    mode: str,
    per_position: bool,
) -> tuple[Array, Array, Array, Array, Array | None]:
    """Delta-net mixer. Returns (out [B, T, D], conv state, ssm state, conv inputs [B, T, C],
    ssm steps)."""
    B, T, _ = h_BTD.shape
    S, Hk, Hv, Kc = config.S, config.Hk, config.Hv, config.ssm_conv_kernel
    eps = config.norm_eps
    qkv = jnp.einsum("btd,od->bto", h_BTD, layer["w_qkv"]).astype(jnp.float32)
    z = jnp.einsum("btd,od->bto", h_BTD, layer["w_z"]).astype(jnp.float32)
    beta = jax.nn.sigmoid(jnp.einsum("btd,od->bto", h_BTD, layer["w_beta"]).astype(jnp.float32))
    alpha = jnp.einsum("btd,od->bto", h_BTD, layer["w_alpha"]).astype(jnp.float32)
    dt_bias = layer["dt_bias"].astype(jnp.float32)[None, None, :]
    g = jax.nn.softplus(alpha + dt_bias) * layer["a"].astype(jnp.float32)[None, None, :]
    beta = jnp.where(valid_BT[..., None], beta, 0.0)
    g = jnp.where(valid_BT[..., None], g, 0.0)

    conv_in = jnp.concatenate([conv_state, qkv], axis=1)  # [B, Kc - 1 + T, C]
    w = layer["conv"].astype(jnp.float32)  # [C, Kc]
    conv = sum(conv_in[:, j : j + T, :] * w[None, None, :, j] for j in range(Kc))
    conv = jax.nn.silu(conv)
    n_valid_B = jnp.sum(valid_BT, axis=1)
    idx = n_valid_B[:, None] + jnp.arange(Kc - 1)[None, :]
    new_conv = jnp.take_along_axis(conv_in, idx[:, :, None], axis=1)

    kd = config.key_dim
    q = l2_norm(conv[..., :kd].reshape(B, T, Hk, S), eps)
    k = l2_norm(conv[..., kd : 2 * kd].reshape(B, T, Hk, S), eps)
    v = conv[..., 2 * kd :].reshape(B, T, Hv, S)
    if Hv != Hk:
        q = jnp.tile(q, (1, 1, Hv // Hk, 1))
        k = jnp.tile(k, (1, 1, Hv // Hk, 1))
    q = q / math.sqrt(S)
    ssm_steps = None
    if per_position or mode == "recurrent" or (mode == "auto" and T == 1):
        M, o, ssm_steps = delta_recurrent(ssm_state, q, k, v, g, beta, keep_steps=per_position)
    else:
        M, o = delta_chunked(ssm_state, q, k, v, g, beta)
    o = rms_norm(o, layer["ssm_norm"], eps) * jax.nn.silu(z.reshape(B, T, Hv, S))
    o = o.reshape(B, T, Hv * S).astype(h_BTD.dtype)
    out = jnp.einsum("bti,oi->bto", o, layer["ssm_out"])
    return out, new_conv, M, qkv, ssm_steps


def apply_partial_rope(x_BTNE: Array, positions_BT: Array, freqs: Array, n_rot: int) -> Array:
    """NeoX-paired rotation of the first n_rot dims (pair i with i + n_rot/2); the rest pass."""
    angle = positions_BT.astype(jnp.float32)[..., None] * freqs[None, None, :]
    c, s = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x32 = x_BTNE.astype(jnp.float32)
    half = n_rot // 2
    x1, x2, rest = x32[..., :half], x32[..., half:n_rot], x32[..., n_rot:]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
    return out.astype(x_BTNE.dtype)


def _attention_layer(
    config: Qwen35Config,
    layer: Params,
    h_BTD: Array,
    positions_BT: Array,
    freqs: Array,
    kv: KVCache,
    j: int,
    n_chunks: Array | None,
    extra: ExtraKV | None = None,
) -> tuple[Array, Array, Array]:
    """Gated attention mixer. Returns (out [B, T, D], new K, new V [B, T, G, E]).

    `extra`: cells attended besides the cache and the new tokens (a drafter's scratch)."""
    B, T, _ = h_BTD.shape
    H, G, E = config.H, config.G, config.E
    eps = config.norm_eps
    qg = jnp.einsum("btd,od->bto", h_BTD, layer["wq"]).reshape(B, T, H, 2 * E)
    q, gate = qg[..., :E], qg[..., E:].reshape(B, T, H * E)
    k = jnp.einsum("btd,od->bto", h_BTD, layer["wk"]).reshape(B, T, G, E)
    v = jnp.einsum("btd,od->bto", h_BTD, layer["wv"]).reshape(B, T, G, E)
    q = rms_norm(q, layer["q_norm"], eps)
    k = rms_norm(k, layer["k_norm"], eps)
    q = apply_partial_rope(q, positions_BT, freqs, config.n_rot)
    k = apply_partial_rope(k, positions_BT, freqs, config.n_rot).astype(kv.k[j].dtype)
    v = v.astype(kv.v[j].dtype)
    qh = q.reshape(B, T, G, H // G, E).transpose(0, 2, 3, 1, 4)
    own = [(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions_BT)]
    if extra is not None:
        own.append((extra.k[j], extra.v[j], extra.pos))
    if n_chunks is None and extra is None:  # a prompt into an empty state
        attn = _attend_prompt(qh, *own[0], 0)
    else:
        cached = None if n_chunks is None else (kv.k[j], kv.v[j], kv.pos)
        attn = _attend(qh, own, positions_BT, 0, cached, n_chunks)
    attn = attn.transpose(0, 3, 1, 2, 4).reshape(B, T, H * E)
    attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
    return jnp.einsum("bti,oi->bto", attn, layer["wo"]), k, v


def forward(
    config: Qwen35Config,
    params: Params,
    tokens_BT: Array,
    positions_BT: Array,
    state: Qwen35State,
    *,
    mode: str = "auto",
    per_position: bool = False,
    cache_empty: bool = False,
    return_hidden: bool = False,
) -> Qwen35Output:
    """One forward over new tokens: logits, the new state and optional per-token states.

    `mode` (static): "auto" (one-token recurrence when T == 1, else the chunked scan),
    "recurrent" or "chunked". `per_position=True` returns every token's recurrent state;
    `return_hidden=True` (static) also returns h_nextn, the LM head's input, for every row.
    `cache_empty` (static): the state holds nothing yet and the new tokens are a prompt,
    their positions increasing along T apart from padding (the attention reads no cache)."""
    if mode not in ("auto", "recurrent", "chunked"):
        raise ValueError(f"mode must be auto, recurrent or chunked, got {mode!r}")
    freqs = jnp.asarray(rope_pair_frequencies(config), jnp.float32)
    valid_BT = positions_BT >= 0
    kv = state.kv
    n_chunks = None
    if not cache_empty:
        chunk = min(CACHE_CHUNK, kv.capacity)
        n_chunks = (used_cells(kv.pos) + chunk - 1) // chunk
    x = params["embed"][tokens_BT]
    new_k, new_v, new_conv, new_ssm, conv_inputs, ssm_steps = [], [], [], [], [], []
    j_attn = j_rec = 0
    for i, layer in enumerate(params["layers"]):
        h = rms_norm(x, layer["attn_norm"], config.norm_eps)
        if config.is_recurrent(i):
            out, c, m, cs, ms = _delta_layer(
                config,
                layer,
                h,
                valid_BT,
                state.conv[j_rec],
                state.ssm[j_rec],
                mode,
                per_position,
            )
            new_conv.append(c)
            new_ssm.append(m)
            conv_inputs.append(cs)
            if ms is not None:
                ssm_steps.append(ms)
            j_rec += 1
        else:
            out, k, v = _attention_layer(
                config, layer, h, positions_BT, freqs, kv, j_attn, n_chunks
            )
            new_k.append(k)
            new_v.append(v)
            j_attn += 1
        x = x + out
        h = rms_norm(x, layer["post_norm"], config.norm_eps)
        gate = jnp.einsum("btd,fd->btf", h, layer["w_gate"])
        up = jnp.einsum("btd,fd->btf", h, layer["w_up"])
        x = x + jnp.einsum("btf,df->btd", jax.nn.silu(gate) * up, layer["w_down"])
    x = rms_norm(x, params["final_norm"], config.norm_eps)
    head = params["embed"] if config.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)
    if new_k:
        kv = commit_kv(kv, positions_BT, tuple(new_k), tuple(new_v), after=logits)
    new_state = Qwen35State(kv=kv, conv=tuple(new_conv), ssm=tuple(new_ssm))
    hidden = x if return_hidden else None
    return Qwen35Output(logits, new_state, tuple(conv_inputs), tuple(ssm_steps), hidden)


# --------------------------------------------------------------------------------- params
def layer_shapes(config: Qwen35Config, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one trunk layer's parameters ([out, in] for matrices)."""
    D, F = config.D, config.F
    out: dict[str, tuple[int, ...]] = {
        "attn_norm": (D,),
        "post_norm": (D,),
        "w_gate": (F, D),
        "w_up": (F, D),
        "w_down": (D, F),
    }
    if config.is_recurrent(layer):
        out.update(
            w_qkv=(config.conv_dim, D),
            w_z=(config.value_dim, D),
            conv=(config.conv_dim, config.ssm_conv_kernel),
            dt_bias=(config.Hv,),
            a=(config.Hv,),
            w_beta=(config.Hv, D),
            w_alpha=(config.Hv, D),
            ssm_norm=(config.S,),
            ssm_out=(D, config.value_dim),
        )
    else:
        out.update(attention_shapes(config))
    return out


def attention_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    H, G, E, D = config.H, config.G, config.E, config.D
    return {
        "wq": (2 * H * E, D),
        "wk": (G * E, D),
        "wv": (G * E, D),
        "q_norm": (E,),
        "k_norm": (E,),
        "wo": (D, H * E),
    }


def nextn_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Required shapes of an MTP block (optional: embed_tokens, shared_head_head/_norm)."""
    D, F = config.D, config.F
    out = {"attn_norm": (D,), "post_norm": (D,), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}
    out.update(attention_shapes(config))
    out.update(eh_proj=(D, 2 * D), enorm=(D,), hnorm=(D,))
    return out


def init_params(config: Qwen35Config, key: Array, std: float = 0.02) -> Params:
    """Random initialisation (N(0, std) matrices, unit norms, a = -exp(U(0, 1)), dt_bias 0)."""
    dtype = jnp.dtype(config.dtype)
    keys = iter(jax.random.split(key, 64 * (config.L + config.n_nextn + 2)))

    def make(name: str, shape: tuple[int, ...]) -> Array:
        if len(shape) == 1:
            if name == "a":
                return -jnp.exp(jax.random.uniform(next(keys), shape)).astype(dtype)
            if name == "dt_bias":
                return jnp.zeros(shape, dtype)
            return jnp.ones(shape, dtype)
        if name == "conv":
            return (jax.random.normal(next(keys), shape) * 0.3).astype(dtype)
        return (jax.random.normal(next(keys), shape) * std).astype(dtype)

    layers = tuple(
        {n: make(n, s) for n, s in layer_shapes(config, i).items()} for i in range(config.L)
    )
    params: Params = {
        "embed": make("embed", (config.V, config.D)),
        "layers": layers,
        "final_norm": jnp.ones((config.D,), dtype),
    }
    if not config.tie_embeddings:
        params["lm_head"] = make("lm_head", (config.V, config.D))
    if config.n_nextn:
        params["nextn"] = tuple(
            {n: make(n, s) for n, s in nextn_shapes(config).items()} for _ in range(config.n_nextn)
        )
    return params


def check_params(config: Qwen35Config, params: Params) -> None:
    """ValueError naming the first missing, extra or mis-shaped parameter."""
    want: dict[str, tuple[int, ...]] = {"embed": (config.V, config.D), "final_norm": (config.D,)}
    if not config.tie_embeddings:
        want["lm_head"] = (config.V, config.D)
    for i in range(config.L):
        want.update({f"layers.{i}.{n}": s for n, s in layer_shapes(config, i).items()})
    optional: dict[str, tuple[int, ...]] = {"embed_tokens": (config.V, config.D)}
    optional.update(shared_head_head=(config.V, config.D), shared_head_norm=(config.D,))
    for i in range(config.n_nextn):
        want.update({f"nextn.{i}.{n}": s for n, s in nextn_shapes(config).items()})
    have: dict[str, tuple[int, ...]] = {}
    for key, value in params.items():
        if key in ("layers", "nextn"):
            expected = config.L if key == "layers" else config.n_nextn
            if len(value) != expected:
                raise ValueError(f"params has {len(value)} {key} entries, config says {expected}")
            for i, layer in enumerate(value):
                for name, arr in layer.items():
                    full = f"{key}.{i}.{name}"
                    if key == "nextn" and name in optional:
                        want[full] = optional[name]
                    have[full] = tuple(arr.shape)
        else:
            have[key] = tuple(value.shape)
    for name, shape in want.items():
        if name not in have:
            raise ValueError(f"parameter {name} is missing (required by the config)")
        if have[name] != shape:
            raise ValueError(f"parameter {name} has shape {have[name]}, expected {shape}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ValueError(f"parameters not used by the config: {', '.join(extra)}")
