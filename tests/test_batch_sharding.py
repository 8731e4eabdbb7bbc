"""A batch job sharded over 8 simulated CPU devices (data=8, data=4 x model=2, data=2 x
model=4) gives the records of one device; two processes joined by `jax.distributed` on
loopback each write their own shard, and the union is the one-process result.

Each run is a subprocess (the device count is fixed when JAX starts:
XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specjax.io.gguf_io import save_gguf
from specjax.jobs import batch as batching
from specjax.testing import tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]

JOB = r"""
import json, sys
import jax
import specjax
from specjax.jobs import batch as batching
model = specjax.load(sys.argv[1])
out = {}
for name in sys.argv[4:]:
    mesh = None
    if name != "one":
        d, m = name.split("x")
        mesh = {"data": int(d), "model": int(m)}
    path = f"{sys.argv[3]}/{name}.jsonl"
    specjax.batch(model, sys.argv[2], path, n_parallel=8, n_ctx=128, prefill_chunk=16,
                  progress=False, mesh=mesh)
    out[name] = {str(r["id"]): r["tokens"] for r in batching.read_results(path)}
print(json.dumps({"devices": jax.device_count(), "records": out}))
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard")
    model = tiny_model_with_tokenizer(0)
    save_gguf(str(d / "t.gguf"), model.config, model.params, model.tokenizer, dtype="f32")
    rng = np.random.default_rng(3)
    lines = []
    for i in range(12):
        req = {
            "tokens": [int(x) for x in rng.integers(3, 90, int(rng.integers(1, 30)))],
            "n_predict": int(rng.integers(4, 20)),
            "seed": i,
        }
        if i % 2:
            req["temperature"] = 0.8
        lines.append(json.dumps(req))
    (d / "req.jsonl").write_text("\n".join(lines) + "\n")
    return d


def _env(devices: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECJAX_COMPILE_CACHE": "0"}
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\d+",
        f"--xla_force_host_platform_device_count={devices}",
        os.environ.get("XLA_FLAGS", ""),
    )
    if "device_count" not in env["XLA_FLAGS"]:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    env.pop("JAX_PLATFORMS", None)
    return env


def test_mesh_in_process_two_devices(files, tmp_path):
    """The default run's check on this process's 2 CPU devices (tests/conftest.py)."""
    import jax

    import specjax

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    model = tiny_model_with_tokenizer(0)
    kw = dict(n_ctx=128, prefill_chunk=16, progress=False)
    records = {}
    for name, np_, mesh in [
        ("one", 1, None),
        ("data2", 2, {"data": 2, "model": 1}),
        ("model2", 1, {"data": 1, "model": 2}),
    ]:
        out = tmp_path / f"{name}.jsonl"
        specjax.batch(model, files / "req.jsonl", out, n_parallel=np_, mesh=mesh, **kw)
        records[name] = {r["id"]: r["tokens"] for r in batching.read_results(out)}
    assert len(records["one"]) == 12
    assert records["data2"] == records["one"]
    assert records["model2"] == records["one"]


@pytest.mark.slow
def test_mesh_shardings_give_the_one_device_records(files):
    proc = subprocess.run(
        [sys.executable, "-c", JOB, str(files / "t.gguf"), str(files / "req.jsonl"), str(files)]
        + ["one", "8x1", "4x2", "2x4"],
        env=_env(8),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    recs = result["records"]
    assert len(recs["one"]) == 12
    for name in ("8x1", "4x2", "2x4"):
        assert recs[name] == recs["one"], name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_processes_write_their_shards(files):
    base = [sys.executable, "-m", "specjax.cli", "batch", "-m", str(files / "t.gguf")]
    base += ["--in", str(files / "req.jsonl"), "-c", "128", "--prefill-chunk", "16"]
    base += ["-np", "4", "--no-progress", "--no-compile-cache"]
    one = files / "single.jsonl"
    subprocess.run([*base, "--out", str(one)], env=_env(1), check=True, timeout=600)
    dist = files / "dist.jsonl"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                *base,
                "--out",
                str(dist),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=_env(1),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    shards = [batching.read_results(batching.shard_path(str(dist), i, 2)) for i in range(2)]
    assert all(len(s) == 6 for s in shards)  # requests 0, 2, 4, ... and 1, 3, 5, ...
    assert not dist.exists()
    union = {r["id"]: r["tokens"] for s in shards for r in s}
    want = {r["id"]: r["tokens"] for r in batching.read_results(one)}
    assert sum(len(s) for s in shards) == len(union) == 12
    assert union == want
