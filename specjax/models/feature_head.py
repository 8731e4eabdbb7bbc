"""What the feature-drafter heads (EAGLE-3 `specjax.models.eagle3`, DFlash / DSpark
`specjax.models.dflash`) share: the config base, parameter init and shape checks, the
target weights a head borrows, the gathered target features and the draft-vocabulary LM head.

A head reads the target's hidden rows at `target_layers` (their concatenation, layer k's row
at columns k * Dt .. (k + 1) * Dt: llama.cpp's `features_buf`), borrows the target's token
embedding and LM head unless it has its own (`own_embed`, `own_lm_head`; llama.cpp's
`ctx_other`), and scores a reduced draft vocabulary of `Vd` ids that `d2t` maps to target ids
(a full-vocabulary row of -inf elsewhere). Its layers are target-style layers described by a
llama `ModelConfig` (`layer_config`) so that the cache, RoPE and attention code is the
target's.

Invariants: every function here is pure and keeps the callers' numbers bit for bit (the same
key splits, the same operations in the same order as the heads' former copies).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.memory.kv import KVCache, used_cells
from specjax.models.config import HeadDims, ModelConfig, float32_factors, rope_frequencies
from specjax.models.llama import CACHE_CHUNK, kernel_weight, linear, rope_angles
from specjax.types import Array, Params

#: The head's fields its layers' llama config (`layer_config`) takes as they are.
_LAYER_FIELDS = (
    *("vocab_size", "dim", "n_heads", "n_kv_heads", "ffn_dim", "head_dim", "rope_theta"),
    "rope_factors",
    *("norm_eps", "max_position", "dtype"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureHeadConfig(HeadDims):
    """The fields every feature head's config has (a frozen, hashable dataclass: a jit
    static argument); subclasses add their own and a layer count `L`."""

    vocab_size: int  # the target's vocabulary (the full logits row)
    draft_vocab: int = 0  # the head's reduced vocabulary; 0 = vocab_size (no d2t)
    dim: int  # the head's width (n_embd_dec)
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0 -> dim // n_heads
    rope_theta: float = 10000.0
    #: per dimension pair divisors of the inverse frequency (llama.cpp's rope_freqs; a
    #: llama3-scaled target's head has them); empty = none
    rope_factors: tuple[float, ...] = ()
    norm_eps: float = 1e-5
    target_hidden: int  # the target's width (n_embd_tgt)
    target_layers: tuple[int, ...]  # the target layers whose features the head reads
    own_embed: bool = False  # else the target's token embedding (`shared_weights`)
    own_lm_head: bool = False  # else the target's LM head
    max_position: int = 4096
    dtype: str = "float32"

    #: the architecture of `layer_config` (its RoPE style) and whether its layers norm Q/K
    LAYER_ARCH: ClassVar[str] = "llama"
    LAYER_QK_NORM: ClassVar[bool] = False

    @property
    def L(self) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        """The head's kind in logs ("EAGLE-3 head")."""
        return f"{self.KIND} head"

    def _tuple_target_layers(self) -> None:
        """Normalise the sequence fields: target_layers as ints, rope_factors as float32."""
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        object.__setattr__(self, "rope_factors", float32_factors(self.rope_factors))

    def check_feature_head(self, positive: tuple[str, ...]) -> None:
        """ValueError naming the numbers for negative layer ids, a non-positive field of
        `positive` or an impossible head split (`check_head_dims`)."""
        if any(i < 0 for i in self.target_layers):
            raise ValueError(f"target layer ids must be >= 0, got {list(self.target_layers)}")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self.check_head_dims()

    def vocab_shapes(self) -> dict[str, tuple[int, ...]]:
        """The head's own vocabulary weights (`param_shapes`' entries, in this order): its
        token embedding and LM head when it does not share the target's (`own_embed`,
        `own_lm_head`), its draft-to-target id table when it has a reduced vocabulary."""
        out: dict[str, tuple[int, ...]] = {}
        if self.own_embed:
            out["embed"] = (self.V, self.D)
        if self.own_lm_head:
            out["lm_head"] = (self.Vd, self.D)
        if self.has_d2t:
            out["d2t"] = (self.Vd,)
        return out

    @property
    def n_embd_enc(self) -> int:
        """Width of the gathered features: one target hidden row per target layer."""
        return len(self.target_layers) * self.target_hidden

    @property
    def layer_config(self) -> ModelConfig:
        """The head's layers as a llama-family config (cache layout, RoPE frequencies and the
        attention code)."""
        fields = self.to_dict()
        return ModelConfig(
            arch=self.LAYER_ARCH,
            n_layers=self.L,
            qk_norm=self.LAYER_QK_NORM,
            **{k: fields[k] for k in _LAYER_FIELDS},
        )


def init_from_shapes(
    shapes: Mapping[str, tuple[int, ...]],
    key: Array,
    dtype: str,
    out_std: float,
    zeros: Collection[str] = (),
) -> Params:
    """Parameters of `shapes`, one key each from `split(key, len(shapes))`: N(0, 0.02)
    matrices (`wo` / `w_down`: N(0, out_std)), unit vectors (`zeros`: zero), an identity
    `d2t`."""
    dt = jnp.dtype(dtype)
    keys = iter(jax.random.split(key, len(shapes)))
    out: Params = {}
    for name, shape in shapes.items():
        k = next(keys)
        if name == "d2t":
            out[name] = jnp.arange(shape[0], dtype=jnp.int32)
        elif name in zeros:
            out[name] = jnp.zeros(shape, dt)
        elif len(shape) == 1:
            out[name] = jnp.ones(shape, dt)
        else:
            std = out_std if name in ("wo", "w_down") else 0.02
            out[name] = (jax.random.normal(k, shape, jnp.float32) * std).astype(dt)
    return out


def check_shapes(
    kind: str,
    want: Mapping[str, tuple[int, ...]],
    got: Mapping[str, Array],
    where: str = "",
    also: Collection[str] = (),
) -> None:
    """ValueError naming the first parameter of `got` that is missing, mis-shaped or extra
    against `want` (`also`: names `got` may hold besides, checked elsewhere)."""
    for name, shape in want.items():
        if name not in got:
            raise ValueError(f"{kind} parameter {where}{name} is missing (required by the config)")
        if tuple(got[name].shape) != shape:
            raise ValueError(
                f"{kind} parameter {where}{name} has shape {tuple(got[name].shape)}, "
                f"expected {shape}"
            )
    extra = sorted(set(got) - set(want) - set(also))
    if extra:
        raise ValueError(f"{kind} parameters not used by the config: {', '.join(extra)}")


def shared_weights(config: FeatureHeadConfig, target_params: Params, target_tied: bool) -> Params:
    """The target's embedding / LM head for a head without its own (llama.cpp's ctx_other)."""
    out: Params = {}
    if not config.own_embed:
        out["embed"] = target_params["embed"]
    if not config.own_lm_head:
        out["lm_head"] = target_params["embed"] if target_tied else target_params["lm_head"]
    return out


def embedding(config: FeatureHeadConfig, params: Params, shared: Params) -> Array:
    """The token embedding the head reads: its own or the target's."""
    return params["embed"] if config.own_embed else shared["embed"]


def gather_features(config: FeatureHeadConfig, hidden: dict[int, Array]) -> Array:
    """[B, T, n * Dt]: the target's features at `target_layers`, layer k's row at columns
    k * Dt .. (k + 1) * Dt (llama.cpp's `features_buf`)."""
    return jnp.concatenate([hidden[i] for i in config.target_layers], axis=-1)


def to_full_vocab(config: HeadDims, params: Params, draft_rows: Array, fill: float) -> Array:
    """Draft-vocabulary rows [..., Vd] float32 scattered through `d2t` into full rows
    [..., V] of `fill` (the rows as they are without a d2t table)."""
    if not config.has_d2t:
        return draft_rows
    full = jnp.full(draft_rows.shape[:-1] + (config.vocab_size,), fill, jnp.float32)
    return full.at[..., params["d2t"]].set(draft_rows)


def vocab_logits(config: FeatureHeadConfig, params: Params, shared: Params, x: Array) -> Array:
    """LM head (its own or the target's) over the draft vocabulary on normed rows `x` ->
    full-vocabulary logits [..., V] float32 (-inf at target ids no draft id maps to)."""
    head = params["lm_head"] if config.own_lm_head else shared["lm_head"]
    logits = linear(x, head, preferred_element_type=jnp.float32)
    return to_full_vocab(config, params, logits, -jnp.inf)


def residual_std(n_layers: int) -> float:
    """Init std of the residual projections (`wo`, `w_down`) of an n-layer head."""
    return 0.02 / math.sqrt(2.0 * n_layers)


def rope(config: FeatureHeadConfig, positions_BT: Array) -> tuple[Array, Array]:
    """(cos, sin) of the head's layers at `positions` (the target's RoPE code)."""
    inv_freq = jnp.asarray(rope_frequencies(config.layer_config), jnp.float32)
    return rope_angles(positions_BT, inv_freq)


def cache_chunks(cache: KVCache) -> tuple[Array, Array]:
    """(chunks of `CACHE_CHUNK` cells the attention reads, cells in use) of a head's cache."""
    chunk = min(CACHE_CHUNK, cache.capacity)
    used = used_cells(cache.pos)
    return (used + chunk - 1) // chunk, used


def kernel_form(params: Params, names: Collection[str]) -> Params:
    """`params` with the weights named in `names` as `llama.KernelWeight` (the native CPU
    kernel's form), the others as they are."""
    return {k: kernel_weight(v) if k in names else v for k, v in params.items()}
