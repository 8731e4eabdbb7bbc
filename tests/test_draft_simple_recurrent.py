"""draft-simple with a recurrent (qwen35) draft model: the draft context's rollback rule.

* Drafter level, against the float64 NumPy qwen35 (`oracles.qwen35_reference`): every round's
  draft equals the greedy continuation of a fresh reference fed the whole accepted history,
  over rounds that accept all, some or none of the draft, a round discarded whole (the
  target-checkpoint path), and draft lengths below and above the draft context's n_rs_seq.
  The per-row counters show which rollback each row took: FULL (n_rs_seq 0, upstream's draft
  contexts) only checkpoints; RS rolls back by planes when the draft context fed at most
  n_rs_seq tokens and by checkpoint otherwise.
* Engine level: on the FULL qwen35 test target (checkpoint + replay), speculative greedy with
  the recurrent draft equals plain greedy, with drafts accepted and rejected.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.qwen35_reference import Reference
from test_hybrid_spec import CFG as TARGET

from specjax import api
from specjax.config import SpecConfig
from specjax.drafters.base import DraftInput, TargetBatch, TokenHistory
from specjax.drafters.draft_simple import DRAFT_ROLLBACK_PATHS, DraftSimpleRecurrent
from specjax.drafters.registry import build_drafters
from specjax.models import qwen35 as q
from specjax.testing import tiny_draft_config

#: the test target's shape (tests/test_hybrid_spec.py), smaller: 2 layers (one delta-net, one
#: attention), 2 query heads, 1 KV head, 2 value heads
DRAFT = q.Qwen35Config.from_dict(
    {**TARGET.to_dict(), "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ssm_v_heads": 2}
)
S = 64
K = 4


@functools.lru_cache(maxsize=1)
def _draft_params() -> dict:
    return q.init_params(DRAFT, jax.random.PRNGKey(7), std=0.3)


def _reference_draft(history: list[int], last: int, n: int) -> list[int]:
    """Greedy continuation of a fresh float64 reference fed history + [last]."""
    ref = Reference(DRAFT, _draft_params())
    for p, t in enumerate(history):
        ref.step(t, p)
    out, tok = [], last
    for i in range(n):
        tok = int(np.argmax(ref.step(tok, len(history) + i)))
        out.append(tok)
    return out


def _inp(history: list[list[int]], last: list[int], n_max: list[int]) -> DraftInput:
    B = len(history)
    toks = np.zeros((B, S), np.int32)
    for b, h in enumerate(history):
        toks[b, : len(h)] = h
    return DraftInput(
        history=TokenHistory(
            tokens=jnp.asarray(toks), length=jnp.asarray([len(h) for h in history], jnp.int32)
        ),
        last_token=jnp.asarray(last, jnp.int32),
        n_max=jnp.asarray(n_max, jnp.int32),
        drafting=jnp.asarray([n > 0 for n in n_max]),
        n_min=jnp.asarray(0, jnp.int32),
        p_min=jnp.asarray(0.0, jnp.float32),
        temperature=jnp.zeros((B,), jnp.float32),
    )


# rounds: per row (n_max, n_accepted); n_accepted None = the round is discarded whole (the
# target restored its checkpoint: rollback to the round's start, same history and id_last)
ROUNDS = [
    ((4, 1), (2, 0)),
    ((3, 3), (4, 4)),
    ((3, 0), (1, 1)),
    ((4, None), (3, None)),
    ((4, 2), (3, 1)),
    ((2, 0), (4, 3)),
]


@pytest.mark.parametrize("n_rs_seq", [0, 3])
def test_drafts_follow_the_accepted_history_on_every_rollback_path(n_rs_seq: int) -> None:
    drafter = DraftSimpleRecurrent(config=DRAFT, target_vocab=DRAFT.V, n_rs_seq=n_rs_seq)
    params = _draft_params()
    rng = np.random.RandomState(3)
    history = [[int(t) for t in rng.randint(0, DRAFT.V, size=n)] for n in (7, 4)]
    last = [5, 2]
    toks = np.zeros((2, 8), np.int32)
    pos = np.full((2, 8), -1, np.int32)
    for b, h in enumerate(history):
        toks[b, : len(h)] = h
        pos[b, : len(h)] = np.arange(len(h))
    state = drafter.init(2, S)
    state = jax.jit(drafter.process)(
        params,
        state,
        TargetBatch(tokens=jnp.asarray(toks), positions=jnp.asarray(pos), is_prompt=True),
    )
    draft = jax.jit(drafter.draft, static_argnums=3)
    rollback = jax.jit(drafter.rollback)
    want_counts = np.zeros((2, 3), np.int64)
    for r, plan in enumerate(ROUNDS):
        n_max = [n for n, _ in plan]
        state, out = draft(params, state, _inp(history, last, n_max), K)
        tokens, valid = np.asarray(out.tokens), np.asarray(out.valid)
        keep = []
        for b, (n, n_acc) in enumerate(plan):
            got = tokens[b, : int(valid[b].sum())].tolist()
            assert got == _reference_draft(history[b], last[b], n), (r, b)
            # the draft context fed id_last and d_1..d_{n-1}: kept iff n <= n_rs_seq
            kept = n <= n_rs_seq
            if not kept:
                want_counts[b, 1] += 1
            if n_acc is None:  # discarded round: back to its start
                keep.append(len(history[b]))
                want_counts[b, 0] += kept
                continue
            correction = (got[n_acc] + 1) % DRAFT.V if n_acc < n else int(rng.randint(DRAFT.V))
            history[b] = history[b] + [last[b]] + got[:n_acc]
            last[b] = correction
            keep.append(len(history[b]))
            want_counts[b, 0] += kept and n - 1 - n_acc > 0  # a tail to remove: a plane
        state = rollback(state, jnp.asarray(keep, jnp.int32))
        assert np.all(np.asarray(state.n_past) <= np.asarray(keep))
    counts = np.asarray(state.rollbacks)
    np.testing.assert_array_equal(counts, want_counts)
    if n_rs_seq == 0:
        assert counts[:, 0].sum() == 0 and counts[:, 1].min() > 0
    else:
        assert counts[:, 0].min() > 0 and counts[:, 1].min() > 0
    assert counts[:, DRAFT_ROLLBACK_PATHS.index("rebuilt")].sum() == 0


def test_the_registry_builds_a_full_recurrent_draft_for_a_qwen35_draft_model() -> None:
    from specjax.drafters.draft_simple import DraftSimple

    target = api.init_model(tiny_draft_config(), seed=1)
    spec = SpecConfig(types=("draft-simple",), draft_n_max=4, k_max=4)
    (rec,), _ = build_drafters(spec, target, api.Model(config=DRAFT, params=_draft_params()))
    assert type(rec) is DraftSimpleRecurrent and rec.n_rs_seq == 0  # FULL, as upstream
    (plain,), _ = build_drafters(spec, target, target)
    assert type(plain) is DraftSimple
    with pytest.raises(ValueError, match="n_rs_seq must be >= 0, got -1"):
        DraftSimpleRecurrent(config=DRAFT, target_vocab=8, n_rs_seq=-1)


@pytest.mark.slow  # suite time: the drafter-level test above checks every draft
def test_engine_greedy_with_a_recurrent_draft_equals_plain_greedy() -> None:
    from test_hybrid_spec import N_NEW, _model, _plain, _prompts

    from specjax.api import generate

    draft = api.Model(config=DRAFT, params=_draft_params())
    spec = SpecConfig(types=("draft-simple",), draft_n_max=4, k_max=4)
    res = generate(
        _model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=spec, draft=draft, n_rs_seq=0
    )
    assert res.tokens == _plain()
    d = res.stats.to_dict()
    assert d["num_draft_tokens"] > d["num_accepted_tokens"] > 0
    assert d["rollback"]["checkpoint"] > 0
    # the draft context (FULL) restored its checkpoint after every drafting round
    assert d["draft_context"]["checkpoint"] > 0 and d["draft_context"]["rs_plane"] == 0
    assert "draft context: 0 rounds rolled back by RS plane" in str(res.stats)


def test_a_llama_target_drafts_with_a_recurrent_draft_model() -> None:
    """`specjax.generate` on an attention-only target with a qwen35 draft (the CLI's `-md`):
    the draft's parameters stay as they are (only Llama-family pytrees take the CPU kernels'
    decode form), and greedy speculation equals plain greedy with drafts made and rejected."""
    # seed 6: the two random models agree now and then
    target = api.init_model(tiny_draft_config(n_layers=2), seed=6)
    draft = api.Model(config=DRAFT, params=_draft_params())
    rng = np.random.RandomState(4)
    prompts = [[int(t) for t in rng.randint(0, 8, size=n)] for n in (9, 5)]
    spec = SpecConfig(types=("draft-simple",), draft_n_max=4, k_max=4, adaptive=False)
    plain = api.generate(target, prompts, max_new_tokens=24)
    out = api.generate(target, prompts, max_new_tokens=24, spec=spec, draft=draft)
    assert out.tokens == plain.tokens
    d = out.stats.to_dict()
    assert d["num_draft_tokens"] > d["num_accepted_tokens"] > 0
