"""The shipped GGUF models: they load, their tokenizer round-trips the validation files, greedy
generation is deterministic, and speculative decoding with them is lossless."""

from __future__ import annotations

from pathlib import Path

import pytest

import specjax
from specjax.drafters.draft_simple import check_vocab_compatible
from specjax.train.data import read_texts, split_files, stdlib_files

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "models" / "code-target" / "code-target-f16.gguf"
DRAFT = ROOT / "models" / "code-draft" / "code-draft-f16.gguf"
PROMPTS = [
    'import os\n\n\ndef read_lines(path):\n    """Return the lines of a text file."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]


@pytest.fixture(scope="module")
def target() -> specjax.Model:
    return specjax.load(str(TARGET))


@pytest.fixture(scope="module")
def draft() -> specjax.Model:
    return specjax.load(str(DRAFT))


def test_shipped_models_load_with_the_documented_shapes(target, draft):
    assert target.config.num_params() == 7_344_384
    assert draft.config.num_params() == 557_696
    assert target.config.F % 256 == 0
    assert draft.config.num_params() * 8 <= target.config.num_params()
    assert target.tokenizer.vocab_size == draft.tokenizer.vocab_size == 2048
    check_vocab_compatible(target.tokenizer, draft.tokenizer, target.config.V, draft.config.V)
    assert target.eog_ids == (1,)


def test_gguf_tokenizer_round_trips_validation_files(target):
    _, val = split_files(stdlib_files())
    texts = read_texts(val[:12])
    assert texts
    for text in texts:
        assert target.decode(target.encode(text, add_special=False)) == text


def test_greedy_generation_is_deterministic(target):
    a = specjax.generate(target, PROMPTS, max_new_tokens=32)
    b = specjax.generate(target, PROMPTS, max_new_tokens=32)
    assert a.tokens == b.tokens
    assert all(len(t) > 0 for t in a.tokens)


@pytest.mark.slow  # suite time: notebook 01 asserts the same on these models (governor on)
def test_speculative_with_shipped_draft_is_lossless(target, draft):
    plain = specjax.generate(target, PROMPTS, max_new_tokens=48)
    spec = specjax.SpecConfig(types=("ngram-mod", "draft-simple"), draft_n_max=4, adaptive=False)
    fast = specjax.generate(target, PROMPTS, max_new_tokens=48, spec=spec, draft=draft)
    assert fast.tokens == plain.tokens
    stats = fast.stats.to_dict()
    # a trained draft agrees with its teacher often: acceptance far above chance
    assert stats["acceptance_rate"] > 0.3, stats


@pytest.mark.peers
def test_llama_cpp_gives_the_same_greedy_tokens(target):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, val = split_files(stdlib_files())
    prompts = [text[:200] for text in read_texts(val[:5])]
    llm = llama_cpp.Llama(model_path=str(TARGET), n_ctx=512, verbose=False)
    for prompt in prompts:
        ids = target.encode(prompt)
        ours = specjax.generate(target, [ids], max_new_tokens=64).tokens[0]
        theirs = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if tok in target.eog_ids or len(theirs) == 64:
                break
            theirs.append(tok)
        assert theirs == ours[: len(theirs)] and len(theirs) == len(ours)


# ------------------------------------------------------------------ code-hybrid (qwen35 hybrid)
HYBRID = ROOT / "models" / "code-hybrid" / "code-hybrid-f16.gguf"
HYBRID_PROMPT = "def read_lines(path):\n"
HYBRID_TRUNK_PARAMS = 3_691_024


@pytest.fixture(scope="module")
def hybrid() -> specjax.Model:
    return specjax.load(str(HYBRID))


def test_shipped_hybrid_loads_with_the_documented_shapes(hybrid, target):
    cfg = hybrid.config
    assert cfg.arch == "qwen35" and cfg.dtype == "float32"  # F16 file, float32 compute on CPU
    assert cfg.num_params() == HYBRID_TRUNK_PARAMS  # the card's count (trunk, no MTP block)
    assert (cfg.D, cfg.L, cfg.n_nextn) == (256, 4, 1)
    assert cfg.attention_layers == (3,) and cfg.recurrent_layers == (0, 1, 2)
    assert len(hybrid.params["nextn"]) == 1
    check_vocab_compatible(target.tokenizer, hybrid.tokenizer, target.config.V, cfg.V)
    assert hybrid.eog_ids == target.eog_ids


def test_shipped_hybrid_greedy_is_deterministic_python(hybrid):
    a = specjax.generate(hybrid, [HYBRID_PROMPT], max_new_tokens=32)
    b = specjax.generate(hybrid, [HYBRID_PROMPT], max_new_tokens=32)
    assert a.tokens == b.tokens and len(a.tokens[0]) > 8
    assert "\n" in a.text[0]  # it writes code lines, not one run-on token stream


@pytest.mark.peers
def test_shipped_hybrid_llama_completion_gives_the_same_greedy_text(hybrid, tmp_path):
    """llama-completion on the shipped file continues the prompt greedily with the same text as
    specjax.generate (float32 compute from the F16 weights on both sides)."""
    import os
    import shutil

    from test_io_gguf_qwen35 import llamacpp_greedy_text

    bin_dir = os.environ.get("SPECJAX_LLAMACPP_BIN")
    tool = shutil.which("llama-completion", path=bin_dir) if bin_dir else None
    if not tool:
        pytest.skip("llama-completion not found (set SPECJAX_LLAMACPP_BIN to llama.cpp's bin)")
    n = 48
    ours = specjax.generate(hybrid, [HYBRID_PROMPT], max_new_tokens=n).text[0]
    theirs = llamacpp_greedy_text(tool, HYBRID, HYBRID_PROMPT, n, 512, tmp_path)
    assert theirs.rstrip("\n") == ours.rstrip("\n")
