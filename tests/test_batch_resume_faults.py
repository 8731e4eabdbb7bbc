"""A resume trusts only records it can check (issue 52, item 5): every line of an existing
results file is validated (keys and types, an id of the input, one record per id, a `check`
over the record and its request); a file with a line it cannot trust is refused unchanged,
naming the line and the id; `--repair` lists what it drops, keeps the file as it was in
`OUT.bak`, and runs the dropped requests again.

The fault-injection test damages a finished results file at random (seeded: truncations,
byte edits, deleted, duplicated and swapped lines, edited values, stray records) and resumes:
whatever the damage, the job ends with exactly one record per request, each equal to the
undamaged run's, or it refuses with the file byte for byte as it was.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import specjax
from specjax.io.gguf_io import save_gguf
from specjax.jobs import batch as batching
from specjax.testing import tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
N_CTX, CHUNK, N_REQ = 64, 16, 8


@pytest.fixture(scope="module")
def model():
    return tiny_model_with_tokenizer(0)


@pytest.fixture(scope="module")
def requests(model):
    rng = np.random.default_rng(3)
    out = []
    for i in range(N_REQ):
        toks = [int(x) for x in rng.integers(3, model.config.V, int(rng.integers(1, 20)))]
        req = {"id": f"r{i:02d}", "tokens": toks, "n_predict": int(rng.integers(1, 9))}
        if i % 2:
            req.update(temperature=0.8, seed=i)
        out.append(req)
    return out


def run_job(model, reqs, out, **kw):
    kw.setdefault("n_ctx", N_CTX)
    kw.setdefault("prefill_chunk", CHUNK)
    kw.setdefault("progress", False)
    kw.setdefault("n_parallel", 4)
    kw.setdefault("log", io.StringIO())
    return specjax.batch(model, reqs, out, **kw)


def comparable(rec: dict) -> dict:
    """A record without its wall time (the one value that differs between runs)."""
    timings = {k: v for k, v in rec["timings"].items() if k != "seconds"}
    return {**{k: v for k, v in rec.items() if k not in ("timings", "check")}, "timings": timings}


@pytest.fixture(scope="module")
def reference(model, requests, tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "full.jsonl"
    run_job(model, requests, path)
    data = path.read_bytes()
    recs = [json.loads(line) for line in data.decode().splitlines()]
    assert sorted(r["id"] for r in recs) == [r["id"] for r in requests]
    return data, {r["id"]: comparable(r) for r in recs}


def final_records(path: Path) -> dict:
    recs = [json.loads(line) for line in path.read_bytes().decode().splitlines()]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), f"an id twice: {ids}"
    return {r["id"]: comparable(r) for r in recs}


def test_records_carry_a_check_that_catches_edits(model, requests, reference):
    data, _ = reference
    rec = json.loads(data.decode().splitlines()[0])
    reqs, _, _ = batching.parse_requests(
        model, requests, n_ctx=N_CTX, defaults=dict(batching_defaults())
    )
    by_id = {r.id: r for r in reqs}
    assert rec["check"] == batching.record_check(rec, by_id[rec["id"]])
    edited = {**rec, "tokens": [*rec["tokens"], 5]}
    assert edited["check"] != batching.record_check(edited, by_id[rec["id"]])
    other = by_id[next(i for i in by_id if i != rec["id"])]
    assert rec["check"] != batching.record_check(rec, other)  # tied to its own request


def batching_defaults():
    return dict(n_predict=64, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                repeat_penalty=1.0, seed=0)  # fmt: skip


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("id_only", "line 4 (id 'r03'): missing tokens"),
        ("stranger", "line 9 (id 'zz'): its id is not a request of the input"),
        ("duplicate", "line 9 (id 'r01'): a second record of its id (first on line"),
        ("edited", "line 2 (id '"),
    ],
)
def test_damaged_file_refused_unchanged_then_repaired(
    model, requests, reference, tmp_path, damage, needle
):
    data, want = reference
    lines = data.decode().splitlines(keepends=True)
    if damage == "id_only":
        lines[3] = json.dumps({"id": "r03"}) + "\n"
        target = "r03"
    elif damage == "stranger":
        lines.append(lines[0].replace(json.loads(lines[0])["id"], "zz", 1))
        target = None
    elif damage == "duplicate":
        first = next(x for x in lines if json.loads(x)["id"] == "r01")
        lines.append(first)
        target = None
    else:
        rec = json.loads(lines[1])
        rec["text"] = rec["text"] + "!"
        lines[1] = json.dumps(rec) + "\n"
        target = rec["id"]
    out = tmp_path / "out.jsonl"
    damaged = "".join(lines).encode()
    out.write_bytes(damaged)
    with pytest.raises(batching.DamagedResultsError) as info:
        run_job(model, requests, out)
    assert needle in str(info.value)
    assert out.read_bytes() == damaged, "a refused file must not change"
    log = io.StringIO()
    summary = run_job(model, requests, out, repair=True, log=log)
    assert "--repair drops" in log.getvalue() and needle.split(":")[0] in log.getvalue()
    assert (tmp_path / "out.jsonl.bak").read_bytes() == damaged  # nothing lost
    assert summary.n_done == (1 if target else 0)
    assert final_records(out) == want


FAULTS = ("truncate", "byte", "delete", "duplicate", "swap", "value", "garbage", "stranger")


def damage(data: bytes, rng: np.random.Generator, kind: str) -> bytes:
    lines = data.splitlines(keepends=True)
    i = int(rng.integers(len(lines)))
    if kind == "truncate":
        return data[: int(rng.integers(len(data)))]
    if kind == "byte":
        pos = int(rng.integers(len(data)))
        return data[:pos] + bytes([int(rng.integers(256))]) + data[pos + 1 :]
    if kind == "delete":
        return b"".join(lines[:i] + lines[i + 1 :])
    if kind == "duplicate":
        return b"".join([*lines, lines[i]])
    if kind == "swap":
        j = int(rng.integers(len(lines)))
        lines[i], lines[j] = lines[j], lines[i]
        return b"".join(lines)
    if kind == "value":
        rec = json.loads(lines[i])
        field = ["tokens", "text", "finish_reason", "stats", "id"][int(rng.integers(5))]
        if field == "tokens":
            rec["tokens"] = [*rec["tokens"], 7] if not rec["tokens"] else [7, *rec["tokens"][1:]]
        elif field == "text":
            rec["text"] += "x"
        elif field == "finish_reason":
            rec["finish_reason"] = "stop" if rec["finish_reason"] != "stop" else "length"
        elif field == "stats":
            rec["stats"]["rounds"] += 1
        else:
            rec["id"] = "r07" if rec["id"] != "r07" else "r00"
        lines[i] = (json.dumps(rec) + "\n").encode()
        return b"".join(lines)
    if kind == "garbage":
        return b"".join([*lines[:i], b'{"id": "r00", "tokens": [\n', *lines[i:]])
    rec = json.loads(lines[i])  # a stranger: a record of an id the input does not hold
    rec["id"] = "nobody"
    return b"".join([*lines, (json.dumps(rec) + "\n").encode()])


@pytest.mark.parametrize("seed", range(3))
def test_random_damage_never_loses_duplicates_or_alters_a_record(
    model, requests, reference, tmp_path, seed
):
    data, want = reference
    rng = np.random.default_rng(seed)
    for trial in range(8):
        kinds = [FAULTS[int(rng.integers(len(FAULTS)))] for _ in range(int(rng.integers(1, 3)))]
        damaged = data
        for kind in kinds:
            if damaged.strip():
                damaged = damage(damaged, rng, kind)
        out = tmp_path / f"out-{trial}.jsonl"
        out.write_bytes(damaged)
        try:
            run_job(model, requests, out)
        except batching.DamagedResultsError as err:
            assert out.read_bytes() == damaged, (kinds, "a refused file changed")
            assert "line " in str(err)
            run_job(model, requests, out, repair=True)
            assert Path(f"{out}.bak").read_bytes() == damaged
        got = final_records(out)
        assert got == want, (seed, trial, kinds)
        # and the repaired or resumed file is itself trusted whole
        assert run_job(model, requests, out).n_done == 0


def test_cli_refuses_then_repairs(model, requests, reference, tmp_path):
    data, want = reference
    gguf = tmp_path / "t.gguf"
    save_gguf(str(gguf), model.config, model.params, model.tokenizer, dtype="f32")
    req = tmp_path / "req.jsonl"
    req.write_text("".join(json.dumps(r) + "\n" for r in requests))
    lines = data.decode().splitlines(keepends=True)
    lines[3] = json.dumps({"id": "r03"}) + "\n"
    damaged = "".join(lines).encode()
    out = tmp_path / "out.jsonl"
    out.write_bytes(damaged)
    cmd = [sys.executable, "-m", "specjax.cli", "batch", "-m", str(gguf), "--in", str(req),
           "--out", str(out), "-np", "4", "-c", str(N_CTX), "--prefill-chunk", str(CHUNK),
           "--no-progress", "-n", "64"]  # fmt: skip
    env = {**os.environ, "SPECJAX_COMPILE_CACHE": str(tmp_path / "jax-cache")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "line 4 (id 'r03'): missing tokens" in proc.stderr
    assert "--repair" in proc.stderr and out.read_bytes() == damaged
    proc = subprocess.run([*cmd, "--repair"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--repair drops" in proc.stderr and "out.jsonl.bak" in proc.stderr
    assert final_records(out) == want
