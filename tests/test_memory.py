"""specjax.memory.ops against a pure-Python model of llama.h's memory API.

The reference keeps, per row, a list of S cells holding (position, token id) or None. It also
models specjax's cell layout (new tokens and copies take the lowest free cells), so the test
compares whole `pos` arrays exactly, plus the llama.h-level facts (per-row position multisets,
pos_min / pos_max, ok). Each written token stores its id in v and its key rotated at its
position in k: v proves data moves with `seq_cp`, k proves `seq_add` / `seq_div` re-rotate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.errors import CacheOverflowError
from specjax.memory import ops as memory
from specjax.memory.kv import KVCache, check_overflow, write_layer, write_positions
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array

B, S, T, G, E = 3, 16, 4, 1, 4
INV_FREQ = (1.0, 0.1)  # theta = 100, E = 4


def new_cache(dtype: str = "float32") -> KVCache:
    return KVCache.init(
        batch=B, capacity=S, n_layers=1, n_kv_heads=G, head_dim=E, inv_freq=INV_FREQ, dtype=dtype
    )


def base_key(token_id: int) -> np.ndarray:
    return np.random.default_rng(token_id).normal(size=(G, E))


def rope_np(x_GE: np.ndarray, pos: int) -> np.ndarray:
    angle = pos * np.asarray(INV_FREQ)
    c, s = np.cos(angle), np.sin(angle)
    x1, x2 = x_GE[:, : E // 2], x_GE[:, E // 2 :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def cells(buf: Array) -> np.ndarray:
    """A cache buffer [B, G, S, E] as [B, S, G, E]: row, cell, head, dim."""
    return np.swapaxes(np.asarray(buf, np.float32), 1, 2)


def _write(cache: KVCache, positions_BT: Array, k_BTGE: Array, v_BTGE: Array) -> KVCache:
    cache, slot_BT = write_positions(cache, positions_BT)
    k = (write_layer(cache.k[0], slot_BT, k_BTGE),)
    v = (write_layer(cache.v[0], slot_BT, v_BTGE),)
    return replace(cache, k=k, v=v)


# Jitted once each: every sequence id, range, shift and divisor is a traced argument.
write_j = jax.jit(_write)
rm_j = jax.jit(memory.seq_rm)
cp_j = jax.jit(memory.seq_cp)
keep_j = jax.jit(memory.seq_keep)
add_j = jax.jit(memory.seq_add)
div_j = jax.jit(memory.seq_div)
pmin_j = jax.jit(memory.seq_pos_min)
pmax_j = jax.jit(memory.seq_pos_max)
clear_j = jax.jit(memory.clear, static_argnames="data")


class Ref:
    """llama.h memory semantics for independent rows, with specjax's lowest-free-cell layout."""

    def __init__(self) -> None:
        self.cells: list[list[tuple[int, int] | None]] = [[None] * S for _ in range(B)]
        self.overflow = [False] * B

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[float, float]:
        return (0 if p0 < 0 else p0), (float("inf") if p1 < 0 else p1)

    def _put(self, row: int, item: tuple[int, int]) -> None:
        free = [i for i, c in enumerate(self.cells[row]) if c is None]
        if free:
            self.cells[row][free[0]] = item
        else:
            self.overflow[row] = True

    def write(self, positions: list[list[int]], ids: list[list[int]]) -> None:
        for row in range(B):
            for p, t in zip(positions[row], ids[row]):
                if p >= 0:
                    self._put(row, (p, t))

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        lo, hi = self._range(p0, p1)
        for row in range(B) if seq < 0 else [seq]:
            self.cells[row] = [
                c if c is None or not lo <= c[0] < hi else None for c in self.cells[row]
            ]
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if src == dst:
            return
        lo, hi = self._range(p0, p1)
        for c in [c for c in self.cells[src] if c is not None and lo <= c[0] < hi]:
            self._put(dst, c)

    def seq_keep(self, seq: int) -> None:
        for row in range(B):
            if row != seq:
                self.cells[row] = [None] * S

    def _map(self, seq: int, p0: int, p1: int, fn) -> None:
        lo, hi = self._range(p0, p1)
        out: list[tuple[int, int] | None] = []
        for c in self.cells[seq]:
            if c is not None and lo <= c[0] < hi:
                p = fn(c[0])
                c = None if p < 0 else (p, c[1])
            out.append(c)
        self.cells[seq] = out

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self._map(seq, p0, p1, lambda p: p + delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        if d > 1:
            self._map(seq, p0, p1, lambda p: p // d)

    def clear(self) -> None:
        self.__init__()

    def pos(self) -> np.ndarray:
        return np.array([[-1 if c is None else c[0] for c in row] for row in self.cells], np.int32)

    def positions(self, row: int) -> list[int]:
        return sorted(c[0] for c in self.cells[row] if c is not None)


def assert_matches(cache: KVCache, ref: Ref) -> None:
    pos = np.asarray(cache.pos)
    np.testing.assert_array_equal(pos, ref.pos(), err_msg="cell positions")
    np.testing.assert_array_equal(np.asarray(cache.overflow), np.array(ref.overflow))
    k, v = cells(cache.k[0]), cells(cache.v[0])
    for row in range(B):
        assert sorted(pos[row][pos[row] >= 0].tolist()) == ref.positions(row)
        expect = ref.positions(row)
        assert int(pmin_j(cache, row)) == (expect[0] if expect else -1)
        assert int(pmax_j(cache, row)) == (expect[-1] if expect else -1)
        for i, c in enumerate(ref.cells[row]):
            if c is None:
                continue
            np.testing.assert_array_equal(v[row, i], np.full((G, E), c[1], np.float32))
            np.testing.assert_allclose(k[row, i], rope_np(base_key(c[1]), c[0]), atol=1e-4)


class Driver:
    """Applies the same operations to the JAX cache (through the jitted ops) and the reference."""

    def __init__(self) -> None:
        self.cache = new_cache()
        self.ref = Ref()
        self.next_id = 1

    def write(self, positions: list[list[int]]) -> None:
        ids = [[0] * T for _ in range(B)]
        k = np.zeros((B, T, G, E), np.float32)
        v = np.zeros((B, T, G, E), np.float32)
        for row in range(B):
            for t, p in enumerate(positions[row]):
                ids[row][t] = self.next_id
                k[row, t] = rope_np(base_key(self.next_id), max(p, 0))
                v[row, t] = self.next_id
                self.next_id += 1
        self.cache = write_j(self.cache, jnp.asarray(positions, jnp.int32), k, v)
        self.ref.write(positions, ids)

    def apply(self, op: tuple) -> None:
        name, *args = op
        if name == "write":
            self.write(args[0])
        elif name == "rm":
            self.cache, ok = rm_j(self.cache, *args)
            assert ok.shape == () and bool(ok)
            assert self.ref.seq_rm(*args)
        elif name == "cp":
            self.cache = cp_j(self.cache, *args)
            self.ref.seq_cp(*args)
        elif name == "keep":
            self.cache = keep_j(self.cache, *args)
            self.ref.seq_keep(*args)
        elif name == "add":
            self.cache = add_j(self.cache, *args)
            self.ref.seq_add(*args)
        elif name == "div":
            self.cache = div_j(self.cache, *args)
            self.ref.seq_div(*args)
        elif name == "clear":
            self.cache = clear_j(self.cache, data=args[0])
            self.ref.clear()
        else:  # pragma: no cover
            raise AssertionError(name)


# ----------------------------------------------------------------------------- property test

_pos = st.integers(-1, 24)
_bound = st.integers(-2, 26)
_row = st.integers(0, B - 1)
_chunk = st.lists(st.lists(_pos, min_size=T, max_size=T), min_size=B, max_size=B)
_write_op = st.tuples(st.just("write"), _chunk)
OPS = st.one_of(
    _write_op,
    _write_op,  # listed twice: writes are as frequent as edits
    st.tuples(st.just("rm"), st.integers(-2, B - 1), _bound, _bound),
    st.tuples(st.just("cp"), _row, _row, _bound, _bound),
    st.tuples(st.just("keep"), _row),
    st.tuples(st.just("add"), _row, _bound, _bound, st.integers(-8, 8)),
    st.tuples(st.just("div"), _row, _bound, _bound, st.integers(1, 4)),
    st.tuples(st.just("clear"), st.booleans()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=12))
def test_memory_ops_match_llama_h_reference(ops: list[tuple]) -> None:
    d = Driver()
    for op in ops:
        d.apply(op)
        assert_matches(d.cache, d.ref)


# ----------------------------------------------------------------------------- literal cases


def filled(lengths: tuple[int, ...] = (8, 8, 8)) -> Driver:
    """Rows holding positions 0..n-1 in cells 0..n-1, written T tokens at a time."""
    d = Driver()
    for start in range(0, max(lengths), T):
        d.write([[p if p < n else -1 for p in range(start, start + T)] for n in lengths])
    return d


def row_pos(d: Driver, row: int) -> list[int]:
    return np.asarray(d.cache.pos[row]).tolist()


def test_whole_sequence_removal_leaves_other_rows() -> None:
    d = filled()
    d.apply(("rm", 1, -1, -1))
    assert row_pos(d, 1) == [-1] * S
    assert row_pos(d, 0)[:8] == list(range(8))
    assert int(memory.seq_pos_max(d.cache, 1)) == -1
    assert_matches(d.cache, d.ref)


def test_tail_removal_with_infinite_p1() -> None:
    d = filled()
    cache, ok = memory.seq_rm(d.cache, 0, 5, -1)
    assert bool(ok)
    assert np.asarray(cache.pos[0]).tolist() == [0, 1, 2, 3, 4] + [-1] * (S - 5)
    assert int(memory.seq_pos_max(cache, 0)) == 4
    assert int(memory.seq_pos_min(cache, 0)) == 0


def test_negative_p0_means_zero_and_empty_ranges_do_nothing() -> None:
    d = filled()
    cache, _ = memory.seq_rm(d.cache, 2, -7, 3)
    assert np.asarray(cache.pos[2]).tolist()[:8] == [-1, -1, -1, 3, 4, 5, 6, 7]
    for p0, p1 in [(4, 4), (6, 2)]:
        same, ok = memory.seq_rm(d.cache, 2, p0, p1)
        assert bool(ok)
        np.testing.assert_array_equal(np.asarray(same.pos), np.asarray(d.cache.pos))


def test_negative_seq_means_every_row() -> None:
    d = filled((8, 6, 3))
    d.apply(("rm", -1, 2, 5))
    for row, n in enumerate((8, 6, 3)):
        expect = [p if p < n and not 2 <= p < 5 else -1 for p in range(S)]
        assert row_pos(d, row) == expect
    assert_matches(d.cache, d.ref)


def test_hole_is_reused_by_the_next_write() -> None:
    d = filled((8, 8, 8))
    d.apply(("rm", 0, 2, 5))
    assert row_pos(d, 0)[:8] == [0, 1, -1, -1, -1, 5, 6, 7]
    cache, slot = write_positions(d.cache, jnp.array([[2, 3, 4, 8], [-1] * T, [-1] * T], jnp.int32))
    assert np.asarray(slot[0]).tolist() == [2, 3, 4, 8]  # the hole first, then the next free cell
    assert np.asarray(slot[1]).tolist() == [S] * T  # padding is not written
    assert np.asarray(cache.pos[0]).tolist()[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    # Later positions also fill holes: cell order carries no meaning.
    d.apply(("rm", 1, 1, 3))
    d.write([[-1] * T, [8, 9, 10, -1], [-1] * T])
    assert row_pos(d, 1)[:11] == [0, 8, 9, 3, 4, 5, 6, 7, 10, -1, -1]
    assert_matches(d.cache, d.ref)


def test_seq_add_shifts_rerotates_and_drops_negative_positions() -> None:
    d = filled((8, 8, 8))
    d.apply(("add", 0, 4, -1, 3))  # 4..7 -> 7..10
    assert row_pos(d, 0)[:8] == [0, 1, 2, 3, 7, 8, 9, 10]
    d.apply(("add", 1, -1, -1, -3))  # 0..2 -> removed (llama_kv_cells::pos_add)
    assert row_pos(d, 1)[:8] == [-1, -1, -1, 0, 1, 2, 3, 4]
    assert_matches(d.cache, d.ref)  # keys equal rope(base, new position)
    assert row_pos(d, 2)[:8] == list(range(8))
    k_before = cells(filled().cache.k[0])
    np.testing.assert_array_equal(cells(d.cache.k[0])[2], k_before[2])  # other rows untouched


def test_seq_add_then_inverse_restores_keys() -> None:
    d = filled()
    cache = memory.seq_add(memory.seq_add(d.cache, 0, -1, -1, 1000), 0, -1, -1, -1000)
    np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(d.cache.pos))
    np.testing.assert_allclose(np.asarray(cache.k[0]), np.asarray(d.cache.k[0]), atol=2e-4)
    moved = memory.seq_add(d.cache, 0, -1, -1, 1000)
    assert not np.allclose(cells(moved.k[0])[0, 1:8], cells(d.cache.k[0])[0, 1:8])


def test_seq_div_halves_positions_and_rerotates() -> None:
    d = filled()
    d.apply(("div", 0, 2, -1, 2))
    assert row_pos(d, 0)[:8] == [0, 1, 1, 1, 2, 2, 3, 3]
    assert_matches(d.cache, d.ref)
    same = memory.seq_div(d.cache, 0, -1, -1, 1)
    np.testing.assert_array_equal(np.asarray(same.pos), np.asarray(d.cache.pos))


def test_seq_cp_copies_range_into_lowest_free_cells() -> None:
    d = filled((8, 3, 0))
    d.apply(("cp", 0, 1, 2, 6))  # positions 2..5 of row 0 -> row 1 cells 3..6
    assert row_pos(d, 1)[:8] == [0, 1, 2, 2, 3, 4, 5, -1]
    np.testing.assert_array_equal(cells(d.cache.k[0])[1, 3:7], cells(d.cache.k[0])[0, 2:6])
    np.testing.assert_array_equal(cells(d.cache.v[0])[1, 3:7], cells(d.cache.v[0])[0, 2:6])
    d.apply(("cp", 0, 0, -1, -1))  # onto itself: no-op
    d.apply(("cp", 0, 2, -1, -1))
    assert row_pos(d, 2) == row_pos(d, 0)
    # Rows evolve independently after the copy (llama.cpp would share the cells).
    d.apply(("add", 2, -1, -1, 5))
    assert row_pos(d, 0)[:8] == list(range(8))
    assert_matches(d.cache, d.ref)


def test_seq_cp_overflow_sets_flag_of_dst_only() -> None:
    d = filled((12, 12, 0))
    d.apply(("cp", 0, 1, -1, -1))  # 12 cells into 4 free ones
    assert np.asarray(d.cache.overflow).tolist() == [False, True, False]
    assert row_pos(d, 1)[12:] == [0, 1, 2, 3]
    assert_matches(d.cache, d.ref)
    with pytest.raises(CacheOverflowError, match=r"rows \[1\]"):
        check_overflow(d.cache)


def test_seq_keep_empties_other_rows() -> None:
    d = filled((8, 5, 3))
    d.apply(("keep", 1))
    assert row_pos(d, 0) == [-1] * S and row_pos(d, 2) == [-1] * S
    assert row_pos(d, 1)[:5] == list(range(5))
    assert_matches(d.cache, d.ref)


def test_pos_min_max_of_empty_and_gapped_rows() -> None:
    d = filled((8, 0, 3))
    assert int(memory.seq_pos_min(d.cache, 1)) == -1
    assert int(memory.seq_pos_max(d.cache, 1)) == -1
    cache, _ = memory.seq_rm(d.cache, 0, 0, 3)
    assert int(memory.seq_pos_min(cache, 0)) == 3
    assert int(memory.seq_pos_max(cache, 0)) == 7
    assert memory.seq_pos_min(cache, 0).dtype == jnp.int32
    assert int(memory.seq_pos_max(cache, 2)) == 2


def test_write_beyond_capacity_sets_overflow_and_check_raises() -> None:
    d = filled((16, 2, 0))
    check_overflow(d.cache)  # exactly full: fine
    d.write([[16, -1, -1, -1], [2, 3, -1, -1], [-1] * T])
    assert np.asarray(d.cache.overflow).tolist() == [True, False, False]
    assert row_pos(d, 0) == list(range(16))  # nothing overwritten
    assert_matches(d.cache, d.ref)
    with pytest.raises(CacheOverflowError, match=r"rows \[0\].*16 cells"):
        check_overflow(d.cache)
    # The flag is sticky through removals; only clear() resets it.
    cache, _ = memory.seq_rm(d.cache, 0, -1, -1)
    assert bool(cache.overflow[0])
    check_overflow(memory.clear(cache))


def test_clear_with_and_without_data() -> None:
    d = filled()
    kept = memory.clear(d.cache)
    assert (np.asarray(kept.pos) == -1).all()
    np.testing.assert_array_equal(np.asarray(kept.k[0]), np.asarray(d.cache.k[0]))
    zeroed = memory.clear(d.cache, data=True)
    assert (np.asarray(zeroed.pos) == -1).all()
    assert not np.asarray(zeroed.k[0]).any() and not np.asarray(zeroed.v[0]).any()
    assert np.asarray(d.cache.k[0]).any()


def test_bfloat16_keys_keep_dtype_after_shift() -> None:
    cache = new_cache("bfloat16")
    cache, slot = write_positions(cache, jnp.array([[0, 1, 2, 3]] * B, jnp.int32))
    k = np.stack([[rope_np(base_key(t), t) for t in range(T)]] * B).astype(np.float32)
    cache = replace(cache, k=(write_layer(cache.k[0], slot, jnp.asarray(k)),))
    moved = memory.seq_add(cache, 0, -1, -1, 4)
    assert moved.k[0].dtype == jnp.bfloat16
    expect = np.stack([rope_np(base_key(t), t + 4) for t in range(T)])
    np.testing.assert_allclose(cells(moved.k[0])[0, :T], expect, atol=3e-2)


def test_host_validation_names_the_numbers() -> None:
    cache = new_cache()
    with pytest.raises(ValueError, match="seq = 3 out of range for a cache of 3 rows"):
        memory.seq_rm(cache, 3, 0, -1)
    with pytest.raises(ValueError, match="seq = -1 out of range"):
        memory.seq_add(cache, -1, 0, -1, 1)
    with pytest.raises(ValueError, match="dst = 5"):
        memory.seq_cp(cache, 0, 5, 0, -1)
    with pytest.raises(ValueError, match="d = 0"):
        memory.seq_div(cache, 0, 0, -1, 0)
    with pytest.raises(ValueError, match="seq = 4"):
        memory.seq_pos_max(cache, 4)
    memory.seq_rm(cache, -1, 0, -1)  # seq < 0 is fine for seq_rm


def test_traced_out_of_range_rows_touch_nothing() -> None:
    d = filled()
    cache, ok = rm_j(d.cache, 7, -1, -1)
    assert bool(ok)
    np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(d.cache.pos))
    cache = cp_j(d.cache, 0, 9, -1, -1)
    np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(d.cache.pos))
    assert not np.asarray(cache.overflow).any()
    cache = add_j(d.cache, 11, -1, -1, 3)
    np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(d.cache.pos))


@pytree_dataclass
class _FullOnlyMemory:
    """A toy recurrent memory: one position counter per row, no partial rollback."""

    n_pos: Array

    def seq_rm(self, seq, p0, p1):
        whole = (jnp.asarray(p0) <= 0) & (jnp.asarray(p1) < 0)
        rows = (jnp.asarray(seq) < 0) | (jnp.arange(self.n_pos.shape[0]) == seq)
        return _FullOnlyMemory(n_pos=jnp.where(rows & whole, 0, self.n_pos)), whole

    def seq_cp(self, src, dst, p0, p1):
        return self

    def seq_keep(self, seq):
        return self

    def seq_add(self, seq, p0, p1, delta):
        raise NotImplementedError

    def seq_div(self, seq, p0, p1, d):
        raise NotImplementedError

    def seq_pos_min(self, seq):
        return jnp.int32(-1)

    def seq_pos_max(self, seq):
        return self.n_pos[seq] - 1

    def clear(self, data=False):
        return _FullOnlyMemory(n_pos=jnp.zeros_like(self.n_pos))

    @property
    def can_shift(self) -> bool:
        return False


def test_memory_protocol_dispatch_and_partial_failure() -> None:
    mem = _FullOnlyMemory(n_pos=jnp.array([5, 3], jnp.int32))
    assert isinstance(mem, memory.Memory)
    assert memory.can_shift(new_cache()) and not memory.can_shift(mem)
    same, ok = memory.seq_rm(mem, 0, 2, -1)
    assert not bool(ok)
    np.testing.assert_array_equal(np.asarray(same.n_pos), [5, 3])
    gone, ok = memory.seq_rm(mem, 0, -1, -1)
    assert bool(ok) and np.asarray(gone.n_pos).tolist() == [0, 3]
    assert int(memory.seq_pos_max(mem, 1)) == 2
    assert np.asarray(memory.clear(mem).n_pos).tolist() == [0, 0]
