"""Lossless greedy speculation for the model-free drafters, alone and chained with draft-simple.

The default run covers every drafter once (rotating the static draft width K over 1, 3, 8)
plus the full chain; `-m slow` covers every drafter x K x batch combination.
"""

from __future__ import annotations

import pytest

from specjax.api import generate
from specjax.config import SpecConfig
from specjax.testing import noisy_copy, tiny_model

BASE_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 20, 21, 22, 20], [30, 31], [40, 41]]
MAX_NEW = [32, 28, 32, 12, 12, 12]
#: A, B, filler, A: drafters keyed on the prompt's end propose B, which the model does not
#: continue with, so drafts get rejected (tiny models otherwise loop and accept everything).
REJECT_ROW = [50, 51, 52, 53, 60, 61, 62, 63, 64, 65, 70, 71, 50, 51, 52, 53]
#: A, then the model's own first tokens after A, then other tokens, filler, A: drafters whose
#: key includes the first sampled token (map-k, map-k4v, ngram-cache) match the model's own
#: continuation and then propose the other tokens, which it rejects.
REJECT_BASE, REJECT_OTHER, FILLER = [80, 81, 82, 83], [93, 94, 95], [90, 91]

SMALL = {
    "ngram-simple": dict(ngram_simple_size_n=1, ngram_simple_size_m=4),
    "ngram-mod": dict(
        ngram_mod_n_match=2, ngram_mod_n_min=1, ngram_mod_n_max=4, ngram_mod_pool_size=4096
    ),
    "ngram-map-k": dict(ngram_map_k_size_n=2, ngram_map_k_size_m=4),
    "ngram-map-k4v": dict(ngram_map_k4v_size_n=2, ngram_map_k4v_size_m=4),
    "ngram-cache": dict(ngram_cache_n_draft=4),
    "draft-simple": dict(draft_n_max=3),
}
DEFAULT_CASES = [
    ("ngram-simple", 1),
    ("ngram-mod", 3),
    ("ngram-map-k", 8),
    ("ngram-map-k4v", 3),
    ("ngram-cache", 8),
]
SLOW_CASES = [
    (t, k) for t in SMALL if t != "draft-simple" for k in (1, 3, 8) if (t, k) not in DEFAULT_CASES
]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def prompts(target):
    """Each base prompt extended by 16 tokens of the model's own greedy continuation: tiny
    random models fall into short loops, so the prompt then holds n-grams the continuation
    repeats, and every n-gram drafter gets something to draft (rows still differ in length)."""
    seed = generate(target, BASE_PROMPTS, max_new_tokens=16)
    # the last row stays short: n-gram drafters find nothing there, draft-simple must step in
    own = generate(target, [REJECT_BASE], max_new_tokens=3).tokens[0]
    keyed_row = REJECT_BASE + own + REJECT_OTHER + FILLER + REJECT_BASE
    extended = [p + t for p, t in zip(BASE_PROMPTS[:3], seed.tokens)]
    return extended + BASE_PROMPTS[3:] + [REJECT_ROW, keyed_row]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return generate(target, prompts, max_new_tokens=MAX_NEW)


def spec_for(types: tuple[str, ...], k: int) -> SpecConfig:
    kwargs: dict = {}
    for t in types:
        kwargs.update(SMALL[t])
    # llama.cpp's drafting semantics are under test: no governor
    return SpecConfig(types=types, k_max=k, adaptive=False, **kwargs)


def check(target, plain, types, k, prompts, max_new=MAX_NEW, rows=None):
    draft = noisy_copy(target, 0.5) if "draft-simple" in types else None
    out = generate(target, prompts, max_new_tokens=max_new, spec=spec_for(types, k), draft=draft)
    expected = plain.tokens[: len(prompts)] if rows is None else [plain.tokens[r] for r in rows]
    assert out.tokens == expected
    stats = out.stats.to_dict()
    assert stats["num_draft_tokens"] > 0, "the drafter never drafted: the test proves nothing"
    # some drafted token was rejected, so trimming after a partial acceptance ran too
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    return stats


@pytest.mark.parametrize("drafter, k", DEFAULT_CASES)
def test_ngram_drafter_is_lossless(target, plain, prompts, drafter, k):
    check(target, plain, (drafter,), k, prompts)


def test_full_chain_is_lossless(target, plain, prompts):
    types = (
        "ngram-simple",
        "ngram-map-k",
        "ngram-map-k4v",
        "ngram-mod",
        "ngram-cache",
        "draft-simple",
    )
    check(target, plain, types, 8, prompts)


@pytest.mark.slow  # suite time: the full chain test covers ngram-mod with draft-simple
def test_ngram_mod_then_draft_simple_share_rows(target, plain, prompts):
    stats = check(target, plain, ("ngram-mod", "draft-simple"), 3, prompts)
    used = [name for name, d in stats["drafters"].items() if d["n_gen_drafts"] > 0]
    assert sorted(used) == ["draft-simple", "ngram-mod"], stats["drafters"]


@pytest.mark.slow
@pytest.mark.parametrize("drafter, k", SLOW_CASES)
def test_ngram_drafter_is_lossless_every_k(target, plain, prompts, drafter, k):
    check(target, plain, (drafter,), k, prompts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter", ["ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache"]
)
def test_ngram_drafter_single_row(target, plain, prompts, drafter):
    # the last row: the one whose drafts get rejected by every drafter
    check(
        target, plain, (drafter, "draft-simple"), 3, prompts[-1:], max_new=MAX_NEW[-1:], rows=[-1]
    )
