"""Training with optax: the target, draft models, the EAGLE-3 / DFlash / MTP heads, the data
pipeline and the differentiable acceptance objectives. Imports `models` and below; nothing
outside `train` imports it."""

# JAX's persistent compilation cache for training runs too (it used to come with `import specjax`;
# compile_cache imports jax and the standard library only).
from specjax.decode import compile_cache as _compile_cache  # noqa: F401
