"""Static model configuration and the parameter layout every loader/writer must produce.

Parameter pytree (plain dicts/tuples; weights stored [out, in], never upcast in the graph):

    params = {
      "embed":      [V, D],
      "layers": (                      # a tuple, one dict per layer
        {
          "attn_norm": [D],
          "wqkv":      [(H + 2G) * E, D],  # rows: H query heads, then G key heads, then G value heads
          "bqkv":      [(H + 2G) * E],     # only when config.qkv_bias (qwen2)
          "q_norm":    [E],                # only when config.qk_norm (qwen3, gemma3)
          "k_norm":    [E],                # only when config.qk_norm (qwen3, gemma3)
          "wo":        [D, H * E],
          "post_attn_norm": [D],           # only gemma3 (norm of the attention output)
          "ffn_norm":  [D],
          "w_gate_up": [2F, D],            # rows: F gate rows, then F up rows
          "w_down":    [D, F],
          "post_ffn_norm": [D],            # only gemma3 (norm of the MLP output)
          # a mixture-of-experts layer (config.is_moe_layer(i), arch qwen3moe) has instead of
          # w_gate_up / w_down (X = n_experts, F' = expert_ffn_dim; specjax.models.moe), the
          # experts input-major ([in, out] per expert, unlike the other weights):
          "router":          [X, D],
          "experts_gate_up": [X, D, 2F'],  # per expert: F' gate columns, then F' up columns
          "experts_down":    [X, F', D],
        }, ...),
      "final_norm": [D],
      "lm_head":    [V, D],            # absent when config.tie_embeddings
    }

RoPE uses the "rotate half" (NeoX / Hugging Face) layout: dimension i pairs with i + E/2.
GGUF `llama` files store Q/K rows permuted for interleaved RoPE; the GGUF loader undoes that.
Pair i turns at theta^(-2i/E) / factor_i: the factors are `rope_factors` when given (llama.cpp's
rope_freqs tensor, whatever produced it), else computed from `rope_scaling` (llama3), else 1.

Gemma 3 (`arch="gemma3"`, transformers' Gemma3ForCausalLM, llama.cpp's `gemma3`): the same
layer with embeddings scaled by sqrt(D), the attention and MLP outputs RMS-normed before the
residual add (`post_attn_norm`, `post_ffn_norm`), q/k norms, a GELU (tanh) gated MLP, queries
scaled by `attn_scale`, RoPE base `rope_theta_swa` (unscaled) on sliding-window layers and
`rope_theta` on the others (their linear scaling: `rope_factors` all equal to the factor), and
an optional final logit soft-cap. Its RMSNorm multiplies by (1 + w): every gemma3 norm weight is stored with the
1 added (as llama.cpp's converter stores it), so `rms_norm` is the llama one.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, ClassVar, Self

from specjax.types import alias

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")
DTYPES = ("float32", "float16", "bfloat16")


def float32_factors(values: Any) -> tuple[float, ...]:
    """RoPE factors as the float32 values a GGUF's rope_freqs tensor holds (so a config and its
    saved-and-loaded copy compare equal)."""
    try:
        return tuple(struct.unpack(f"{len(values)}f", struct.pack(f"{len(values)}f", *values)))
    except (OverflowError, struct.error) as e:
        raise ValueError(f"rope_factors must be float32 numbers: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type = "llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


class DecoderDims:
    """The dimension keys (specjax.types) of a decoder's sizes, shared by the model configs
    (`ModelConfig`, qwen35's) and the feature-drafter heads' (`HeadDims`): a frozen dataclass
    with `vocab_size`, `dim`, `n_heads`, `n_kv_heads`, `head_dim` (0 = dim / n_heads) and
    `ffn_dim` fields inherits them."""

    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int

    V = alias("vocab_size")
    D = alias("dim")
    H = alias("n_heads")
    G = alias("n_kv_heads")
    F = alias("ffn_dim")

    @property
    def E(self) -> int:
        return self.head_dim or self.dim // self.n_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(DecoderDims):
    """Everything static about a Llama-family decoder. Hashable: usable as a jit static arg."""

    arch: str = "llama"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0 -> dim // n_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per dimension pair [E/2]: the inverse frequency is divided by it (llama.cpp's rope_freqs;
    # kept as float32 values, as the tensor holds them). Empty = from rope_scaling; never both.
    rope_factors: tuple[float, ...] = ()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0  # 0 = no sliding-window layers
    # Per layer: True = sliding-window layer. Empty with sliding_window > 0 means every layer.
    swa_layers: tuple[bool, ...] = ()
    max_position: int = 4096  # training context (metadata only; capacity is per cache)
    dtype: str = "float32"
    # Gemma 3 (`arch="gemma3"`; the defaults leave the other archs as they were):
    rope_theta_swa: float = 0.0  # RoPE base of the sliding-window layers (0 = rope_theta)
    attn_scale: float = 0.0  # the queries' score scale (0 = 1 / sqrt(head_dim))
    final_logit_softcap: float = 0.0  # logits = c * tanh(logits / c) (0 = off)
    # Mixture of experts (arch qwen3moe; specjax.models.moe): 0 experts = dense FFNs.
    n_experts: int = 0
    n_experts_used: int = 0  # top-k experts per token
    expert_ffn_dim: int = 0  # each expert's feed-forward width F'
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum 1
    # Per layer: True = mixture-of-experts FFN, False = dense (ffn_dim). Empty with
    # n_experts > 0 means every layer.
    moe_layers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(ARCHS)}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim == 0 and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads})")
        if self.E % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.E}")
        if self.swa_layers and len(self.swa_layers) != self.n_layers:
            raise ValueError(
                f"swa_layers has {len(self.swa_layers)} entries for {self.n_layers} layers"
            )
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.arch == "gemma3" and not self.qk_norm:
            raise ValueError("gemma3 has q/k norms: qk_norm must be True")
        for name in ("rope_theta_swa", "attn_scale", "final_logit_softcap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "rope_factors", float32_factors(self.rope_factors))
        if self.rope_factors:
            if self.rope_scaling is not None:
                raise ValueError("give rope_factors or rope_scaling, not both")
            if len(self.rope_factors) != self.E // 2:
                raise ValueError(
                    f"rope_factors has {len(self.rope_factors)} entries; head_dim {self.E} "
                    f"has {self.E // 2} dimension pairs"
                )
            bad = [f for f in self.rope_factors if not (math.isfinite(f) and f > 0)]
            if bad:
                raise ValueError(f"rope_factors must be finite and positive, got {bad[:4]}")
        self._check_experts()

    def _check_experts(self) -> None:
        moe = self.arch == "qwen3moe"
        if moe != (self.n_experts > 0):
            raise ValueError(
                f"arch {self.arch!r} with n_experts={self.n_experts}: qwen3moe has experts "
                "(n_experts > 0), the other architectures none"
            )
        if not moe:
            if self.moe_layers:
                raise ValueError(f"moe_layers given for arch {self.arch!r}, which has no experts")
            return
        if not self.qk_norm:
            raise ValueError("qwen3moe has q/k norm: set qk_norm=True")
        if not 1 <= self.n_experts_used <= self.n_experts:
            raise ValueError(
                f"n_experts_used must be in 1..n_experts ({self.n_experts}), "
                f"got {self.n_experts_used}"
            )
        if self.expert_ffn_dim <= 0:
            raise ValueError(f"expert_ffn_dim must be positive, got {self.expert_ffn_dim}")
        if self.moe_layers and len(self.moe_layers) != self.n_layers:
            raise ValueError(
                f"moe_layers has {len(self.moe_layers)} entries for {self.n_layers} layers"
            )

    L = alias("n_layers")

    def layer_window(self, layer: int) -> int:
        """Sliding window of `layer` (0 = full attention)."""
        if self.sliding_window <= 0:
            return 0
        if not self.swa_layers or self.swa_layers[layer]:
            return self.sliding_window
        return 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s FFN is a mixture of experts (else dense, `ffn_dim` wide)."""
        if self.n_experts <= 0:
            return False
        return not self.moe_layers or self.moe_layers[layer]

    def num_params(self) -> int:
        E, D, F, H, G, V = self.E, self.D, self.F, self.H, self.G, self.V
        per_layer = 2 * D + (H + 2 * G) * E * D + D * H * E
        per_layer += (H + 2 * G) * E if self.qkv_bias else 0
        per_layer += 2 * E if self.qk_norm else 0
        per_layer += 2 * D if self.arch == "gemma3" else 0
        total = V * D + self.L * per_layer + D
        for i in range(self.L):
            if self.is_moe_layer(i):
                total += self.n_experts * (D + 3 * D * self.expert_ffn_dim)
            else:
                total += 3 * D * F
        return total if self.tie_embeddings else total + V * D

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        scaling = data.get("rope_scaling")
        if isinstance(scaling, dict):
            data["rope_scaling"] = RopeScaling(**scaling)
        for name in ("swa_layers", "moe_layers"):
            if name in data and data[name] is not None:
                data[name] = tuple(bool(x) for x in data[name])
        if data.get("rope_factors") is not None:
            data["rope_factors"] = tuple(float(x) for x in data["rope_factors"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**data)


def rope_frequencies(config: ModelConfig) -> list[float]:
    """Inverse frequencies [E/2]: theta^(-2i/E) divided by `rope_factors`, or with llama3
    scaling (host-side, float64): those of every layer but gemma3's sliding-window ones
    (`layer_rope_frequencies`)."""
    E = config.E
    inv = [1.0 / (config.rope_theta ** (2 * i / E)) for i in range(E // 2)]
    if config.rope_factors:
        return [f / d for f, d in zip(inv, config.rope_factors)]
    s = config.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out


def layer_rope_frequencies(config: ModelConfig, layer: int) -> list[float]:
    """Inverse frequencies [E/2] of `layer`: a gemma3 sliding-window layer's from
    `rope_theta_swa` unscaled (llama.cpp's `rope_freq_base_train_swa`, scale 1), every other
    layer's `rope_frequencies`."""
    if config.arch == "gemma3" and config.layer_window(layer) > 0:
        E, theta = config.E, config.rope_theta_swa or config.rope_theta
        return [1.0 / (theta ** (2 * i / E)) for i in range(E // 2)]
    return rope_frequencies(config)


def rope_pair_factors(config: ModelConfig) -> list[float]:
    """llama.cpp's rope_freqs [E/2] for `config`: each pair's divisor (all 1 without scaling)."""
    if config.rope_factors:
        return list(config.rope_factors)
    plain = rope_frequencies(dataclasses.replace(config, rope_scaling=None))
    return [p / s for p, s in zip(plain, rope_frequencies(config))]


class HeadDims(DecoderDims):
    """Dimension keys (specjax.types) and shape checks shared by the feature-drafter heads
    (EAGLE-3, DFlash / DSpark): a frozen dataclass with `DecoderDims`' fields and
    `draft_vocab` (0 = the full vocabulary) inherits them."""

    draft_vocab: int
    #: the head's name in error messages
    KIND: ClassVar[str] = "head"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The config from `to_dict`'s output; unknown keys are an error, lists become tuples."""
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.KIND} config keys: {', '.join(unknown)}")
        if "target_layers" in data:
            data["target_layers"] = tuple(data["target_layers"])
        if data.get("rope_factors") is not None:
            data["rope_factors"] = tuple(float(x) for x in data["rope_factors"])
        return cls(**data)

    def check_head_dims(self) -> None:
        """ValueError naming the numbers for a draft vocabulary or head split that cannot be."""
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(
                f"draft_vocab must be in 0..vocab_size ({self.vocab_size}), got {self.draft_vocab}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim == 0 and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads})")

    @property
    def Vd(self) -> int:
        return self.draft_vocab or self.vocab_size

    @property
    def has_d2t(self) -> bool:
        return self.Vd != self.vocab_size
