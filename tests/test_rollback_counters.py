"""Rollback-path counters, one schema for every target (specjax.decode.stats.ROLLBACK_PATHS): an
attention-only target (PART) counts its rejected drafts in `seq_rm` and never in `rs_plane` /
`checkpoint`; `record_rollback` against a plain-Python transcription; the hybrid target's
report has the same keys (`to_dict()["rollback"]`, what `specjax generate --out` writes)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.config import SpecConfig
from specjax.decode.stats import ROLLBACK_PATHS, SpecStats, record_rollback
from specjax.testing import noisy_copy, tiny_config


def test_record_rollback_counts_rows_as_the_spec_says() -> None:
    rng = np.random.RandomState(0)
    s = SpecStats.create(2, 4)
    want = dict.fromkeys(ROLLBACK_PATHS, 0)
    step = jax.jit(record_rollback)
    for _ in range(5):
        verified = rng.rand(6) < 0.7
        n_rb = rng.randint(0, 3, size=6)
        s = step(s, jnp.asarray(verified), jnp.asarray(n_rb, jnp.int32))
        for v, n in zip(verified, n_rb):
            if v:
                want["seq_rm" if n > 0 else "full_accept"] += 1
    assert s.to_dict()["rollback"] == want


def test_attention_target_rolls_back_by_seq_rm() -> None:
    model = api.init_model(tiny_config(vocab_size=16), seed=2)
    rng = np.random.RandomState(1)
    prompts = [[int(t) for t in np.tile(rng.randint(0, 16, size=4), 4)] for _ in range(3)]
    spec = SpecConfig(types=("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=6,
                      adaptive=False)  # fmt: skip
    out = api.generate(model, prompts, max_new_tokens=32, spec=spec)
    d = out.stats.to_dict()
    rb = d["rollback"]
    assert set(rb) == set(ROLLBACK_PATHS)
    assert rb["seq_rm"] > 0 and d["num_accepted_tokens"] < d["num_draft_tokens"]
    assert rb["rs_plane"] == rb["checkpoint"] == rb["replay"] == rb["seq_rm_failed"] == 0
    assert rb["seq_rm"] + rb["full_accept"] == d["num_drafts"]
    assert any(line.startswith(f"rollback: {rb['seq_rm']} by seq_rm") for line in out.stats.lines())


def test_hybrid_report_uses_the_same_schema() -> None:
    stats = SpecStats.create(1, 4).to_host()
    counts = np.arange(1, len(ROLLBACK_PATHS) + 1)
    counts[ROLLBACK_PATHS.index("seq_rm")] = 0
    stats = dataclasses.replace(stats, n_rollback=counts)
    rep = api.SpecReport(
        stats=stats, names=("ngram-simple",), target_memory={"seq_rm_type": "RS", "n_rs_seq": 4}
    )
    d = rep.to_dict()
    rb = d["rollback"]
    assert list(rb) == list(ROLLBACK_PATHS) and rb["seq_rm"] == 0
    assert d["seq_rm_type"] == "RS" and d["n_rs_seq"] == 4
    assert rep.lines()[0] == "target memory: RS (n_rs_seq = 4)"
    assert rep.lines()[-1].startswith("rollback: 0 by seq_rm, 3 by RS plane, 4 by checkpoint")


# ------------------------------------------------ PART: speculative == plain greedy, B = 4
PART_PROMPT_LENGTHS = (7, 13, 22, 30)
PART_N_NEW = 40


@functools.lru_cache(maxsize=1)
def _part_target() -> api.Model:
    # seed 3: its greedy text repeats with breaks, so both n-gram drafters have drafts rejected
    return api.init_model(tiny_config(vocab_size=16), seed=3)


def _part_prompts() -> list[list[int]]:
    """Four rows of different lengths, each a repeated random unit (n-gram drafts find
    matches in the prompt) with a random tail (not every draft is accepted)."""
    rng = np.random.RandomState(1)
    prompts = []
    for n in PART_PROMPT_LENGTHS:
        unit = rng.randint(0, 16, size=rng.randint(3, 6))
        row = np.resize(unit, n)
        row[-2:] = rng.randint(0, 16, size=2)
        prompts.append([int(t) for t in row])
    return prompts


@functools.lru_cache(maxsize=1)
def _part_plain() -> list[list[int]]:
    return api.generate(_part_target(), _part_prompts(), max_new_tokens=PART_N_NEW).tokens


def _part_spec(kind: str) -> tuple[SpecConfig, api.Model | None]:
    if kind == "ngram-simple":
        spec = SpecConfig(types=("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=6,
                          adaptive=False)  # fmt: skip
        return spec, None
    if kind == "ngram-mod":
        spec = SpecConfig(types=("ngram-mod",), ngram_mod_n_match=2, ngram_mod_n_min=2,
                          ngram_mod_n_max=6, ngram_mod_pool_size=4096, adaptive=False)  # fmt: skip
        return spec, None
    # a draft that agrees with the target often but not always: partial acceptance
    spec = SpecConfig(types=("draft-simple",), draft_n_max=5, adaptive=False)
    return spec, noisy_copy(_part_target(), 0.3)


@pytest.mark.parametrize(
    "kind",
    [
        "ngram-simple",
        pytest.param("ngram-mod", marks=pytest.mark.slow),
        pytest.param("draft-simple", marks=pytest.mark.slow),
    ],
)
def test_part_path_equals_plain_greedy_for_rows_of_different_lengths(kind: str) -> None:
    """An attention-only target (seq_rm type PART): speculative decoding of 4 rows of different
    prompt lengths gives plain greedy decoding's tokens, and its rejected drafts were rolled back
    by seq_rm (the KV cells beyond the accepted prefix dropped), never by a plane or checkpoint."""
    spec, draft = _part_spec(kind)
    out = api.generate(
        _part_target(), _part_prompts(), max_new_tokens=PART_N_NEW, spec=spec, draft=draft
    )
    assert out.tokens == _part_plain()
    d = out.stats.to_dict()
    rb = d["rollback"]
    assert rb["seq_rm"] > 0 and 0 < d["num_accepted_tokens"] < d["num_draft_tokens"]
    assert rb["rs_plane"] == rb["checkpoint"] == rb["replay"] == rb["seq_rm_failed"] == 0
