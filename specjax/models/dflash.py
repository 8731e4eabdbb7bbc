"""DFlash / DSpark block drafter (llama.cpp's `dflash` architecture, src/models/dflash.cpp).

A Qwen3-style stack of `n_layers` decoder layers (pre-norm, Q/K RMSNorm, NeoX RoPE, SwiGLU)
with its own KV cache, driven in two modes:

* KV injection (`inject_kv`, upstream's embedding batch): `g = RMSNorm_enc(fc(f) * fc_scale)`
  where `f` is the concatenation of the target's features at `target_layers` (any count >= 1,
  interleaved per row as upstream's `features_buf`); per layer `K = RoPE(k_norm(wk g))`,
  `V = wv g` at the rows' real positions. No attention, no output.
* block denoising (`block_forward`, upstream's token batch): the block `[id_last, MASK ...]`
  is embedded with the (target's) token embedding and run through the layers; attention
  reads the injected context plus the whole block WITHOUT a causal mask inside the block
  (every block row sees every block row); final norm -> LM head (the target's unless the
  head has its own) -> scattered through `d2t` into a full-vocabulary row of -inf.
* DSpark Markov head (`markov_head`, in-graph per block): `prev` = the anchor token; for
  block position i from `i_draft_beg` (0 with `sample_from_anchor`, else 1):
  `bias = markov_w2 . markov_w1[prev]` (scattered through d2t), `logits_i += bias`,
  `conf_i = sigmoid(conf_proj . [h_i ; markov_w1[prev]] + b)` with `h_i` the final-normed
  hidden, then `prev = argmax(logits_i)` (a greedy chain, whatever the sampling).

Parameter dict (weights [out, in], as specjax.models.config)::

    fc          [D, n_target_layers * Dt]   fc_scale [1] (optional)
    enc_norm    [D]                         final_norm [D]
    layers      tuple of {attn_norm [D], wqkv [(H + 2G) E, D], q_norm [E], k_norm [E],
                          wo [D, H E], ffn_norm [D], w_gate_up [2F, D], w_down [D, F]}
    embed       [V, D]        only with own_embed (else the target's, in `shared`)
    lm_head     [Vd, D]       only with own_lm_head (else the target's, in `shared`)
    d2t         [Vd] int32    only when draft_vocab < vocab_size
    markov_w1   [V, R]        DSpark (markov_rank R > 0)
    markov_w2   [Vd, R]       DSpark; markov_w2_scale [1] optional
    conf_proj   [1, D + R]    DSpark with a confidence head; conf_proj_b [1]

Invariants: `block_forward` and `inject_kv` read the cache and never write it (the caller
commits with `specjax.models.llama.commit_kv`); the attention and RoPE are the target's code
(`specjax.models.llama.attend_segments`: the CPU kernel when the head's weights are in the
kernel form, else XLA; `apply_rope`), non-causality comes from giving every block query the
mask position of the block's last row while RoPE uses the real positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from specjax.memory.kv import KVCache
from specjax.models import feature_head as fh
from specjax.models import llama
from specjax.models.feature_head import FeatureHeadConfig
from specjax.types import Array, Params, alias

#: `dflash.block_size` when the metadata key is absent (upstream's default).
DEFAULT_BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig(FeatureHeadConfig):
    """Static configuration of a DFlash / DSpark head. Hashable (a jit static argument)."""

    KIND: ClassVar[str] = "DFlash"
    LAYER_ARCH: ClassVar[str] = "qwen3"
    LAYER_QK_NORM: ClassVar[bool] = True

    #: (fields of `FeatureHeadConfig`)
    norm_eps: float = 1e-6
    n_layers: int
    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int
    #: DSpark: rank of the Markov head (0 = plain DFlash)
    markov_rank: int = 0
    has_confidence: bool = True  # DSpark only
    sample_from_anchor: bool = True  # DSpark only (`dflash.sample_from_anchor`)
    fc_scale: bool = False
    markov_w2_scale: bool = False

    def __post_init__(self) -> None:
        self._tuple_target_layers()
        if not self.target_layers:
            raise ValueError("DFlash needs at least one target layer (target_layers)")
        self.check_feature_head(
            ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "target_hidden")
        )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be in 0..{self.vocab_size - 1}, got {self.mask_token_id}"
            )
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")

    L = alias("n_layers")
    R = alias("markov_rank")

    @property
    def is_dspark(self) -> bool:
        return self.markov_rank > 0

    def describe(self) -> str:
        return "DSpark head" if self.is_dspark else "DFlash head"

    def max_draft(self, dspark: bool) -> int:
        """Upstream's clamp: block_size - 1 tokens for DFlash (the block is `[id_last, MASK x
        (block_size - 1)]`), block_size for DSpark reading from the anchor."""
        return self.block_size if dspark and self.sample_from_anchor else self.block_size - 1

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        D, E, H, G, F = self.D, self.E, self.H, self.G, self.F
        return {
            "attn_norm": (D,),
            "wqkv": ((H + 2 * G) * E, D),
            "q_norm": (E,),
            "k_norm": (E,),
            "wo": (D, H * E),
            "ffn_norm": (D,),
            "w_gate_up": (2 * F, D),
            "w_down": (D, F),
        }

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Top-level parameters (the per-layer ones: `layer_shapes`)."""
        D = self.D
        out: dict[str, tuple[int, ...]] = {
            "fc": (D, self.n_embd_enc),
            "enc_norm": (D,),
            "final_norm": (D,),
        }
        if self.fc_scale:
            out["fc_scale"] = (1,)
        out.update(self.vocab_shapes())
        if self.is_dspark:
            out["markov_w1"] = (self.V, self.R)
            out["markov_w2"] = (self.Vd, self.R)
            if self.markov_w2_scale:
                out["markov_w2_scale"] = (1,)
            if self.has_confidence:
                out["conf_proj"] = (1, D + self.R)
                out["conf_proj_b"] = (1,)
        return out

    def num_params(self) -> int:
        """Trainable parameters (d2t is an index table, not counted)."""
        top = sum(math.prod(s) for k, s in self.param_shapes().items() if k != "d2t")
        return top + self.L * sum(math.prod(s) for s in self.layer_shapes().values())


def init_params(config: DFlashConfig, key: Array) -> Params:
    """N(0, 0.02) matrices (residual projections / sqrt(2L)), unit norms, identity d2t."""
    out_std = fh.residual_std(config.L)
    k_top, *k_layers = jax.random.split(key, 1 + config.L)

    def fill(shapes: dict[str, tuple[int, ...]], key: Array) -> Params:
        return fh.init_from_shapes(shapes, key, config.dtype, out_std, zeros=("conf_proj_b",))

    params = fill(config.param_shapes(), k_top)
    params["layers"] = tuple(fill(config.layer_shapes(), k) for k in k_layers)
    return params


def check_params(config: DFlashConfig, params: Params) -> None:
    """ValueError naming the first parameter that is missing, extra or mis-shaped."""
    fh.check_shapes(config.KIND, config.param_shapes(), params, also=("layers",))
    layers = params.get("layers", ())
    if len(layers) != config.L:
        raise ValueError(f"DFlash head has {len(layers)} layers, the config says {config.L}")
    for i, layer in enumerate(layers):
        fh.check_shapes(config.KIND, config.layer_shapes(), layer, f"layers[{i}].")


#: The target's embedding / LM head for a head without its own (`feature_head.shared_weights`).
shared_weights = fh.shared_weights


# ------------------------------------------------------------------------------- encoder
#: [B, T, n * Dt]: the target's features at `target_layers` (`feature_head.gather_features`).
gather_features = fh.gather_features


def encode(config: DFlashConfig, params: Params, feats_BTF: Array) -> Array:
    """The encoder: `RMSNorm_enc(fc(f) [* fc_scale])` -> g rows [B, T, D]."""
    x = llama.linear(feats_BTF.astype(jnp.dtype(config.dtype)), params["fc"])
    if config.fc_scale:
        x = x * params["fc_scale"][0]
    return llama.rms_norm(x, params["enc_norm"], config.norm_eps)


class LayerKV(NamedTuple):
    k: tuple[Array, ...]  # per layer [B, T, G, E], rotated, in the cache's dtype
    v: tuple[Array, ...]


def inject_kv(
    config: DFlashConfig,
    params: Params,
    g_BTD: Array,
    positions_BT: Array,
    cache: KVCache | None = None,
) -> LayerKV:
    """K/V of every layer computed from `g` (k_norm + RoPE on K; V as is): the KV injection."""
    E, G = config.E, config.G
    B, T, _ = g_BTD.shape
    cos, sin = fh.rope(config, positions_BT)
    ks, vs = [], []
    for i, layer in enumerate(params["layers"]):
        # Q's rows of wqkv are computed and dropped: one product on the fused matrix (a
        # `llama.KernelWeight` on CPU cannot be sliced), and Q is a third of it
        kv = llama.linear(g_BTD, layer["wqkv"])[..., config.H * E :]
        k = llama.rms_norm(kv[..., : G * E].reshape(B, T, G, E), layer["k_norm"], config.norm_eps)
        v = kv[..., G * E :].reshape(B, T, G, E)
        k = llama.apply_rope(k, cos, sin)
        if cache is not None:
            k, v = k.astype(cache.k[i].dtype), v.astype(cache.v[i].dtype)
        ks.append(k)
        vs.append(v)
    return LayerKV(tuple(ks), tuple(vs))


class BlockOutput(NamedTuple):
    logits: Array  # [B, W, V] float32 (Markov bias added for DSpark)
    hidden: Array  # [B, W, D] final-normed hidden (the confidence head's input)
    conf: Array | None  # [B, W] float32 DSpark confidence (None without a confidence head)


def head_logits(config: DFlashConfig, params: Params, shared: Params, h_norm: Array) -> Array:
    """LM head over the draft vocabulary -> full-vocabulary row (-inf off d2t)."""
    return fh.vocab_logits(config, params, shared, h_norm)


def markov_head(
    config: DFlashConfig,
    params: Params,
    base_BWV: Array,
    hidden_BWD: Array,
    anchor_B: Array,
    prev_BW: Array | None = None,
) -> tuple[Array, Array | None]:
    """DSpark's in-graph Markov chain over the block (upstream `build_dspark_markov_head`):
    biased logits [B, W, V] and sigmoid confidences [B, W] (None without a confidence head;
    slot 0 without `sample_from_anchor` is padding, never read). `prev_BW` (training:
    teacher forcing) gives each row's previous token instead of the greedy chain."""
    W = base_BWV.shape[1]
    beg = 0 if config.sample_from_anchor else 1
    w1, w2 = params["markov_w1"], params["markov_w2"]
    prev = anchor_B.astype(jnp.int32)
    cols = [base_BWV[:, 0]] if beg else []
    confs = [jax.nn.sigmoid(base_BWV[:, 0, 0])] if beg else []
    for i in range(beg, W):
        if prev_BW is not None:
            prev = prev_BW[:, i].astype(jnp.int32)
        w1_prev = w1[prev].astype(jnp.float32)  # [B, R]
        bias = jnp.einsum("vr,br->bv", w2.astype(jnp.float32), w1_prev)
        if config.markov_w2_scale:
            bias = bias * params["markov_w2_scale"][0]
        bias = fh.to_full_vocab(config, params, bias, 0.0)
        col = base_BWV[:, i] + bias
        cols.append(col)
        if config.has_confidence:
            feat = jnp.concatenate([hidden_BWD[:, i].astype(jnp.float32), w1_prev], axis=-1)
            c = feat @ params["conf_proj"][0].astype(jnp.float32) + params["conf_proj_b"][0]
            confs.append(jax.nn.sigmoid(c))
        prev = jnp.argmax(col, axis=-1).astype(jnp.int32)
    logits = jnp.stack(cols, axis=1)
    conf = jnp.stack(confs, axis=1) if config.has_confidence else None
    return logits, conf


def block_forward(
    config: DFlashConfig,
    params: Params,
    shared: Params,
    tokens_BW: Array,
    positions_BW: Array,
    mask_pos_BW: Array,
    cache: KVCache | None,
    ctx: tuple[LayerKV, Array] | None = None,
    prev_BW: Array | None = None,
) -> BlockOutput:
    """Block denoising: logits (+ DSpark bias) and confidences of every block row, and the
    final-normed hidden [B, W, D]. The layers run with RoPE at `positions` (-1 = padding,
    never attended) and attention visibility from `mask_pos` (a query sees every key at
    position <= its mask position: the block's last position for every block row gives
    non-causal attention). Context: the cache and/or an explicit `(kv, pos [B, C])`
    (training). `prev_BW` (training): the DSpark chain's teacher-forced previous tokens
    (`markov_head`)."""
    E, H, G = config.E, config.H, config.G
    x = fh.embedding(config, params, shared)[tokens_BW].astype(jnp.dtype(config.dtype))
    B, W, _ = x.shape
    cos, sin = fh.rope(config, positions_BW)
    # per layer: the cached cells the block reads (none without a cache)
    cells: list[llama.CachedCells | None] = [None] * len(params["layers"])
    if cache is not None:
        n_chunks, used = fh.cache_chunks(cache)
        cells = [
            llama.CachedCells((k, v, cache.pos), n_chunks, used) for k, v in zip(cache.k, cache.v)
        ]
    # the kernel form of the weights (`kernel_params`, CPU) runs the attention on the native
    # kernel too: the block's rows over its own cells and the cached ones, a call each
    native = bool(params["layers"]) and isinstance(params["layers"][0]["wqkv"], llama.KernelWeight)
    for i, layer in enumerate(params["layers"]):
        h = llama.rms_norm(x, layer["attn_norm"], config.norm_eps)
        qkv = llama.linear(h, layer["wqkv"])
        q = llama.rms_norm(qkv[..., : H * E].reshape(B, W, H, E), layer["q_norm"], config.norm_eps)
        k = llama.rms_norm(
            qkv[..., H * E : (H + G) * E].reshape(B, W, G, E), layer["k_norm"], config.norm_eps
        )
        v = qkv[..., (H + G) * E :].reshape(B, W, G, E)
        q = llama.apply_rope(q, cos, sin)
        k = llama.apply_rope(k, cos, sin)
        if cache is not None:
            k = k.astype(cache.k[i].dtype)
            v = v.astype(cache.v[i].dtype)
        qg = q.reshape(B, W, G, H // G, E).transpose(0, 2, 3, 1, 4)
        own = [(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions_BW)]
        if ctx is not None:
            kv, ctx_pos = ctx
            own.append((kv.k[i].transpose(0, 2, 1, 3), kv.v[i].transpose(0, 2, 1, 3), ctx_pos))
        attn = llama.attend_segments(qg, own, mask_pos_BW, 0, cells[i], native)
        attn = attn.transpose(0, 3, 1, 2, 4).reshape(B, W, H * E)
        x = x + llama.linear(attn, layer["wo"])
        h = llama.rms_norm(x, layer["ffn_norm"], config.norm_eps)
        gate_up = llama.linear(h, layer["w_gate_up"])
        gate, up = gate_up[..., : config.F], gate_up[..., config.F :]
        x = x + llama.linear(jax.nn.silu(gate) * up, layer["w_down"])
    h = llama.rms_norm(x, params["final_norm"], config.norm_eps)
    logits = head_logits(config, params, shared, h)
    conf = None
    if config.is_dspark:
        logits, conf = markov_head(config, params, logits, h, tokens_BW[:, 0], prev_BW)
    return BlockOutput(logits, h, conf)


def kernel_params(params: Params) -> Params:
    """`params` with `fc`, every layer's linear weights and an own LM head as
    `llama.KernelWeight` (few-row products on `specjax.kernels.cpu` instead of XLA's dots and
    YNNPACK fusions, which cost ~0.1-0.3 ms each per round at a block's few rows). For CPU
    with the kernel available; `api` makes this form for the engine, training keeps plain
    arrays."""
    out = dict(params)
    out["fc"] = llama.kernel_weight(params["fc"])
    if "lm_head" in params:
        out["lm_head"] = llama.kernel_weight(params["lm_head"])
    out["layers"] = tuple(fh.kernel_form(layer, llama.LINEAR_WEIGHTS) for layer in params["layers"])
    return out
