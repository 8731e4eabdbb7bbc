"""Draft n_max, n_min and p_min never recompile below the static draft width.

The static width K of the draft-model types is max(draft_n_max, 16) unless `k_max` is given;
n_max, n_min and p_min are traced (`RunParams`). Varying them at the `generate` level compiles
nothing (JAX's compile events and `specjax.api.compile_count()`), and each value still acts:
drafts never exceed n_max, nothing shorter than n_min is drafted, p_min 1 drafts nothing.
Positive controls: an explicit `k_max`, an n_max above 16 and another context bucket compile.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specjax import api
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.testing import count_compiles, noisy_copy, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]


def spec_config(**kw: object) -> SpecConfig:
    """llama.cpp's fixed draft budget: no draft governor where specjax has one."""
    if "adaptive" in {f.name for f in dataclasses.fields(SpecConfig)}:
        kw.setdefault("adaptive", False)
    return SpecConfig(**kw)  # type: ignore[arg-type]


def test_static_width():
    assert spec_config(types=("draft-simple",), draft_n_max=3).resolved_k_max() == 16
    assert spec_config(types=("draft-simple",), draft_n_max=20).resolved_k_max() == 20
    assert spec_config(types=("draft-simple",), draft_n_max=3, k_max=4).resolved_k_max() == 4
    assert spec_config(types=("ngram-simple",), ngram_simple_size_m=5).resolved_k_max() == 5
    assert spec_config(types=("draft-simple",), draft_n_max=3).n_max() == 3  # upstream's


@pytest.fixture(scope="module")
def models():
    target = tiny_model(0)
    return target, noisy_copy(target, 0.1)


def run(models, n_ctx=128, **spec):
    target, draft = models
    cfg = spec_config(types=("draft-simple",), **spec)
    out = generate(target, PROMPTS, max_new_tokens=20, spec=cfg, draft=draft, n_ctx=n_ctx)
    return out.stats.to_dict()


def longest_draft(stats):
    per_pos = np.asarray(stats["drafters"]["draft-simple"]["n_acc_tokens_per_pos"])
    return int(np.max(np.nonzero(per_pos)[0], initial=-1)) + 1


def test_n_max_p_min_n_min_do_not_recompile(models):
    run(models, draft_n_max=3)
    before = api.compile_count()
    with count_compiles() as events:
        results = {n_max: run(models, draft_n_max=n_max) for n_max in (1, 2, 5, 8, 16)}
        high_p_min = run(models, draft_n_max=8, draft_p_min=1.0)
        some_p_min = run(models, draft_n_max=8, draft_p_min=0.11)  # top-10 probs ~0.1
        n_min = run(models, draft_n_max=8, draft_n_min=6)
    assert api.compile_count() == before and events == []
    # the traced values act: the longest accepted draft follows n_max ...
    for n_max, stats in results.items():
        assert 0 < longest_draft(stats) <= n_max
    assert longest_draft(results[8]) > 2
    # ... p_min 1 keeps no draft token, 0.11 fewer than 0 ...
    assert high_p_min["num_draft_tokens"] == 0
    assert 0 < some_p_min["num_draft_tokens"] < results[8]["num_draft_tokens"]
    # ... and n_min clears drafts shorter than 6 tokens
    assert n_min["num_draft_tokens"] >= 6 * n_min["num_drafts"] > 0


@pytest.mark.parametrize(
    "change",
    [
        dict(k_max=8),
        # suite time: one static size shows the rule; the others run with -m slow
        pytest.param(dict(draft_n_max=20), marks=pytest.mark.slow),
        pytest.param(dict(n_ctx=256), marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_static_sizes_do_compile(models, change):
    run(models, draft_n_max=3)
    change = dict(change)
    n_ctx = change.pop("n_ctx", 128)
    change.setdefault("draft_n_max", 3)
    before = api.compile_count()
    with count_compiles() as events:
        run(models, n_ctx=n_ctx, **change)
    assert api.compile_count() > before and events


@pytest.mark.slow  # suite time: synthetic verification is covered elsewhere
def test_synthetic_rates_are_sized_by_n_max_not_the_static_width(models):
    """llama.cpp takes n_max synthetic acceptance rates; the static width (16) is wider."""
    target, draft = models
    cfg = spec_config(types=("draft-simple",), draft_n_max=3, synth_rates=(1.0, 1.0, 0.0))
    out = generate(target, PROMPTS, max_new_tokens=20, spec=cfg, draft=draft, n_ctx=128)
    stats = out.stats.to_dict()
    per_pos = stats["accepted_per_position"]  # rates 1, 1, 0: a draft's first token always
    assert len(per_pos) == 16 and per_pos[0] == stats["num_drafts"] > 0
    assert per_pos[1] > 0 and not any(per_pos[2:])
    cfg = spec_config(types=("draft-simple",), draft_n_max=3, synth_rates=(0.5,) * 16)
    with pytest.raises(ValueError, match="must contain 3 values, got 16"):
        generate(target, PROMPTS, max_new_tokens=20, spec=cfg, draft=draft, n_ctx=128)
