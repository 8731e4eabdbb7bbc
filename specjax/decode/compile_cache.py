"""JAX's persistent compilation cache, on by default in a per-user directory.

A second identical `specjax generate` then loads its compiled executables from disk instead
of running XLA again. JAX's cache is keyed by the lowered program, so it still pays tracing
and lowering (about 1.5 s for the engine on 2 CPU cores) in every process; specjax therefore
also keeps its engine executables, serialised, in `<cache dir>/specjax-executables/`, keyed by
what determines the program before tracing (`executable_key`): the entry point, the static
engine configuration, the arguments' structure, shapes, dtypes and shardings, specjax's own
source and what its modules' constants and functions are bound to in the process (a constant
set at run time is not in the source), the JAX version, backend, devices, XLA flags and JAX's
configuration. A warm start
loads them directly and traces nothing.

Where the cache lives, in order of precedence:

1. `set_compile_cache(path)` / `set_compile_cache(None)` (the CLI's `--no-compile-cache`);
2. the environment variable `SPECJAX_COMPILE_CACHE`: `0`, `off`, `false`, `no` or empty turns
   the cache off, any other value is the directory;
3. JAX's own setting, when the user already chose one (`JAX_COMPILATION_CACHE_DIR` or
   `jax.config.update("jax_compilation_cache_dir", ...)`): specjax leaves it alone;
4. `$XDG_CACHE_HOME/specjax/jax`, else `~/.cache/specjax/jax`.

Invariants: `enable_default()` runs once, when this module is first imported (the API, the
engine's executables and the batch jobs all import it), and never raises (a cache
that cannot be set up only means slower starts); while specjax's cache is on, every
compilation is eligible (`jax_persistent_cache_min_compile_time_secs = 0`, no minimum entry
size), because the engine's executables take well under JAX's default 1 s threshold to compile
on small models; `current()` is the directory in use or None. A stored executable that cannot
be read is compiled again and rewritten (never trusted half-read).

The store keeps what is used most, within a size: every load counts a use of its entry (a
`.uses` file beside it: the count and the time of the last use), and when the entries take
more than `MAX_STORED_BYTES` the ones of least value go first, value being the uses (halved
for every `USE_HALF_LIFE_S` since the last one) per megabyte. A configuration run often (the
demo) therefore stays after dozens of others run once, and a big executable used once goes
before a small one used as often.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any

import jax

ENV_VAR = "SPECJAX_COMPILE_CACHE"
_OFF_VALUES = frozenset({"", "0", "off", "false", "no", "none"})
#: LRU bound on the default directory (JAX evicts the least recently used entries above it).
DEFAULT_MAX_BYTES = 2 * 2**30

_state: dict[str, str | None] = {"dir": None}
#: Bound on the bytes of `specjax-executables/` (an entry is ~1-10 MB of machine code);
#: `SPECJAX_EXECUTABLE_STORE_BYTES` overrides it.
MAX_STORED_BYTES = 2 * 2**30
#: Age after which a use counts half in an entry's value (a week).
USE_HALF_LIFE_S = 7 * 24 * 3600.0
_STORE = "specjax-executables"


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


# ------------------------------------------------------------------ stored executables


@functools.cache
def _environment_digest() -> str:
    """What, besides the call itself, decides the compiled program: specjax's source (its
    native kernel's too), JAX's version and configuration, the backend and its devices,
    XLA's flags."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent  # specjax/
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.cc"), *package.rglob("*.h")]):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    config = sorted(
        (k, v)
        for k, v in jax.config.values.items()
        if isinstance(v, (bool, int, float, str, type(None))) and "cache" not in k
    )
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    for part in (jax.__version__, sys.version, config, devices, os.environ.get("XLA_FLAGS", "")):
        h.update(repr(part).encode())
    return h.hexdigest()


#: Values a module-level constant may hold for `_bindings_digest` to key it by its repr.
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _binding_text(value: Any, package: Path) -> str:
    """What a module attribute contributes to `_bindings_digest`: a constant's repr; for a
    function (jitted or not) or class, where it was defined, and for one defined outside
    specjax's source tree the bytes of its file (a module loaded from elsewhere)."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value):
        return repr(value)
    if isinstance(value, frozenset) and all(isinstance(v, _PLAIN) for v in value):
        return repr(sorted(value, key=repr))  # (a set's order follows the string hash seed)
    target = value
    while hasattr(target, "__wrapped__"):
        target = target.__wrapped__
    if not callable(target):
        return type(value).__qualname__
    where = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    code = getattr(target, "__code__", None)
    if code is not None:
        path = Path(code.co_filename).resolve()
        if package not in path.parents and path.is_file():
            stat = path.stat()
            where += _file_digest(str(path), stat.st_mtime_ns, stat.st_size)
    return where


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    """sha256 of a file's bytes, read once per process for each (path, mtime, size): every
    key hashes the files of the functions specjax binds from other packages (~60 ms a key)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _bindings_digest() -> str:
    """What specjax's modules are bound to in this process, as far as it can decide a traced
    program beyond their source: every UPPER_CASE constant's value (`adaptive.MAX_BACKOFF`,
    say, set by a user or a benchmark) and where every function and class attribute was
    defined (a function rebound to another one). Lower-case plain values are state (counters,
    caches), not read while tracing, and left out. Computed per key: it can change between
    calls (a module imported later adds its own bindings: a key may change once, never to
    one of another program)."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent  # specjax/
    names = sorted(m for m in list(sys.modules) if m == "specjax" or m.startswith("specjax."))
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("__") or isinstance(value, types.ModuleType):
                continue  # (a submodule attribute appears when it is imported)
            if isinstance(value, _PLAIN) and not attr.isupper():
                continue
            h.update(f"{name}.{attr}={_binding_text(value, package)};".encode())
    return h.hexdigest()


def executable_key(
    fn: Any, static: Any, args: Any, options: dict[str, str] | None = None
) -> str | None:
    """Stable key of the executable `fn.lower(static, *args).compile(options)` would produce,
    or None when some part has no stable text (an object printed by address). It covers the
    source (`_environment_digest`) and what the source's names are bound to at the call
    (`_bindings_digest`): a stored executable traced with other constants or functions is
    never loaded."""
    leaves, treedef = jax.tree.flatten(args)
    text = repr(
        (
            getattr(fn, "__module__", None),
            getattr(fn, "__qualname__", None),
            static,
            str(treedef),
            [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves],
            sorted((options or {}).items()),
        )
    )
    if " at 0x" in text or getattr(fn, "__qualname__", None) is None:
        return None
    digests = _environment_digest() + _bindings_digest()
    return hashlib.sha256((digests + text).encode()).hexdigest()


def _store_dir() -> Path | None:
    directory = current()
    return Path(directory) / _STORE if directory else None


def _device_ids(compiled: Any) -> list[int]:
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    devices = getattr(unloaded, "device_list", None) or jax.devices()[:1]
    return [d.id for d in devices]


def load_executable(key: str | None) -> Any | None:
    """The stored executable for `key`, or None (cache off, not stored, or unreadable)."""
    store = _store_dir()
    if key is None or store is None:
        return None
    path = store / f"{key}.exe"
    try:
        payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
        from jax.experimental.serialize_executable import deserialize_and_load

        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[i] for i in device_ids]
        exe = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        record_use(path)
        return exe
    except FileNotFoundError:
        return None
    except Exception as err:  # a truncated or foreign file: compile again, then rewrite it
        warnings.warn(f"specjax: ignoring stored executable {path} ({err})", stacklevel=2)
        return None


@contextlib.contextmanager
def _bypassing_jax_cache() -> Any:
    # An executable that JAX's cache deserialised cannot be serialised again (XLA CPU drops
    # its kernels: "Function ... not found" when run), so what the store keeps is compiled
    # by XLA itself.
    if not _jax_option("jax_enable_compilation_cache"):
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    _reset_jax_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        _reset_jax_cache()


def compile_or_load(
    fn: Any, static: Any, args: tuple[Any, ...], options: dict[str, str] | None = None
) -> tuple[Any, bool]:
    """`fn.lower(static, *args).compile(options)` (XLA compiler options), or the executable an
    earlier process stored for the same key. Returns (executable, whether XLA compiled it
    here)."""
    key = executable_key(fn, static, args, options) if _store_dir() is not None else None
    if key is None:
        return fn.lower(static, *args).compile(compiler_options=options), True
    exe = load_executable(key)
    if exe is not None:
        return exe, False
    with _bypassing_jax_cache():
        exe = fn.lower(static, *args).compile(compiler_options=options)
    save_executable(key, exe)
    return exe, True


def save_executable(key: str | None, compiled: Any) -> None:
    """Store `compiled` under `key`, atomically. Failing to store only means a slower next
    start: programs JAX cannot serialise (hoisted constants) are skipped quietly."""
    store = _store_dir()
    if key is None or store is None:
        return
    from jax.experimental.serialize_executable import serialize

    try:
        blob = pickle.dumps((*serialize(compiled), _device_ids(compiled)))
    except (ValueError, NotImplementedError, pickle.PicklingError, TypeError):
        return
    try:
        store.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=store, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, store / f"{key}.exe")
        record_use(store / f"{key}.exe")
        evict(store, keep=store / f"{key}.exe")
    except OSError as err:
        warnings.warn(f"specjax: could not store an executable ({err})", stacklevel=2)


def _uses_path(exe: Path) -> Path:
    return exe.with_suffix(".uses")


def read_uses(exe: Path) -> tuple[float, float]:
    """(decayed use count as of the last use, time of the last use) of a stored entry; an
    entry without a readable record counts one use at its file's time."""
    try:
        count, last = _uses_path(exe).read_text().split()
        return float(count), float(last)
    except (OSError, ValueError):
        try:
            return 1.0, exe.stat().st_mtime
        except OSError:
            return 0.0, 0.0


def record_use(exe: Path, now: float | None = None) -> None:
    """Count a use of the stored entry `exe` (written atomically; a lost race between two
    processes loses a count, nothing else)."""
    now = time.time() if now is None else now
    count, last = read_uses(exe) if _uses_path(exe).exists() else (0.0, now)
    count = count * 0.5 ** (max(now - last, 0.0) / USE_HALF_LIFE_S) + 1.0
    try:
        fd, tmp = tempfile.mkstemp(dir=exe.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(f"{count!r} {now!r}\n")
        os.replace(tmp, _uses_path(exe))
    except OSError:
        pass


def entry_value(exe: Path, now: float) -> float:
    """Uses per megabyte, each use halved per `USE_HALF_LIFE_S` since the last one."""
    count, last = read_uses(exe)
    try:
        size = exe.stat().st_size
    except OSError:
        return 0.0
    return count * 0.5 ** (max(now - last, 0.0) / USE_HALF_LIFE_S) / max(size / 2**20, 1e-3)


def store_budget() -> int:
    env = os.environ.get("SPECJAX_EXECUTABLE_STORE_BYTES", "").strip()
    return int(float(env)) if env else MAX_STORED_BYTES


def evict(store: Path, keep: Path | None = None, budget: int | None = None) -> list[Path]:
    """Remove the entries of least value (`entry_value`) until the store holds at most
    `budget` bytes (default `store_budget()`), never `keep`; returns the removed entries."""
    budget = store_budget() if budget is None else budget
    now = time.time()
    entries = []
    for exe in store.glob("*.exe"):
        try:
            entries.append((entry_value(exe, now), exe.stat().st_size, exe))
        except OSError:
            continue
    total = sum(size for _, size, _ in entries)
    removed = []
    for _value, size, exe in sorted(entries, key=lambda e: (e[0], -e[1])):
        if total <= budget:
            break
        if keep is not None and exe == keep:
            continue
        exe.unlink(missing_ok=True)
        _uses_path(exe).unlink(missing_ok=True)
        total -= size
        removed.append(exe)
    return removed


enable_default()
