"""The executable store keeps what is used most, within a size (issue 52, item 8): a
configuration run again and again (the demo) stays after dozens of others run once, on disk
(`compile_cache.evict`, bounded in bytes, not a count) and in a process (`executables._compiled`)."""

from __future__ import annotations

import os
import time

import numpy as np

from specjax.decode import compile_cache, executables


def fake_entry(store, name: str, size: int, uses: int, age_s: float = 0.0) -> object:
    exe = store / f"{name}.exe"
    exe.write_bytes(b"\0" * size)
    t = time.time() - age_s
    for _ in range(uses):
        compile_cache.record_use(exe, now=t)
    os.utime(exe, (t, t))
    return exe


def test_a_run_used_twice_outlives_ninety_used_once(tmp_path):
    store = tmp_path / "specjax-executables"
    store.mkdir()
    demo = [fake_entry(store, f"demo{i}", 3 * 2**20, uses=2, age_s=3600) for i in range(3)]
    others = [fake_entry(store, f"other{i}", 3 * 2**20, uses=1) for i in range(90)]
    # no count bound: 93 entries, well within the byte budget, all stay (the old store kept 64)
    assert compile_cache.evict(store) == []
    assert len(list(store.glob("*.exe"))) == 93
    # over a budget of 60 entries' bytes, the once-used ones go, the demo stays
    removed = compile_cache.evict(store, budget=60 * 3 * 2**20)
    assert len(removed) == 33 and not set(removed) & set(demo)
    assert all(p.exists() for p in demo)
    assert all(not p.with_suffix(".uses").exists() for p in removed)
    assert len([p for p in others if p.exists()]) == 57


def test_size_counts_a_big_entry_used_once_goes_first(tmp_path):
    store = tmp_path / "s"
    store.mkdir()
    big = fake_entry(store, "big", 8 * 2**20, uses=1)
    small = [fake_entry(store, f"small{i}", 2**20, uses=1) for i in range(4)]
    assert compile_cache.evict(store, budget=6 * 2**20) == [big]
    assert all(p.exists() for p in small)


def test_uses_decay_and_are_recorded(tmp_path):
    exe = tmp_path / "k.exe"
    exe.write_bytes(b"x")
    now = time.time()
    compile_cache.record_use(exe, now=now - compile_cache.USE_HALF_LIFE_S)
    compile_cache.record_use(exe, now=now)
    count, last = compile_cache.read_uses(exe)
    assert abs(count - 1.5) < 1e-9 and last == now  # the older use counts half
    assert compile_cache.read_uses(tmp_path / "none.exe") == (0.0, 0.0)


def test_in_process_executables_kept_by_use(monkeypatch):
    made = []

    def fake_compile(fn, engine, args, options):
        made.append(engine)
        return object(), True

    monkeypatch.setattr(compile_cache, "compile_or_load", fake_compile)
    monkeypatch.setattr(executables, "_COMPILED_MAX", 3)
    saved = dict(executables._COMPILED)
    executables._COMPILED.clear()
    executables._COMPILED_USES.clear()
    try:
        x = np.zeros(2, np.float32)
        demo = executables._compiled(executables._compiled, "demo", x)
        for _ in range(3):
            assert executables._compiled(executables._compiled, "demo", x) is demo
        for i in range(10):  # ten other configurations, each once
            executables._compiled(executables._compiled, f"other{i}", x)
        assert executables._compiled(executables._compiled, "demo", x) is demo  # still there
        assert made.count("demo") == 1 and len(executables._COMPILED) == 3
    finally:
        executables._COMPILED.clear()
        executables._COMPILED.update(saved)
        executables._COMPILED_USES.clear()
