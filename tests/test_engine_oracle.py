"""Greedy `specjax.generate` against an independent oracle: a host loop of `specjax.forward`
(one row at a time, its own cache) and numpy argmax.

The engine's lossless tests compare speculative with plain decoding, both from the same
engine; here neither the engine's loop, its batching and padding, its bucketed shapes nor its
verify / commit logic take part in the reference. B = 4 rows of different prompt lengths,
plain and with draft-simple and ngram-simple (drafts made, some rejected).

The model's weights are scaled up so that every greedy choice wins by a clear logit margin
(checked): the oracle's single-row forwards and the engine's batched ones round differently,
and a near tie would make the comparison depend on rounding rather than on the engine.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from specjax.api import Model, forward, generate
from specjax.config import SpecConfig
from specjax.testing import noisy_copy, tiny_model

#: Different lengths (1 to 14 tokens), some with repeats so n-gram drafters find matches early.
PROMPTS = [[7], [5, 6, 7, 5, 6], [3, 1, 2, 3, 3, 1, 2, 3, 3], [*range(12), 1, 2]]
MAX_NEW = 20
#: Smallest gap between the best and second-best logit the oracle accepts.
MIN_MARGIN = 0.03


@pytest.fixture(scope="module")
def target() -> Model:
    # V = 12: greedy continuations repeat n-grams (the n-gram drafter gets accepted drafts)
    base = tiny_model(3, vocab_size=12)
    return dataclasses.replace(
        base, params=jax.tree.map(lambda x: x * 40 if x.ndim > 1 else x, base.params)
    )


def greedy_oracle(model: Model, prompt: list[int], n_new: int) -> tuple[list[int], float]:
    """Greedy continuation by hand, one token per forward (the prompt too), one row, one cache.
    Returns the generated tokens and the smallest top-1 / top-2 logit margin met on the way."""
    cache = model.new_cache(1, 64)
    tokens = list(prompt)
    margin = np.inf
    for pos in range(len(prompt) + n_new - 1):
        logits, cache = forward(model, [[tokens[pos]]], [[pos]], cache)
        if pos >= len(prompt) - 1:  # the logits of the last prompt token onwards choose
            row = np.asarray(logits[0, -1], np.float64)
            second, first = np.sort(row)[-2:]
            margin = min(margin, first - second)
            tokens.append(int(np.argmax(row)))
    return tokens[len(prompt) :], float(margin)


@pytest.fixture(scope="module")
def oracle(target) -> list[list[int]]:
    rows = []
    for prompt in PROMPTS:
        tokens, margin = greedy_oracle(target, prompt, MAX_NEW)
        assert margin > MIN_MARGIN, (prompt, margin)
        rows.append(tokens)
    return rows


def test_plain_greedy_equals_the_oracle(target, oracle):
    out = generate(target, PROMPTS, max_new_tokens=MAX_NEW)
    assert out.tokens == oracle
    assert out.finish_reasons == ["length"] * 4


def test_speculative_greedy_equals_the_oracle(target, oracle):
    """ngram-simple and draft-simple chained (one compile): rows with an n-gram match draft
    from it, the others from the draft model, as llama.cpp's relay."""
    spec = SpecConfig(
        types=("ngram-simple", "draft-simple"),
        ngram_simple_size_n=1,
        ngram_simple_size_m=4,
        draft_n_max=3,
        adaptive=False,
    )
    draft = noisy_copy(target, 0.5, seed=2)
    out = generate(target, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, draft=draft)
    assert out.tokens == oracle
    stats = out.stats.to_dict()
    # both drafters drafted; drafts were accepted and rejected (trimming after partial
    # acceptance ran)
    for name in ("ngram-simple", "draft-simple"):
        assert stats["drafters"][name]["n_gen_drafts"] > 0, stats
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
