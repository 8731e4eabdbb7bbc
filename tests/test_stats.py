"""Speculative counters: llama.cpp's relay/accept bookkeeping and its exact printed lines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.decode.stats import (
    SpecStats,
    format_impl_lines,
    format_server_lines,
    record_accept,
    record_begin,
    record_draft,
)

NAMES = ("ngram-mod", "draft-simple", "ngram-cache")

_draft = jax.jit(record_draft)
_accept = jax.jit(record_accept)


def _arr(values, dtype=jnp.int32):
    return jnp.asarray(values, dtype)


def _scenario() -> SpecStats:
    """Three rows, three chained drafters, two rounds (see the comments for upstream's view)."""
    s = SpecStats.create(n_impl=3, k=4)
    s = record_begin(s, _arr([True, True, False], bool))
    # round 1: rows 0/1 drafted by impls 0/1, row 2 by nobody -> every impl is called
    s = _draft(s, _arr([0, 1, -1]), _arr([3, 2, 0]), _arr([True, True, True], bool))
    s = _accept(s, _arr([0, 1, -1]), _arr([2, 0, 0]), _arr([True, True, False], bool))
    # round 2: impl 0 serves both drafting rows -> the relay stops after it
    s = _draft(s, _arr([0, -1, 0]), _arr([4, 0, 1]), _arr([True, False, True], bool))
    return _accept(
        s,
        _arr([0, -1, 0]),
        _arr([4, 0, 1]),
        _arr([True, False, True], bool),
        _arr([True, False, False], bool),
    )


def test_scenario_counters():
    h = _scenario().to_host()
    np.testing.assert_array_equal(h.n_call_begin, [2, 2, 2])
    np.testing.assert_array_equal(h.n_call_draft, [2, 1, 1])
    np.testing.assert_array_equal(h.n_call_accept, [3, 1, 0])
    np.testing.assert_array_equal(h.n_gen_drafts, [3, 1, 0])
    np.testing.assert_array_equal(h.n_acc_drafts, [3, 0, 0])
    np.testing.assert_array_equal(h.n_gen_tokens, [8, 2, 0])
    np.testing.assert_array_equal(h.n_acc_tokens, [7, 0, 0])
    np.testing.assert_array_equal(h.n_acc_tokens_per_pos, [[3, 2, 1, 1], [0] * 4, [0] * 4])
    assert (h.n_draft_tokens, h.n_draft_accepted, h.n_verif_steps) == (10, 6, 4)  # replay: 4 -> 3
    np.testing.assert_array_equal(h.n_accepted_per_pos, [3, 2, 1, 0])


def test_printed_lines_are_exact():
    s = _scenario()
    lines = format_impl_lines(s, NAMES, [(0.0123, 1.5, 0.0), (0.0, 2.25, 0.1), (0.0, 0.0, 0.0)])
    assert lines == [
        "statistics        ngram-mod: #calls(b,g,a) =    2      2      3, #gen drafts =      3, "
        "#acc drafts =     3, #gen tokens =      8, #acc tokens =     7, #mean acc len = 3.33, "
        "#acc rate/pos = (1.000, 0.667, 0.333, 0.333), dur(b,g,a) = 0.012, 1.500, 0.000 ms",
        "statistics     draft-simple: #calls(b,g,a) =    2      1      1, #gen drafts =      1, "
        "#acc drafts =     0, #gen tokens =      2, #acc tokens =     0, #mean acc len = 1.00, "
        "#acc rate/pos = (), dur(b,g,a) = 0.000, 2.250, 0.100 ms",
        "statistics      ngram-cache: #calls(b,g,a) =    2      1      0, #gen drafts =      0, "
        "#acc drafts =     0, #gen tokens =      0, #acc tokens =     0, "
        "dur(b,g,a) = 0.000, 0.000, 0.000 ms",
    ]
    assert format_server_lines(s) == [
        "draft acceptance = 0.60000 (    6 accepted /    10 generated), mean len =  2.50",
        "     acc per pos = (0.750, 0.500, 0.250)",
    ]
    assert format_server_lines(SpecStats.create(3, 4)) == []
    with pytest.raises(ValueError):
        format_impl_lines(s, NAMES[:2])


def test_to_dict_uses_vllm_names():
    d = _scenario().to_dict(NAMES)
    assert d["num_drafts"] == 4
    assert d["num_draft_tokens"] == 10
    assert d["num_accepted_tokens"] == 6
    assert d["mean_acceptance_length"] == pytest.approx(2.5)
    assert d["acceptance_rate"] == pytest.approx(0.6)
    assert d["accepted_per_position"] == [3, 2, 1, 0]
    assert d["acceptance_rate_per_position"] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    mod = d["drafters"]["ngram-mod"]
    assert mod["n_acc_tokens"] == 7 and mod["mean_acc_len"] == pytest.approx(1 + 7 / 3)
    assert d["drafters"]["ngram-cache"]["mean_acc_len"] is None


class _Reference:
    """Straight transcription of common_speculative_draft/_accept and the server's commit."""

    def __init__(self, n_impl: int, k: int):
        self.impl = [
            dict(
                call_draft=0,
                call_accept=0,
                gen_drafts=0,
                acc_drafts=0,
                gen_tokens=0,
                acc_tokens=0,
                per_pos=[],
            )
            for _ in range(n_impl)
        ]
        self.srv = dict(draft_tokens=0, accepted=0, steps=0, per_pos=[0] * k)

    def draft(self, impl_idx, lengths, drafting):
        still = list(drafting)
        for i, imp in enumerate(self.impl):
            if not any(still):
                break
            imp["call_draft"] += 1
            for b, want in enumerate(still):
                if want and impl_idx[b] == i and lengths[b] > 0:
                    still[b] = False
                    imp["gen_drafts"] += 1
                    imp["gen_tokens"] += lengths[b]
        for b, want in enumerate(drafting):
            if want:
                self.srv["draft_tokens"] += lengths[b]

    def accept(self, impl_idx, n_acc, active, replay):
        for b, on in enumerate(active):
            if not on:
                continue
            imp, n = self.impl[impl_idx[b]], n_acc[b]
            imp["per_pos"] += [0] * max(0, n - len(imp["per_pos"]))
            for j in range(n):
                imp["per_pos"][j] += 1
            if n > 0:
                imp["acc_drafts"] += 1
                imp["acc_tokens"] += n
            imp["call_accept"] += 1
            n_srv = n - 1 if replay[b] and n > 0 else n
            self.srv["accepted"] += n_srv
            self.srv["steps"] += 1
            for j in range(min(n_srv, len(self.srv["per_pos"]))):
                self.srv["per_pos"][j] += 1


_row = st.tuples(
    st.booleans(),  # drafting
    st.integers(-1, 1),  # winning impl
    st.integers(0, 4),  # draft length
    st.integers(0, 4),  # accepted (clipped to the length)
    st.booleans(),  # replay
)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(_row, min_size=3, max_size=3), min_size=1, max_size=6))
def test_counters_match_reference_and_invariants(rounds):
    n_impl, k = 2, 4
    s = SpecStats.create(n_impl, k)
    ref = _Reference(n_impl, k)
    for rows in rounds:
        drafting = [r[0] for r in rows]
        got = [r[0] and r[1] >= 0 and r[2] > 0 for r in rows]
        impl_idx = [r[1] if g else -1 for r, g in zip(rows, got)]
        lengths = [r[2] if r[0] and r[1] >= 0 else 0 for r in rows]
        n_acc = [min(r[3], r[2]) if g else 0 for r, g in zip(rows, got)]
        replay = [r[4] for r in rows]
        s = _draft(s, _arr(impl_idx), _arr(lengths), _arr(drafting, bool))
        s = _accept(s, _arr(impl_idx), _arr(n_acc), _arr(got, bool), _arr(replay, bool))
        ref.draft(impl_idx, lengths, drafting)
        ref.accept(impl_idx, n_acc, got, replay)
    h = s.to_host()
    for i, imp in enumerate(ref.impl):
        assert h.n_call_draft[i] == imp["call_draft"]
        assert h.n_call_accept[i] == imp["call_accept"]
        assert (h.n_gen_drafts[i], h.n_gen_tokens[i]) == (imp["gen_drafts"], imp["gen_tokens"])
        assert (h.n_acc_drafts[i], h.n_acc_tokens[i]) == (imp["acc_drafts"], imp["acc_tokens"])
        padded = imp["per_pos"] + [0] * (k - len(imp["per_pos"]))
        np.testing.assert_array_equal(h.n_acc_tokens_per_pos[i], padded)
    assert h.n_draft_tokens == ref.srv["draft_tokens"]
    assert (h.n_draft_accepted, h.n_verif_steps) == (ref.srv["accepted"], ref.srv["steps"])
    np.testing.assert_array_equal(h.n_accepted_per_pos, ref.srv["per_pos"])
    # invariants
    per_pos = h.n_acc_tokens_per_pos
    assert np.all(np.diff(per_pos, axis=1) <= 0) and np.all(np.diff(h.n_accepted_per_pos) <= 0)
    np.testing.assert_array_equal(per_pos[:, 0], h.n_acc_drafts)
    np.testing.assert_array_equal(per_pos.sum(axis=1), h.n_acc_tokens)
    assert np.all(h.n_acc_tokens <= h.n_gen_tokens) and np.all(h.n_acc_drafts <= h.n_call_accept)
    assert h.n_draft_accepted <= h.n_draft_tokens
    assert h.n_accepted_per_pos.sum() == h.n_draft_accepted
