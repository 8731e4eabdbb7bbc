"""Drafters the draft governor would never ask are left out of the run (`adaptive.never_asks`,
`prices.unpaying_drafters`): the same tokens, statistics that say why, and the rest of the chain
asked at its own price."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import specjax
from specjax import api
from specjax.config import SpecConfig
from specjax.decode import engine as eng
from specjax.decode import governor as adaptive
from specjax.drafters.registry import build_drafters
from specjax.jobs import batch as batching

MODELS = Path(__file__).resolve().parent.parent / "models"
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("


def _cost(verify: float, step: float, call: float, catch_up: bool = False) -> adaptive.CostModel:
    f32 = jnp.float32
    return adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(verify, f32),
        draft_step=jnp.asarray(step, f32),
        call=jnp.asarray(call, f32),
        catch_up=jnp.asarray(step, f32) if catch_up else None,
    )


def _margin_at_prior(verify, step, call, batch, k_max, widths, caps) -> float:
    """Plain-Python float64 transcription of the governor's rule (specjax.decode.governor's module
    docstring) at its prior, every row hitting: the best of (tokens per cost of a draft of
    k <= min(caps[0], k_max) tokens) / (tokens per cost of plain decoding) - 1, over 1..batch
    active rows. Drafting pays somewhere iff it is > 0."""
    a = adaptive.PRIOR_ACCEPT
    assert adaptive.PRIOR_HIT == 1.0  # so every row drafts and the verify is always wide

    def fwd(n: float) -> float:
        return 1.0 + (n - 1.0) * verify

    best = -1.0
    for n in range(1, batch + 1):
        plain = n / fwd(n)
        for k in range(1, min(k_max, caps[0]) + 1):
            width = min(w for w in widths if w >= k + 1)
            tokens = n * (1.0 + sum(a**i for i in range(1, k + 1)))
            cost = fwd(n * width) + k * step * fwd(n) + call
            best = max(best, (tokens / cost) / plain - 1.0)
    return best


@settings(max_examples=40, deadline=None)
@given(
    verify=st.floats(0.0, 0.6),
    step=st.floats(0.0, 0.4),
    call=st.floats(0.0, 4.0),
    batch=st.integers(1, 6),
    shape=st.sampled_from([(4, (1, 5), (4,)), (16, (1, 5, 17), (4, 16)), (2, (1, 3), (2,))]),
)
def test_never_asks_is_the_rule_at_its_prior_for_every_number_of_active_rows(
    verify, step, call, batch, shape
):
    k_max, widths, caps = shape
    margin = _margin_at_prior(verify, step, call, batch, k_max, widths, caps)
    assume(abs(margin) > 1e-4)  # float32 decides ties the oracle's float64 cannot see
    got = adaptive.never_asks(_cost(verify, step, call), batch, k_max, widths, caps)
    assert got == (margin < 0)


@jax.jit
def _round(gov, cost, budget_B, active_B):
    caps = (4, 16)
    governed, gov = adaptive.choose_budget(gov, cost, budget_B, active_B, 16, (1, 5, 17), caps=caps)
    asked = active_B & (governed > 0)
    draft_len = jnp.where(asked, governed, 0)
    return governed, adaptive.observe(gov, asked, draft_len, draft_len, caps)


@pytest.mark.parametrize("catch_up", [False, True])
def test_a_chain_never_asked_from_the_prior_stays_unasked_round_after_round(catch_up):
    """The governor itself, round after round with rows finishing and budgets shrinking:
    a price `never_asks` calls unpaying gets no draft in 300 rounds; a price a little lower
    (drafting pays at the prior) is asked in a first round."""
    B, verify, step = 4, 0.4, 0.125
    lo = 0.0
    hi = 10.0
    while hi - lo > 1e-3:  # the threshold price, by bisection on never_asks
        mid = (lo + hi) / 2
        if adaptive.never_asks(_cost(verify, step, mid, catch_up), B, 16, (1, 5, 17), (4, 16)):
            hi = mid
        else:
            lo = mid
    assert 0.5 < lo < 5.0  # the CPU prices put the threshold among real asks' prices
    rng = jax.random.PRNGKey(0)
    gov = adaptive.Governor.create(B)
    unpaying = _cost(verify, step, hi + 0.01, catch_up)
    for r in range(300):
        rng, k1, k2 = jax.random.split(rng, 3)
        active = jax.random.uniform(k1, (B,)) < max(0.1, 1.0 - r / 300)
        budget = jax.random.randint(k2, (B,), 0, 17)
        governed, gov = _round(gov, unpaying, budget, active)
        assert not bool(jnp.any(governed > 0)), r
    # a little cheaper, a fresh governor asks for a draft at some number of active rows
    paying = _cost(verify, step, lo - 0.01, catch_up)
    full = jnp.full((B,), 16, jnp.int32)
    fresh = adaptive.Governor.create(B)
    asked = [bool(jnp.any(_round(fresh, paying, full, jnp.arange(B) < n)[0] > 0))
             for n in range(1, B + 1)]  # fmt: skip
    assert any(asked)


@pytest.fixture(scope="module")
def models():
    load = specjax.load
    return (
        load(str(MODELS / "code-target" / "code-target-f16.gguf")),
        load(str(MODELS / "code-eagle3" / "code-eagle3-f16.gguf")),
    )


def test_a_head_that_never_pays_is_left_out_and_the_rest_of_the_chain_is_asked(models):
    """On this CPU an EAGLE-3 ask is priced above what a 4-token draft can win at B = 1
    (tests/test_prices.py): with the governor on, `generate` leaves the head out (no feature
    extraction, no per-round recording) and says so; priced together with ngram-mod the
    chain was never asked, alone ngram-mod drafts over the repeated text. Greedy output is
    plain decoding's either way."""
    target, head = models
    kw = dict(max_new_tokens=48, n_ctx=256)
    plain = specjax.generate(target, [PROMPT], **kw)
    spec = SpecConfig(types=("draft-eagle3", "ngram-mod"), draft_n_max=4, ngram_mod_n_match=4,
                      ngram_mod_n_min=1, ngram_mod_n_max=8)  # fmt: skip
    out = specjax.generate(target, [PROMPT], spec=spec, draft=head, **kw)
    assert out.tokens == plain.tokens
    assert out.stats.names == ("ngram-mod",)
    dropped = out.stats.governor["dropped"]
    assert list(dropped) == ["draft-eagle3"] and "2.23" in dropped["draft-eagle3"]
    assert any("draft-eagle3 off for this run" in line for line in out.stats.lines())
    d = out.stats.to_dict()
    assert d["drafters"]["ngram-mod"]["n_gen_drafts"] > 0
    assert 0 < d["num_accepted_tokens"] < d["num_draft_tokens"]
    assert json.dumps(d)  # the report stays serialisable

    # priced as one chain (the sum of its asks) the governor would never have asked it
    drafters, _ = build_drafters(spec, target, head)
    engine = eng.Engine(
        target=target.config, drafters=drafters, k_max=api.chain_k_max(spec, drafters),
        capacity=256, out_capacity=64, eog_ids=(),
    )  # fmt: skip
    cost = api.cost_model(spec, target, head, batch=1, k_max=engine.k_max, capacity=256,
                          drafters=drafters)  # fmt: skip
    caps = engine.draft_caps()
    assert adaptive.never_asks(cost, 1, engine.k_max, engine.verify_widths(), caps)

    # the governor off: the head drafts (llama.cpp's behaviour), some drafts rejected
    forced = specjax.generate(target, [PROMPT], spec=spec.replace(adaptive=False), draft=head, **kw)
    assert forced.tokens == plain.tokens
    assert "dropped" not in forced.stats.governor or not forced.stats.governor["dropped"]
    e3 = forced.stats.to_dict()["drafters"]["draft-eagle3"]
    assert 0 < e3["n_acc_tokens"] < e3["n_gen_tokens"]


def test_generators_and_batch_jobs_leave_it_out_too(models, tmp_path):
    """A Generator keeps the left-out head's state as it was across calls; a batch job's
    report says what it left out. Both emit plain decoding's tokens."""
    target, head = models
    spec = SpecConfig(types=("draft-eagle3", "ngram-simple"), draft_n_max=4)
    plain = specjax.generate(target, [PROMPT], max_new_tokens=16, n_ctx=256)
    gen = specjax.Generator(target, spec=spec, draft=head, n_ctx=256)
    head_at = [d.name for d in gen.drafters].index("draft-eagle3")
    before = gen.states[head_at]
    for _ in range(2):
        out = gen.generate([PROMPT], max_new_tokens=16)
        assert out.tokens == plain.tokens
        assert out.stats.names == ("ngram-simple",)
    assert gen.states[head_at] is before

    job = batching.batch(target, [{"id": 0, "prompt": PROMPT}, {"id": 1, "prompt": PROMPT}],
                         tmp_path / "out.jsonl", n_parallel=2, spec=spec, draft=head,
                         n_predict=16, progress=False, log=io.StringIO())  # fmt: skip
    assert list(job.stats.governor["dropped"]) == ["draft-eagle3"]
    results = batching.read_results(tmp_path / "out.jsonl")
    assert [r["tokens"] for r in results] == [plain.tokens[0]] * 2
