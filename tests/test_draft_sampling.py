"""`--spec-draft-sampling` / `SpecConfig.draft_sampling`.

greedy (default, as upstream): draft-simple drafts its argmax and the target verifies by match,
so at temperature > 0 the output is token for token plain sampling with the same seed
(upstream's server test `test_with_and_without_draft`, at 0.2; here 0.2 and 0.8), while
drafts are made, accepted and rejected. probabilistic: sampled drafts and rejection sampling
(its distribution is tested in test_engine.py and test_verify.py); here it runs and drafts.
"""

from __future__ import annotations

import dataclasses

import pytest

from specjax.api import generate
from specjax.cli import command as cli
from specjax.config import SpecConfig
from specjax.testing import noisy_copy, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40]]
# top_k 3 sharpens the random model's distributions so that some argmax drafts are accepted
SAMPLING = dict(max_new_tokens=24, top_k=3, seed=[1, 2, 3, 4])


def spec_config(**kw: object) -> SpecConfig:
    """llama.cpp's fixed draft budget: no draft governor where specjax has one."""
    if "adaptive" in {f.name for f in dataclasses.fields(SpecConfig)}:
        kw.setdefault("adaptive", False)
    return SpecConfig(**kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def models():
    target = tiny_model(0)
    return target, noisy_copy(target, 0.3)


@pytest.mark.parametrize("temperature", [0.8, pytest.param(0.2, marks=pytest.mark.slow)])
def test_greedy_drafting_reproduces_plain_sampling(models, temperature):
    target, draft = models
    plain = generate(target, PROMPTS, temperature=temperature, **SAMPLING)
    spec = spec_config(types=("draft-simple",), draft_n_max=4)
    assert spec.draft_sampling == "greedy"
    out = generate(target, PROMPTS, temperature=temperature, spec=spec, draft=draft, **SAMPLING)
    assert out.tokens == plain.tokens
    stats = out.stats.to_dict()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.mark.slow  # suite time: test_engine's rejection-sampling test drafts probabilistically,
# accepts and rejects at both drafted positions, and checks the exact joint
def test_probabilistic_drafting_runs(models):
    target, draft = models
    spec = spec_config(types=("draft-simple",), draft_n_max=4, draft_sampling="probabilistic")
    out = generate(target, PROMPTS, temperature=0.8, spec=spec, draft=draft, **SAMPLING)
    stats = out.stats.to_dict()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert [len(t) for t in out.tokens] == [24] * 4


def test_draft_sampling_option():
    with pytest.raises(ValueError, match="draft sampling must be one of greedy, probabilistic"):
        SpecConfig(types=("draft-simple",), draft_sampling="sampled")
    base = ["-m", "x", "-p", "y", "--spec-type", "draft-simple"]
    spec = cli._spec_from_options(cli._load_options(base))
    assert spec.draft_sampling == "greedy"
    flags = [*base, "--spec-draft-sampling", "probabilistic"]
    assert cli._spec_from_options(cli._load_options(flags)).draft_sampling == "probabilistic"
    with pytest.raises(SystemExit):
        cli._load_options([*base, "--spec-draft-sampling", "sampled"])
