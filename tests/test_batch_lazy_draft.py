"""draft-simple's deferred prompt (`lazy_prompt`): continuous batching skips the draft
model's prompt forward at prefill, and `draft` catches up from the token history.

The independent source is the eager path (`process` of the whole prompt at prefill, as
`specjax.generate` runs it): after the catch-up, the draft cache must hold the same
positions and (to float rounding: batch-1 chunks of CATCH_UP_ROW vs one prompt forward)
the same K/V, and the round must draft the same tokens. Prompt lengths exercise every path:
several batch-1 chunks plus a batched remainder, one batch-1 chunk, the batched step alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import draft_simple as ds
from specjax.drafters.base import DraftInput, TargetBatch, TokenHistory
from specjax.models.llama import new_cache
from specjax.testing import noisy_copy, tiny_model

S, K = 192, 4
LENGTHS = [2 * ds.CATCH_UP_ROW + ds.CATCH_UP + 3, ds.CATCH_UP + 5, 5]


def _prompt_batch(tokens_BS: np.ndarray, lengths: list[int]) -> TargetBatch:
    """The first `lengths[b]` tokens of each row as one prompt batch (padding at -1)."""
    T = max(lengths)
    pos_BT = np.where(np.arange(T)[None, :] < np.asarray(lengths)[:, None], np.arange(T), -1)
    return TargetBatch(
        tokens=jnp.asarray(tokens_BS[:, :T]),
        positions=jnp.asarray(pos_BT, jnp.int32),
        hidden=(),
        is_prompt=True,
    )


def test_deferred_prompt_catches_up_to_the_eager_cache_and_drafts():
    target = tiny_model(0)
    draft = noisy_copy(target, 0.3)
    d = ds.DraftSimple(config=draft.config, target_vocab=target.config.V)
    B, V = len(LENGTHS), target.config.V
    rng = np.random.default_rng(0)
    unit = rng.integers(3, V, 7)
    tokens_BS = np.zeros((B, S), np.int32)
    for b, n in enumerate(LENGTHS):
        tokens_BS[b, :n] = np.resize(unit, n) if b != 1 else rng.integers(3, V, n)
    length_B = jnp.asarray(LENGTHS, jnp.int32)
    hist = TokenHistory(tokens=jnp.asarray(tokens_BS), length=length_B)
    last = jnp.asarray(tokens_BS[:, 0])  # id_last: the first generated token, at `length`

    # eager: the whole prompt through `process`, as a prefill does
    eager = jax.jit(d.process)(draft.params, d.init(B, S), _prompt_batch(tokens_BS, LENGTHS))
    lazy = d.init(B, S)
    assert int(jnp.max(lazy.n_past)) == 0

    inp = DraftInput(
        history=hist,
        last_token=last,
        n_max=jnp.full((B,), K, jnp.int32),
        drafting=jnp.ones((B,), bool),
        n_min=jnp.asarray(0, jnp.int32),
        p_min=jnp.asarray(0.0, jnp.float32),
        temperature=jnp.zeros((B,), jnp.float32),
        seed=jnp.zeros((B,), jnp.int32),
    )
    step = jax.jit(lambda s: d._catch_up(draft.params, s, hist, inp.drafting))
    caught = step(lazy)
    ref = step(eager)  # nothing to catch up: the eager cache as it is
    np.testing.assert_array_equal(np.asarray(caught.n_past), np.asarray(length_B))
    np.testing.assert_array_equal(np.asarray(ref.n_past), np.asarray(length_B))
    np.testing.assert_array_equal(np.asarray(caught.cache.pos), np.asarray(ref.cache.pos))
    occupied = np.asarray(ref.cache.pos) >= 0  # [B, S]
    for a, b in zip(caught.cache.k + caught.cache.v, ref.cache.k + ref.cache.v):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)  # [B, G, S, E]
        mask = occupied[:, None, :, None]
        np.testing.assert_allclose(np.where(mask, a, 0), np.where(mask, b, 0), atol=2e-2)

    run = jax.jit(lambda s: d.draft(draft.params, s, inp, K))
    s_lazy, out_lazy = run(d.init(B, S))
    s_eager, out_eager = run(eager)
    np.testing.assert_array_equal(np.asarray(out_lazy.valid), np.asarray(out_eager.valid))
    np.testing.assert_array_equal(
        np.asarray(jnp.where(out_lazy.valid, out_lazy.tokens, -1)),
        np.asarray(jnp.where(out_eager.valid, out_eager.tokens, -1)),
    )
    assert bool(jnp.any(out_lazy.valid))
    np.testing.assert_array_equal(np.asarray(s_lazy.n_past), np.asarray(s_eager.n_past))
    # the cache layout (cells in position order) is the new_cache's
    assert caught.cache.k[0].shape == new_cache(draft.config, B, S).k[0].shape


def test_catch_up_of_one_token_equals_the_eager_cache():
    """The usual catch-up (a round after every draft was accepted: one token behind) takes
    a 1-wide forward; rows 0, 1 and 3 behind in one call take the CATCH_UP-wide one. Both
    must leave the cache the whole prompt's `process` leaves."""
    target = tiny_model(0)
    draft = noisy_copy(target, 0.3)
    d = ds.DraftSimple(config=draft.config, target_vocab=target.config.V)
    lengths = [9, 14, 6]
    B, V = len(lengths), target.config.V
    tokens_BS = np.zeros((B, S), np.int32)
    tokens_BS[:, :16] = np.random.default_rng(1).integers(3, V, (B, 16))
    hist = TokenHistory(tokens=jnp.asarray(tokens_BS), length=jnp.asarray(lengths, jnp.int32))

    process = jax.jit(d.process)  # one compiled forward per prompt width, not op by op

    def processed(n_B: list[int]) -> ds.DraftSimpleState:
        return process(draft.params, d.init(B, S), _prompt_batch(tokens_BS, n_B))

    full = processed(lengths)
    step = jax.jit(lambda s: d._catch_up(draft.params, s, hist, jnp.ones((B,), bool)))
    for behind in ([1, 1, 1], [0, 1, 3]):
        caught = step(processed([n - k for n, k in zip(lengths, behind)]))
        np.testing.assert_array_equal(np.asarray(caught.n_past), lengths)
        np.testing.assert_array_equal(np.asarray(caught.cache.pos), np.asarray(full.cache.pos))
        mask = (np.asarray(full.cache.pos) >= 0)[:, None, :, None]
        for a, b in zip(caught.cache.k + caught.cache.v, full.cache.k + full.cache.v):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(np.where(mask, a, 0), np.where(mask, b, 0), atol=2e-2)
