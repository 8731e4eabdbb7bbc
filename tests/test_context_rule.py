"""One context rule on every path (issue 52, item 1; `specjax.decode.inputs.fit_context`): the
context is `n_ctx` / `-c`, else the model's training context; a prompt that does not fit is
refused with its numbers before anything runs; a run that reaches the context stops with
finish_reason `context` (and says so on the CLI's stderr); a context beyond the training
context warns once. And hybrid timings (item 2): compile, prefill and decode apart.

Tiny models with a training context of 32 (attention) and 32 (qwen35 hybrid); the CLI runs
in process (`cli.main`) on a tiny GGUF."""

from __future__ import annotations

import json
import warnings

import jax
import numpy as np
import pytest

import specjax
from specjax.cli import command as cli
from specjax.decode import inputs
from specjax.io.gguf_io import save_gguf
from specjax.io.gguf_qwen35 import save_qwen35_gguf
from specjax.jobs import batch as batching
from specjax.models import qwen35
from specjax.testing import tiny_config, tiny_model_with_tokenizer, tiny_qwen35_config

CTX = 32


@pytest.fixture(scope="module")
def model():
    return specjax.init_model(tiny_config(max_position=CTX), 0)  # no tokenizer: no EOG


@pytest.fixture(scope="module")
def hybrid():
    cfg = tiny_qwen35_config(vocab_size=8, max_position=CTX)
    return specjax.Model(config=cfg, params=qwen35.init_params(cfg, jax.random.PRNGKey(0)))


@pytest.fixture(autouse=True)
def fresh_warnings():
    inputs._WARNED.clear()
    yield
    inputs._WARNED.clear()


def prompt(n: int, vocab: int = 8) -> list[int]:
    return [int(t) for t in np.random.default_rng(n).integers(3, vocab, n)]


@pytest.mark.parametrize("which", ["model", "hybrid"])
def test_a_prompt_that_does_not_fit_is_refused_on_every_path(which, request):
    m = request.getfixturevalue(which)
    long = prompt(CTX)  # CTX tokens leave no cell for a generated one
    fits = f"prompt of {CTX} tokens does not fit a context of {CTX}"
    with pytest.raises(ValueError, match=fits):
        specjax.generate(m, [long], max_new_tokens=4)
    with pytest.raises(ValueError, match=fits):
        specjax.generate(m, [long], max_new_tokens=4, n_ctx=0)
    with pytest.raises(ValueError, match=f"prompt of {CTX} tokens does not fit a context of 16"):
        specjax.generate(m, [prompt(4), long], max_new_tokens=4, n_ctx=16)
    with pytest.raises(ValueError, match=fits):
        specjax.Generator(m).generate([long], max_new_tokens=4)
    defaults = dict(n_predict=4, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                    repeat_penalty=1.0, seed=0)  # fmt: skip
    reqs, errors, _ = batching.parse_requests(
        m, [{"id": "a", "tokens": long}], n_ctx=CTX, defaults=defaults
    )
    assert not reqs and fits in errors[0].error


@pytest.mark.parametrize("which", ["model", "hybrid"])
def test_a_run_stops_at_the_training_context(which, request):
    """n_ctx None is the training context, not a size from the prompt and max_new_tokens:
    the last token sits at position CTX - 1, finish_reason context; an explicit context
    past it runs on."""
    m = request.getfixturevalue(which)
    p = prompt(20)
    out = specjax.generate(m, [p], max_new_tokens=30)
    assert out.finish_reasons == ["context"] and len(out.tokens[0]) == CTX - 20
    gen = specjax.Generator(m).generate([p], max_new_tokens=30)
    assert gen.finish_reasons == ["context"] and gen.tokens == out.tokens
    with pytest.warns(inputs.ContextWarning, match="beyond the model's training context of 32"):
        longer = specjax.generate(m, [p], max_new_tokens=30, n_ctx=64)
    assert longer.finish_reasons == ["length"] and longer.tokens[0][: CTX - 20] == out.tokens[0]


def test_beyond_the_training_context_warns_once(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            specjax.generate(model, [[3, 4, 5]], max_new_tokens=2, n_ctx=48)
        specjax.Generator(model, n_ctx=48).generate([[3, 4, 5]], max_new_tokens=2)
        specjax.generate(model, [[3, 4, 5]], max_new_tokens=2, n_ctx=CTX)  # within: none
    assert [str(w.message) for w in caught if w.category is inputs.ContextWarning] == [
        "context of 48 cells is beyond the model's training context of 32: text past "
        "position 32 may degrade"
    ]


def test_sizes_from_the_run_stay_within_the_context(model):
    """Without n_ctx the capacity is what the run needs (a bucket), at most the context."""
    sizes = inputs.build_engine_inputs(model, [[1] * 5], max_new_tokens=4, n_ctx=None, k_max=0)
    assert sizes[1] == CTX  # a bucket of 128 would pass the training context of 32
    big = specjax.init_model(tiny_config(max_position=1024), 0)
    sizes = inputs.build_engine_inputs(big, [[1] * 5], max_new_tokens=4, n_ctx=None, k_max=0)
    assert sizes[1] == 128
    assert inputs.fit_context(big, [5], 4096, warn=False) == (4096, 4096)


def test_batch_jobs_stop_at_the_context(model, tmp_path):
    reqs = [{"id": "a", "tokens": prompt(20), "n_predict": 30}, {"id": "b", "tokens": [3, 4]}]
    with open(tmp_path / "log", "w") as log:
        summary = batching.batch(
            model, reqs, tmp_path / "o.jsonl", n_parallel=2, n_predict=4, progress=False, log=log
        )
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").open())}
    assert records["a"]["finish_reason"] == "context" and len(records["a"]["tokens"]) == 12
    assert records["b"]["finish_reason"] == "length"
    assert (summary.n_context, summary.context) == (1, CTX)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    m = tiny_model_with_tokenizer(0, max_position=CTX)
    path = tmp_path_factory.mktemp("ctx") / "t.gguf"
    save_gguf(str(path), m.config, m.params, m.tokenizer, dtype="f32")
    return str(path), m


def test_cli_refuses_says_where_it_stopped_and_warns_once(tiny_gguf, tmp_path, capsys):
    path, m = tiny_gguf
    text = "def add(a, b):\n    return a + b\n" * 3
    n = len(m.encode(text))
    assert n >= CTX
    assert cli.main(["generate", "-m", path, "-p", text, "-n", "8"]) == 1
    err = capsys.readouterr().err
    assert f"error: prompt of {n} tokens does not fit a context of {CTX}" in err
    assert "-c/--ctx-size" in err and "Traceback" not in err

    short = "def add(a, b):"
    k = len(m.encode(short))
    out = tmp_path / "o.jsonl"
    assert cli.main(["generate", "-m", path, "-p", short, "-n", "64", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    record = json.loads(out.read_text())
    assert record["finish_reason"] == "context" and len(record["tokens"]) == CTX - k
    assert f"stopped at the context of {CTX} tokens (prompt {k} + {CTX - k} generated" in err

    assert cli.main(["generate", "-m", path, "-p", short, "-n", "40", "-c", "64"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "training context" in line]
    assert lines == [
        "specjax: warning: context of 64 cells is beyond the model's training context of "
        "32: text past position 32 may degrade"
    ]


def test_hybrid_timings_count_compile_prefill_and_decode_apart(tmp_path, capsys):
    """Item 2: a qwen35 target through the CLI reports a prefill time, and compile time is
    not decode time (a fresh process-local compile of a 16-token run)."""
    from specjax.io.tokenizer import Tokenizer

    tok = Tokenizer.from_file("models/tokenizer/tokenizer.json")
    cfg = tiny_qwen35_config(vocab_size=tok.vocab_size, max_position=256)
    path = tmp_path / "h.gguf"
    save_qwen35_gguf(path, cfg, qwen35.init_params(cfg, jax.random.PRNGKey(0)), tok, "f32")
    specjax.api.clear_compiled()
    out = tmp_path / "o.jsonl"
    argv = ["generate", "-m", str(path), "-p", "def add(a, b):\n" * 8, "-n", "16"]
    assert cli.main([*argv, "--out", str(out), "--no-compile-cache"]) == 0
    err = capsys.readouterr().err
    t = json.loads(out.read_text())["timings"]
    assert t["prefill_seconds"] > 0 and t["decode_seconds"] > 0
    assert t["compile_seconds"] > t["decode_seconds"]  # compiling is not decoding
    assert f"prefill: {t['prompt_tokens']} tokens in {t['prefill_seconds']:.3f} s" in err


def test_api_clamps_draft_limits_to_what_the_context_leaves(model):
    """The API applies the CLI's draft clamp (`config.fit_draft_limits`) to the context: an
    n_max far beyond what the context leaves after the prompt is cut to it, with a warning
    naming both numbers (it kept a 1,000-token draft width from compiling); the tokens are
    plain greedy's. A limit within the context is left as it is, whatever max_new_tokens
    (the rounds' budgets stop drafts there; a clamp would change the compiled width)."""
    from specjax.config import SpecConfig

    ids = prompt(20)
    plain = specjax.generate(model, [ids], max_new_tokens=6, n_ctx=CTX)
    spec = SpecConfig(types=("ngram-mod",), ngram_mod_n_max=1000, ngram_mod_n_min=1)
    room = r"\(n_ctx 32, prompt of 20 tokens\): --spec-ngram-mod-n-max 1000 -> 11$"
    with pytest.warns(UserWarning, match=room):
        out = specjax.generate(model, [ids], max_new_tokens=6, n_ctx=CTX, spec=spec)
    assert out.tokens == plain.tokens
    within = SpecConfig(types=("ngram-mod",), ngram_mod_n_max=8, ngram_mod_n_min=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specjax.generate(model, [ids], max_new_tokens=3, n_ctx=CTX, spec=within)
