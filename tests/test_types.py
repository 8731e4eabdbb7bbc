"""specjax.types' size aliases (`alias`, `axis_size`): they read the field, part or array axis
they name, stay out of the dataclass fields (so pytree leaves, equality, hashing and jit static
arguments are the fields' alone) and cannot be assigned."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from specjax.memory.kv import KVCache
from specjax.memory.swa import SWACache
from specjax.models.config import ModelConfig
from specjax.models.qwen35 import Qwen35Config, new_state
from specjax.types import ReadOnly, alias, axis_size

TINY = dict(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def test_config_dimension_keys_read_their_fields():
    c = ModelConfig(**TINY)
    assert (c.V, c.D, c.L, c.H, c.G, c.E, c.F) == (48, 32, 2, 4, 2, 8, 64)
    assert ModelConfig(**TINY, head_dim=16).E == 16
    q = Qwen35Config(**TINY, head_dim=16, ssm_state_size=8, ssm_k_heads=2, ssm_v_heads=4)
    assert (q.V, q.D, q.L, q.H, q.G, q.E, q.F) == (48, 32, 2, 4, 2, 16, 64)
    assert (q.S, q.Hk, q.Hv) == (8, 2, 4)


def test_aliases_are_not_fields_and_keep_hashing():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not names & {"V", "D", "L", "H", "G", "E", "F"}
    c = ModelConfig(**TINY)
    assert set(c.to_dict()) == names
    assert c == ModelConfig.from_dict(c.to_dict()) and hash(c) == hash(ModelConfig(**TINY))
    assert isinstance(ModelConfig.V, ReadOnly)  # the class attribute is the descriptor
    traced = jax.jit(lambda x, config: x * config.V, static_argnums=1)
    assert int(traced(jnp.int32(2), c)) == 96


def test_state_sizes_read_parts_and_axes_and_leaves_are_unchanged():
    cache = KVCache.init(
        batch=3, capacity=5, n_layers=1, n_kv_heads=2, head_dim=4, inv_freq=(1.0, 0.5)
    )
    assert (cache.batch, cache.capacity) == (cache.pos.shape[0], cache.pos.shape[1]) == (3, 5)
    assert len(jax.tree.leaves(cache)) == 4  # k, v, pos, overflow
    ring = KVCache.init(batch=3, capacity=2, n_layers=1, n_kv_heads=2, head_dim=4, inv_freq=())
    swa = SWACache(full=cache, ring=ring, swa=(False, True), window=2)
    assert (swa.batch, swa.capacity, swa.ring_cells) == (3, 5, 2)
    q = Qwen35Config(**TINY, head_dim=16, ssm_state_size=8, ssm_k_heads=2, ssm_v_heads=4)
    state = new_state(q, 2, 6)
    assert (state.batch, state.capacity) == (2, 6) == state.kv.pos.shape


def test_aliases_are_read_only_and_say_what_they_read():
    class Sizes:
        n = alias("inner.count")
        rows = axis_size("table", 0)

        def __init__(self) -> None:
            self.inner = type("Inner", (), {"count": 7})()
            self.table = jnp.zeros((4, 2))

    s = Sizes()
    assert (s.n, s.rows) == (7, 4)
    with pytest.raises(AttributeError, match=r"n is read-only: it reads inner\.count"):
        s.n = 3  # type: ignore[misc]
