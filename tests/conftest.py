"""Test-wide JAX settings: strict dtype and rank promotion catch silent broadcasting bugs."""

import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
# Tests never read or fill the user's persistent compilation cache (specjax turns it on by
# default); tests/test_compile_cache.py turns it on in a temporary directory.
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "0")

import jax
import pytest

from specjax import api

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
