"""JAX's persistent compilation cache, on by default in a per-user directory.

A second identical `specjax generate` then loads its compiled executables from disk instead
of running XLA again; tracing and lowering are still paid in every process (they are what
produce the cache key).

Where the cache lives, in order of precedence:

1. `set_compile_cache(path)` / `set_compile_cache(None)` (the CLI's `--no-compile-cache`);
2. the environment variable `SPECJAX_COMPILE_CACHE`: `0`, `off`, `false`, `no` or empty turns
   the cache off, any other value is the directory;
3. JAX's own setting, when the user already chose one (`JAX_COMPILATION_CACHE_DIR` or
   `jax.config.update("jax_compilation_cache_dir", ...)`): specjax leaves it alone;
4. `$XDG_CACHE_HOME/specjax/jax`, else `~/.cache/specjax/jax`.

Invariants: `enable_default()` runs once when `specjax` is imported and never raises (a cache
that cannot be set up only means slower starts); while specjax's cache is on, every
compilation is eligible (`jax_persistent_cache_min_compile_time_secs = 0`, no minimum entry
size), because the engine's executables take well under JAX's default 1 s threshold to compile
on small models; `current()` is the directory in use or None.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import jax

ENV_VAR = "SPECJAX_COMPILE_CACHE"
_OFF_VALUES = frozenset({"", "0", "off", "false", "no", "none"})
#: LRU bound on the default directory (JAX evicts the least recently used entries above it).
DEFAULT_MAX_BYTES = 2 * 2**30

_state: dict[str, str | None] = {"dir": None}


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/specjax/jax`, else `~/.cache/specjax/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specjax" / "jax"


def current() -> str | None:
    """The compilation cache directory specjax configured, or None when it is off."""
    return _state["dir"]


def _jax_option(name: str) -> Any:
    return getattr(jax.config, name)  # options are dynamic attributes of jax.config


def _reset_jax_cache() -> None:
    # JAX opens its cache once, lazily, at the first compilation: forget the opened one so
    # the next compilation uses the new directory (or none).
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def set_compile_cache(path: str | os.PathLike[str] | None) -> str | None:
    """Use `path` as the persistent compilation cache (created if missing); None turns it off.

    Returns the directory in use (absolute) or None. Applies to compilations that happen after
    the call, in this process.
    """
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        _state["dir"] = None
        _reset_jax_cache()
        return None
    directory = Path(path).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if _jax_option("jax_compilation_cache_max_size") == -1:
        try:
            import filelock  # noqa: F401  (JAX needs it to bound the cache)

            jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
        except ImportError:
            pass
    _state["dir"] = str(directory)
    _reset_jax_cache()
    return _state["dir"]


def enable_default() -> str | None:
    """Apply `SPECJAX_COMPILE_CACHE`, else the user's JAX setting, else the default directory."""
    try:
        env = os.environ.get(ENV_VAR)
        if env is not None:
            if env.strip().lower() in _OFF_VALUES:
                return set_compile_cache(None)
            return set_compile_cache(env)
        user_dir = _jax_option("jax_compilation_cache_dir")
        if user_dir:  # the user configured JAX's cache: keep it as it is
            _state["dir"] = str(user_dir)
            return _state["dir"]
        return set_compile_cache(default_dir())
    except Exception as err:  # e.g. a read-only home: run without the cache
        warnings.warn(f"specjax: persistent compilation cache disabled ({err})", stacklevel=2)
        _state["dir"] = None
        return None
