"""Test-wide JAX settings: strict dtype and rank promotion catch silent broadcasting bugs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
# Tests never read or fill the user's persistent compilation cache (specjax turns it on by
# default); tests/test_compile_cache.py turns it on in a temporary directory.
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "0")

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
