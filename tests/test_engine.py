"""Engine behaviour: speculative greedy == plain greedy, no retracing, bad input, rejection at T=1."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, engine, sampling
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.testing import count_compiles, noisy_copy, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def plain(target):
    return generate(target, PROMPTS, max_new_tokens=[24, 24, 10, 24])


def with_eog(model, eog):
    return dataclasses.replace(model, eog=tuple(eog))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_simple_greedy_is_lossless(target, plain, k):
    draft = noisy_copy(target, 0.6)
    spec = SpecConfig(types=("draft-simple",), draft_n_max=k)
    out = generate(target, PROMPTS, max_new_tokens=[24, 24, 10, 24], spec=spec, draft=draft)
    assert out.tokens == plain.tokens
    stats = out.stats.to_dict()
    # the noisy draft must exercise both acceptance and rejection, or the test proves little
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_single_row_matches_batch(target, plain):
    draft = noisy_copy(target, 0.6)
    spec = SpecConfig(types=("draft-simple",), draft_n_max=3)
    out = generate(target, [PROMPTS[0]], max_new_tokens=24, spec=spec, draft=draft)
    assert out.tokens[0] == plain.tokens[0]


def test_rows_finishing_early_on_eog(target, plain):
    # pick a token that row 0 produces mid-way: that row must stop there, others continue
    eog_tok = plain.tokens[0][5]
    model = with_eog(target, [eog_tok])
    ref = generate(model, PROMPTS, max_new_tokens=24)
    assert ref.finish_reasons[0] == "stop"
    assert ref.tokens[0] == plain.tokens[0][: plain.tokens[0].index(eog_tok)]
    spec = SpecConfig(types=("draft-simple",), draft_n_max=3)
    out = generate(model, PROMPTS, max_new_tokens=24, spec=spec, draft=noisy_copy(model, 0.3))
    assert out.tokens == ref.tokens
    assert out.finish_reasons == ref.finish_reasons


def test_self_draft_accepts_everything(target, plain):
    spec = SpecConfig(types=("draft-simple",), draft_n_max=3)
    out = generate(target, PROMPTS, max_new_tokens=[24, 24, 10, 24], spec=spec, draft=target)
    assert out.tokens == plain.tokens
    stats = out.stats.to_dict()
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    per_pos = stats["accepted_per_position"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))


def test_generation_compiles_once_across_sampling_params(target):
    spec = SpecConfig(types=("draft-simple",), draft_n_max=3)
    draft = noisy_copy(target, 0.6)
    kwargs = dict(spec=spec, draft=draft)
    generate(target, PROMPTS[:2], max_new_tokens=12, temperature=0.0, **kwargs)
    before = api.compile_count()
    with count_compiles() as events:
        generate(
            target,
            PROMPTS[:2],
            max_new_tokens=9,
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            min_p=0.05,
            seed=123,
            **kwargs,
        )
        generate(
            target,
            PROMPTS[:2],
            max_new_tokens=15,
            temperature=1.3,
            seed=7,
            repeat_penalty=1.1,
            **kwargs,
        )
    assert api.compile_count() == before
    assert events == []


def test_plain_sampling_replays_exactly_and_batch_independent(target):
    a = generate(target, PROMPTS, max_new_tokens=16, temperature=0.9, seed=[1, 2, 3, 4])
    b = generate(target, PROMPTS, max_new_tokens=16, temperature=0.9, seed=[1, 2, 3, 4])
    assert a.tokens == b.tokens
    alone = generate(target, [PROMPTS[2]], max_new_tokens=16, temperature=0.9, seed=3)
    assert alone.tokens[0] == a.tokens[2][:16]


def test_match_verification_reproduces_sampled_stream(target):
    """draft-and-match must not change a seeded sampled stream (llama.cpp's server test)."""
    plain = generate(target, PROMPTS[:2], max_new_tokens=16, temperature=0.8, top_k=5, seed=42)
    spec = SpecConfig(types=("ngram-simple",), ngram_simple_size_n=1, ngram_simple_size_m=4)
    out = generate(
        target, PROMPTS[:2], max_new_tokens=16, temperature=0.8, top_k=5, seed=42, spec=spec
    )
    assert out.tokens == plain.tokens


def test_step_does_not_retrace_across_rounds(target):
    spec = SpecConfig(types=("draft-simple",), draft_n_max=3)
    from specjax.drafters.registry import build_drafters

    draft = noisy_copy(target, 0.6)
    drafters, dparams = build_drafters(spec, target, draft)
    eng = engine.Engine(
        target=target.config, drafters=drafters, k_max=3, capacity=128, out_capacity=64
    )
    tokens = jnp.asarray([[5, 6, 7, 0], [1, 2, 0, 0]], jnp.int32)
    lengths = jnp.asarray([3, 2], jnp.int32)

    def run_params(temp, n_max):
        return engine.RunParams(
            sampling=sampling.SamplingParams.create(
                batch=2, temperature=temp, top_k=0, top_p=1.0, min_p=0.0, seed=5
            ),
            max_new=jnp.asarray([20, 20], jnp.int32),
            n_max=jnp.asarray(n_max, jnp.int32),
            n_min=jnp.asarray(0, jnp.int32),
            p_min=jnp.asarray(0.0, jnp.float32),
            synth_rates=jnp.zeros((3,), jnp.float32),
        )

    state = engine.prefill_jit(eng, target.params, dparams, tokens, lengths, run_params(0.0, 3))
    state = engine.step_jit(eng, target.params, dparams, state, run_params(0.0, 3))
    # drafter params are traced too: the target's own weights accept everything, the noisy
    # copy's mostly nothing, so rounds differ in outcome without changing any static value
    rounds = [
        (0.0, 1, dparams),
        (0.5, 3, (target.params,)),
        (1.0, 2, dparams),
        (0.0, 0, dparams),
        (0.0, 3, (target.params,)),
    ]
    accepted = set()
    with count_compiles() as events:
        for temp, n_max, params in rounds:
            before = int(state.stats.n_draft_accepted)
            state = engine.step_jit(eng, target.params, params, state, run_params(temp, n_max))
            accepted.add(int(state.stats.n_draft_accepted) - before)
    assert events == []
    assert len(accepted) > 1  # rounds really had different outcomes


def test_bad_inputs_raise_clear_errors(target):
    with pytest.raises(ValueError, match="token id 97 is out of range for a vocabulary of 97"):
        generate(target, [[1, 97]], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(target, [[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt of 40 tokens does not fit a context of 32"):
        generate(target, [list(range(40))], max_new_tokens=4, n_ctx=32)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(target, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown speculative type: ngram-foo"):
        SpecConfig(types=("ngram-foo",))
    with pytest.raises(ValueError, match="draft-simple needs a draft model"):
        generate(target, [[1, 2]], max_new_tokens=4, spec=SpecConfig(types=("draft-simple",)))
    cache = target.new_cache(1, 16)
    with pytest.raises(ValueError, match=r"must both be \[B, T\]"):
        api.forward(target, np.zeros((1, 3), np.int32), np.zeros((1, 4), np.int32), cache)
    with pytest.raises(ValueError, match="must be integers"):
        api.forward(target, np.zeros((1, 3), np.float32), np.zeros((1, 3), np.int32), cache)


def test_incompatible_draft_vocab_is_rejected(target):
    other = tiny_model(1, vocab_size=300)
    with pytest.raises(ValueError, match="differs from the target's 97 by more than 128"):
        generate(
            target,
            [[1, 2]],
            max_new_tokens=4,
            spec=SpecConfig(types=("draft-simple",)),
            draft=other,
        )


def test_context_end_stops_rows(target):
    # memory holds positions 0..31; the last sampled token is emitted without being stored
    out = generate(target, [list(range(1, 20))], max_new_tokens=100, n_ctx=32)
    assert out.finish_reasons == ["context"]
    assert len(out.tokens[0]) == 32 - 19 + 1
    spec = SpecConfig(types=("draft-simple",), draft_n_max=8)
    fast = generate(
        target, [list(range(1, 20))], max_new_tokens=100, n_ctx=32, spec=spec, draft=target
    )
    assert fast.tokens == out.tokens  # the draft budget kept every verify batch inside n_ctx


@pytest.mark.slow
def test_rejection_sampling_engine_preserves_target_distribution():
    """At T=1 the second generated token's marginal equals the target's exact marginal."""
    model = tiny_model(3, vocab_size=12)
    draft = noisy_copy(model, 1.0, seed=4)
    prompt = [1, 2, 3]
    n = 3000
    spec = SpecConfig(types=("draft-simple",), draft_n_max=2)
    out = generate(
        model,
        [prompt] * n,
        max_new_tokens=2,
        temperature=1.0,
        seed=list(range(n)),
        spec=spec,
        draft=draft,
    )
    second = np.asarray([t[1] for t in out.tokens])
    # exact marginal of token 2: sum_t1 p(t1 | prompt) p(t2 | prompt, t1)
    logits, _ = api.forward(
        model, np.asarray([prompt]), np.asarray([[0, 1, 2]]), model.new_cache(1, 8)
    )
    p1 = np.asarray(jax.nn.softmax(logits[0, -1]))
    toks = np.asarray([prompt + [t] for t in range(12)])
    logits2, _ = api.forward(model, toks, np.tile(np.arange(4), (12, 1)), model.new_cache(12, 8))
    p2 = np.asarray(jax.nn.softmax(logits2[:, -1], axis=-1))
    expected = p1 @ p2
    counts = np.bincount(second, minlength=12)
    stat = np.sum((counts - n * expected) ** 2 / (n * expected))
    assert stat < 40.0, (stat, counts, n * expected)  # chi2(11) p<1e-4 ~ 35.6
    assert out.stats.to_dict()["num_accepted_tokens"] > 0
