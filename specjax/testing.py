"""Tiny models and helpers for tests, notebooks and docs examples (no files, no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.api import Model, init_model
from specjax.decode import governor as adaptive
from specjax.decode.engine import RunParams
from specjax.models import dflash as df
from specjax.models import forward_fn, new_cache
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params
from specjax.models.qwen35 import Qwen35Config

#: Backend-compile event JAX records once per XLA compilation.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def tiny_config(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **overrides: object) -> Model:
    return init_model(tiny_config(**overrides), seed)


def tiny_draft_config(**overrides: object) -> ModelConfig:
    """The tests' tiny Llama draft model for the tiny qwen35 targets (`tiny_qwen35_config`
    with vocab_size 8): one layer, two heads sharing one KV head."""
    fields: dict[str, object] = dict(vocab_size=8, n_layers=1, n_heads=2, n_kv_heads=1)
    fields.update(overrides)
    return tiny_config(**fields)


def tiny_qwen35_config(**overrides: object) -> Qwen35Config:
    """The tests' tiny qwen35 (hybrid) model: 4 layers, gated delta-net and attention in
    turn (`full_attention_interval` 2), vocabulary 64. `overrides`: `Qwen35Config` fields
    (the tests' variants: vocab_size 8, max_position 256, n_nextn 1)."""
    fields: dict[str, object] = dict(
        vocab_size=64,
        dim=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=48,
        rope_dim=8,
        rope_theta=10000.0,
        ssm_state_size=8,
        ssm_k_heads=2,
        ssm_v_heads=4,
        ssm_conv_kernel=4,
        full_attention_interval=2,
    )
    fields.update(overrides)
    return Qwen35Config(**fields)  # type: ignore[arg-type]


def jittered_params(config: ModelConfig, seed: int = 0) -> dict:
    """init_params with non-trivial norms and biases, so swapped or dropped tensors show
    (file round-trip tests: all-ones norms would hide a mix-up)."""
    params = init_params(config, jax.random.PRNGKey(seed))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 64))

    def jitter(x: jax.Array) -> jax.Array:
        return x + (0.1 * jax.random.normal(next(keys), x.shape)).astype(x.dtype)

    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for name in ("attn_norm", "ffn_norm", "bqkv", "q_norm", "k_norm"):
            if name in layer:
                layer[name] = jitter(layer[name])
        layers.append(layer)
    params["layers"] = tuple(layers)
    params["final_norm"] = jitter(params["final_norm"])
    return params


# compiled once per config (op by op, every eager jnp op would compile a program of its own)
_forward = jax.jit(forward_fn, static_argnums=0)


def leaves_equal(a: object, b: object) -> bool:
    """Whether two pytrees are the same parameters: structure, dtypes and values (what file
    round-trip tests compare between the saved and the loaded parameters)."""
    same_structure: bool = jax.tree.structure(a) == jax.tree.structure(b)  # type: ignore[operator]
    return same_structure and all(
        x.dtype == y.dtype and bool(jnp.array_equal(x, y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def row_logits(config: ModelConfig, params: dict, ids: list[int]) -> np.ndarray:
    """Logits `[1, len(ids), V]` of one token row at positions 0.. over a fresh cache: what
    file round-trip tests compare between the saved and the loaded parameters."""
    out = _forward(
        config,
        params,
        jnp.asarray([ids], jnp.int32),
        jnp.arange(len(ids), dtype=jnp.int32)[None],
        new_cache(config, 1, 16),
    )
    return np.asarray(out.logits)


def noisy_copy(model: Model, scale: float, seed: int = 1) -> Model:
    """The same architecture with Gaussian noise added to every weight: a draft model that
    agrees with `model` often but not always (partial acceptance in tests)."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [
        x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if x.ndim > 1 else x
        for x, k in zip(leaves, keys)
    ]
    return Model(
        config=model.config,
        params=jax.tree.unflatten(treedef, noisy),
        tokenizer=model.tokenizer,
        eog=model.eog,
    )


@contextmanager
def count_compiles() -> Iterator[list[float]]:
    """Collects one entry per XLA backend compilation inside the block."""
    events: list[float] = []

    def listener(event: str, duration_secs: float, **_: str | int) -> None:
        if event == COMPILE_EVENT:
            events.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


_TINY_TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, item):\n"
    "        self.items.append(item)\n\nfor i in range(10):\n    print(i)\n"
    "import os\nimport sys\nif __name__ == '__main__':\n    main()\n"
)


def tiny_tokenizer(vocab_size: int = 300) -> object:
    """A byte-level BPE trained in well under a second on a few lines of Python."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from specjax.io.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TINY_TEXT] * 20, trainer)
    return Tokenizer(tok, bos_id=0, eos_id=1, pad_id=2, add_bos=False)


def tiny_model_with_tokenizer(seed: int = 0, **overrides: object) -> Model:
    tokenizer = tiny_tokenizer()
    vocab = tokenizer.vocab_size  # type: ignore[attr-defined]
    return init_model(tiny_config(vocab_size=vocab, **overrides), seed, tokenizer=tokenizer)


def run_params(
    max_new: list[int],
    *,
    temperature: float = 0.0,
    seed: int = 0,
    n_max: int = 4,
    k_max: int = 4,
    cost: adaptive.CostModel | None = None,
) -> RunParams:
    """Per-call values for tests that drive `specjax.decode.engine` directly: one row per entry of
    `max_new`, the samplers (top-k/p, min-p) off, n_min 0, p_min 0, and the draft governor
    off unless `cost` is given."""
    return RunParams(
        sampling=sampling.SamplingParams.create(
            batch=len(max_new), temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed
        ),
        max_new=jnp.asarray(max_new, jnp.int32),
        n_max=jnp.asarray(n_max, jnp.int32),
        n_min=jnp.asarray(0, jnp.int32),
        p_min=jnp.asarray(0.0, jnp.float32),
        synth_rates=jnp.zeros((max(k_max, 1),), jnp.float32),
        cost=adaptive.CostModel.off() if cost is None else cost,
    )


def tiny_block_head(
    target: Model, dspark: bool = False, seed: int = 1, **overrides: object
) -> Model:
    """A random DFlash (or DSpark) head for `target` reading its layers 0, 1 and L, whose LM
    head is the target's embedding (the anchor row proposes roughly id_last, the mask rows a
    context average): drafts both accepted and rejected. `overrides`: `DFlashConfig` fields."""
    tc = target.config
    fields: dict[str, object] = dict(
        vocab_size=tc.V,
        dim=tc.D,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        target_hidden=tc.D,
        target_layers=(0, 1, tc.L),
        block_size=4,
        mask_token_id=tc.V - 1,
        markov_rank=8 if dspark else 0,
        own_lm_head=True,
    )
    fields.update(overrides)
    cfg = df.DFlashConfig(**fields)  # type: ignore[arg-type]
    params = df.init_params(cfg, jax.random.key(seed))
    params["lm_head"] = target.params["embed"]
    return Model(config=cfg, params=params, tokenizer=target.tokenizer)  # type: ignore[arg-type]
