"""The persistent compilation cache: on by default in the user cache dir, off by env var,
option or API, and a second process loads the executables the first one compiled.

Each scenario runs in a fresh Python process (JAX opens its cache once per process, and the
rest of the suite runs with the cache off, see conftest.py). JAX's own monitoring events are
the independent witness: `backend_compile` durations count compile requests (served by XLA or
by the cache), `/jax/compilation_cache/cache_misses` counts executables compiled and written,
`/jax/compilation_cache/cache_hits` those loaded from disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specjax.cli import command as cli

# Runs in the child process: configures the cache as told, compiles, reports what happened.
_CHILD = r"""
import json, sys
import jax

events, compiles, traced = {}, [0], []
jax.monitoring.register_event_listener(
    lambda name, **kw: events.__setitem__(name, events.get(name, 0) + 1))
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.__setitem__(0, compiles[0] + (name == "COMPILE_EVENT")))
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, fun_name="", **kw: traced.append(fun_name)
    if name == "/jax/core/compile/jaxpr_trace_duration" else None)

import specjax
from specjax.decode import compile_cache

mode = sys.argv[1]
if mode.startswith("set:"):
    specjax.set_compile_cache(mode[4:] or None)
tokens = governor = None
if mode == "generate":
    from specjax.testing import tiny_model

    out = specjax.generate(tiny_model(0), [[5, 6, 7, 8, 9]], max_new_tokens=6)
    tokens = out.tokens
elif mode.startswith("ngram"):  # "ngram" or "ngram:PRIOR_WEIGHT=0.25" (a patched constant)
    from specjax.decode import governor as adaptive
    from specjax.testing import tiny_model

    for assignment in mode.split(":")[1:]:
        name, value = assignment.split("=")
        setattr(adaptive, name, float(value))
    spec = specjax.SpecConfig(types=("ngram-simple",), ngram_simple_size_n=3)
    out = specjax.generate(tiny_model(0), [[5, 6, 7, 8, 9]], max_new_tokens=40, spec=spec)
    tokens, governor = out.tokens, out.stats.to_dict()["governor"]
else:
    jax.block_until_ready(jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7)))
print(json.dumps({
    "dir": compile_cache.current(),
    "hits": events.get("/jax/compilation_cache/cache_hits", 0),
    "misses": events.get("/jax/compilation_cache/cache_misses", 0),
    "compiles": compiles[0],
    "tokens": tokens,
    "governor": governor,
    "traced": traced,
}))
"""


def _run(mode: str, tmp_path: Path, cache_env: str | None) -> dict:
    from specjax.testing import COMPILE_EVENT

    env = dict(os.environ)
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_env is None:
        env.pop("SPECJAX_COMPILE_CACHE", None)
    else:
        env["SPECJAX_COMPILE_CACHE"] = cache_env
    code = _CHILD.replace("COMPILE_EVENT", COMPILE_EVENT)
    proc = subprocess.run(
        [sys.executable, "-c", code, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _entries(path: Path) -> list[Path]:
    return sorted(path.glob("*-cache")) if path.is_dir() else []


def test_default_dir_is_created_and_filled(tmp_path):
    report = _run("jit", tmp_path, cache_env=None)
    expected = tmp_path / "xdg" / "specjax" / "jax"
    assert report["dir"] == str(expected)
    # a few-millisecond compilation is written too (min compile time 0, no min entry size)
    assert report["misses"] >= 1
    assert len(_entries(expected)) == report["misses"]


def test_env_var_turns_it_off(tmp_path):
    report = _run("jit", tmp_path, cache_env="0")
    assert report["dir"] is None
    assert report["compiles"] >= 1
    assert not _entries(tmp_path / "xdg" / "specjax" / "jax")
    assert report["hits"] == report["misses"] == 0


def test_set_compile_cache_none_turns_it_off(tmp_path):
    report = _run("set:", tmp_path, cache_env=None)
    assert report["dir"] is None
    assert not _entries(tmp_path / "xdg" / "specjax" / "jax")


def test_set_compile_cache_chooses_the_dir(tmp_path):
    chosen = tmp_path / "chosen"
    report = _run(f"set:{chosen}", tmp_path, cache_env="0")
    assert report["dir"] == str(chosen.resolve())
    assert _entries(chosen)


def _stored(path: Path) -> list[Path]:
    return sorted((path / "specjax-executables").glob("*.exe"))


def test_second_process_loads_the_engine_without_tracing_it(tmp_path):
    """The engine's executables are stored by the first process and loaded by the next one
    without tracing, lowering or compiling; a damaged entry is compiled again and rewritten;
    an entry stored while JAX's own cache was warm (whose executables cannot be serialised
    again) still runs."""
    cache_dir = tmp_path / "cache"
    cold = _run("generate", tmp_path, cache_env=str(cache_dir))
    assert {"prefill", "generate_loop"} <= set(cold["traced"])
    assert len(_stored(cache_dir)) >= 2  # at least the prefill and the generation loop
    assert cold["misses"] >= 1  # JAX's cache still takes the small helper programs

    warm = _run("generate", tmp_path, cache_env=str(cache_dir))
    assert not {"prefill", "generate_loop"} & set(warm["traced"]), warm["traced"]
    assert warm["misses"] == 0, "a second identical run compiled again"
    assert warm["tokens"] == cold["tokens"]

    damaged = _stored(cache_dir)[0]
    damaged.write_bytes(damaged.read_bytes()[:1000])
    repaired = _run("generate", tmp_path, cache_env=str(cache_dir))
    assert repaired["tokens"] == cold["tokens"]
    assert damaged.stat().st_size > 1000  # compiled again and rewritten

    for entry in _stored(cache_dir):  # JAX's cache is warm, the store empty
        entry.unlink()
    refill = _run("generate", tmp_path, cache_env=str(cache_dir))
    assert len(_stored(cache_dir)) >= 2
    reload = _run("generate", tmp_path, cache_env=str(cache_dir))
    assert not {"prefill", "generate_loop"} & set(reload["traced"])
    assert refill["tokens"] == reload["tokens"] == cold["tokens"]


def test_an_executable_traced_with_a_patched_constant_is_not_loaded_for_the_unpatched_one(tmp_path):
    """A module constant read while tracing (`adaptive.PRIOR_WEIGHT`, set at run time by a
    user or a benchmark) is not in specjax's source: the store must not hand the executable
    traced with the patched value to a process running with the shipped one (it once did,
    and benchmarks/peers.py then measured a governor the code did not have)."""
    cache_dir = str(tmp_path / "cache")
    fresh = _run("ngram", tmp_path, cache_env="0")  # the shipped constant, nothing stored
    patched = _run("ngram:PRIOR_WEIGHT=0.25", tmp_path, cache_env=cache_dir)
    assert patched["governor"] != fresh["governor"]  # (the constant changes the program)
    assert patched["tokens"] == fresh["tokens"]  # (the governor never changes greedy tokens)
    shipped = _run("ngram", tmp_path, cache_env=cache_dir)
    assert "generate_loop" in shipped["traced"]  # traced anew, not loaded
    assert shipped["governor"] == fresh["governor"]
    again = _run("ngram", tmp_path, cache_env=cache_dir)
    assert "generate_loop" not in again["traced"]  # its own executable, stored and loaded
    assert again["governor"] == fresh["governor"]


def test_executable_keys_follow_constants_and_functions_not_state(monkeypatch):
    """`executable_key` changes with an UPPER_CASE module constant and with a function an
    attribute is rebound to, and comes back when they do; lower-case values (counters,
    caches) do not enter it."""
    import jax.numpy as jnp

    from specjax.decode import compile_cache, executables
    from specjax.decode import engine as eng
    from specjax.decode import governor as adaptive
    from specjax.decode.engine import prefill_jit

    args = (jnp.zeros((2, 3), jnp.float32),)

    def key() -> str | None:
        return compile_cache.executable_key(prefill_jit, "static", args)

    shipped = key()
    with monkeypatch.context() as m:
        m.setattr(adaptive, "MAX_BACKOFF", adaptive.MAX_BACKOFF + 1)
        assert key() != shipped
    assert key() == shipped
    with monkeypatch.context() as m:
        m.setattr(eng, "spec_step", lambda *a, **k: None)
        assert key() != shipped
    assert key() == shipped
    with monkeypatch.context() as m:
        m.setattr(executables, "_compiles_made", executables._compiles_made + 7)
        assert key() == shipped


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], None),
        (["--no-compile-cache"], False),
        (["--compile-cache", "/tmp/x"], "/tmp/x"),
    ],
)
def test_cli_options(argv, expected):
    opts = cli._load_options(["-m", "model.gguf", "-p", "x", *argv])
    assert opts["compile_cache"] == expected


def test_cli_options_are_exclusive():
    with pytest.raises(SystemExit):
        cli._load_options(["-m", "m.gguf", "--no-compile-cache", "--compile-cache", "/tmp/x"])


def test_stored_executables_are_keyed_by_their_compiler_options():
    """The prefill is compiled with its own XLA options on CPU (`executables._CPU_PREFILL_OPTIONS`):
    an executable stored with other options must never be loaded in its place."""
    import jax.numpy as jnp

    from specjax.decode import compile_cache, executables
    from specjax.decode.engine import prefill_jit

    args = (jnp.zeros((2, 3), jnp.float32),)
    options = executables._CPU_PREFILL_OPTIONS
    plain = compile_cache.executable_key(prefill_jit, "static", args)
    with_options = compile_cache.executable_key(prefill_jit, "static", args, options)
    assert plain is not None and with_options is not None
    assert plain != with_options
    assert with_options == compile_cache.executable_key(prefill_jit, "static", args, dict(options))
