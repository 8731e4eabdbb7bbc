"""Drafter state through checkpoint + replay on the qwen35 hybrid target (FULL path,
specjax.decode.engine over the hybrid memory): a checkpointed round restores the drafters with the target (their
memory trimmed by rollback, their per-row `data_spec` set back by `set_spec_state`, no
`accept`), as upstream's server (spec 7.5).

`BoundaryDrafter` keeps EAGLE-3's deferred boundary (`pending_pos`: the last position in
memory, moved by `process` to the end of every target batch and by `accept` to the last
accepted row) and checkpoints it through `spec_state` / `set_spec_state`. Between rounds its
boundary must be every row's `length - 1`; a checkpointed round that forgot to restore it
would leave it at the end of the rejected verify batch. It drafts on rows at even positions
only, so draft-simple (a llama draft sharing the 8-token vocabulary, its own KV cache) drafts
the others: two stateful drafters on the FULL path, and the output is plain greedy decoding."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, testing
from specjax.config import SpecConfig
from specjax.decode import engine as eng
from specjax.decode.stats import rollback_dict
from specjax.drafters.base import Drafter, DraftInput, DraftOutput, TargetBatch, TokenHistory
from specjax.drafters.registry import build_drafters
from specjax.models import qwen35 as q
from specjax.pytree import pytree_dataclass, replace
from specjax.testing import tiny_draft_config, tiny_qwen35_config
from specjax.types import Array

N_NEW = 24


CFG = tiny_qwen35_config(vocab_size=8, max_position=256)


def _model() -> api.Model:  # test_hybrid_spec's target: an 8-token vocabulary, std 0.2
    return api.Model(config=CFG, params=q.init_params(CFG, jax.random.PRNGKey(1), std=0.2))


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(0)
    return [[int(t) for t in rng.randint(0, CFG.V, size=n)] for n in (5, 12, 20, 9)]


@pytree_dataclass
class BoundaryState:
    pending_pos: Array  # [B]
    first: Array  # [B] first position of the last target batch
    rows: Array  # [B] rows of the last target batch


@dataclasses.dataclass(frozen=True)
class BoundaryDrafter(Drafter):
    name: ClassVar[str] = "test-boundary"
    max_draft_len: int = 4

    def init(self, batch: int, capacity: int) -> BoundaryState:
        z = jnp.zeros((batch,), jnp.int32)
        return BoundaryState(pending_pos=z - 1, first=z, rows=z)

    def begin(self, state: BoundaryState, history: TokenHistory) -> BoundaryState:
        return replace(state, pending_pos=(history.length - 1).astype(jnp.int32))

    def process(self, params: Any, state: BoundaryState, batch: TargetBatch) -> BoundaryState:
        valid = batch.positions >= 0
        has = jnp.any(valid, axis=1)
        beg = jnp.min(jnp.where(valid, batch.positions, 1 << 30), axis=1)
        end = jnp.max(batch.positions, axis=1)
        return BoundaryState(
            pending_pos=jnp.where(has, end, state.pending_pos).astype(jnp.int32),
            first=jnp.where(has, beg, state.first).astype(jnp.int32),
            rows=jnp.where(has, end - beg + 1, state.rows).astype(jnp.int32),
        )

    def draft(
        self, params: Any, state: BoundaryState, inp: DraftInput, k_max: int
    ) -> tuple[BoundaryState, DraftOutput]:
        B = inp.last_token.shape[0]
        mine = inp.drafting & (inp.history.length % 2 == 0)
        n = jnp.minimum(inp.n_max, self.max_draft_len)
        valid = mine[:, None] & (jnp.arange(k_max)[None] < n[:, None])
        tokens = jnp.broadcast_to(inp.last_token[:, None], (B, k_max)).astype(jnp.int32)
        return state, DraftOutput(tokens=tokens, valid=valid)

    def accept(
        self, state: BoundaryState, n_accepted: Array, is_other: Array, active: Array
    ) -> BoundaryState:
        rows = active & (state.rows > 0)
        i = jnp.maximum(jnp.minimum(n_accepted, state.rows - 1), 0)
        return replace(state, pending_pos=jnp.where(rows, state.first + i, state.pending_pos))

    def rollback(self, state: BoundaryState, keep: Array) -> BoundaryState:
        return state

    def spec_state(self, state: BoundaryState) -> dict[str, Array]:
        return {"pending_pos": state.pending_pos}

    def set_spec_state(
        self, state: BoundaryState, saved: dict[str, Array], rows_B: Array
    ) -> BoundaryState:
        return replace(
            state, pending_pos=jnp.where(rows_B, saved["pending_pos"], state.pending_pos)
        )


@functools.lru_cache(maxsize=1)
def _draft() -> api.Model:
    return api.init_model(tiny_draft_config(), seed=3)


@pytest.mark.slow  # 40-70 s on 2 shared cores (a host-stepped loop, two drafters)
def test_full_path_restores_drafter_state_and_equals_plain_greedy() -> None:
    model, prompts = _model(), _prompts()
    spec = SpecConfig(types=("draft-simple",), draft_n_max=4, k_max=4)
    (simple,), dparams = build_drafters(spec, model, _draft())
    B = len(prompts)
    T = 32
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    run = testing.run_params([N_NEW] * B, n_max=4, k_max=4)
    engine = eng.Engine(
        target=model.config,
        drafters=(BoundaryDrafter(), simple),
        k_max=4,
        n_rs_seq=0,  # FULL: every rejection restores the checkpoint and replays
        capacity=128,
        out_capacity=32,
    )
    dp = (None, dparams[0])
    prefill = jax.jit(eng.prefill, static_argnames=("engine",))
    step = jax.jit(eng.spec_step, static_argnames=("engine",))
    st = prefill(engine, model.params, dp, jnp.asarray(tokens), lengths, run)
    n_steps = 0
    while not bool(jnp.all(st.done)) and n_steps < 2 * 64:
        st = step(engine, model.params, dp, st, run)
        n_steps += 1
        host = jax.device_get(st)
        live = ~host.done
        boundary = host.drafter_states[0].pending_pos
        # the boundary is the last position in memory for every row, after every round
        np.testing.assert_array_equal(boundary[live], host.length[live] - 1)
        # draft-simple's cache holds nothing beyond the committed prefix
        assert np.all(host.drafter_states[1].n_past <= host.length)
    plain = api.generate(model, prompts, max_new_tokens=N_NEW, n_ctx=128).tokens
    host = jax.device_get(st)
    got = [[int(t) for t in host.out_tokens[b, : host.out_len[b]]] for b in range(B)]
    assert got == plain
    paths = rollback_dict(host.stats.n_rollback)
    assert paths["checkpoint"] > 0 and paths["rs_plane"] == 0
    assert int(host.stats.n_draft_accepted) > 0
