"""Model architectures (pure forwards over parameter pytrees)."""

from specjax.models.config import ModelConfig, RopeScaling, rope_frequencies
from specjax.models.llama import ForwardOutput, forward_fn, init_params, new_cache

__all__ = [
    "ForwardOutput",
    "ModelConfig",
    "RopeScaling",
    "forward_fn",
    "init_params",
    "new_cache",
    "rope_frequencies",
]
