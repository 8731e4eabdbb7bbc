"""Greedy speculative decoding on the SHIPPED hybrid target models/code-hybrid (qwen35, F16 GGUF
with an MTP/nextn head) equals plain greedy decoding token for token, for B = 4 rows of real
code prompts of different lengths, for draft-simple (draft = models/code-draft, the same
tokenizer and vocabulary), ngram-mod and draft-mtp, each on both rollback paths:

* RS (n_rs_seq = 4, drafts of up to 6 tokens): rejected drafts of <= 4 tokens roll back by an
  RS plane, longer ones by checkpoint + replay;
* FULL (n_rs_seq = 0): every rejection is a checkpoint restore + replay.

The counters show each path was taken. tests/test_hybrid_spec.py and tests/test_draft_mtp.py
test the same on random-init models; this file checks it on the trained weights and real text,
where logits are closer together. One case runs in the default suite, the rest are `slow`."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import specjax
from specjax.api import generate
from specjax.config import SpecConfig

ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "models" / "code-hybrid" / "code-hybrid-f16.gguf"
DRAFT = ROOT / "models" / "code-draft" / "code-draft-f16.gguf"
PROMPTS = ROOT / "benchmarks" / "prompts"
#: (file, prompt length in tokens): four rows of different lengths
ROWS = (
    ("humaneval_short.py", 20),
    ("repetitive.py", 45),
    ("norepeat.py", 70),
    ("humaneval_main.py", 33),
)
N_NEW = 48
N_CTX = 256
N_MAX = 6  # drafts longer and shorter than the 4 RS planes

pytestmark = pytest.mark.skipif(
    not (HYBRID.exists() and DRAFT.exists()), reason="models/code-hybrid or code-draft not shipped"
)


@functools.lru_cache(maxsize=1)
def _hybrid() -> specjax.Model:
    return specjax.load(str(HYBRID))


@functools.lru_cache(maxsize=1)
def _prompts() -> list[list[int]]:
    tok = _hybrid().tokenizer
    return [tok.encode((PROMPTS / name).read_text())[:n] for name, n in ROWS]


@functools.lru_cache(maxsize=1)
def _plain() -> list[list[int]]:
    return generate(_hybrid(), _prompts(), max_new_tokens=N_NEW, n_ctx=N_CTX).tokens


def _spec(kind: str) -> tuple[SpecConfig, specjax.Model | None]:
    if kind == "draft-simple":
        draft = specjax.load(str(DRAFT))
        return SpecConfig(types=("draft-simple",), draft_n_max=N_MAX, k_max=N_MAX), draft
    if kind == "ngram-mod":
        spec = SpecConfig(types=("ngram-mod",), ngram_mod_n_match=2, ngram_mod_n_min=2,
                          ngram_mod_n_max=N_MAX, ngram_mod_pool_size=4096, k_max=N_MAX)  # fmt: skip
        return spec, None
    return SpecConfig(types=("draft-mtp",), draft_n_max=N_MAX), None


def _check(kind: str, n_rs_seq: int) -> None:
    prompts = _prompts()
    assert len({len(p) for p in prompts}) == 4
    spec, draft = _spec(kind)
    res = generate(_hybrid(), prompts, max_new_tokens=N_NEW, n_ctx=N_CTX, spec=spec,
                          draft=draft, n_rs_seq=n_rs_seq)  # fmt: skip
    assert res.tokens == _plain()
    d = res.stats.to_dict()
    paths = d["rollback"]
    assert list(d["drafters"]) == [kind]
    assert d["num_draft_tokens"] > d["num_accepted_tokens"] > 0  # drafts made, some rejected
    assert paths["seq_rm_failed"] == 0 and paths["seq_rm"] == 0
    assert paths["checkpoint"] > 0 and paths["replay"] == paths["checkpoint"]
    if n_rs_seq:
        assert d["seq_rm_type"] == "RS" and d["n_rs_seq"] == n_rs_seq
        assert paths["rs_plane"] > 0  # rejected drafts of <= 4 tokens
    else:
        assert d["seq_rm_type"] == "FULL" and paths["rs_plane"] == 0


def test_shipped_hybrid_draft_mtp_rs_path_equals_plain_greedy() -> None:
    """The default-suite representative: the GGUF's own nextn head drafts; RS planes and
    checkpoint + replay both taken."""
    _check("draft-mtp", 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "n_rs_seq"),
    [
        ("draft-mtp", 0),
        ("ngram-mod", 4),
        ("ngram-mod", 0),
        ("draft-simple", 4),
        ("draft-simple", 0),
    ],
)
def test_shipped_hybrid_speculative_equals_plain_greedy(kind: str, n_rs_seq: int) -> None:
    _check(kind, n_rs_seq)
