"""What a user gave is never lost and every user error is one line (issue 52, items 3, 6, 7, 9):
output paths checked before any work, a failed write after generating keeps the text on stdout
and says where the records went, raw prompt bytes, one rule for empty prompts, draft limits
clamped to the context, llama.cpp's draft flag names, statistics lines without `nan`.

Exit codes and files are the process's: those run as `python -m specjax.cli` subprocesses on the
tiny GGUF model (one shared compilation cache); the rest call `cli.main` in the test process.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specjax.cli import command as cli
from specjax.decode.stats import (
    SpecStats,
    format_acceptance_lines,
    format_governor_lines,
    format_server_lines,
)
from specjax.io.gguf_io import save_gguf
from specjax.jobs import batch as batching
from specjax.testing import tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("robust")
    model = tiny_model_with_tokenizer(0)
    save_gguf(str(d / "t.gguf"), model.config, model.params, model.tokenizer, dtype="f32")
    return d, model


def run_cli(d: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECJAX_COMPILE_CACHE": str(d / "jax-cache")}
    return subprocess.run(
        [sys.executable, "-m", "specjax.cli", *args],
        capture_output=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


# ------------------------------------------------------------------------ output paths


def test_unwritable_out_refused_before_loading_anything(tiny, tmp_path):
    d, _ = tiny
    missing = tmp_path / "no-such-dir" / "o.jsonl"
    # the model path is not even read: the check comes first
    proc = run_cli(
        d, "generate", "-m", str(tmp_path / "nothing.gguf"), "-p", "x", "--out", str(missing)
    )
    one_line_error(proc, "--out", str(missing), "No such file or directory")
    (tmp_path / "f").write_text("")
    proc = run_cli(
        d, "batch", "-m", str(d / "t.gguf"), "--in", str(tmp_path / "f"), "--out",
        str(tmp_path / "f" / "o.jsonl"),
    )  # fmt: skip
    one_line_error(proc, "--out", "Not a directory")


def test_out_paths_checked_in_process(tiny, tmp_path, capsys):
    d, _ = tiny
    gguf = str(d / "t.gguf")
    assert cli.main(["generate", "-m", gguf, "-p", "x", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: --out {tmp_path}: is a directory\n"
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"tokens": [5, 6]}) + "\n")
    args = ["batch", "-m", gguf, "--in", str(req), "--out", str(tmp_path / "o.jsonl")]
    assert cli.main([*args, "--errors", str(tmp_path / "x" / "e.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --errors") and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()  # the check created nothing
    with pytest.raises(SystemExit, match=r"request file .* not found"):
        cli.main(["batch", "-m", gguf, "--in", str(tmp_path / "none.jsonl"), "--out", "o"])


def test_a_failed_write_after_generating_keeps_the_text_and_the_records(tiny):
    """/dev/full opens for writing (the check passes) and then fails every write (ENOSPC)."""
    d, _ = tiny
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    proc = run_cli(d, "generate", "-m", str(d / "t.gguf"), "-p", "def f(x):", "-n", "4",
                   "--out", "/dev/full")  # fmt: skip
    line = one_line_error(proc, "--out /dev/full", "the generated text is on stdout")
    assert proc.stdout.decode().startswith("def f(x):")
    elsewhere = line.split("the records are in ")[1].split(" instead")[0]
    record = json.loads(Path(elsewhere).read_text())
    assert record["prompt"] == "def f(x):" and len(record["tokens"]) <= 4
    Path(elsewhere).unlink()


def test_broken_config_is_one_line(tmp_path):
    for text in ("model: [unclosed\n", "- just\n- a list\n"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        with pytest.raises(SystemExit, match=f"config file {cfg}"):
            cli.main(["generate", "--config", str(cfg)])


# ------------------------------------------------------------------------ prompts


def test_non_utf8_prompt_file_becomes_byte_tokens(tiny, tmp_path, capsysbinary):
    d, model = tiny
    data = b"def caf\xe9(x):\xff"
    path = tmp_path / "latin1.py"
    path.write_bytes(data + b"\n")
    assert cli._read_prompts({"file": str(path)}) == [data]
    out = tmp_path / "o.jsonl"
    args = ["generate", "-m", str(d / "t.gguf"), "-f", str(path), "-n", "2", "--out", str(out)]
    assert cli.main(args) == 0
    assert capsysbinary.readouterr().out.startswith(data)  # stdout: the prompt's bytes as read
    record = json.loads(out.read_text())
    want = model.tokenizer.encode_bytes(data)
    assert record["prompt_tokens"] == want
    head = model.tokenizer.encode("def caf")
    assert want[: len(head)] == head  # the valid run as text
    assert model.tokenizer.decode(want).encode("utf-8", "replace")  # decodable
    # valid UTF-8 is encoded exactly as text
    assert model.tokenizer.encode_bytes("déf ü".encode()) == model.tokenizer.encode("déf ü")


def test_spm_vocabulary_refuses_raw_bytes_clearly():
    from specjax.io.tokenizer import Tokenizer

    tok = Tokenizer.__new__(Tokenizer)
    tok._vocab_type = "llama"  # (only the refusal is under test)
    with pytest.raises(ValueError, match=r"byte 3 \(0xFF\) is not UTF-8"):
        tok.encode_bytes(b"abc\xff")


def test_empty_prompt_same_rule_in_generate_and_batch(tiny, tmp_path, capsys):
    """The tiny model adds no BOS: an empty prompt has no token, refused by both; a model that
    adds BOS runs it on BOS alone in both (request parsing shown here; generate by
    tests/test_cli.py's BOS fixture)."""
    d, model = tiny
    assert cli.main(["generate", "-m", str(d / "t.gguf"), "-p", "", "-n", "2"]) == 1
    assert "empty" in capsys.readouterr().err
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"prompt": ""}) + "\n")
    args = ["batch", "-m", str(d / "t.gguf"), "--in", str(req), "--out", str(tmp_path / "o")]
    assert cli.main([*args, "--no-progress"]) == 1
    assert "line 1: empty prompt" in capsys.readouterr().err

    from specjax.io.tokenizer import Tokenizer

    tok = model.tokenizer
    bos = Tokenizer(tok.hf_tokenizer, bos_id=0, eos_id=1, pad_id=2, add_bos=True)
    bos_model = type(model)(config=model.config, params=model.params, tokenizer=bos)
    defaults = dict(n_predict=2, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                    repeat_penalty=1.0, seed=0)  # fmt: skip
    reqs, errors, _ = batching.parse_requests(bos_model, [{"prompt": ""}], n_ctx=64,
                                              defaults=defaults)  # fmt: skip
    assert not errors and reqs[0].tokens == (0,)
    assert bos_model.encode("") == [0]  # what generate's prompt becomes


def test_bad_request_bytes_are_a_bad_line(tiny, tmp_path):
    _, model = tiny
    req = tmp_path / "req.jsonl"
    req.write_bytes(b'{"tokens": [5]}\n{"prompt": "caf\xe9"}\n')
    defaults = dict(n_predict=2, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                    repeat_penalty=1.0, seed=0)  # fmt: skip
    reqs, errors, _ = batching.parse_requests(model, str(req), n_ctx=64, defaults=defaults)
    assert len(reqs) == 1 and [e.line for e in errors] == [2]
    assert "not UTF-8" in errors[0].error


# ------------------------------------------------------------------------ drafting limits


@pytest.mark.parametrize(
    "flag, dest, value",
    [
        ("--draft-max", "spec_draft_n_max", 5),
        ("--draft-n", "spec_draft_n_max", 6),
        ("--draft", "spec_draft_n_max", 7),
        ("--draft-min", "spec_draft_n_min", 2),
        ("--draft-n-min", "spec_draft_n_min", 1),
        ("--draft-p-min", "spec_draft_p_min", 0.5),
    ],
)
def test_llama_cpp_draft_flag_names(flag, dest, value):
    opts = cli._load_options(["-m", "x", "-p", "y", flag, str(value)])
    assert opts[dest] == value


def test_fit_drafts_clamps_with_one_note():
    from specjax.config import SpecConfig

    log = io.StringIO()
    spec = SpecConfig(types=("draft-simple", "ngram-mod"), draft_n_max=1000, draft_n_min=900)
    fitted = cli.fit_drafts(spec, 200, "context 512, prompt of 311 tokens", log)
    assert (fitted.draft_n_max, fitted.draft_n_min, fitted.ngram_mod_n_max) == (200, 200, 64)
    note = log.getvalue()
    assert note.count("\n") == 1 and "--spec-draft-n-max 1000 -> 200" in note
    assert "ngram-simple" not in note  # only the chain's own limits
    log = io.StringIO()
    zero = cli.fit_drafts(SpecConfig(types=("draft-simple",), draft_n_max=0), 100, "", log)
    assert zero is None and "left out, speculation off" in log.getvalue()
    log = io.StringIO()
    mixed = cli.fit_drafts(
        SpecConfig(types=("ngram-simple", "draft-simple"), draft_n_max=0), 100, "", log
    )
    assert mixed.types == ("ngram-simple",)
    assert cli.fit_drafts(spec, 0, "-n 1", io.StringIO()) is None


def test_draft_limit_beyond_the_context_is_clamped_in_a_run(tiny, tmp_path, capsys):
    d, _ = tiny
    gguf = str(d / "t.gguf")
    out = tmp_path / "o.jsonl"
    args = ["generate", "-m", gguf, "-md", gguf, "-p", "def add(a, b):", "-n", "8", "-c", "32",
            "--spec-type", "draft-simple", "--spec-draft-n-max", "1000", "--spec-governor",
            "off", "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "clamped" in line]
    assert len(notes) == 1 and "--spec-draft-n-max 1000 -> 7" in notes[0], err
    assert "nan" not in err
    per_pos = [line for line in err.splitlines() if "acc per pos" in line]
    assert per_pos and per_pos[0].count(",") < 7  # no column for positions never reached
    record = json.loads(out.read_text())
    assert len(record["tokens"]) <= 8


def test_draft_n_max_zero_runs_without_the_draft_model(tiny, capsys):
    d, _ = tiny
    gguf = str(d / "t.gguf")
    args = ["generate", "-m", gguf, "-md", gguf, "-p", "def add(a, b):", "-n", "4",
            "--spec-type", "draft-simple", "--spec-draft-n-max", "0"]  # fmt: skip
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "draft-simple left out, speculation off" in err
    assert "speculative: off" in err and "draft governor" not in err


# ------------------------------------------------------------------------ statistics lines


def test_acceptance_lines_have_no_zero_columns_and_no_nan():
    assert format_acceptance_lines(0, 0, 0, [0] * 64) == []
    lines = format_acceptance_lines(0, 12, 4, [0] * 64)
    assert lines[1] == "     acc per pos = (none)" and "nan" not in "".join(lines)
    lines = format_acceptance_lines(3, 8, 2, [2, 1] + [0] * 62)
    assert lines[1] == "     acc per pos = (1.000, 0.500)"
    assert format_acceptance_lines(3, 8, 0, [2, 1])[0].endswith("mean len =  1.00")
    assert format_server_lines(SpecStats.create(1, 64)) == []
    gov = format_governor_lines({"enabled": True, "rounds": 7, "throttled": 1, "off": 2,
                                 "dropped": {"x": "why"}})  # fmt: skip
    assert gov == [
        "draft governor: on, drafting shortened in 1 and off in 2 of 7 rounds",
        "draft governor: x off for this run: why",
    ]
    assert format_governor_lines({}) == []


def test_lookup_stats_print_no_nan():
    from specjax.io import lookup

    lines = lookup.LookupStats(3, 10, 0, 0).lines()
    assert lines[-1] == "accept       = n/a (nothing drafted)"
    assert not any("nan" in line for line in lines)
