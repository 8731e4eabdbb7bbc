"""Training with optax: the target, draft models, the EAGLE-3 / DFlash / MTP heads, the data
pipeline and the differentiable acceptance objectives. Imports `models` and below; nothing
outside `train` imports it."""
