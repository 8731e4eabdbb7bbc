"""Training loop: loss goes down, kill + resume equals an uninterrupted run, data determinism."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax.models.config import ModelConfig
from specjax.train.data import split_files, stdlib_files
from specjax.train.target import (
    TokenSampler,
    TrainConfig,
    apply_overrides,
    bits_per_byte,
    eval_windows,
    load_params_npz,
    save_params_npz,
    train,
)

VOCAB = 32


def _tokens(n: int = 6000, seed: int = 0) -> np.ndarray:
    """A learnable stream: noisy counting mod VOCAB (next token is mostly current + 1)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n,), np.uint16)
    t = 0
    for i in range(n):
        t = (t + 1) % VOCAB if rng.random() < 0.9 else int(rng.integers(VOCAB))
        out[i] = t
    return out


def _config(tmp_path: Path, run: str, **train_kw: object) -> TrainConfig:
    np.save(tmp_path / "train.npy", _tokens(6000, 0))
    np.save(tmp_path / "val.npy", _tokens(700, 1))
    raw = {
        "model": {
            "vocab_size": VOCAB,
            "dim": 32,
            "n_layers": 1,
            "n_heads": 2,
            "n_kv_heads": 1,
            "ffn_dim": 64,
            "max_position": 32,
        },
        "data": {
            "tokenizer": None,
            "tokens_path": str(tmp_path / "train.npy"),
            "val_tokens_path": str(tmp_path / "val.npy"),
            "seq_len": 16,
            "batch_size": 4,
        },
        "optim": {"lr": 1e-2, "warmup_steps": 3},
        "train": {
            "run_dir": str(tmp_path / run),
            "steps": 24,
            "log_every": 4,
            "eval_every": 0,
            "checkpoint_every": 4,
            "progress": False,
            **train_kw,
        },
    }
    return TrainConfig.from_dict(raw)


def _params(run_dir: Path) -> dict[str, np.ndarray]:
    _, params = load_params_npz(run_dir / "params.npz")
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}


def test_tiny_training_lowers_loss(tmp_path: Path) -> None:
    summary = train(_config(tmp_path, "run"))
    losses = [r["loss"] for r in summary["log"] if "loss" in r]
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.5, losses
    # Validation bpb (1 byte per token without a tokenizer) beats the uniform log2(V) bits.
    assert summary["val"]["bpb"] < math.log2(VOCAB) - 0.5
    assert summary["val"]["tokens"] == 699


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The reference run: 24 steps without interruption (summary, final parameters)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    summary = train(_config(tmp, "full"))
    return summary, _params(tmp / "full")


def _count_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the step number after every training step `train` runs in this process."""
    import specjax.train.target as train_module

    done: list[int] = []
    make_train_step = train_module.make_train_step

    def counting(*args, **kwargs):
        step_fn = make_train_step(*args, **kwargs)

        def step(state, *rest):
            state, metrics = step_fn(state, *rest)
            done.append(int(state.step))
            return state, metrics

        return step

    monkeypatch.setattr(train_module, "make_train_step", counting)
    return done


def test_killed_run_resumes_to_identical_parameters(
    tmp_path: Path, uninterrupted: tuple[dict, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    full, full_params = uninterrupted
    killed = train(_config(tmp_path, "resumed", stop_at_step=10))
    assert killed["stopped"] == "stop_at_step" and killed["step"] == 10
    assert not (tmp_path / "resumed" / "params.npz").exists()
    done = _count_steps(monkeypatch)
    resumed = train(_config(tmp_path, "resumed"))
    assert resumed["step"] == 24
    assert done == list(range(11, 25))  # restored the step-10 checkpoint, not a fresh start
    a, b = full_params, _params(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # Same loss curve (log rows past the restored checkpoint are regenerated, not duplicated).
    la = [(r["step"], r["loss"]) for r in full["log"] if "loss" in r]
    lb = [(r["step"], r["loss"]) for r in resumed["log"] if "loss" in r]
    assert la == lb


#: Run in a child process: train per the YAML config in argv[1], but after step argv[2] write
#: the marker file argv[3] and wait to be killed (the parent sends SIGKILL).
_CHILD = """
import sys, time
import jax
import specjax.train.target as tr

cfg = tr.load_config(sys.argv[1])
kill_after, marker = int(sys.argv[2]), sys.argv[3]
make_train_step = tr.make_train_step

def make_stalling_step(*args, **kwargs):
    step_fn = make_train_step(*args, **kwargs)

    def step(state, *rest):
        state, metrics = step_fn(state, *rest)
        if int(state.step) == kill_after:
            jax.block_until_ready((state, metrics))
            open(marker, "w").write("ready")
            time.sleep(600)
        return state, metrics

    return step

tr.make_train_step = make_stalling_step
tr.train(cfg)
"""


def test_sigkilled_run_resumes_to_identical_parameters_and_losses(
    tmp_path: Path, uninterrupted: tuple[dict, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL between checkpoints (step 10; checkpoints every 4): no clean shutdown, no
    final save, possibly a checkpoint half written. The next run restores the last complete
    checkpoint, regenerates the log rows after it, and ends with the uninterrupted run's
    parameters and loss curve."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    full, full_params = uninterrupted
    cfg = _config(tmp_path, "killed")
    config_path = tmp_path / "killed.yaml"
    config_path.write_text(yaml.safe_dump(cfg.to_dict()))
    marker = tmp_path / "at-step-10"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(config_path), "10", str(marker)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
            assert time.monotonic() < deadline, "the child never reached step 10"
            time.sleep(0.1)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    run_dir = tmp_path / "killed"
    assert not (run_dir / "params.npz").exists()
    logged = [json.loads(line)["step"] for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert logged == [4, 8]  # what the killed run had written

    done = _count_steps(monkeypatch)
    resumed = train(cfg)
    assert resumed["step"] == 24 and resumed["stopped"] == "done"
    # restored the last complete checkpoint, not a fresh start: step 8, or step 4 when the
    # kill came before orbax finished writing step 8 in the background (its save of step 8
    # waited for step 4's, so that one is complete)
    restored = done[0] - 1
    assert restored in (4, 8) and done == list(range(restored + 1, 25)), done
    a, b = full_params, _params(run_dir)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    la = [(r["step"], r["loss"]) for r in full["log"] if "loss" in r]
    lb = [(r["step"], r["loss"]) for r in resumed["log"] if "loss" in r]
    assert la == lb and len(la) == 6
    on_disk = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in on_disk if "loss" in r] == la


def test_auto_steps_and_max_seconds_are_recorded(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "auto", auto_steps_seconds=0.5, max_seconds=600.0, checkpoint_every=0)
    summary = train(cfg)
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    assert plan["steps"] == summary["planned_steps"] == summary["step"] >= 1
    assert plan["measured_seconds_per_step"] > 0


def test_sampler_is_a_pure_function_of_seed_and_step() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    a = TokenSampler(tokens, 16, 4, seed=3)
    b = TokenSampler(tokens, 16, 4, seed=3)
    # Query b in a different order: results depend on (seed, step) only.
    later = b.batch(200)
    np.testing.assert_array_equal(a.batch(0), b.batch(0))
    np.testing.assert_array_equal(a.batch(200), later)
    assert not np.array_equal(a.batch(0), TokenSampler(tokens, 16, 4, seed=4).batch(0))
    batch = a.batch(5)
    assert batch.shape == (4, 17) and batch.dtype == np.int32
    np.testing.assert_array_equal(np.diff(batch, axis=1), 1)  # contiguous windows
    # One epoch visits each window exactly once.
    n = a.n_windows
    starts = np.concatenate([a.starts(s) for s in range(n // 4)])
    assert len(set((starts % 16).tolist())) == 1
    assert len(set(starts.tolist())) == len(starts)


def test_eval_windows_score_every_target_once() -> None:
    tokens = np.arange(1, 41, dtype=np.uint16)  # 40 tokens -> 39 targets
    windows, mask = eval_windows(tokens, 16)
    assert windows.shape == (3, 17) and mask.shape == (3, 16)
    targets = windows[:, 1:][mask > 0]
    np.testing.assert_array_equal(targets, np.arange(2, 41))


def test_bits_per_byte_of_uniform_model(tmp_path: Path) -> None:
    """An all-zero model predicts uniformly: nats/token = ln V; bpb = that / ln2 / bytes."""
    cfg = ModelConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    from specjax.models import init_params

    params = jax.tree.map(lambda x: x * 0, init_params(cfg, jax.random.key(0)))
    tokens = _tokens(100)
    nbytes = np.full((VOCAB,), 2.0, np.float32)
    r = bits_per_byte(cfg, params, tokens, 16, 2, nbytes)
    assert r["tokens"] == 99 and r["bytes"] == 198
    assert r["nats_per_token"] == pytest.approx(math.log(VOCAB), rel=1e-5)
    assert r["bpb"] == pytest.approx(math.log2(VOCAB) / 2, rel=1e-5)


def test_params_npz_round_trip(tmp_path: Path) -> None:
    cfg = ModelConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32)
    from specjax.models import init_params

    params = init_params(cfg, jax.random.key(1))
    save_params_npz(tmp_path / "p.npz", cfg, params)
    cfg2, params2 = load_params_npz(tmp_path / "p.npz")
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_config_rejects_unknown_keys_and_applies_overrides() -> None:
    raw = {
        "model": {
            "vocab_size": 8,
            "dim": 8,
            "n_layers": 1,
            "n_heads": 1,
            "n_kv_heads": 1,
            "ffn_dim": 8,
        }
    }
    with pytest.raises(ValueError, match="lr_peak"):
        TrainConfig.from_dict({**raw, "optim": {"lr_peak": 1.0}})
    cfg = TrainConfig.from_dict(apply_overrides(raw, ["train.steps=7", "data.tokens_path=x.npy"]))
    assert cfg.train.steps == 7 and cfg.data.tokens_path == "x.npy"


def test_split_is_deterministic_by_whole_files() -> None:
    files = [f"pkg/mod{i:03d}.py" for i in range(120)]
    shuffled = list(reversed(files))
    train_a, val_a = split_files(files)
    train_b, val_b = split_files(shuffled)
    assert (train_a, val_a) == (train_b, val_b)
    assert val_a == ["pkg/mod049.py", "pkg/mod099.py"]
    assert sorted(train_a + val_a) == files and not set(train_a) & set(val_a)


def test_stdlib_file_list_is_sorted_and_excludes_site_packages() -> None:
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 500
    assert all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)
    assert "os.py" in files


def test_training_log_with_a_partial_last_line_is_read_up_to_it(tmp_path) -> None:
    """A kill while appending to train_log.jsonl leaves half a line: resuming drops it (the
    record is written again); a broken line before the end is an error naming the line."""
    from specjax.train.target import _read_log

    log = tmp_path / "train_log.jsonl"
    log.write_text('{"step": 4, "loss": 1.5}\n{"step": 8, "loss": 1.2}\n{"step": 12, "lo')
    assert _read_log(log, 8) == [{"step": 4, "loss": 1.5}, {"step": 8, "loss": 1.2}]
    assert _read_log(log, 4) == [{"step": 4, "loss": 1.5}]
    log.write_text('{"step": 4, "loss": 1.5}\n{"step": 8, "lo\n{"step": 12, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        _read_log(log, 12)
