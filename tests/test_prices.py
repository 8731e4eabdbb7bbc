"""The governor's prices measured on the device (`specjax.decode.prices`: `cost_model`, `measure`)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

import specjax
from specjax import api
from specjax.config import SpecConfig
from specjax.decode import prices
from specjax.drafters.ngram_cache import NgramCache
from specjax.drafters.ngram_mod import NgramMod
from specjax.drafters.ngram_simple import NgramSimple
from specjax.drafters.registry import build_drafters

MODELS = Path(__file__).resolve().parent.parent / "models"


def _line_times(u: float, v: float, batch: int, width: int) -> tuple[float, float]:
    """Seconds of forwards of batch and batch x width tokens under fwd(n) = u (1 + (n-1) v)."""
    return u * (1 + (batch - 1) * v), u * (1 + (batch * width - 1) * v)


@pytest.mark.parametrize("batch,width,v", [(1, 5, 0.25), (4, 5, 0.01), (32, 9, 0.4), (8, 2, 0.0)])
def test_fit_recovers_the_price_of_a_linear_forward(batch, width, v):
    t_step, t_verify = _line_times(2e-3, v, batch, width)
    got = prices.fit(t_step, t_verify, 0.5 * t_step, batch, width)
    assert got["verify_token"] == pytest.approx(v, abs=1e-9)
    assert got["draft_step"] == pytest.approx(0.5)


def test_fit_clips_what_no_line_explains():
    # faster with more tokens: free; faster than linear growth: a whole forward per token
    assert prices.fit(1.0, 0.9, None, 1, 5) == {"verify_token": 0.0}
    assert prices.fit(1.0, 3.0, None, 4, 2)["verify_token"] == prices.MAX_VERIFY_TOKEN
    with pytest.raises(ValueError, match="width=1"):
        prices.fit(1.0, 1.0, None, 1, 1)
    with pytest.raises(ValueError, match="t_step=0"):
        prices.fit(0, 1.0, None, 1, 5)


@pytest.fixture(scope="module")
def shipped():
    return (
        specjax.load(str(MODELS / "code-target" / "code-target-f16.gguf")),
        specjax.load(str(MODELS / "code-draft" / "code-draft-f16.gguf")),
    )


def test_measure_times_each_model_and_shape_once(shipped, monkeypatch):
    target, draft = shipped
    made = []

    def fake_timer(config, params, cache, width, fill_BT):
        # the target: 1 ms per forward of one token per row, +0.2 ms per extra token; the
        # draft: 0.3 ms
        made.append((config.L, cache.batch, width, fill_BT.shape[1]))
        rows = cache.batch
        if config is draft.config:
            return lambda: 0.3e-3
        return lambda: 1e-3 * (1 + (rows * width - 1) * 0.2)

    monkeypatch.setattr(prices, "forward_timer", fake_timer)
    monkeypatch.setattr(prices, "_MEASURED", {})
    got = prices.measure(target, draft, 2, 5, 512)
    assert got["verify_token"] == pytest.approx(0.2)
    assert got["draft_step"] == pytest.approx(0.3 / 1.2)
    assert sorted(made) == sorted(
        [(target.config.L, 2, 1, 256), (target.config.L, 2, 5, 256), (draft.config.L, 2, 1, 256)]
    )
    assert prices.measure(target, draft, 2, 5, 512) == got and len(made) == 3  # kept
    prices.measure(target, None, 4, 5, 64)  # another shape: timed, a cache of 64 half filled
    assert made[3:] == [(target.config.L, 4, 1, 32), (target.config.L, 4, 5, 32)]
    # a pytree without the Llama family's fused Q/K/V weight is not timed
    other = dataclasses.replace(target, params={"layers": ({"w": target.params["embed"]},)})
    assert prices.measure(other, None, 1, 5, 64) is None and len(made) == 5


def test_cost_model_uses_measured_prices_when_asked(shipped, monkeypatch):
    target, draft = shipped
    calls = []

    def fake_measure(model, draft_model, batch, width, capacity):
        calls.append((draft_model is not None, batch, width, capacity))
        return {"verify_token": 0.123, "draft_step": 0.456}

    monkeypatch.setattr(prices, "measure", fake_measure)
    kw = dict(batch=3, k_max=16, capacity=512)
    spec = SpecConfig(types=("draft-simple",), draft_n_max=4, cost_calibrate=True)
    cost = api.cost_model(spec, target, draft, **kw)
    assert (float(cost.verify_token), float(cost.draft_step)) == pytest.approx((0.123, 0.456))
    assert calls == [(True, 3, 5, 512)]  # the verify of the longest draft n_max lets through
    chain = SpecConfig(types=("ngram-mod", "draft-simple"), draft_n_max=4, cost_calibrate=True)
    api.cost_model(chain, target, draft, **kw)
    assert calls[-1] == (True, 3, api.CALIBRATION_K + 1, 512)  # ngram-mod's n_max is 64
    # prices given explicitly win; no draft-simple: no draft timed
    given = SpecConfig(types=("draft-simple",), cost_calibrate=True, cost_verify_token=0.3)
    assert float(api.cost_model(given, target, draft, **kw).verify_token) == pytest.approx(0.3)
    api.cost_model(SpecConfig(types=("ngram-simple",), cost_calibrate=True), target, None, **kw)
    assert calls[-1] == (False, 3, api.CALIBRATION_K + 1, 512)  # n_max 48, capped
    # on CPU by default, with the governor off, or for synthetic acceptance: nothing timed
    n = len(calls)
    cost = api.cost_model(SpecConfig(types=("draft-simple",)), target, draft, **kw)
    assert float(cost.verify_token) == pytest.approx(api.CPU_VERIFY_TOKEN)
    off = SpecConfig(types=("draft-simple",), cost_calibrate=True, adaptive=False)
    api.cost_model(off, target, draft, **kw)
    api.cost_model(spec, target, draft, synthetic=True, **kw)
    assert len(calls) == n


def test_measured_prices_on_this_machine_are_prices(shipped, monkeypatch):
    """The real timing path runs on the shipped pair and gives prices the cost model can use
    (their values are measured by benchmarks, not asserted here)."""
    target, draft = shipped
    monkeypatch.setattr(prices, "_MEASURED", {})
    got = prices.measure(target, draft, 1, 5, 256)
    assert 0.0 <= got["verify_token"] <= prices.MAX_VERIFY_TOKEN
    assert math.isfinite(got["draft_step"]) and got["draft_step"] > 0


def test_the_governor_prices_asking_each_drafter_of_the_chain(shipped, monkeypatch):
    """Without `cost_call` the price of an asked round is the engine's part plus each
    drafter's measured ask (benchmarks/governor.py ask: an ngram-mod ask cost an eighth of a
    plain round, an ngram-simple ask a fifteenth); a given `cost_call` wins; on an
    accelerator, where asks were not timed, the engine's part alone. Pricing every chain at
    the engine's part (the old default) fails the first asserts."""
    target, _ = shipped
    kw = dict(batch=1, k_max=64, capacity=512)
    chain = SpecConfig(types=("ngram-cache", "ngram-mod"))
    drafters, _ = build_drafters(chain, target, None)
    assert [d.name for d in drafters] == ["ngram-mod", "ngram-cache"]
    price = api.ASK_OVERHEAD + NgramMod.ask_steps + NgramCache.ask_steps
    assert NgramMod.ask_steps > NgramSimple.ask_steps > 0.0 and NgramCache.ask_steps > 0.0
    assert api.chain_call_price(drafters) == pytest.approx(price)
    cost = api.cost_model(chain, target, None, drafters=drafters, **kw)
    assert float(cost.call) == pytest.approx(price)
    (simple,), _ = build_drafters(SpecConfig(types=("ngram-simple",)), target, None)
    cost = api.cost_model(SpecConfig(types=("ngram-simple",)), target, None, drafters=[simple])
    assert float(cost.call) == pytest.approx(api.ASK_OVERHEAD + NgramSimple.ask_steps)
    given = SpecConfig(types=("ngram-cache", "ngram-mod"), cost_call=0.2)
    assert float(
        api.cost_model(given, target, None, drafters=drafters, **kw).call
    ) == pytest.approx(0.2)
    assert api.chain_call_price(drafters, on_cpu=False) == api.ASK_OVERHEAD
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(prices, "measure", lambda *a, **k: None)  # (no timing here)
    cost = api.cost_model(chain, target, None, drafters=drafters, **kw)
    assert float(cost.call) == pytest.approx(api.ASK_OVERHEAD)


def test_generate_prices_the_chain_it_built(shipped, monkeypatch):
    """`generate` hands the drafters it built to the cost model (the price of asking them)."""
    target, _ = shipped
    seen = []
    real = api.chain_call_price

    def spy(drafters, on_cpu=True, **kw):
        seen.append(tuple(d.name for d in drafters))
        return real(drafters, on_cpu, **kw)

    monkeypatch.setattr(prices, "chain_call_price", spy)
    spec = SpecConfig(types=("ngram-simple",), draft_n_max=4)
    specjax.generate(target, [[1, 2, 3, 4]], max_new_tokens=4, n_ctx=64, spec=spec)
    assert seen and set(seen) == {("ngram-simple",)}  # (again when it weighs each drafter)
    priced = len(seen)
    specjax.generate(
        target, [[1, 2, 3, 4]], max_new_tokens=4, n_ctx=64, spec=spec.replace(cost_call=0.1)
    )
    assert len(seen) == priced  # a given price is used as it is


def test_a_feature_head_is_priced_by_its_measured_ask(shipped, monkeypatch):
    """On CPU an EAGLE-3 ask (a head step per drafted token, ~100 small kernels each) costs
    ~2.6 plain rounds of the shipped target and a DFlash block ~1.25 (benchmarks/governor.py ask
    --heads). Priced so, no EAGLE-3 draft pays at B = 1, not even one the governor's prior
    expects accepted in full (0.95 a token), and the governor leaves it off from the first
    round, while a DFlash block is still worth probing. Priced at the engine's part alone
    (`ask_steps` 0, as before), the governor asked EAGLE-3 for drafts it could not pay for."""
    import jax.numpy as jnp

    from specjax.decode import governor as adaptive
    from specjax.drafters.eagle3 import Eagle3Drafter

    target, _ = shipped
    heads = {
        "draft-eagle3": specjax.load(MODELS / "code-eagle3" / "code-eagle3-f16.gguf"),
        "draft-dflash": specjax.load(MODELS / "code-dflash" / "code-dflash-f16.gguf"),
    }
    kw = dict(batch=1, k_max=4, capacity=512)

    def first_budget(kind: str) -> int:
        spec = SpecConfig(types=(kind,), draft_n_max=4, cost_calibrate=False)
        drafters, _ = build_drafters(spec, target, heads[kind])
        cost = api.cost_model(spec, target, heads[kind], drafters=drafters, **kw)
        assert float(cost.call) == pytest.approx(api.chain_call_price(drafters))
        budget, _ = adaptive.choose_budget(
            adaptive.Governor.create(1), cost, jnp.asarray([4]), jnp.asarray([True]), 4
        )
        return int(budget[0])

    assert first_budget("draft-eagle3") == 0
    assert first_budget("draft-dflash") > 0
    monkeypatch.setattr(Eagle3Drafter, "ask_steps", 0.0)
    assert first_budget("draft-eagle3") > 0


def test_asks_are_priced_smaller_beside_a_larger_target(shipped):
    """An ask costs about fixed time, a larger target's round more: measured against the
    shipped target, the asks' price scales down with the target's parameters (so a 1B
    target's EAGLE-3 head is asked for drafts), never up."""
    from specjax.drafters.eagle3 import Eagle3Drafter
    from specjax.models.config import ModelConfig

    target, _ = shipped
    head = specjax.load(MODELS / "code-eagle3" / "code-eagle3-f16.gguf")
    spec = SpecConfig(types=("draft-eagle3",), draft_n_max=4, cost_calibrate=False)
    drafters, _ = build_drafters(spec, target, head)
    shipped_price = api.ASK_OVERHEAD + Eagle3Drafter.ask_steps
    assert target.config.num_params() == api.ASK_REFERENCE_PARAMS
    assert api.chain_call_price(drafters, target_params=api.ASK_REFERENCE_PARAMS) == (
        pytest.approx(shipped_price)
    )
    assert api.chain_call_price(drafters, target_params=1000) == pytest.approx(shipped_price)
    big = ModelConfig(
        vocab_size=32_000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192
    )
    scale = api.ASK_REFERENCE_PARAMS / big.num_params()
    assert scale < 0.01
    got = api.chain_call_price(drafters, target_params=big.num_params())
    assert got == pytest.approx(api.ASK_OVERHEAD + Eagle3Drafter.ask_steps * scale)
    cost = api.cost_model(spec, specjax.Model(config=big, params={}, tokenizer=None), head,
                          drafters=drafters, batch=1, k_max=4, capacity=512)  # fmt: skip
    assert float(cost.call) == pytest.approx(got)


def test_a_moe_verify_is_measured_and_priced_above_a_dense_one(monkeypatch):
    """A verify of a mixture-of-experts target reads each token's own experts: its measured
    price per extra token is well above a dense target's with the same active FFN width (the
    dense one reads its FFN once for all the verify's tokens). On CPU the MoE target's price
    is measured by default; the dense target keeps CPU_VERIFY_TOKEN."""
    from specjax.testing import tiny_model

    shape = dict(vocab_size=256, dim=512, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True)
    dense = tiny_model(0, arch="qwen3", ffn_dim=1024, **shape)
    experts = dict(n_experts=16, n_experts_used=2, expert_ffn_dim=512, norm_topk_prob=True)
    moe = tiny_model(0, arch="qwen3moe", ffn_dim=1024, **experts, **shape)
    monkeypatch.setattr(prices, "_MEASURED", {})
    monkeypatch.setattr(prices, "LOOPS", 3)
    got = {name: prices.measure(m, None, 1, 5, 32)["verify_token"]
           for name, m in (("dense", dense), ("moe", moe))}  # fmt: skip
    assert got["moe"] > max(2 * got["dense"], got["dense"] + 0.2), got
    spec = SpecConfig(types=("ngram-simple",), draft_n_max=4)
    kw = dict(batch=1, k_max=4, capacity=32)
    timed = got["moe"]  # kept: not timed again
    assert float(api.cost_model(spec, moe, None, **kw).verify_token) == pytest.approx(timed)
    assert float(api.cost_model(spec, dense, None, **kw).verify_token) == pytest.approx(
        api.CPU_VERIFY_TOKEN
    )
