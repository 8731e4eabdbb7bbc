"""Host-side input handling of the public API, against llama.cpp's rules.

* Text prompts are tokenized as llama.cpp's `common_tokenize(ctx, text, add_special=true,
  parse_special=true)` (src/llama-vocab.cpp): BOS first when the model's metadata says
  add_bos, EOS last when it says add_eos, a second BOS (with a warning) when the text itself
  starts with the BOS token's text. Token-id prompts are used exactly as given.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import specjax
from specjax.api import Model
from specjax.decode.inputs import _tokenize_prompts
from specjax.io.tokenizer import Tokenizer
from specjax.testing import tiny_config, tiny_tokenizer

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


# ------------------------------------------------------------------ sampling parameters
# llama.cpp: --temp clamps to >= 0 (common/arg.cpp) and temp <= 0 is greedy; top-k <= 0,
# top-p >= 1 and min-p <= 0 are "off" (src/llama-sampler.cpp); --repeat-penalty must be finite
# and > 0; n_predict -1 generates until the context is full.


def test_sampling_args_clamp_what_llama_cpp_reads_as_off():
    from specjax.decode.inputs import _sampling_args

    args = _sampling_args(2, -0.5, -3, 1.5, -0.2, 1.1)
    assert args["temperature"].tolist() == [0.0, 0.0]
    assert args["top_k"].tolist() == [0, 0]
    assert args["top_p"].tolist() == [1.0, 1.0]
    assert args["min_p"].tolist() == [0.0, 0.0]
    kept = _sampling_args(2, [0.7, 2.0], [5, 0], [0.9, 0.0], [0.05, 1.0], [1.0, 0.5])
    assert kept["top_k"].tolist() == [5, 0] and kept["top_p"].tolist()[1] == 0.0
    assert kept["min_p"].tolist()[1] == 1.0 and kept["repeat_penalty"].tolist() == [1.0, 0.5]
    assert kept["temperature"].tolist() == pytest.approx([0.7, 2.0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
        (dict(repeat_penalty=0.0), "repeat_penalty must be finite and greater than 0.*got 0.0"),
        (dict(repeat_penalty=-1.0), "repeat_penalty must be finite and greater than 0.*got -1.0"),
        (dict(repeat_penalty=float("inf")), "repeat_penalty must be finite.*got inf"),
        (dict(repeat_penalty=1e-39), "repeat_penalty must be finite.*got 1e-39"),
        (dict(temperature=float("nan")), "temperature must be a number, got nan"),
        (dict(top_p=float("nan")), "top_p must be a number, got nan"),
        (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
        (dict(top_k="many"), "top_k must be a number, got 'many'"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1, or -1 .*got 0"),
        (dict(max_new_tokens=-3), "max_new_tokens must be >= 1, or -1 .*got -3"),
        (dict(max_new_tokens=[4, 0]), "max_new_tokens must be >= 1, or -1 .*got 0"),
        (dict(temperature=[0.5, 0.5, 0.5]), "temperature has 3 values for 2 prompts"),
    ],
)
def test_refused_sampling_values_raise_naming_the_value(kwargs, message):
    model = specjax.init_model(tiny_config(), 0)
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        specjax.generate(model, [[1, 2, 3], [4, 5]], **kwargs)


@pytest.fixture(scope="module")
def ctx_model() -> Model:
    return specjax.init_model(tiny_config(max_position=32), 0)  # no tokenizer: no EOG


def test_out_of_range_values_run_as_llama_cpp_reads_them(ctx_model):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]

    def run(**kw):
        base = dict(max_new_tokens=6, n_ctx=32, seed=3, temperature=1.5)
        return specjax.generate(ctx_model, prompts, **{**base, **kw}).tokens

    reference = run()
    assert run(top_p=1.5) == run(top_p=1.0) == reference
    assert run(top_k=-4) == reference
    assert run(min_p=-0.5) == reference
    greedy = run(temperature=0.0)
    assert run(temperature=-1.0) == greedy != reference


def test_n_predict_minus_one_generates_until_the_context_is_full(ctx_model):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    for n_ctx in (32, None):  # None: llama.cpp's -c 0, the model's training context (32)
        out = specjax.generate(ctx_model, prompts, max_new_tokens=-1, n_ctx=n_ctx)
        assert out.finish_reasons == ["context", "context"]
        # as llama.cpp: n_ctx - L tokens, the last one at position n_ctx - 1
        assert [len(t) for t in out.tokens] == [32 - 3, 32 - 5]
    mixed = specjax.generate(ctx_model, prompts, max_new_tokens=[-1, 4], n_ctx=32)
    assert [len(t) for t in mixed.tokens] == [29, 4]
    assert mixed.finish_reasons == ["context", "length"]
    assert mixed.tokens[0] == out.tokens[0] and mixed.tokens[1] == out.tokens[1][:4]


def test_prompt_width_pays_for_at_most_half_again_the_prompt():
    """The prefill's static width: powers of two up to 128 (the shapes every short-prompt
    test compiles stay as they were), then a half step between powers, so a prompt pays for
    less than 1.5x its tokens (a 360-token prompt ran in a 512-wide forward before)."""
    from specjax.api import build_engine_inputs, prompt_bucket

    widths = sorted({prompt_bucket(n) for n in range(1, 4097)})
    assert widths == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    for n in range(1, 4097):
        width = prompt_bucket(n)
        assert width >= n
        assert n <= 128 or width < 1.5 * n
    model = specjax.init_model(tiny_config(max_position=1024), 0)
    sizes = build_engine_inputs(model, [[1] * 360], max_new_tokens=4, n_ctx=None, k_max=0)
    assert sizes[0] == 384


def test_a_prompt_in_a_half_step_width_continues_as_one_unpadded_forward():
    """150 tokens run in the 192-wide prefill; its first greedy token equals the argmax of a
    plain forward over exactly those 150 tokens (no padding, no bucket)."""
    model = specjax.init_model(tiny_config(max_position=256), 1)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 97, 150)]
    logits, _ = specjax.forward(model, [prompt], [list(range(150))], model.new_cache(1, 256))
    row = np.asarray(logits[0, -1], np.float64)
    second, first = np.sort(row)[-2:]
    assert first - second > 1e-3  # a clear winner: the comparison does not hang on rounding
    out = specjax.generate(model, [prompt], max_new_tokens=1, n_ctx=256, temperature=0.0)
    assert out.tokens == [[int(np.argmax(row))]]
