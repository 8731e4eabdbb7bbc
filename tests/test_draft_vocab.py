"""draft-simple's vocabulary check against llama.cpp's `common_speculative_are_compatible`
(common/speculative.cpp): same vocab type; same add_bos, and the same BOS id when it is added;
likewise EOS; sizes within 128 of each other; token texts equal from id 5 up to the smaller
vocabulary. Every rule is exercised on both sides of its boundary."""

from __future__ import annotations

import dataclasses

import pytest

import specjax
from specjax.drafters.draft_simple import check_vocab_compatible
from specjax.drafters.registry import build_drafters
from specjax.errors import VocabMismatchError
from specjax.io.tokenizer import Tokenizer
from specjax.testing import tiny_config, tiny_tokenizer


@dataclasses.dataclass
class Vocab:
    """The fields llama.cpp compares, and nothing else."""

    tokens: list[str]
    vocab_type: str = "gpt2"
    add_bos: bool = True
    bos_id: int | None = 1
    add_eos: bool = False
    eos_id: int | None = 2

    def token_text(self, i: int) -> str:
        return self.tokens[i]


def _texts(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


def _check(target: Vocab, draft: Vocab) -> None:
    check_vocab_compatible(target, draft, len(target.tokens), len(draft.tokens))


def test_identical_vocabularies_pass():
    _check(Vocab(_texts(300)), Vocab(_texts(300)))


def test_vocab_type_must_match():
    with pytest.raises(VocabMismatchError, match=r"draft vocab type 'llama' differs.*'gpt2'"):
        _check(Vocab(_texts(300)), Vocab(_texts(300), vocab_type="llama"))


@pytest.mark.parametrize("special", ["bos", "eos"])
def test_bos_eos_add_flags_and_ids(special):
    add, ident = f"add_{special}", f"{special}_id"
    base = Vocab(_texts(300), add_bos=False, add_eos=False)
    # different add flags: refused
    with pytest.raises(VocabMismatchError, match=f"draft {special.upper()} settings"):
        _check(base, dataclasses.replace(base, **{add: True}))
    # both added, different ids: refused
    both = dataclasses.replace(base, **{add: True})
    with pytest.raises(VocabMismatchError, match=f"{special.upper()} settings.*id=7.*id="):
        _check(both, dataclasses.replace(both, **{ident: 7}))
    # not added: the ids are not compared (upstream checks them only when add is set)
    _check(base, dataclasses.replace(base, **{ident: 7}))
    _check(both, dataclasses.replace(both))


def test_size_difference_of_128_passes_and_129_fails():
    target = Vocab(_texts(300))
    _check(target, Vocab(_texts(300 + 128)))
    _check(target, Vocab(_texts(300 - 128)))
    with pytest.raises(
        VocabMismatchError, match=r"draft vocab size 429 differs.*300 by more than 128"
    ):
        _check(target, Vocab(_texts(300 + 129)))
    with pytest.raises(VocabMismatchError, match=r"size 171 differs.*300 by more than 128"):
        _check(target, Vocab(_texts(300 - 129)))


def test_token_texts_compared_from_id_5_to_the_smaller_size():
    target = Vocab(_texts(300))
    for i in (5, 150, 299):
        texts = _texts(300)
        texts[i] = "other"
        with pytest.raises(VocabMismatchError, match=f"draft token {i} is 'other'.*'t{i}'"):
            _check(target, Vocab(texts))
    low = _texts(300)
    low[:5] = ["a", "b", "c", "d", "e"]  # ids 0..4 (specials) are not compared
    _check(target, Vocab(low))
    _check(target, Vocab(_texts(300) + ["only-in-draft"] * 20))  # beyond the smaller vocab


def test_real_tokenizers_and_the_registry_path():
    base = tiny_tokenizer()
    texts = [base.token_text(i) for i in range(base.vocab_size)]
    texts[5] = "Ġrenamed"

    def tok(**kw):
        return Tokenizer(base.hf_tokenizer, bos_id=0, eos_id=1, pad_id=2, **kw)

    renamed = tok(tokens=texts)
    check_vocab_compatible(base, tok(), base.vocab_size, base.vocab_size)
    with pytest.raises(VocabMismatchError, match="draft token 5 is 'Ġrenamed'"):
        check_vocab_compatible(base, renamed, base.vocab_size, base.vocab_size)

    config = tiny_config(vocab_size=base.vocab_size)
    target = specjax.init_model(config, 0, tokenizer=base)
    spec = specjax.SpecConfig(types=("draft-simple",))
    for bad, message in (
        (renamed, "draft token 5"),
        (tok(add_bos=True), "draft BOS settings"),
    ):
        draft = specjax.init_model(config, 1, tokenizer=bad)
        with pytest.raises(VocabMismatchError, match=message):
            build_drafters(spec, target, draft)
        with pytest.raises(ValueError, match=message):  # VocabMismatchError is a ValueError
            specjax.generate(target, [[5, 6]], max_new_tokens=2, spec=spec, draft=draft)
    # without tokenizers only the sizes can be compared
    far = specjax.init_model(tiny_config(vocab_size=base.vocab_size + 129), 1)
    with pytest.raises(VocabMismatchError, match="differs from the target's 300 by more than 128"):
        build_drafters(spec, specjax.init_model(config, 0), far)
    near = specjax.init_model(tiny_config(vocab_size=base.vocab_size + 128), 1)
    build_drafters(spec, specjax.init_model(config, 0), near)


def test_draft_vocabulary_smaller_than_the_draft_top_k():
    """llama.cpp's draft sampler keeps the top 10 tokens, clamped to the vocabulary: a pair
    of 8-token models drafts (and verifies losslessly) instead of failing in top_k."""
    target = specjax.init_model(tiny_config(vocab_size=8), 0)
    draft = specjax.init_model(tiny_config(vocab_size=8), 0)  # same weights: drafts accepted
    prompt = [[3, 4, 5, 6, 3, 4]]
    plain = specjax.generate(target, prompt, max_new_tokens=12)
    spec = specjax.SpecConfig(types=("draft-simple",), draft_n_max=4, adaptive=False)
    out = specjax.generate(target, prompt, max_new_tokens=12, spec=spec, draft=draft)
    assert out.tokens == plain.tokens
    assert out.stats.to_dict()["num_draft_tokens"] > 0
