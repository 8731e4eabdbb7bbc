"""Test-wide JAX settings: strict dtype and rank promotion catch silent broadcasting bugs."""

import gc
import os
import shutil
import tempfile

# Test programs are tiny and compiled once each, so compilation, not execution, is most of the
# suite's time (~75% of test_engine.py's, by JAX's compile events). LLVM's optimisation level 0
# cuts a test's compile time by 30-50% (measured on 2 cores) and leaves XLA's HLO passes, which
# the copy-counting tests read, as they are. XLA CPU's MLIR fusion emitters build an MLIR
# pipeline per fusion (a quarter of a speculative engine's compile in a perf profile); its
# elemental LLVM emitter compiles the same fusions in about half the time (one-off, JAX's
# compile events over test_engine.py and test_decode_path.py: 447 -> 239 s of backend
# compilation; full default run on 2 cores: 1991 -> 1258 s).
# SPECJAX_TEST_XLA_OPT=1 keeps XLA's defaults (to run the suite as users compile).
TEST_XLA_FLAGS = "--xla_force_host_platform_device_count=2"
if os.environ.get("SPECJAX_TEST_XLA_OPT", "0") == "0":
    TEST_XLA_FLAGS += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
# Tests never read or fill the user's persistent compilation cache (specjax turns it on by
# default). A run shares one of its own instead, in a temporary directory made by the first
# process (pytest-xdist workers and the CLI subprocesses of tests inherit it), removed at the
# end: a program that recurs in another module or worker is then loaded, not compiled again.
# SPECJAX_TEST_RUN_CACHE=0 runs without it; tests/test_compile_cache.py sets its own.
_RUN_CACHE = "SPECJAX_TEST_RUN_CACHE"
_OWNS_RUN_CACHE = _RUN_CACHE not in os.environ
if _OWNS_RUN_CACHE:
    os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="specjax-test-cache-")
os.environ["SPECJAX_COMPILE_CACHE"] = os.environ[_RUN_CACHE]

import jax  # noqa: E402
import pytest  # noqa: E402

from specjax import api  # noqa: E402
from specjax.decode import compile_cache  # noqa: E402


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWNS_RUN_CACHE and os.environ.get(_RUN_CACHE, "0") != "0":
        shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)


@pytest.fixture
def no_compile_cache():
    """The persistent compilation cache off for one test (tests that count compilations)."""
    previous = compile_cache.current()
    compile_cache.set_compile_cache(None)
    yield
    compile_cache.set_compile_cache(previous)


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True, scope="module")
def _release_executables_after_each_module():
    """A test worker compiles thousands of programs; each keeps its machine code mapped until
    released. Releasing them per module keeps a worker far below vm.max_map_count (65530),
    past which XLA segfaults while compiling (seen late in full runs)."""
    yield
    api.clear_compiled()
    gc.collect()
