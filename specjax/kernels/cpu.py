"""Native CPU kernels for the few-row linear products of decode and verify steps.

At one to a few dozen activation rows a linear layer is a matrix-vector product: it reads its
whole weight matrix for two FLOPs per weight, so its speed is memory bandwidth. XLA's CPU dot
runs it on one thread, and reads f16 weights only after converting the whole matrix. The
kernel in `kernels/linear.cc` reads f16 (or f32) weights packed in panels of 16 outputs
(`pack_panels`, done once per model), converts them in registers, accumulates an outer
product per input with no horizontal sums, and splits the panels over XLA's intra-op thread
pool; it is
called from jitted code through the XLA FFI (`jax.ffi.ffi_call`). The attention of a few new
tokens over the KV cache (`attend_cache`, `kernels/attention.cc`) is the other per-step cost
XLA spreads over many small kernels; it runs there too, reading each used K/V row once. So
does the drafters' top-10 of the draft logits at every draft step (`top_k`,
`kernels/top_k.cc`): one pass per row instead of XLA's full sort or ~80 small kernels. And
ngram-cache's counting of new stream positions into its hash tables (`ngram_cache_ingest`,
`kernels/ngram_cache.cc`): a few probes a position instead of loops of gathers and scatters.

Invariants:
- `linear_rows(x, w)` = `x @ w.T` in float32, with each (row, output) sum computed in an order
  that depends on nothing but the row and the weight row: a row's result is bit-identical
  whatever the number of rows beside it (a token decoded alone, in a batch of 32, or verified
  among draft rows gets the same logits).
- The kernel is built on first use with the system C++ compiler (`-O3 -march=native`, for the
  machine it runs on) into `$XDG_CACHE_HOME/specjax/kernels/<digest>/` (else
  `~/.cache/specjax/kernels/`, else a temporary directory), written under a temporary name and
  renamed, so concurrent processes never load half a library. The digest covers the source,
  the compiler, the flags, the CPU's features and the XLA FFI headers.
- `available()` never raises. Without a compiler, off CPU, on a build failure (one warning), or
  with `SPECJAX_CPU_KERNELS=0`, it is False and callers keep XLA's dot.
- Inference only: the custom call has no derivative rule (training never sees kernel weights).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

ENV_VAR = "SPECJAX_CPU_KERNELS"
TARGET = "specjax_linear"
ATTEND_TARGET = "specjax_attend_cache"
TOP_K_TARGET = "specjax_top_k"
NGRAM_CACHE_TARGET = "specjax_ngram_cache_ingest"
_KERNELS = Path(__file__).resolve().parent
_SOURCES = (
    _KERNELS / "linear.cc",
    _KERNELS / "attention.cc",
    _KERNELS / "top_k.cc",
    _KERNELS / "ngram_cache.cc",
)
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
_OFF_VALUES = frozenset({"0", "off", "false", "no", "none"})

#: Products with at most this many activation rows use the kernel; more rows (a long prompt)
#: go to XLA's dot. On the 2-core AVX2 host the panel kernel ran at 160-190 GFLOP/s for the
#: target's matrices at 16-512 rows against XLA's dot (YNNPACK) at 55-174, level at 1024
#: (`benchmarks/kernels.py`'s `linear_block_rows`); a 65-token verify forward (ngram-mod's
#: width, one row past the earlier limit of 64) took 13.5 / 14.5 ms instead of 19.2 / 20.6
#: (its `forward_ms`, two runs alternating with the commit before, on a busy host:
#: benchmarks/results/kernels-forward-{before,after}.json hold the first pair).
MAX_ROWS = 512

_state: dict[str, Any] = {"library": None, "error": None, "forced_off": False}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specjax" / "kernels"


def _digest(compiler: str) -> str:
    h = hashlib.sha256()
    for path in sorted(_KERNELS.iterdir()):
        if path.suffix in (".cc", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    for part in (version.stdout, " ".join(_FLAGS), platform.machine(), _cpu_features()):
        h.update(part.encode())
    include = Path(jax.ffi.include_dir())
    for header in sorted((include / "xla" / "ffi" / "api").glob("*.h")):
        h.update(header.read_bytes())
    return h.hexdigest()[:24]


def compile_kernels(compiler: str, flags: tuple[str, ...], output: str | os.PathLike[str]) -> None:
    """Compile the kernel sources with `flags` into the shared library `output`; a failure
    raises RuntimeError naming the compiler's error lines (not its last warnings)."""
    include = f"-I{jax.ffi.include_dir()}"
    command = [compiler, *flags, include, *map(str, _SOURCES), "-o", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        detail = "\n".join(errors[:20]) or done.stderr[-2000:]
        raise RuntimeError(f"{' '.join(command)} failed:\n{detail}")


def _build(compiler: str) -> Path:
    """The library for this source, compiler and CPU: from the cache, else compiled there."""
    digest = _digest(compiler)
    for root in (_build_dir(), Path(tempfile.gettempdir()) / "specjax-kernels"):
        target = root / digest / "libspecjax_kernels.so"
        if target.exists():
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue  # a read-only cache: try the next place
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            compile_kernels(compiler, _FLAGS, tmp)
            os.replace(tmp, target)  # atomic: another process sees all of it or nothing
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return target
    raise RuntimeError(f"no writable directory for the kernel under {_build_dir()}")


def _load() -> ctypes.CDLL | None:
    if _state["library"] is not None or _state["error"] is not None:
        return _state["library"]
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler (g++ or $CXX) found")
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SpecjaxLinear), "cpu")
        capsule = jax.ffi.pycapsule(library.SpecjaxAttendCache)
        jax.ffi.register_ffi_target(ATTEND_TARGET, capsule, "cpu")
        capsule = jax.ffi.pycapsule(library.SpecjaxTopK)
        jax.ffi.register_ffi_target(TOP_K_TARGET, capsule, "cpu")
        capsule = jax.ffi.pycapsule(library.SpecjaxNgramCacheIngest)
        jax.ffi.register_ffi_target(NGRAM_CACHE_TARGET, capsule, "cpu")
        _state["library"] = library
    except Exception as err:  # no kernel only means XLA's slower dot
        _state["error"] = str(err)
        warnings.warn(f"specjax: CPU kernel unavailable, using XLA's dot ({err})", stacklevel=3)
    return _state["library"]


def available() -> bool:
    """Whether `linear_rows` can run here: CPU backend, not turned off, kernel built."""
    if _state["forced_off"] or os.environ.get(ENV_VAR, "").strip().lower() in _OFF_VALUES:
        return False
    if jax.default_backend() != "cpu":
        return False
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why the kernel could not be built or loaded (None if it was, or was never tried)."""
    return _state["error"]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, `available()` is False (to compare against XLA's dot)."""
    before = _state["forced_off"]
    _state["forced_off"] = True
    try:
        yield
    finally:
        _state["forced_off"] = before


#: Outputs per weight panel of `linear_panels` (`kernels/linear.cc`).
PANEL = 16


def pack_panels(w: Any) -> Any:
    """`w [out, in]` as the kernel's panels `[ceil(out / 16), in, 16]`: panels[p, i, j] =
    w[16 p + j, i], zero past the last output. NumPy in, NumPy out (host-side, done once
    when a model's decode form is built); a JAX array is packed in the graph."""
    xp = np if isinstance(w, np.ndarray) else jnp
    out, inp = w.shape
    panels = -(-out // PANEL)
    padded = xp.pad(w, ((0, panels * PANEL - out), (0, 0)))
    return padded.reshape(panels, PANEL, inp).transpose(0, 2, 1)


def _call(x: Array, panels: Array, out: int) -> Array:
    out_type = jax.ShapeDtypeStruct((*x.shape[:-1], out), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out_type)(x, panels)


def attend_cache(
    q_BGQE: Array,
    k_BGSE: Array,
    v_BGSE: Array,
    k_pos_BS: Array,
    q_pos_BT: Array,
    n_used: Array | int,
    window: int,
) -> tuple[Array, Array, Array]:
    """The online-softmax state (max, normaliser `[B, G, Q]`, weighted sum `[B, G, Q, E]`) of
    float32 query rows (`Q = R * T`, token fastest) over the cached cells below `n_used`, by
    `llama.attention_mask`'s visibility rule; see `kernels/attention.cc`."""
    B, G, Q, E = q_BGQE.shape
    f32 = jnp.float32
    out_types = (
        jax.ShapeDtypeStruct((B, G, Q), f32),
        jax.ShapeDtypeStruct((B, G, Q), f32),
        jax.ShapeDtypeStruct((B, G, Q, E), f32),
    )
    call = jax.ffi.ffi_call(ATTEND_TARGET, out_types)
    used = jnp.asarray(n_used, jnp.int32).reshape(())
    m, total, acc = call(
        q_BGQE,
        k_BGSE,
        v_BGSE,
        k_pos_BS.astype(jnp.int32),
        q_pos_BT.astype(jnp.int32),
        used,
        window=np.int64(window),
    )
    return m, total, acc


def top_k(x: Array, k: int) -> tuple[Array, Array]:
    """`jax.lax.top_k(x, k)` over the last axis of float32 `x` (no NaN) in one pass per row on
    the kernel: values descending, equal values by lower index (`kernels/top_k.cc`)."""
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k must be in [1, {x.shape[-1]}], got {k}")
    out_types = (
        jax.ShapeDtypeStruct((*x.shape[:-1], k), jnp.float32),
        jax.ShapeDtypeStruct((*x.shape[:-1], k), jnp.int32),
    )
    call = jax.ffi.ffi_call(TOP_K_TARGET, out_types, vmap_method="broadcast_all")
    values, indices = call(x.astype(jnp.float32), k=np.int64(k))
    return values, indices


def ngram_cache_ingest(
    tables: tuple[Array, ...],
    tokens_BS: Array,
    length_B: Array,
    last_B: Array,
    target_B: Array,
    *,
    cap: int,
    max_probe: int,
    lookup: bool,
    open_sequence: bool,
) -> tuple[Array, ...]:
    """ngram-cache's context tables (`NgramCacheState`'s 14 fields, in order) with stream
    positions `[cache_size, target)` counted in, updated in place (each output aliases its
    input: pass donated buffers); see `kernels/ngram_cache.cc`."""
    out_types = tuple(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tables)
    stream = (tokens_BS, length_B, last_B, target_B)
    aliases = {len(stream) + i: i for i in range(len(tables))}
    call = jax.ffi.ffi_call(NGRAM_CACHE_TARGET, out_types, input_output_aliases=aliases)
    return tuple(
        call(
            *(x.astype(jnp.int32) for x in stream),
            *tables,
            cap=np.int64(cap),
            max_probe=np.int64(max_probe),
            lookup=np.int64(lookup),
            open_sequence=np.int64(open_sequence),
        )
    )


def linear_rows(x: Array, w: Array) -> Array:
    """`x @ w.T` (f32 `[..., in]` by f16/f32 `[out, in]`) on the kernel; see the module doc.
    The weight is packed into panels in the graph: weights used every step are packed once
    instead (`pack_panels`, `linear_panels`)."""
    return linear_panels(x, pack_panels(w), w.shape[0])


def linear_panels(x: Array, panels: Array, out: int) -> Array:
    """`x @ w.T` for the first `out` outputs of a weight packed by `pack_panels` (f16 or f32
    `[P, in, 16]`); float32 `[..., out]`."""
    # custom_vmap takes array arguments only: the output count travels as a shape
    return _linear_panels(x, panels, jnp.zeros((out,), jnp.int8))


@jax.custom_batching.custom_vmap
def _linear_panels(x: Array, panels: Array, out_marker: Array) -> Array:
    return _call(x, panels, out_marker.shape[0])


@_linear_panels.def_vmap
def _linear_panels_vmap(
    axis_size: int, in_batched: list[bool], x: Array, panels: Array, out_marker: Array
) -> tuple[Array, bool]:
    x_batched, w_batched, _ = in_batched
    out = out_marker.shape[-1]
    if w_batched:  # a weight per batch element: no shared matrix to stream
        x = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        w = panels.transpose(0, 1, 3, 2).reshape(axis_size, -1, panels.shape[2])[:, :out]
        return jnp.einsum("b...i,boi->b...o", x, w.astype(jnp.float32)), True
    return _call(x, panels, out), True  # the batch axis is just more leading rows
