"""Hybrid memory (specjax.memory.hybrid) against a plain-Python transcription of llama.cpp's
recurrent `seq_rm` rules (llama-memory-recurrent.cpp, llama-memory-hybrid.cpp) and against the
float64 qwen35 recurrence (tests/oracles/qwen35_reference.py): plane d holds the state d tokens
before the tail, a rollback of r <= n_rs_seq restores plane r, a failed seq_rm changes nothing,
and the NO / PART / FULL / RS probe follows common_context_can_seq_rm."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.qwen35_reference import Reference

from specjax import api
from specjax.memory import ops as memory
from specjax.memory.hybrid import HybridMemory, RecurrentMemory, SeqRmType, can_seq_rm
from specjax.memory.hybrid import forward_memory as _forward_memory
from specjax.models import qwen35 as q
from specjax.models.config import ModelConfig
from specjax.pytree import replace
from specjax.testing import tiny_qwen35_config

CFG = tiny_qwen35_config()
INF = 2**31 - 1


@functools.lru_cache(maxsize=1)
def _params() -> dict:
    return q.init_params(CFG, jax.random.PRNGKey(0), std=0.2)


forward_memory = jax.jit(_forward_memory, static_argnames=("config", "cache_empty"))


# ------------------------------------------------------------------ transcription of upstream
class UpstreamRecurrent:
    """llama_memory_recurrent's per-sequence bookkeeping: one cell per seq (seq b -> cell b)."""

    def __init__(self, n_seq: int, n_rs_seq: int) -> None:
        self.n_seq, self.n_rs_seq = n_seq, n_rs_seq
        self.pos = [-1] * n_seq  # cells[b].pos, tail of seq b (-1: no tail)
        self.rs_idx = [0] * n_seq

    def decode(self, seq: int, last_pos: int) -> None:  # a ubatch of this seq; s_copy resets
        self.pos[seq] = last_pos
        self.rs_idx[seq] = 0

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        if p0 < 0:
            p0 = 0
        if p1 < 0:
            p1 = INF
        if seq >= self.n_seq:
            return False
        rm_all = p0 == 0 and p1 == INF
        if rm_all:
            if seq < 0:
                self.rs_idx = [0] * self.n_seq
            else:
                self.rs_idx[seq] = 0
        if seq >= 0:
            if self.pos[seq] >= 0:
                pos = self.pos[seq]
                if 0 < p0 <= pos and p1 > pos:
                    rollback = pos - (p0 - 1)
                    pending = self.rs_idx[seq] != 0
                    if not pending and 1 <= rollback <= self.n_rs_seq:
                        self.rs_idx[seq] = rollback
                        self.pos[seq] = p0 - 1
                        return True
                    return False
                if p0 <= pos < p1:
                    self.pos[seq] = -1
        else:
            if p0 != p1 and (p0 != 0 or p1 != INF):
                return False
            for b in range(self.n_seq):
                if p0 <= self.pos[b] < p1:
                    self.pos[b] = -1
        return True


@functools.partial(jax.jit, static_argnames=())
def _rm(mem: RecurrentMemory, seq, p0, p1):
    return mem.seq_rm(seq, p0, p1)


def test_seq_rm_follows_upstream_rules_on_random_operations() -> None:
    """Random decodes and seq_rm calls (traced seq / p0 / p1: one compilation): ok, tail and
    pending rollback equal the transcription's; a failed call returns the memory unchanged."""
    rng = np.random.RandomState(0)
    B, R = 3, 3
    ref = UpstreamRecurrent(B, R)
    mem = RecurrentMemory.init(CFG, B, R)
    # distinct non-zero plane contents, so "unchanged" is a real check
    mem = replace(mem, ssm=tuple(s + rng.rand(*s.shape).astype(np.float32) for s in mem.ssm))
    n_fail = n_roll = n_pending = seq = 0
    for _ in range(600):
        if rng.rand() < 0.3:
            b = rng.randint(B)
            last = ref.pos[b] + 1 + rng.randint(6)
            ref.decode(b, last)
            mem = replace(
                mem,
                pos=mem.pos.at[b].set(last),
                rs_idx=mem.rs_idx.at[b].set(0),
            )
            continue
        seq = seq if rng.rand() < 0.6 else int(rng.choice([-1, 0, 1, 2]))  # often the same
        near_tail = ref.pos[max(seq, 0)] - rng.randint(0, 5) + 1  # rollbacks of 0..4
        p0 = int(rng.choice([-1, 0, rng.randint(0, 12)] + [near_tail] * 8))
        p1 = int(rng.choice([-1, -1, rng.randint(0, 14)]))
        if seq >= 0 and ref.rs_idx[seq] and 0 < p0 <= ref.pos[seq] and p1 < 0:
            n_pending += 1
        want = ref.seq_rm(seq, p0, p1)
        new, ok = _rm(mem, jnp.int32(seq), jnp.int32(p0), jnp.int32(p1))
        assert bool(ok) == want, (seq, p0, p1)
        if not want:
            n_fail += 1
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(mem)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(new.pos), ref.pos)
        np.testing.assert_array_equal(np.asarray(new.rs_idx), ref.rs_idx)
        n_roll += int(np.sum(np.asarray(new.rs_idx) > np.asarray(mem.rs_idx)))
        mem = new
    assert n_fail > 5 and n_roll > 5 and n_pending > 5  # every branch was exercised


def test_removed_rows_start_from_zero_and_seq_cp_copies_the_state() -> None:
    rng = np.random.RandomState(1)
    mem = RecurrentMemory.init(CFG, 2, 1)
    mem = replace(
        mem,
        conv=tuple(c + rng.rand(*c.shape).astype(np.float32) for c in mem.conv),
        ssm=tuple(s + rng.rand(*s.shape).astype(np.float32) for s in mem.ssm),
        pos=jnp.asarray([5, 7], jnp.int32),
        count=jnp.asarray([6, 8], jnp.int32),
    )
    cp = mem.seq_cp(0, 1, 3, 4)
    assert np.asarray(cp.pos).tolist() == [5, 5]
    for got, want in zip(jax.tree.leaves(cp.current()), jax.tree.leaves(mem.current())):
        assert np.asarray(want[0]).any()
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[0]))
    out, ok = mem.seq_rm(1, 0, -1)
    assert bool(ok) and np.asarray(out.pos).tolist() == [5, -1]
    for state in jax.tree.leaves(out.current()):  # the removed row reads zeros, row 0 not
        assert not np.asarray(state[1]).any() and np.asarray(state[0]).any()


def _padded(rows: list[np.ndarray], start: list[int], T: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    toks = np.zeros((len(rows), T), np.int32)
    pos = np.full((len(rows), T), -1, np.int32)
    for b, (r, s) in enumerate(zip(rows, start)):
        toks[b, : len(r)] = r
        pos[b, : len(r)] = s + np.arange(len(r))
    return jnp.asarray(toks), jnp.asarray(pos)


def _ref_states(tokens: np.ndarray) -> list[tuple[dict, dict]]:
    """(conv, ssm) per layer after each prefix length 0..n (float64 oracle)."""
    ref = Reference(CFG, _params())
    out = [
        ({i: c.copy() for i, c in ref.conv.items()}, {i: s.copy() for i, s in ref.state.items()})
    ]
    for p, t in enumerate(tokens):
        ref.step(int(t), p)
        out.append(
            (
                {i: c.copy() for i, c in ref.conv.items()},
                {i: s.copy() for i, s in ref.state.items()},
            )
        )
    return out


def test_planes_hold_earlier_states_and_rollback_restores_plane_r() -> None:
    """Two rows fed in batches of uneven sizes (7|4 then 2|1 then 3|3 tokens) with n_rs_seq = 3:
    after each batch plane d is the float64 state d tokens before the tail (planes reaching
    into earlier batches included). Then seq_rm rolls row 0 back by 3 and row 1 by 2 (p0 the
    tail - r + 1), and a forward of new tokens gives the logits of the truncated sequences."""
    R = 3
    rng = np.random.RandomState(2)
    full = [rng.randint(0, CFG.V, size=12), rng.randint(0, CFG.V, size=8)]
    sizes = [(7, 4), (2, 1), (3, 3)]
    mem = HybridMemory.init(CFG, 2, 16, n_rs_seq=R)
    done = [0, 0]
    states = [_ref_states(f) for f in full]
    for n0, n1 in sizes:
        rows = [full[0][done[0] : done[0] + n0], full[1][done[1] : done[1] + n1]]
        toks, pos = _padded(rows, done, 8)
        _, mem = forward_memory(CFG, _params(), toks, pos, mem)
        done = [done[0] + n0, done[1] + n1]
        conv_planes, ssm_planes = mem.rec.in_order()
        for b in range(2):
            assert int(mem.rec.pos[b]) == done[b] - 1
            for d in range(R + 1):
                conv_want, ssm_want = states[b][done[b] - d]
                for j, layer in enumerate(CFG.recurrent_layers):
                    np.testing.assert_allclose(
                        np.asarray(ssm_planes[j][d, b]), ssm_want[layer], atol=1e-4
                    )
                    np.testing.assert_allclose(
                        np.asarray(conv_planes[j][d, b]), conv_want[layer], atol=1e-5, rtol=1e-5
                    )
    roll = [3, 2]
    for b, r in enumerate(roll):
        mem, ok = _seq_rm(mem, b, done[b] - r, -1)
        assert bool(ok)
        assert int(mem.seq_pos_max(b)) == done[b] - r - 1
        # a second rollback before a decode is refused (upstream's single-use pending index)
        _, ok2 = _seq_rm(mem, b, done[b] - r - 1, -1)
        assert not bool(ok2)
    extra = [rng.randint(0, CFG.V, size=4), rng.randint(0, CFG.V, size=2)]
    keep = [done[b] - roll[b] for b in range(2)]
    toks, pos = _padded(extra, keep, 8)
    logits, mem = forward_memory(CFG, _params(), toks, pos, mem)
    for b in range(2):
        ref = Reference(CFG, _params())
        seq = np.concatenate([full[b][: keep[b]], extra[b]])
        want = [ref.step(int(t), p) for p, t in enumerate(seq)][keep[b] :]
        got = np.asarray(logits[b, : len(extra[b])])
        np.testing.assert_allclose(got, np.stack(want), atol=1e-4 * np.abs(want).max())


def test_hybrid_seq_rm_beyond_planes_fails_and_changes_nothing() -> None:
    """A tail removal longer than n_rs_seq: ok False, KV cells and recurrent state intact (the
    recurrent part is tried first); within n_rs_seq: the KV cells from p0 on are dropped."""
    toks, pos = _padded([np.arange(6) % CFG.V, np.arange(3)], [0, 0], 8)
    mem = HybridMemory.init(CFG, 2, 16, n_rs_seq=3)
    assert isinstance(mem, memory.Memory) and not memory.can_shift(mem)
    _, mem = forward_memory(CFG, _params(), toks, pos, mem)
    bad, ok = _seq_rm(mem, 0, 2, -1)  # rollback 4 > 3
    assert not bool(ok)
    for a, b in zip(jax.tree.leaves(bad), jax.tree.leaves(mem)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    good, ok = _seq_rm(mem, 0, 4, -1)
    assert bool(ok)
    assert int(good.seq_pos_max(0)) == 3 and int(good.seq_pos_min(0)) == 3
    assert sorted(np.asarray(good.kv.pos[0])[np.asarray(good.kv.pos[0]) >= 0]) == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.asarray(good.kv.pos[1]), np.asarray(mem.kv.pos[1]))
    # FULL memory (no planes): any partial tail removal fails, whole-sequence removal works
    full = HybridMemory.init(CFG, 2, 16, n_rs_seq=0)
    _, full = forward_memory(CFG, _params(), toks, pos, full)
    assert not bool(_seq_rm(full, 0, 5, -1)[1])
    cleared, ok = _seq_rm(full, 0, -1, -1)
    assert bool(ok) and int(cleared.seq_pos_max(0)) == -1
    for state in jax.tree.leaves(cleared.rec.current()):
        assert not np.asarray(state[0]).any() and np.asarray(state[1]).any()


_seq_rm = jax.jit(lambda mem, seq, p0, p1: memory.seq_rm(mem, seq, p0, p1))  # llama.h dispatch


def test_probe_returns_upstream_types_and_leaves_caller_state_alone() -> None:
    model = api.Model(config=CFG, params=_params())
    toks, pos = _padded([np.arange(5), np.arange(3)], [0, 0], 8)
    _, mem = forward_memory(CFG, _params(), toks, pos, HybridMemory.init(CFG, 2, 16, 0))
    before = [np.asarray(x).copy() for x in jax.tree.leaves(mem)]
    assert can_seq_rm(model) == SeqRmType.FULL
    assert can_seq_rm(model, n_rs_seq=4) == SeqRmType.RS
    for a, b in zip(before, jax.tree.leaves(mem)):
        np.testing.assert_array_equal(a, np.asarray(b))
    llama = api.init_model(
        ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    )
    assert can_seq_rm(llama) == SeqRmType.PART
    broken = api.Model(config=CFG, params={"embed": _params()["embed"]})  # decode fails
    assert can_seq_rm(broken) == SeqRmType.NO
    assert can_seq_rm(object()) == SeqRmType.NO


@pytest.mark.parametrize("n_rs_seq", [0, 3])
def test_whole_forward_equals_plain_qwen35_forward(n_rs_seq: int) -> None:
    """forward_memory with or without planes gives the qwen35 forward's logits and state."""
    rng = np.random.RandomState(4)
    toks, pos = _padded([rng.randint(0, CFG.V, size=8), rng.randint(0, CFG.V, size=3)], [0, 0], 8)
    mem = HybridMemory.init(CFG, 2, 16, n_rs_seq)
    logits, mem = forward_memory(CFG, _params(), toks, pos, mem)
    out = _plain(_params(), toks, pos, q.new_state(CFG, 2, 16))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(out.logits), atol=1e-4)
    for j in range(len(CFG.recurrent_layers)):
        np.testing.assert_allclose(
            np.asarray(mem.rec.in_order()[1][j][0]), np.asarray(out.state.ssm[j]), atol=1e-4
        )


_plain = jax.jit(functools.partial(q.forward, CFG))


def test_num_params_counts_the_trunk() -> None:
    """Qwen35Config.num_params (the CLI's banner) == the initialised trunk's parameter count."""
    assert CFG.num_params() == sum(x.size for x in jax.tree.leaves(_params()))
