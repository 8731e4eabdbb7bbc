"""Host-side input handling of the public API, against llama.cpp's rules.

* Text prompts are tokenized as llama.cpp's `common_tokenize(ctx, text, add_special=true,
  parse_special=true)` (src/llama-vocab.cpp): BOS first when the model's metadata says
  add_bos, EOS last when it says add_eos, a second BOS (with a warning) when the text itself
  starts with the BOS token's text. Token-id prompts are used exactly as given.
"""

from __future__ import annotations

import warnings

import pytest

import specjax
from specjax.api import Model, _tokenize_prompts
from specjax.testing import tiny_config, tiny_tokenizer
from specjax.tokenizer import Tokenizer

BOS, EOS = 0, 1  # specjax.testing.tiny_tokenizer: "<s>" = 0, "</s>" = 1


def _model(add_bos: bool, add_eos: bool = False) -> Model:
    base = tiny_tokenizer()
    tok = Tokenizer(
        base.hf_tokenizer, bos_id=BOS, eos_id=EOS, pad_id=2, add_bos=add_bos, add_eos=add_eos
    )
    return specjax.init_model(tiny_config(vocab_size=tok.vocab_size), 0, tokenizer=tok)


@pytest.fixture(scope="module")
def plain_ids() -> list[int]:
    ids = tiny_tokenizer().encode("def add(a, b):")
    assert ids and BOS not in ids and EOS not in ids
    return ids


def test_text_prompt_gets_bos_only_when_the_metadata_says_so(plain_ids):
    with_bos, without = _model(add_bos=True), _model(add_bos=False)
    assert with_bos.encode("def add(a, b):") == [BOS, *plain_ids]
    assert without.encode("def add(a, b):") == plain_ids
    assert with_bos.encode("def add(a, b):", add_special=False) == plain_ids
    assert _tokenize_prompts(with_bos, ["def add(a, b):"]) == [[BOS, *plain_ids]]
    assert _tokenize_prompts(without, "def add(a, b):") == [plain_ids]
    # llama.cpp: an empty text with add_bos is [BOS], not an empty prompt
    assert _tokenize_prompts(with_bos, [""]) == [[BOS]]
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        _tokenize_prompts(without, [""])


def test_add_eos_appends_eos():
    model = _model(add_bos=True, add_eos=True)
    ids = model.encode("x = 1")
    assert ids[0] == BOS and ids[-1] == EOS and ids[1:-1] == tiny_tokenizer().encode("x = 1")


def test_text_starting_with_bos_text_gets_two_bos_and_a_warning(plain_ids):
    model = _model(add_bos=True)
    with pytest.warns(UserWarning, match="starts with 2 BOS tokens"):
        ids = model.encode("<s>def add(a, b):")
    assert ids == [BOS, BOS, *plain_ids]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.encode("<s>def add(a, b):", parse_special=False)[0] == BOS


def test_id_prompts_stay_exactly_as_given(plain_ids):
    model = _model(add_bos=True)
    assert _tokenize_prompts(model, [plain_ids]) == [plain_ids]
    assert _tokenize_prompts(model, plain_ids) == [plain_ids]
    assert _tokenize_prompts(model, [[BOS, BOS, 5]]) == [[BOS, BOS, 5]]


def test_generate_reports_the_prompt_tokens_it_ran(plain_ids):
    model = _model(add_bos=True)
    text = specjax.generate(model, ["def add(a, b):"], max_new_tokens=2)
    ids = specjax.generate(model, [plain_ids], max_new_tokens=2)
    assert text.prompt_tokens == [[BOS, *plain_ids]]
    assert ids.prompt_tokens == [plain_ids]
