"""The executables `generate` runs, kept in this process (`specjax.decode.compile_cache` is the store
on disk they are loaded from when it is on).

`_compiled(fn, engine, *args)` is the one place executables are made: an entry point of
`specjax.decode.engine` (or `specjax.jobs.continuous`) compiled for a static engine and the arguments'
structure, shapes and dtypes, kept in `_COMPILED` while it is among those used most. Beside
them: the drafter states recycled between one-shot calls (`_SPARES`), and `_lru_put`, the
least-recently-used insertion the process's other small caches use (`specjax.decode.weights`'
decode forms, `specjax.decode.prices`' measurements). `compile_count` / `clear_compiled` are public
(re-exported by `specjax.api`).
"""

from __future__ import annotations

import gc
from typing import Any

import jax

from specjax.control import compiler_options
from specjax.decode import compile_cache
from specjax.decode import engine as eng

#: Executables `generate` compiled, most recently used last, and how often each was asked
#: for. Bounded by what they hold, not by a count: every executable holds its machine code in
#: its own memory mappings (~3 per kernel, hundreds of kernels per engine program), and a
#: process that kept them all would eventually hit the kernel's map limit (vm.max_map_count,
#: 65530 by default), after which XLA crashes while compiling. Above `_MAX_MAPPED_REGIONS`
#: mappings (or `_COMPILED_MAX` entries, a backstop for small programs) the entry used least
#: goes first (fewest uses, then least recently used), so what a process runs most stays;
#: never one of the `_RECENT_KEPT` used last (a `generate` call's prefill and loop), so a new
#: configuration is not evicted by older ones used more.
_COMPILED: dict[Any, Any] = {}
_COMPILED_USES: dict[Any, int] = {}
_COMPILED_MAX = 512
_RECENT_KEPT = 2
_MAX_MAPPED_REGIONS = 32768
_compiles_made = 0

#: Final drafter states of recent one-shot `generate` calls whose chain can renew them
#: (`renew`: ngram-mod), by (chain, B, S), handed to the next such call as `engine.prefill`'s
#: spare: it starts from fresh states made in their buffers instead of allocating and filling
#: them again (32 MB for ngram-mod's default pool: ~6 ms and ~8,000 page faults a call on the
#: 2-core host). Never read by a run except through `renew`, so no output or statistic
#: depends on them; `clear_compiled` drops them.
_SPARES: dict[Any, Any] = {}
_SPARES_MAX = 2


def _mapped_regions() -> int:
    """Memory mappings of this process (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _lru_put(cache: dict[Any, Any], key: Any, value: Any, over: Any) -> None:
    """Insert `key` as most recently used (dicts keep insertion order), then drop the least
    recently used entries while `over(cache)` holds, never the one just inserted."""
    cache[key] = value
    dropped = False
    while len(cache) > 1 and over(cache):
        del cache[next(iter(cache))]
        dropped = True
    if dropped:
        gc.collect()  # what an entry held goes when its last reference does


#: XLA CPU options of the prefill executable. XLA hands the prefill's large dots, softmax and
#: reductions to YNNPACK, whose pipelines (slinky) are built on the executable's first run:
#: ~0.2 s of a warm CLI start's 0.35 s first prefill on 2 cores (perf), for ~15-25% faster
#: prefills after it. A `generate` call prefills once, so the one-off cost is what it pays;
#: without those fusions the first prefill takes ~0.15 s (benchmarks/peers.py's prefill, a
#: later call, read 0.53-0.62x of llama.cpp after this, 0.70-0.76x before). The decode loop
#: keeps the default (its products run on `specjax.kernels.cpu`).
_CPU_PREFILL_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def _compiler_options(fn: Any) -> dict[str, str] | None:
    """XLA options of an entry point's executable on this backend (`control.compiler_options`,
    plus the CPU prefill's)."""
    options = compiler_options(jax.default_backend())
    if fn is eng.prefill_jit and jax.default_backend() == "cpu":
        options.update(_CPU_PREFILL_OPTIONS)
    return options or None


def _compiled(fn: Any, engine: eng.Engine, *args: Any) -> Any:
    """AOT-compiled executable of a jitted engine entry point, cached per (engine, shapes).

    Keeps compilation out of the measured prefill/decode time. Keyed like jit's own cache:
    static engine + pytree structure + leaf shapes/dtypes; values never enter the key. The
    cache keeps the executables used most (`_COMPILED`). With the compilation cache on, an
    executable compiled by an earlier process is loaded from disk without tracing
    (`compile_cache.load_executable`).
    """
    global _compiles_made
    leaves, treedef = jax.tree.flatten(args)
    # (dtypes as they are: str() of each of the ~270 leaves' was ~1.3 ms of a call)
    key = (fn, engine, treedef, tuple((tuple(x.shape), x.dtype) for x in leaves))
    exe = _COMPILED.pop(key, None)
    _COMPILED_USES[key] = _COMPILED_USES.get(key, 0) + 1
    if exe is not None:
        _COMPILED[key] = exe  # most recently used
        return exe
    exe, compiled_here = compile_cache.compile_or_load(fn, engine, args, _compiler_options(fn))
    _compiles_made += compiled_here
    _COMPILED[key] = exe
    dropped = False
    while len(_COMPILED) > 1 and (
        len(_COMPILED) > _COMPILED_MAX or _mapped_regions() > _MAX_MAPPED_REGIONS
    ):
        # fewest uses first, the least recently used of them (dict order) before the others
        order = [k for k in list(_COMPILED)[:-_RECENT_KEPT] if k != key]
        if not order:
            break
        victim = min(enumerate(order), key=lambda e: (_COMPILED_USES.get(e[1], 0), e[0]))[1]
        del _COMPILED[victim]
        _COMPILED_USES.pop(victim, None)
        dropped = True
    if len(_COMPILED_USES) > 2 * len(_COMPILED) + 64:  # counts of entries cleared elsewhere
        for k in [k for k in _COMPILED_USES if k not in _COMPILED]:
            del _COMPILED_USES[k]
    if dropped:
        gc.collect()  # what an entry held goes when its last reference does
    return exe


def compile_count() -> int:
    """Number of executables `generate` has compiled in this process (never decreases)."""
    return _compiles_made


def clear_compiled() -> None:
    """Drop every executable `generate` and JAX's jit caches hold, releasing their memory
    (and the drafter states kept for the next call's reuse, `_SPARES`).

    The next call compiles again (or reads JAX's persistent compilation cache, when on).
    """
    _COMPILED.clear()
    _COMPILED_USES.clear()
    _SPARES.clear()
    jax.clear_caches()
