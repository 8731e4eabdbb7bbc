"""The relay inside the engine: fixed priority, first non-empty draft wins a row, truncation
to the row's budget, impl_last, and accept fan-out with is_other (llama.cpp 4.4-4.5)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.decode import engine
from specjax.decode import governor as adaptive
from specjax.drafters.base import DraftOutput, ModelFreeDrafter
from specjax.pytree import pytree_dataclass
from specjax.testing import tiny_model
from specjax.types import Array


@pytree_dataclass
class CallLog:
    asked: Array  # [B] rows this drafter was asked to draft for
    own: Array  # [B] accept(is_other=False)
    other: Array  # [B] accept(is_other=True)
    last_n: Array  # [B] n_accepted passed to the last accept


@dataclasses.dataclass(frozen=True)
class FakeDrafter(ModelFreeDrafter):
    name: ClassVar[str] = "fake"
    rows: tuple[bool, ...]
    length: int
    token: int

    def init(self, batch: int, capacity: int) -> CallLog:
        z = jnp.zeros((batch,), jnp.int32)
        return CallLog(asked=z, own=z, other=z, last_n=z - 1)

    def draft(self, params, state: CallLog, inp, k_max: int):
        B = inp.last_token.shape[0]
        fires = jnp.asarray(self.rows)[:, None] & (jnp.arange(k_max)[None, :] < self.length)
        state = dataclasses.replace(state, asked=state.asked + inp.drafting.astype(jnp.int32))
        return state, DraftOutput(tokens=jnp.full((B, k_max), self.token, jnp.int32), valid=fires)

    def accept(self, state: CallLog, n_accepted, is_other, active) -> CallLog:
        own = active & ~is_other
        other = active & is_other
        return dataclasses.replace(
            state,
            own=state.own + own.astype(jnp.int32),
            other=state.other + other.astype(jnp.int32),
            last_n=jnp.where(active, n_accepted, state.last_n),
        )


def test_relay_priority_truncation_and_fanout():
    model = tiny_model(0)
    first = FakeDrafter(rows=(True, False, False, True), length=4, token=3)
    second = FakeDrafter(rows=(True, True, False, False), length=2, token=4)
    eng = engine.Engine(
        target=model.config, drafters=(first, second), k_max=4, capacity=64, out_capacity=32
    )
    tokens = jnp.asarray([[5, 6, 7], [8, 9, 0], [1, 2, 3], [4, 5, 6]], jnp.int32)
    lengths = jnp.asarray([3, 2, 3, 3], jnp.int32)
    run = engine.RunParams(
        sampling=sampling.SamplingParams.create(
            batch=4, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0
        ),
        # row 3 may generate 3 tokens: 1 after prefill, so its budget is 3 - 1 - 1 = 1
        max_new=jnp.asarray([20, 20, 20, 3], jnp.int32),
        n_max=jnp.asarray(3, jnp.int32),
        n_min=jnp.asarray(0, jnp.int32),
        p_min=jnp.asarray(0.0, jnp.float32),
        synth_rates=jnp.zeros((4,), jnp.float32),
        cost=adaptive.CostModel.off(),
    )
    state = engine.prefill_jit(eng, model.params, (None, None), tokens, lengths, run)
    state = engine.step_jit(eng, model.params, (None, None), state, run)
    log_first, log_second = (
        np.asarray(x) for x in (state.drafter_states[0].asked, state.drafter_states[1].asked)
    )
    # the first drafter is asked for every row; the second only for rows the first left empty
    np.testing.assert_array_equal(log_first, [1, 1, 1, 1])
    np.testing.assert_array_equal(log_second, [0, 1, 1, 0])
    np.testing.assert_array_equal(np.asarray(state.impl_last), [0, 1, -1, 0])
    # accept goes to the winner with is_other=False, to the other with is_other=True;
    # row 2 had no draft, so nobody is told anything about it
    s0, s1 = state.drafter_states
    np.testing.assert_array_equal(np.asarray(s0.own), [1, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(s0.other), [0, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(s1.own), [0, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(s1.other), [1, 0, 0, 1])
    stats = state.stats.to_host()
    # drafted tokens: row 0 -> 4, row 1 -> 2, row 3 -> truncated to its budget of 1
    np.testing.assert_array_equal(stats.n_gen_tokens, [5, 2])
    np.testing.assert_array_equal(stats.n_gen_drafts, [2, 1])
    np.testing.assert_array_equal(stats.n_call_draft, [1, 1])
    np.testing.assert_array_equal(stats.n_call_accept, [2, 1])
    assert int(stats.n_draft_tokens) == 7
