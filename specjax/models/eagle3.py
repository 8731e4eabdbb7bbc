"""EAGLE-3 draft head (llama.cpp's `eagle3` architecture, src/models/eagle3.cpp) as pure functions.

Two graphs over one parameter dict:

* encoder: `g = fc(RMSNorm_enc(f))` (the norm only with `norm_before_fc`), where `f` is the
  concatenation of the target's features at `target_layers` ([B, T, 3 * target_hidden]).
* decoder: ONE transformer layer with its own KV cache. Per row the inputs are a token and a
  `g` row: `e = RMSNorm(embed(tok), attn_norm)`, `gn = RMSNorm(g, hidden_norm)`; Q/K/V read
  `concat(e, gn)` (width 2D); the attention residual is `g` (or `gn` with
  `norm_before_residual`); SwiGLU FFN with pre-norm and residual. The pre-final-norm hidden
  ("prenorm") is returned as the next step's `g`; final norm -> LM head over the draft vocab
  -> scattered through `d2t` into a full-vocabulary row of -inf (when the head has a `d2t`).

Parameter dict (weights [out, in], as specjax.models.config)::

    fc          [D, 3 * Dt]         enc_norm [3 * Dt]   (only with norm_before_fc)
    attn_norm   [D]                 hidden_norm [D]
    wqkv        [(H + 2G) * E, 2D]  wo [D, H * E]
    ffn_norm    [D]                 w_gate_up [2F, D]   w_down [D, F]
    final_norm  [D]
    embed       [V, D]              only with own_embed (else the target's, in `shared`)
    lm_head     [Vd, D]             only with own_lm_head (else the target's, in `shared`)
    d2t         [Vd] int32          only when draft_vocab < vocab_size: target id of draft id i

Invariants:
* The decoder layer reuses the target's code: RoPE (`rope_angles`/`apply_rope`, rotate-half),
  attention over cache + own rows + `extra` scratch cells by position
  (`specjax.models.llama._layer_attention`), RMSNorm and the cache layout; only the Q/K/V
  input and the residual differ. `decoder_qkv` / `decoder_out` are shared with training
  (`specjax.train.eagle3`), whose attention differs (training-time test rollout).
* Like `forward_compute`, `decoder_compute` reads the cache and never writes it; `commit_kv`
  writes afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from specjax.memory.kv import KVCache, used_cells
from specjax.models.config import HeadDims, ModelConfig, float32_factors, rope_frequencies
from specjax.models.llama import (
    CACHE_CHUNK,
    ExtraKV,
    KernelWeight,
    _layer_attention,
    apply_rope,
    kernel_weight,
    linear,
    rms_norm,
    rope_angles,
)
from specjax.types import Array, Params

#: llama.cpp requires exactly three target layers (`extract_layers`).
N_TARGET_LAYERS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config(HeadDims):
    """Static configuration of an EAGLE-3 head. Hashable: usable as a jit static argument."""

    KIND: ClassVar[str] = "EAGLE-3"

    vocab_size: int  # the target's vocabulary (the full logits row)
    draft_vocab: int = 0  # the head's reduced vocabulary; 0 = vocab_size (no d2t)
    dim: int  # n_embd_dec
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0 -> dim // n_heads
    rope_theta: float = 10000.0
    #: per dimension pair divisors of the inverse frequency (llama.cpp's rope_freqs; a
    #: llama3-scaled target's head has them); empty = none
    rope_factors: tuple[float, ...] = ()
    norm_eps: float = 1e-5
    target_hidden: int  # n_embd_tgt
    target_layers: tuple[int, ...]  # extract_layers (3 ids)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    own_embed: bool = False
    own_lm_head: bool = False
    max_position: int = 4096
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        object.__setattr__(self, "rope_factors", float32_factors(self.rope_factors))
        if len(self.target_layers) != N_TARGET_LAYERS:
            raise ValueError(
                f"EAGLE-3 needs exactly {N_TARGET_LAYERS} target layers (extract_layers), "
                f"got {len(self.target_layers)}: {list(self.target_layers)}"
            )
        if any(i < 0 for i in self.target_layers):
            raise ValueError(f"target layer ids must be >= 0, got {list(self.target_layers)}")
        for name in ("vocab_size", "dim", "n_heads", "n_kv_heads", "ffn_dim", "target_hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self.check_head_dims()

    @property
    def L(self) -> int:
        return 1

    @property
    def n_embd_enc(self) -> int:
        return N_TARGET_LAYERS * self.target_hidden

    @property
    def layer_config(self) -> ModelConfig:
        """The decoder layer as a one-layer llama config (cache, RoPE and attention code)."""
        return ModelConfig(
            arch="llama",
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=1,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_factors=self.rope_factors,
            norm_eps=self.norm_eps,
            max_position=self.max_position,
            dtype=self.dtype,
        )

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        D, E, H, G, F = self.D, self.E, self.H, self.G, self.F
        out: dict[str, tuple[int, ...]] = {
            "fc": (D, self.n_embd_enc),
            "attn_norm": (D,),
            "hidden_norm": (D,),
            "wqkv": ((H + 2 * G) * E, 2 * D),
            "wo": (D, H * E),
            "ffn_norm": (D,),
            "w_gate_up": (2 * F, D),
            "w_down": (D, F),
            "final_norm": (D,),
        }
        if self.norm_before_fc:
            out["enc_norm"] = (self.n_embd_enc,)
        if self.own_embed:
            out["embed"] = (self.vocab_size, D)
        if self.own_lm_head:
            out["lm_head"] = (self.Vd, D)
        if self.has_d2t:
            out["d2t"] = (self.Vd,)
        return out

    def num_params(self) -> int:
        """Trainable parameters of the head (d2t is an index table, not counted)."""
        return sum(math.prod(s) for k, s in self.param_shapes().items() if k != "d2t")


def init_params(config: Eagle3Config, key: Array) -> Params:
    """N(0, 0.02) matrices (residual projections / sqrt(2)), unit norms, identity d2t."""
    dtype = jnp.dtype(config.dtype)
    shapes = config.param_shapes()
    keys = iter(jax.random.split(key, len(shapes)))
    out: Params = {}
    for name, shape in shapes.items():
        k = next(keys)
        if name == "d2t":
            out[name] = jnp.arange(shape[0], dtype=jnp.int32)
        elif len(shape) == 1:
            out[name] = jnp.ones(shape, dtype)
        else:
            std = 0.02 / math.sqrt(2.0) if name in ("wo", "w_down") else 0.02
            out[name] = (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)
    return out


def check_params(config: Eagle3Config, params: Params) -> None:
    """ValueError naming the first parameter that is missing, extra or mis-shaped."""
    want = config.param_shapes()
    for name, shape in want.items():
        if name not in params:
            raise ValueError(f"EAGLE-3 parameter {name} is missing (required by the config)")
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"EAGLE-3 parameter {name} has shape {tuple(params[name].shape)}, expected {shape}"
            )
    extra = sorted(set(params) - set(want))
    if extra:
        raise ValueError(f"EAGLE-3 parameters not used by the config: {', '.join(extra)}")


def shared_weights(config: Eagle3Config, target_params: Params, target_tied: bool) -> Params:
    """The target's embedding / LM head for a head without its own (llama.cpp's ctx_other)."""
    out: Params = {}
    if not config.own_embed:
        out["embed"] = target_params["embed"]
    if not config.own_lm_head:
        out["lm_head"] = target_params["embed"] if target_tied else target_params["lm_head"]
    return out


# ------------------------------------------------------------------------------- encoder
def gather_features(config: Eagle3Config, hidden: dict[int, Array]) -> Array:
    """[B, T, 3 * Dt]: the target's features at `target_layers`, interleaved per row as
    llama.cpp's `features_buf` (layer k's row at columns k * Dt .. (k + 1) * Dt)."""
    return jnp.concatenate([hidden[i] for i in config.target_layers], axis=-1)


def encode(config: Eagle3Config, params: Params, feats_BTF: Array) -> Array:
    """The encoder graph: `fc(RMSNorm_enc(f))` -> g rows [B, T, D]."""
    x = feats_BTF.astype(jnp.dtype(config.dtype))
    if config.norm_before_fc:
        x = rms_norm(x, params["enc_norm"], config.norm_eps)
    return linear(x, params["fc"])


# ------------------------------------------------------------------------------- decoder
class DecoderQKV(NamedTuple):
    q: Array  # [B, T, H, E] rotated
    k: Array  # [B, T, G, E] rotated
    v: Array  # [B, T, G, E]
    residual: Array  # [B, T, D]


def decoder_qkv(
    config: Eagle3Config,
    params: Params,
    shared: Params,
    tokens_BT: Array,
    g_BTD: Array,
    positions_BT: Array,
) -> DecoderQKV:
    """Q/K/V of the decoder layer from `concat(RMSNorm(embed(tok)), RMSNorm_2(g))`."""
    E, H, G = config.E, config.H, config.G
    embed = params["embed"] if config.own_embed else shared["embed"]
    e = rms_norm(embed[tokens_BT].astype(g_BTD.dtype), params["attn_norm"], config.norm_eps)
    gn = rms_norm(g_BTD, params["hidden_norm"], config.norm_eps)
    x = jnp.concatenate([e, gn], axis=-1)
    qkv = linear(x, params["wqkv"])
    B, T = tokens_BT.shape
    q = qkv[..., : H * E].reshape(B, T, H, E)
    k = qkv[..., H * E : (H + G) * E].reshape(B, T, G, E)
    v = qkv[..., (H + G) * E :].reshape(B, T, G, E)
    inv_freq = jnp.asarray(rope_frequencies(config.layer_config), jnp.float32)
    cos, sin = rope_angles(positions_BT, inv_freq)
    residual = gn if config.norm_before_residual else g_BTD
    return DecoderQKV(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual)


def decoder_out(config: Eagle3Config, params: Params, attn_BTI: Array, residual: Array) -> Array:
    """Output projection, residual, SwiGLU FFN: the pre-norm hidden ("prenorm", next g)."""
    x = residual + linear(attn_BTI, params["wo"])
    h = rms_norm(x, params["ffn_norm"], config.norm_eps)
    gate_up = linear(h, params["w_gate_up"])
    gate, up = gate_up[..., : config.F], gate_up[..., config.F :]
    return x + linear(jax.nn.silu(gate) * up, params["w_down"])


def head_logits(config: Eagle3Config, params: Params, shared: Params, prenorm: Array) -> Array:
    """Final norm -> LM head over the draft vocabulary -> full-vocabulary row [..., V] float32
    (-inf at target ids no draft id maps to when the head has a d2t table)."""
    x = rms_norm(prenorm, params["final_norm"], config.norm_eps)
    head = params["lm_head"] if config.own_lm_head else shared["lm_head"]
    logits = linear(x, head, preferred_element_type=jnp.float32)
    if not config.has_d2t:
        return logits
    full = jnp.full(logits.shape[:-1] + (config.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., params["d2t"]].set(logits)


class DecoderCompute(NamedTuple):
    logits: Array  # [B, T, V] float32
    k: tuple[Array, ...]  # ([B, T, G, E],) in the cache's dtype
    v: tuple[Array, ...]
    prenorm: Array  # [B, T, D]


def decoder_compute(
    config: Eagle3Config,
    params: Params,
    shared: Params,
    tokens_BT: Array,
    g_BTD: Array,
    positions_BT: Array,
    cache: KVCache,
    *,
    extra: ExtraKV | None = None,
) -> DecoderCompute:
    """The decoder graph over rows `(token, g)` at `positions` (-1 = padding); the cache is
    read, never written (see `commit_kv`)."""
    lc = config.layer_config
    qkv = decoder_qkv(config, params, shared, tokens_BT, g_BTD, positions_BT)
    k = qkv.k.astype(cache.k[0].dtype)
    v = qkv.v.astype(cache.v[0].dtype)
    chunk = min(CACHE_CHUNK, cache.capacity)
    used = used_cells(cache.pos)
    n_chunks = (used + chunk - 1) // chunk
    # decode weights in the native kernel's form (`kernel_params`): the native attention too
    native = isinstance(params["wqkv"], KernelWeight)
    attn = _layer_attention(lc, 0, qkv.q, k, v, positions_BT, cache, n_chunks, extra, native, used)
    prenorm = decoder_out(config, params, attn, qkv.residual)
    out = head_logits(config, params, shared, prenorm)
    return DecoderCompute(out, (k,), (v,), prenorm)


#: The head's linear weights `kernel_params` gives the native CPU kernel's form.
LINEAR_WEIGHTS = ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")


def kernel_params(params: Params) -> Params:
    """`params` with the linear weights as `llama.KernelWeight` (decode and draft steps on
    `specjax.kernels.cpu`, the attention on its native kernel too). For CPU with the kernel
    available; `api` makes this form for the engine, training keeps plain arrays."""
    return {k: kernel_weight(v) if k in LINEAR_WEIGHTS else v for k, v in params.items()}
