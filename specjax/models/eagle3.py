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
  (`specjax.models.llama._attention_over_cells`), RMSNorm and the cache layout; only the Q/K/V
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

from specjax.memory.kv import KVCache
from specjax.models import feature_head as fh
from specjax.models.feature_head import FeatureHeadConfig
from specjax.models.llama import (
    CachedCells,
    ExtraKV,
    KernelWeight,
    _attention_over_cells,
    apply_rope,
    linear,
    rms_norm,
)
from specjax.types import Array, Params

#: llama.cpp requires exactly three target layers (`extract_layers`).
N_TARGET_LAYERS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config(FeatureHeadConfig):
    """Static configuration of an EAGLE-3 head. Hashable: usable as a jit static argument."""

    KIND: ClassVar[str] = "EAGLE-3"

    #: (fields of `FeatureHeadConfig`; target_layers: llama.cpp's extract_layers, 3 ids)
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    def __post_init__(self) -> None:
        self._tuple_target_layers()
        if len(self.target_layers) != N_TARGET_LAYERS:
            raise ValueError(
                f"EAGLE-3 needs exactly {N_TARGET_LAYERS} target layers (extract_layers), "
                f"got {len(self.target_layers)}: {list(self.target_layers)}"
            )
        self.check_feature_head(
            ("vocab_size", "dim", "n_heads", "n_kv_heads", "ffn_dim", "target_hidden")
        )

    @property
    def L(self) -> int:
        return 1

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
        out.update(self.vocab_shapes())
        return out

    def num_params(self) -> int:
        """Trainable parameters of the head (d2t is an index table, not counted)."""
        return sum(math.prod(s) for k, s in self.param_shapes().items() if k != "d2t")


def init_params(config: Eagle3Config, key: Array) -> Params:
    """N(0, 0.02) matrices (residual projections / sqrt(2)), unit norms, identity d2t."""
    return fh.init_from_shapes(config.param_shapes(), key, config.dtype, fh.residual_std(1))


def check_params(config: Eagle3Config, params: Params) -> None:
    """ValueError naming the first parameter that is missing, extra or mis-shaped."""
    fh.check_shapes(config.KIND, config.param_shapes(), params)


#: The target's embedding / LM head for a head without its own (`feature_head.shared_weights`).
shared_weights = fh.shared_weights


# ------------------------------------------------------------------------------- encoder
#: [B, T, 3 * Dt]: the target's features at `target_layers` (`feature_head.gather_features`).
gather_features = fh.gather_features


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
    embed = fh.embedding(config, params, shared)
    e = rms_norm(embed[tokens_BT].astype(g_BTD.dtype), params["attn_norm"], config.norm_eps)
    gn = rms_norm(g_BTD, params["hidden_norm"], config.norm_eps)
    x = jnp.concatenate([e, gn], axis=-1)
    qkv = linear(x, params["wqkv"])
    B, T = tokens_BT.shape
    q = qkv[..., : H * E].reshape(B, T, H, E)
    k = qkv[..., H * E : (H + G) * E].reshape(B, T, G, E)
    v = qkv[..., (H + G) * E :].reshape(B, T, G, E)
    cos, sin = fh.rope(config, positions_BT)
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
    return fh.vocab_logits(config, params, shared, x)


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
    cached = CachedCells((cache.k[0], cache.v[0], cache.pos), *fh.cache_chunks(cache))
    # decode weights in the native kernel's form (`kernel_params`): the native attention too
    native = isinstance(params["wqkv"], KernelWeight)
    attn = _attention_over_cells(lc, 0, qkv.q, k, v, positions_BT, cached, extra, native)
    prenorm = decoder_out(config, params, attn, qkv.residual)
    out = head_logits(config, params, shared, prenorm)
    return DecoderCompute(out, (k,), (v,), prenorm)


#: The head's linear weights `kernel_params` gives the native CPU kernel's form.
LINEAR_WEIGHTS = ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")


def kernel_params(params: Params) -> Params:
    """`params` with the linear weights as `llama.KernelWeight` (decode and draft steps on
    `specjax.kernels.cpu`, the attention on its native kernel too). For CPU with the kernel
    available; `api` makes this form for the engine, training keeps plain arrays."""
    return fh.kernel_form(params, LINEAR_WEIGHTS)
