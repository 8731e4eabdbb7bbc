"""Ctrl-C (issue 52, item 4): `specjax generate` stops within a segment of the loop, keeps
what it generated (stdout, and a record with finish_reason `interrupted` in --out) and exits
130 without a traceback; `specjax batch` leaves whole records and the requests in flight for
resume, exit 130; a Ctrl-C at start-up is one line, exit 130.

The loop in segments (`continuous.run_rounds`) gives what one `generate_loop` call gives,
tokens, statistics and governor counters, even one round per segment. Signals and exit
codes are the process's: those tests run `python -m specjax.cli` subprocesses on a
tiny GGUF model (one compilation cache) and send SIGINT once output has started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specjax
from specjax import api
from specjax.cli import command as cli
from specjax.config import SpecConfig
from specjax.io.gguf_io import save_gguf
from specjax.testing import noisy_copy, tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("sigint")
    model = tiny_model_with_tokenizer(0)
    save_gguf(str(d / "t.gguf"), model.config, model.params, model.tokenizer, dtype="f32")
    return d, model


def start(d: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "SPECJAX_COMPILE_CACHE": str(d / "jax-cache")}
    return subprocess.Popen(
        [sys.executable, "-m", "specjax.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )


def interrupt_when(
    proc: subprocess.Popen, ready, timeout: float = 240
) -> tuple[bytes, bytes, float]:
    """SIGINT once `ready(stdout, stderr)`; returns (stdout, stderr, seconds to the exit)."""
    out, err = b"", b""
    assert proc.stdout is not None and proc.stderr is not None
    pipes = (proc.stdout, proc.stderr)
    for pipe in pipes:
        os.set_blocking(pipe.fileno(), False)
    t0 = time.monotonic()
    while not ready(out, err):
        assert proc.poll() is None, err.decode()
        assert time.monotonic() - t0 < timeout, err.decode()
        out += pipes[0].read() or b""
        err += pipes[1].read() or b""
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    for pipe in pipes:
        os.set_blocking(pipe.fileno(), True)
    rest_out, rest_err = proc.communicate(timeout=60)
    return out + rest_out, err + rest_err, time.monotonic() - sent


def test_generate_keeps_what_it_generated(tiny):
    d, model = tiny
    out_path = d / "o.jsonl"
    prompt = "def f(x):"
    proc = start(d, "generate", "-m", str(d / "t.gguf"), "-p", prompt, "-n", "4000",
                 "--stream", "--out", str(out_path))  # fmt: skip
    out, err, seconds = interrupt_when(proc, lambda o, e: len(o) > len(prompt) + 40)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text
    assert "interrupted (Ctrl-C)" in text
    assert seconds < 5  # (stopping takes one segment, ~0.2 s; the rest is the exit)
    record = json.loads(out_path.read_text())
    assert record["finish_reason"] == "interrupted"
    assert 0 < len(record["tokens"]) < 4000
    shown = out.decode()
    assert shown.startswith(prompt) and shown.endswith("\n")
    # what the stream showed is the record's text (an unfinished character waits)
    assert record["text"].startswith(shown[len(prompt) : -1].rstrip("\ufffd"))
    assert record["text"] == model.decode(record["tokens"])


def test_batch_leaves_whole_records_and_resumes(tiny):
    d, _ = tiny
    req = d / "req.jsonl"
    req.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "prompt": f"def f{i}(x):", "n_predict": 200, "seed": i})
            + "\n"
            for i in range(24)
        )
    )
    out_path = d / "b.jsonl"
    args = ["batch", "-m", str(d / "t.gguf"), "--in", str(req), "--out", str(out_path),
            "-np", "2", "--no-progress"]  # fmt: skip
    proc = start(d, *args)
    _, err, _ = interrupt_when(proc, lambda o, e: out_path.exists() and out_path.stat().st_size)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "interrupted (Ctrl-C)" in text
    data = out_path.read_bytes()
    assert data.endswith(b"\n")
    first = [json.loads(line) for line in data.splitlines()]
    assert 0 < len(first) < 24
    proc = start(d, *args)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()
    ids = [json.loads(line)["id"] for line in out_path.read_bytes().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(24))


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_ctrl_c_at_start_up_is_one_line(tiny, command):
    d, _ = tiny
    if command == "generate":
        args = ["generate", "-m", str(d / "t.gguf"), "-p", "x", "-n", "8"]
        ready = b"specjax: model"
    else:
        req = d / "one.jsonl"
        req.write_text('{"prompt": "x"}\n')
        args = ["batch", "-m", str(d / "t.gguf"), "--in", str(req), "--out", str(d / "s.jsonl")]
        ready = b"to run with"
    proc = start(d, *args)
    _, err, _ = interrupt_when(proc, lambda o, e: ready in e)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "interrupted (Ctrl-C)" in text


def test_generate_without_stream_writes_a_partial_record(tiny, tmp_path, capsys, monkeypatch):
    """The CLI's loop without --stream: Ctrl-C (the handler's flag, set at the third time the
    loop asks) gives the text so far, a record marked interrupted and status 130."""
    d, _ = tiny
    asked = []

    def poll(self: cli.Interrupt) -> bool:
        self.asked = True
        asked.append(1)
        self.hit = self.hit or len(asked) >= 3
        return self.hit

    monkeypatch.setattr(cli.Interrupt, "__call__", poll)
    monkeypatch.setattr(api, "INTERRUPT_INTERVAL_S", 0.0)  # one round per segment
    monkeypatch.setattr(api, "INTERRUPT_FIRST_ROUNDS", 1)
    out_path = tmp_path / "o.jsonl"
    argv = ["generate", "-m", str(d / "t.gguf"), "-p", "def f(x):", "-n", "64"]
    assert cli.main([*argv, "--out", str(out_path), "--no-compile-cache"]) == 130
    captured = capsys.readouterr()
    record = json.loads(out_path.read_text())
    assert record["finish_reason"] == "interrupted"
    # prefill's token, then one round per segment: interrupted after two segments
    assert len(record["tokens"]) == 3
    assert captured.out == "def f(x):" + record["text"] + "\n"
    assert "interrupted (Ctrl-C) after 3 generated token(s)" in captured.err


def test_segments_give_the_one_call_run(monkeypatch):
    """One round per segment (the interrupt's loop) and one `generate_loop` call: the same
    tokens, finish reasons, rounds, statistics and governor counters, for a plain run, a
    governed chain that drafts in some rounds and is off in stretches (the loop's off
    rounds, cut by every segment's end), and a draft model with the governor off."""
    model = tiny_model_with_tokenizer(0)
    draft = noisy_copy(model, 0.3)
    monkeypatch.setattr(api, "INTERRUPT_INTERVAL_S", 0.0)  # one round per segment
    monkeypatch.setattr(api, "INTERRUPT_FIRST_ROUNDS", 1)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11]]
    governed = SpecConfig(types=("ngram-mod",), ngram_mod_n_match=2, ngram_mod_n_min=1,
                          ngram_mod_n_max=4)  # fmt: skip
    drafting = SpecConfig(types=("draft-simple",), draft_n_max=3, adaptive=False)
    for spec, temperature in ((None, 0.7), (governed, 0.0), (drafting, 0.7)):
        kw = dict(max_new_tokens=[60, 40], spec=spec, draft=draft, temperature=temperature, seed=3)
        one = specjax.generate(model, prompts, **kw)
        seg = specjax.generate(model, prompts, interrupt=lambda: False, **kw)
        assert seg.tokens == one.tokens and seg.finish_reasons == one.finish_reasons
        assert seg.timings["n_rounds"] == one.timings["n_rounds"]
        if spec is not None:
            assert seg.stats.to_dict() == one.stats.to_dict()
            assert one.stats.to_dict()["num_drafts"] > 0
        if spec is governed:  # asked in some rounds, off in others
            assert 0 < one.stats.governor["off"] < one.stats.governor["rounds"]
    stopped = specjax.generate(model, prompts, interrupt=lambda: True, max_new_tokens=8)
    assert stopped.finish_reasons == ["interrupted", "interrupted"]
    assert [len(t) for t in stopped.tokens] == [1, 1]  # the prefill's token


def test_ctrl_c_while_jax_is_imported_is_one_line(tiny):
    """A Ctrl-C in the first ~0.2 s, while `specjax.cli.main` is still importing JAX: `import
    specjax` and `specjax.cli` load nothing heavy, so main's handler is already in place."""
    d, _ = tiny
    proc = start(d, "generate", "-m", str(d / "t.gguf"), "-p", "x", "-n", "8")
    time.sleep(0.25)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and text.strip() == "specjax: interrupted (Ctrl-C)"


def test_import_specjax_loads_no_jax():
    """What makes the test above hold: the package and the command's module import no JAX."""
    code = "import sys, specjax, specjax.cli; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr
    code = "import sys, specjax; specjax.SpecConfig; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "True", out.stderr
