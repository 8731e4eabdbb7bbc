"""PARTIAL_ONLY prompt checkpoints of a hybrid memory (specjax.memory.checkpoint): a restored
checkpoint continues exactly as the memory it was taken from (recurrent state restored, KV
trimmed by seq_rm), the orbax round trip is exact, corruption and mismatches raise an error
naming the file and the field, and a process killed while saving leaves the previous checkpoint
readable."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.memory import checkpoint as sc
from specjax.memory.hybrid import HybridMemory
from specjax.memory.hybrid import forward_memory as _forward_memory
from specjax.models import qwen35 as q
from specjax.testing import tiny_qwen35_config

CFG = tiny_qwen35_config()
forward_memory = jax.jit(_forward_memory, static_argnames=("config", "cache_empty"))


@functools.lru_cache(maxsize=1)
def _params() -> dict:
    return q.init_params(CFG, jax.random.PRNGKey(0), std=0.2)


def _feed(mem: HybridMemory, rows: list[np.ndarray], start: list[int]):
    toks = np.zeros((2, 8), np.int32)
    pos = np.full((2, 8), -1, np.int32)
    for b, (r, s) in enumerate(zip(rows, start)):
        toks[b, : len(r)] = r
        pos[b, : len(r)] = s + np.arange(len(r))
    return forward_memory(CFG, _params(), jnp.asarray(toks), jnp.asarray(pos), mem)


@functools.lru_cache(maxsize=1)
def _snapshot() -> tuple[HybridMemory, sc.PromptCheckpoint]:
    rng = np.random.RandomState(0)
    mem = HybridMemory.init(CFG, 2, 32, n_rs_seq=2)
    _, mem = _feed(mem, [rng.randint(0, CFG.V, size=7), rng.randint(0, CFG.V, size=5)], [0, 0])
    return mem, sc.take(mem, 1, n_tokens=5)


def test_restored_checkpoint_continues_as_the_memory_it_was_taken_from(tmp_path: Path) -> None:
    mem0, ckpt = _snapshot()
    assert int(ckpt.pos_max) == 4 and int(ckpt.n_tokens) == 5
    # the target's PARTIAL_ONLY data is the recurrent state only (no attention KV)
    assert set(ckpt.data_tgt) == {"conv", "ssm"}
    path = sc.save(tmp_path / "slot1", ckpt, sc.model_id(CFG))
    assert path.is_dir()
    loaded = sc.load(tmp_path / "slot1", ckpt, sc.model_id(CFG))
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(ckpt)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rng = np.random.RandomState(1)
    _, mem1 = _feed(mem0, [rng.randint(0, CFG.V, size=3), rng.randint(0, CFG.V, size=6)], [7, 5])
    restored = sc.restore(mem1, 1, loaded)
    nxt = [rng.randint(0, CFG.V, size=2), rng.randint(0, CFG.V, size=4)]
    want, _ = _feed(mem0, nxt, [9, 5])
    got, _ = _feed(restored, nxt, [10, 5])
    np.testing.assert_allclose(np.asarray(got[1, :4]), np.asarray(want[1, :4]), atol=1e-5)
    assert not np.allclose(
        np.asarray(_feed(mem1, nxt, [10, 11])[0][1, :4]), np.asarray(want[1, :4])
    )


def _largest_file(root: Path) -> Path:
    files = [p for p in root.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_corruption_and_mismatch_name_the_file_and_field(tmp_path: Path) -> None:
    _, ckpt = _snapshot()
    path = sc.save(tmp_path / "slot", ckpt, sc.model_id(CFG))
    # another model: the recorded config differs
    other = CFG.to_dict() | {"ffn_dim": 64}
    with pytest.raises(sc.CheckpointError, match=r"slot/1: field meta\.model\.config"):
        sc.load(tmp_path / "slot", ckpt, {"arch": "qwen35", "config": other})
    # a memory of other shapes: the field and its shapes are named
    wrong = sc.PromptCheckpoint(
        n_tokens=ckpt.n_tokens,
        pos_min=ckpt.pos_min,
        pos_max=ckpt.pos_max,
        data_tgt={"conv": ckpt.data_tgt["conv"], "ssm": tuple(s[:2] for s in ckpt.data_tgt["ssm"])},
        data_dft={},
        data_spec={},
    )
    with pytest.raises(
        sc.CheckpointError, match=r"field data_tgt\['ssm'\]\[0\] is float32\[4, 8, 8\]"
    ):
        sc.load(tmp_path / "slot", wrong, sc.model_id(CFG))
    with pytest.raises(sc.CheckpointError, match=r"field data_tgt.ssm.0 has shape \(2, 8, 8\)"):
        sc.restore(_snapshot()[0], 0, wrong)
    # a data item from another save (readable, but not the bytes this meta recorded)
    other_ckpt = sc.take(_snapshot()[0], 0, n_tokens=7)
    other_path = sc.save(tmp_path / "other", other_ckpt, sc.model_id(CFG))
    shutil.rmtree(path / "data_tgt")
    shutil.copytree(other_path / "data_tgt", path / "data_tgt")
    with pytest.raises(
        sc.CheckpointError, match=r"slot/1: field data_tgt\['conv'\]\[0\] is corrupted"
    ):
        sc.load(tmp_path / "slot", ckpt, sc.model_id(CFG))
    # flipped bytes in the data of the target's state
    victim = _largest_file(path / "data_tgt")
    raw = bytearray(victim.read_bytes())
    for i in range(len(raw) // 3, len(raw) // 3 + 64):
        raw[i] ^= 0x5A
    victim.write_bytes(bytes(raw))
    with pytest.raises(sc.CheckpointError, match=r"slot/1: field data_tgt"):
        sc.load(tmp_path / "slot", ckpt, sc.model_id(CFG))


_WRITER = textwrap.dedent(
    """
    import sys, numpy as np, jax.numpy as jnp
    from specjax.memory import checkpoint as sc
    i = 0
    while True:
        i += 1
        ck = sc.PromptCheckpoint(
            n_tokens=jnp.int32(i), pos_min=jnp.int32(0), pos_max=jnp.int32(i),
            data_tgt={"conv": (jnp.full((3, 2048), i, jnp.float32),),
                      "ssm": (jnp.full((4, 64, 64), i, jnp.float32),)},
            data_dft={}, data_spec={},
        )
        sc.save(sys.argv[1], ck, {"arch": "test"})
        print(i, flush=True)
    """
)


def test_a_kill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A writer saving in a loop is killed (SIGKILL) mid-run: the newest complete checkpoint
    loads, and it is internally consistent (every field from the same save)."""
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = dict(os.environ, PYTHONPATH=str(Path(sc.__file__).parents[2]), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "slot")], stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    for _ in range(3):  # let it finish a few saves, then kill it during the next ones
        assert proc.stdout.readline()
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    like = sc.PromptCheckpoint(
        n_tokens=jnp.int32(0),
        pos_min=jnp.int32(0),
        pos_max=jnp.int32(0),
        data_tgt={
            "conv": (jnp.zeros((3, 2048), jnp.float32),),
            "ssm": (jnp.zeros((4, 64, 64), jnp.float32),),
        },
        data_dft={},
        data_spec={},
    )
    got = sc.load(tmp_path / "slot", like, {"arch": "test"})
    i = int(got.n_tokens)
    assert i >= 3 and int(got.pos_max) == i
    assert np.all(np.asarray(got.data_tgt["conv"][0]) == i)
    assert np.all(np.asarray(got.data_tgt["ssm"][0]) == i)
