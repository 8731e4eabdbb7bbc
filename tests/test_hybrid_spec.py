"""Greedy speculative decoding on the qwen35 hybrid target (specjax.decode.engine over the hybrid memory) equals plain
greedy decoding (specjax.hybrid's one-token loop) token for token, for B = 4 rows of different
prompt lengths, on each rollback path; the per-path counters show the path was taken:

* RS (n_rs_seq = 4, drafts up to 8): rejections after drafts of <= 4 tokens roll back by an RS
  plane, after longer drafts by checkpoint + replay (upstream's `use_ckpt_tgt` rule);
* FULL (n_rs_seq = 0): every rejection is a checkpoint restore + replay.

The target is a random-init qwen35 with an 8-token vocabulary, so its greedy text repeats and
n-gram drafts are partly accepted (std 0.2: logits far apart, no argmax near-ties)."""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
import pytest

from specjax import api
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.models import qwen35 as q
from specjax.testing import tiny_draft_config, tiny_qwen35_config

CFG = tiny_qwen35_config(vocab_size=8, max_position=256)
N_NEW = 64
SIMPLE = SpecConfig(types=("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=8, k_max=8)


@functools.lru_cache(maxsize=1)
def _model() -> api.Model:
    return api.Model(config=CFG, params=q.init_params(CFG, jax.random.PRNGKey(1), std=0.2))


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(0)
    return [[int(t) for t in rng.randint(0, CFG.V, size=n)] for n in (5, 12, 20, 9)]


@functools.lru_cache(maxsize=1)
def _plain() -> list[list[int]]:
    return generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128).tokens


def test_rs_path_equals_plain_greedy_with_drafts_shorter_and_longer_than_planes() -> None:
    from specjax import api

    res = generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=SIMPLE, n_rs_seq=4)
    assert res.tokens == _plain()
    d = res.stats.to_dict()
    paths = d["rollback"]
    assert d["seq_rm_type"] == "RS" and d["n_rs_seq"] == 4
    assert paths["rs_plane"] > 0  # rejected drafts of <= 4 tokens: an RS plane
    assert paths["checkpoint"] > 0  # rejected drafts of 5..8 tokens: checkpoint + replay
    assert paths["replay"] == paths["checkpoint"]
    assert paths["full_accept"] > 0 and d["num_accepted_tokens"] > 0
    assert paths["seq_rm_failed"] == 0
    # max_new_tokens is traced: another value in the same bucket does not recompile
    size = api.compile_count()
    short = generate(
        _model(), _prompts(), max_new_tokens=N_NEW - 4, n_ctx=128, spec=SIMPLE, n_rs_seq=4
    )
    assert api.compile_count() == size
    assert short.tokens == [t[: N_NEW - 4] for t in _plain()]


def test_full_path_rolls_back_by_checkpoint_and_replay_only() -> None:
    res = generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=SIMPLE, n_rs_seq=0)
    assert res.tokens == _plain()
    d = res.stats.to_dict()
    assert d["seq_rm_type"] == "FULL"
    assert d["rollback"]["rs_plane"] == 0
    assert (
        d["rollback"]["checkpoint"] > 0 and d["rollback"]["replay"] == d["rollback"]["checkpoint"]
    )
    assert d["num_accepted_tokens"] > 0


MOD = SpecConfig(
    types=("ngram-mod",),
    ngram_mod_n_match=2,
    ngram_mod_n_min=2,
    ngram_mod_n_max=8,
    ngram_mod_pool_size=4096,
    k_max=8,
)


@pytest.mark.slow
def test_ngram_mod_rs_path_equals_plain_greedy() -> None:
    res = generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=MOD, n_rs_seq=4)
    assert res.tokens == _plain()
    paths = res.stats.to_dict()["rollback"]
    assert paths["rs_plane"] > 0 and paths["checkpoint"] > 0


@pytest.mark.slow
def test_ngram_mod_full_path_equals_plain_greedy() -> None:
    """ngram-mod with n_rs_seq = 0 (FULL): every rejection restores the checkpoint and replays
    the accepted list; no RS plane is used."""
    res = generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=MOD, n_rs_seq=0)
    assert res.tokens == _plain()
    d = res.stats.to_dict()
    paths = d["rollback"]
    assert d["seq_rm_type"] == "FULL" and list(d["drafters"]) == ["ngram-mod"]
    assert paths["rs_plane"] == 0 and paths["seq_rm_failed"] == 0
    assert paths["checkpoint"] > 0 and paths["replay"] == paths["checkpoint"]
    assert d["num_accepted_tokens"] > 0


def test_target_of_type_no_disables_speculation_with_a_warning(monkeypatch) -> None:
    import specjax.memory.hybrid as hm

    monkeypatch.setattr(hm, "can_seq_rm", lambda model, n_rs_seq=0: hm.SeqRmType.NO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=SIMPLE)
    assert any("seq_rm type NO" in str(w.message) for w in caught)
    assert res.stats is None and res.tokens == _plain()


@pytest.mark.slow
@pytest.mark.parametrize("n_rs_seq", [4, 0])
def test_draft_simple_equals_plain_greedy_on_both_paths(n_rs_seq: int) -> None:
    """draft-simple with a random llama draft sharing the 8-token vocabulary (drafts of up to
    6 tokens: RS rounds roll back by planes or, beyond 4, by checkpoint)."""
    draft = api.init_model(tiny_draft_config(), seed=3)
    spec = SpecConfig(types=("draft-simple",), draft_n_max=6, k_max=6)
    res = generate(
        _model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=spec, draft=draft,
        n_rs_seq=n_rs_seq,
    )  # fmt: skip
    assert res.tokens == _plain()
    paths = res.stats.to_dict()["rollback"]
    assert paths["checkpoint"] > 0
    assert (paths["rs_plane"] > 0) == (n_rs_seq > 0)


@pytest.mark.slow
def test_context_end_is_the_same_for_plain_and_speculative() -> None:
    """max_new_tokens = -1: rows stop at a full context of 32, the last token at position 31
    (llama.cpp's rule, as specjax.decode.engine), plain and speculative alike."""
    plain = generate(_model(), _prompts(), max_new_tokens=-1, n_ctx=32)
    assert plain.finish_reasons == ["context"] * 4
    assert [len(p) + len(t) for p, t in zip(_prompts(), plain.tokens)] == [32] * 4
    res = generate(_model(), _prompts(), max_new_tokens=-1, n_ctx=32, spec=SIMPLE, n_rs_seq=4)
    assert res.tokens == plain.tokens and res.finish_reasons == plain.finish_reasons
