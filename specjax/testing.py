"""Tiny models and helpers for tests, notebooks and docs examples (no files, no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import jax
import jax.numpy as jnp

from specjax.api import Model, init_model
from specjax.models.config import ModelConfig

#: Backend-compile event JAX records once per XLA compilation.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def tiny_config(**overrides: object) -> ModelConfig:
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **overrides: object) -> Model:
    return init_model(tiny_config(**overrides), seed)


def noisy_copy(model: Model, scale: float, seed: int = 1) -> Model:
    """The same architecture with Gaussian noise added to every weight: a draft model that
    agrees with `model` often but not always (partial acceptance in tests)."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [
        x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if x.ndim > 1 else x
        for x, k in zip(leaves, keys)
    ]
    return Model(config=model.config, params=jax.tree.unflatten(treedef, noisy),
                 tokenizer=model.tokenizer, eog=model.eog)


@contextmanager
def count_compiles() -> Iterator[list[float]]:
    """Collects one entry per XLA backend compilation inside the block."""
    events: list[float] = []

    def listener(event: str, duration: float, **_: object) -> None:
        if event == COMPILE_EVENT:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
