"""`specjax batch` killed with SIGKILL at random moments, restarted until done, gives exactly
the records of an uninterrupted run: same ids, same tokens and texts, no duplicates, and no
partial line at any moment. Requests mix temperature 0 and 0.8 (with seeds). The default run
decodes plainly: what is under test is the writer and the resume, and a plain engine compiles
in a fraction of a speculative one's time. The slow one also runs speculation (ngram-mod +
draft-simple, drafting every round) and speculation under the draft governor (whose off rounds
run lean).

All runs are `python -m specjax.cli batch` subprocesses sharing a persistent compilation
cache, so restarts do not compile again. (That these records equal `specjax.generate` per
request is tests/test_batch.py's business.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specjax.io.gguf_io import save_gguf
from specjax.jobs import batch as batching
from specjax.testing import noisy_copy, tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
N_CTX, CHUNK, NP = 128, 16, 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kill")
    model = tiny_model_with_tokenizer(0)
    draft = noisy_copy(model, 0.3)
    save_gguf(str(d / "t.gguf"), model.config, model.params, model.tokenizer, dtype="f32")
    save_gguf(str(d / "d.gguf"), draft.config, draft.params, draft.tokenizer, dtype="f32")
    rng = np.random.default_rng(7)
    lines = []
    for i in range(48):
        L = int(rng.integers(1, 41))
        unit = [int(x) for x in rng.integers(3, model.config.V, 4)]
        toks = (unit * 11)[:L] if i % 3 == 0 else [int(x) for x in rng.integers(3, 90, L)]
        req = {"id": f"r{i}", "tokens": toks, "n_predict": int(rng.integers(8, 33)), "seed": i}
        if i % 2:
            req["temperature"] = 0.8
        lines.append(json.dumps(req))
    # the default test's 24 requests; the slow one's 48 leave work for 5 kills however
    # many records a run writes before it is killed
    (d / "req.jsonl").write_text("\n".join(lines[:24]) + "\n")
    (d / "req48.jsonl").write_text("\n".join(lines) + "\n")
    return d


SPEC_FLAGS = [
    "--spec-type",
    "ngram-mod,draft-simple",
    "--spec-ngram-mod-n-match",
    "4",
    "--spec-ngram-mod-n-min",
    "2",
    "--spec-ngram-mod-n-max",
    "8",
    "--spec-draft-n-max",
    "4",
    "--spec-governor",
    "off",
]


def check_whole_lines(path: Path) -> int:
    """Every line whole and parseable, no id twice; returns the number of lines."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "a partial line after SIGKILL"
    ids = [json.loads(line)["id"] for line in data.decode().splitlines()]
    assert len(ids) == len(set(ids)), "an id written twice"
    return len(ids)


def killed_until_done(
    files: Path, speculative: bool | str, kills: int, seed: int, requests: str
) -> tuple[Path, list]:
    out = files / f"killed-{speculative}-{seed}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "specjax.cli",
        "batch",
        "-m",
        str(files / "t.gguf"),
        "--in",
        str(files / requests),
        "--out",
        str(out),
        "-np",
        str(NP),
        "-c",
        str(N_CTX),
        "--prefill-chunk",
        str(CHUNK),
        "--fsync-interval",
        "0.05",
        "--no-progress",
        "--compile-cache",
        str(files / "jax-cache"),
    ]
    if speculative:
        cmd += ["-md", str(files / "d.gguf"), *SPEC_FLAGS]
    if speculative == "governed":  # the draft governor decides (lean rounds when it is off)
        cmd[-1] = "on"
    # one device; the rest of the test run's XLA flags (tests/conftest.py) kept
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags.strip()}
    env.pop("SPECJAX_COMPILE_CACHE", None)
    rng = np.random.default_rng(seed)
    logs: list[tuple[int, str]] = []
    n_killed = 0
    for _attempt in range(kills + 5):
        before = check_whole_lines(out)
        err = files / f"stderr-{speculative}-{seed}-{_attempt}.txt"
        with open(err, "w") as fh:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=fh)
            if n_killed < kills:
                # kill at a random moment once this run has written 1 or 2 new records
                # (anywhere in the next prefill, segment or write), so that every run is
                # killed while it still has work, however fast the machine
                wanted = before + int(rng.integers(1, 3))
                deadline = time.monotonic() + 300
                while proc.poll() is None and time.monotonic() < deadline:
                    if check_whole_lines(out) >= wanted:
                        break
                    time.sleep(0.005)
                time.sleep(float(rng.uniform(0.0, 0.05)))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    n_killed += 1
                    check_whole_lines(out)
                    logs.append((before, err.read_text()))
                    continue
            rc = proc.wait(timeout=600)
        text = err.read_text()
        assert rc == 0, text[-3000:]
        logs.append((before, text))
        break
    assert n_killed == kills
    return out, logs


def run_and_compare(
    files: Path, speculative: bool | str, kills: int, seed: int, n_requests: int
) -> None:
    requests = "req.jsonl" if n_requests == 24 else f"req{n_requests}.jsonl"
    # the uninterrupted run (it also fills the compile cache)
    ref, _ = killed_until_done(files, speculative, 0, seed, requests)
    want = {r["id"]: r for r in batching.read_results(ref, repair=False)}
    out, logs = killed_until_done(files, speculative, kills, seed + 1, requests)
    got = {r["id"]: r for r in batching.read_results(out, repair=False)}
    assert check_whole_lines(out) == len(want) == n_requests
    assert sorted(got) == sorted(want)
    for rid in want:
        for key in ("tokens", "text", "finish_reason"):
            assert got[rid][key] == want[rid][key], (rid, key)
    # every restart logs how many finished requests it skipped
    for before, text in logs[1:]:
        assert f"skipped {before} already in" in text, text[-2000:]


def test_sigkill_resume_mixed_temperatures(files):
    run_and_compare(files, speculative=False, kills=2, seed=0, n_requests=24)


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, True, "governed"])
def test_sigkill_resume_many_kills(files, speculative):
    run_and_compare(files, speculative=speculative, kills=5, seed=11, n_requests=48)
