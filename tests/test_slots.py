"""Slot save / restore (specjax.jobs.slots, `generate(slot_save_path=...)`, `specjax generate
--slot-save-path`): a generation restored from a slot prefills only the prompt after the
slot's prompt and gives the tokens of a full prefill (the ordinary prefill path is the
reference), on an attention-only target and on the qwen35 hybrid target (KV + recurrent
state); a slot whose state is wrong gives other tokens (the restored state is really used);
existing slots are never replaced silently; mismatched or corrupted slots raise an error
naming the file and the field."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax import api
from specjax.cli import command as cli
from specjax.config import SpecConfig
from specjax.jobs import slots
from specjax.memory.checkpoint import CheckpointError
from specjax.models import qwen35 as q
from specjax.models.config import ModelConfig
from specjax.testing import tiny_config, tiny_qwen35_config

LLAMA = tiny_config(vocab_size=64)
HYBRID = tiny_qwen35_config(vocab_size=8, max_position=256)
N = 24


@functools.lru_cache(maxsize=2)
def _llama(seed: int = 0) -> api.Model:
    return api.init_model(LLAMA, seed=seed)


@functools.lru_cache(maxsize=1)
def _hybrid() -> api.Model:
    return api.Model(config=HYBRID, params=q.init_params(HYBRID, jax.random.PRNGKey(1), std=0.2))


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(0, vocab, size=n)]


def _zeroed(state: slots.SlotState, names: tuple[str, ...]) -> slots.SlotState:
    data = {
        k: tuple(np.zeros_like(a) if k in names else a for a in v) for k, v in state.data.items()
    }
    return slots.SlotState(tokens=state.tokens, data=data)


def test_attention_slot_restore_gives_the_tokens_of_a_full_prefill(tmp_path: Path) -> None:
    model = _llama()
    base = _ids(20, LLAMA.V, 0)
    prompts = [base, base + _ids(5, LLAMA.V, 1), _ids(9, LLAMA.V, 2)]
    plain = api.generate(model, prompts, max_new_tokens=N).tokens
    # saving runs the generation from the saved state: same tokens, no second prefill
    kw = dict(max_new_tokens=N, slot_save_path=str(tmp_path))
    saved = api.generate(model, prompts, slot_save=["sys", None, None], **kw)
    assert saved.tokens == plain
    assert saved.timings["slots"]["saved"][0]["n_tokens"] == 20
    res = api.generate(model, prompts, slot_restore=["sys", "sys", None], **kw)
    assert res.tokens == plain
    assert res.timings["slots"]["prefill_tokens_skipped"] == 2 * 19
    # the restored cells are what the generation reads: a zeroed V gives other tokens
    state = slots.load_slot(model, tmp_path, "sys")
    assert state.n_cached == 19 and state.data["k"][0].shape == (LLAMA.G, 19, LLAMA.E)
    slots.write_slot(model, _zeroed(state, ("v",)), tmp_path, "zero", cache_type_k="f16",
                     cache_type_v="f16")  # fmt: skip
    bad = api.generate(model, prompts, slot_restore=["zero", "zero", None], **kw)
    assert bad.tokens[:2] != plain[:2] and bad.tokens[2] == plain[2]


def test_hybrid_slot_holds_kv_and_recurrent_state(tmp_path: Path) -> None:
    model = _hybrid()
    base = _ids(12, HYBRID.V, 3)
    prompts = [base, base + _ids(6, HYBRID.V, 4), _ids(9, HYBRID.V, 5)]
    plain = api.generate(model, prompts, max_new_tokens=N, n_ctx=128).tokens
    state = slots.save_slot(model, base, tmp_path, "sys")
    assert set(state.data) == {"k", "v", "conv", "ssm"}  # a full slot, not PARTIAL_ONLY
    assert state.data["k"][0].shape == (HYBRID.G, 11, HYBRID.E)
    kw = dict(max_new_tokens=N, n_ctx=128, slot_save_path=str(tmp_path))
    res = api.generate(model, prompts, slot_restore=["sys", "sys", None], **kw)
    assert res.tokens == plain and res.timings["slots"]["prefill_tokens_skipped"] == 22
    # each part of the slot is read: zeroing the recurrent state or the KV changes the text
    for part in (("conv", "ssm"), ("k", "v")):
        slots.write_slot(model, _zeroed(state, part), tmp_path, part[0])
        bad = api.generate(model, prompts, slot_restore=[part[0], part[0], None], **kw)
        assert bad.tokens[:2] != plain[:2] and bad.tokens[2] == plain[2], part


@pytest.mark.slow
def test_hybrid_speculative_run_from_a_slot_equals_plain_greedy(tmp_path: Path) -> None:
    model = _hybrid()
    base = _ids(12, HYBRID.V, 3)
    prompts = [base, base + _ids(6, HYBRID.V, 4), _ids(9, HYBRID.V, 5)]
    plain = api.generate(model, prompts, max_new_tokens=N, n_ctx=128).tokens
    slots.save_slot(model, base, tmp_path, "sys")
    spec = SpecConfig(
        types=("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=8, k_max=8
    )
    res = api.generate(
        model, prompts, max_new_tokens=N, n_ctx=128, spec=spec, slot_save_path=str(tmp_path),
        slot_restore=["sys", "sys", None],
    )  # fmt: skip
    assert res.tokens == plain and res.stats.to_dict()["rollback"]["checkpoint"] > 0


def test_existing_slot_is_not_replaced_without_overwrite(tmp_path: Path) -> None:
    model = _llama()
    a, b = _ids(10, LLAMA.V, 6), _ids(12, LLAMA.V, 7)
    slots.save_slot(model, a, tmp_path, "s")
    with pytest.raises(slots.SlotExistsError, match=rf"{tmp_path}/s: a slot named 's' exists"):
        slots.save_slot(model, b, tmp_path, "s")
    with pytest.raises(slots.SlotExistsError, match="overwrite=True"):
        api.generate(model, [b], max_new_tokens=2, slot_save_path=str(tmp_path), slot_save="s")
    assert slots.load_slot(model, tmp_path, "s").tokens == tuple(a)
    slots.save_slot(model, b, tmp_path, "s", overwrite=True)
    assert slots.load_slot(model, tmp_path, "s").tokens == tuple(b)
    for bad in ("", "../s", "a/b", ".", "x\n"):
        with pytest.raises(ValueError, match="slot name"):
            slots.save_slot(model, a, tmp_path, bad)


def test_mismatched_or_corrupted_slot_names_the_file_and_the_field(tmp_path: Path) -> None:
    model = _llama()
    base = _ids(20, LLAMA.V, 8)
    slots.save_slot(model, base, tmp_path, "s")
    where = rf"{tmp_path}/s/1: field"
    with pytest.raises(CheckpointError, match=rf"{where} meta\.model\.weights"):
        slots.load_slot(_llama(1), tmp_path, "s")  # same config, other weights
    other = api.init_model(ModelConfig(**{**LLAMA.to_dict(), "ffn_dim": 48}), seed=0)
    with pytest.raises(CheckpointError, match=rf"{where} meta\.model\.config"):
        slots.load_slot(other, tmp_path, "s")
    with pytest.raises(CheckpointError, match=rf"{where} meta\.extra\.cache_type_k is 'float16'"):
        api.generate(model, [base], max_new_tokens=2, slot_save_path=str(tmp_path),
                     slot_restore="s", cache_type_k="f32")  # fmt: skip
    with pytest.raises(CheckpointError, match=rf"{where} meta\.extra\.tokens differs from prompt "
                       r"0 at token 3"):  # fmt: skip
        changed = base[:3] + [(base[3] + 1) % LLAMA.V] + base[4:]
        api.generate(model, [changed], max_new_tokens=2, slot_save_path=str(tmp_path),
                     slot_restore="s")  # fmt: skip
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/none: no slot named 'none'"):
        slots.load_slot(model, tmp_path, "none")
    files = [p for p in (tmp_path / "s/1/data_tgt").rglob("*") if p.is_file()]
    size = max(p.stat().st_size for p in files)
    for victim in (p for p in files if p.stat().st_size == size):  # orbax keeps two copies
        raw = bytearray(victim.read_bytes())
        for i in range(len(raw) // 3, len(raw) // 3 + 64):
            raw[i] ^= 0x5A
        victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{where} data_tgt"):
        slots.load_slot(model, tmp_path, "s")


def test_cli_slot_save_then_restore(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from specjax.io.gguf_io import save_gguf
    from specjax.testing import tiny_model_with_tokenizer

    m = tiny_model_with_tokenizer(0)
    gguf = tmp_path / "tiny.gguf"
    save_gguf(str(gguf), m.config, m.params, m.tokenizer, dtype="f32")
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    base = ["generate", "-m", str(gguf), "-n", "8", "--slot-save-path", str(slot_dir)]
    assert cli.main([*base, "-p", "def add(a, b):", "--slot-save", "add"]) == 0
    first = capsys.readouterr()
    assert "slot: saved add (" in first.err
    out = tmp_path / "r.jsonl"
    argv = [*base, "-p", "def add(a, b):", "--slot-restore", "add", "--out", str(out)]
    assert cli.main(argv) == 0
    second = capsys.readouterr()
    assert second.out == first.out and "slot: prompt 0 restored add (" in second.err
    record = json.loads(out.read_text())
    assert record["timings"]["slots"]["prefill_tokens_skipped"] > 0
    assert cli.main([*base, "-p", "def add(a, b):", "--slot-save", "add"]) == 1
    assert "a slot named 'add' exists" in capsys.readouterr().err
    assert cli.main([*base, "-p", "import os", "--slot-restore", "add"]) == 1
    assert "meta.extra.tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not a directory"):
        cli.main(["generate", "-m", str(gguf), "-p", "x", "--slot-save-path", str(gguf),
                  "--slot-save", "a"])  # fmt: skip


# ------------------------------------------------ a kill between slot save and use loses nothing
_SLOT_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    from specjax import api
    from specjax.jobs import slots
    from specjax.models import qwen35 as q

    mode, directory, cfg_json, prompts_json = sys.argv[1:5]
    n_new = int(sys.argv[5])
    cfg = q.Qwen35Config.from_dict(json.loads(cfg_json))
    model = api.Model(config=cfg, params=q.init_params(cfg, jax.random.PRNGKey(1), std=0.2))
    prompts, suffix = json.loads(prompts_json)
    if mode == "write":  # save the slot again and again, alternating two prompts, until killed
        i = 0
        while True:
            prompt = prompts[i % 2]
            api.generate(model, [prompt], max_new_tokens=1, n_ctx=128, slot_save_path=directory,
                         slot_save="sys", slot_overwrite=True)
            print(i, flush=True)
            i += 1
    else:  # a fresh process: continue from whatever the slot holds
        state = slots.load_slot(model, directory, "sys")
        prompt = list(state.tokens) + suffix
        res = api.generate(model, [prompt], max_new_tokens=n_new, n_ctx=128,
                           slot_save_path=directory, slot_restore="sys")
        print(json.dumps({"prompt": prompt, "tokens": res.tokens[0],
                          "skipped": res.timings["slots"]["prefill_tokens_skipped"]}))
    """
)


def _has_tmp_step(slot_dir: Path) -> bool:
    """orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it when complete."""
    return slot_dir.is_dir() and any("tmp" in p.name for p in slot_dir.iterdir())


@pytest.mark.slow
def test_a_kill_between_slot_save_and_use_loses_nothing(tmp_path: Path) -> None:
    """A process re-saving slot `sys` through `generate(slot_save=..., slot_overwrite=True)`
    (alternating two prompts of different lengths) is SIGKILLed mid-save; a fresh process
    restores the slot and continues: its tokens are exactly those of an uninterrupted plain
    greedy run of the same prompt (the slot is one complete save, never a torn mix)."""
    model = _hybrid()
    prompts = [_ids(12, HYBRID.V, 3), _ids(17, HYBRID.V, 9)]
    suffix = _ids(5, HYBRID.V, 10)
    slots.save_slot(model, prompts[0], tmp_path, "sys")  # the slot exists before the writer runs
    script = tmp_path / "worker.py"
    script.write_text(_SLOT_WORKER)
    env = dict(os.environ, PYTHONPATH=str(Path(slots.__file__).parents[2]), JAX_PLATFORMS="cpu")
    args = [str(tmp_path), json.dumps(HYBRID.to_dict()), json.dumps([prompts, suffix]), str(N)]
    rng = np.random.RandomState(0)
    torn = False
    for _ in range(3):  # until a kill lands inside a save (its tmp step left on disk)
        writer = subprocess.Popen(
            [sys.executable, str(script), "write", *args], stdout=subprocess.PIPE, env=env
        )
        assert writer.stdout is not None
        for _ in range(3):  # warm up: both prompt lengths compiled, complete saves done
            assert writer.stdout.readline()
        deadline = time.perf_counter() + 60
        while not _has_tmp_step(tmp_path / "sys") and time.perf_counter() < deadline:
            time.sleep(0.001)  # wait for the next save to start writing its step
        time.sleep(0.02 * rng.rand())  # somewhere inside it
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        torn = _has_tmp_step(tmp_path / "sys")
        if torn:
            break
    assert torn, "no kill landed inside a save"
    out = subprocess.run(
        [sys.executable, str(script), "restore", *args], capture_output=True, env=env,
        text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]  # e.g. a slot left with no complete step
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["prompt"][: -len(suffix)] in prompts  # the slot holds one of the saved prompts
    assert got["skipped"] == len(got["prompt"][: -len(suffix)]) - 1  # the slot was used
    plain = api.generate(model, [got["prompt"]], max_new_tokens=N, n_ctx=128).tokens[0]
    assert got["tokens"] == plain
