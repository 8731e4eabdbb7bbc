"""Streaming `generate`: the pieces handed to `stream` add up to the final text, arrive in
several calls, and the tokens equal a non-streamed run's (the same rounds, read between
calls). `specjax generate --stream` prints what a plain run prints."""

from __future__ import annotations

import pytest

import specjax
from specjax.cli import command as cli
from specjax.io.gguf_io import save_gguf
from specjax.testing import tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_model_with_tokenizer(0)


def test_stream_pieces_add_up_to_the_text(model):
    prompts = ["def add(a, b):", "x = 1\n"]
    plain = specjax.generate(model, prompts, max_new_tokens=20, n_ctx=128)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    streamed = specjax.generate(
        model,
        prompts,
        max_new_tokens=20,
        n_ctx=128,
        stream=lambda row, text: pieces[row].append(text),
        stream_rounds=3,
    )
    assert streamed.tokens == plain.tokens
    for row in (0, 1):
        assert "".join(pieces[row]) == plain.text[row]
        assert len(pieces[row]) >= 3  # 20 tokens in calls of 3 rounds


def test_cli_stream_prints_the_same(model, tmp_path, capsys):
    path = tmp_path / "t.gguf"
    save_gguf(str(path), model.config, model.params, model.tokenizer, dtype="f32")
    args = ["generate", "-m", str(path), "-p", "def f(x):", "-n", "12", "-c", "128"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    assert cli.main([*args, "--stream"]) == 0
    assert capsys.readouterr().out == plain
    with pytest.raises(SystemExit, match="--stream takes one prompt, got 2"):
        cli.main([*args, "-p", "y", "--stream"])
