"""Engine behaviour: speculative greedy == plain greedy, no retracing, bad input, rejection at T=1
(the exact joint of two drafted positions)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, sampling
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.decode import engine, executables
from specjax.decode import governor as adaptive
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
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=k)
    out = generate(target, PROMPTS, max_new_tokens=[24, 24, 10, 24], spec=spec, draft=draft)
    assert out.tokens == plain.tokens
    stats = out.stats.to_dict()
    # the noisy draft must exercise both acceptance and rejection, or the test proves little
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.mark.slow  # suite time: batch independence is also covered by tests/test_batch.py
def test_single_row_matches_batch(target, plain):
    draft = noisy_copy(target, 0.6)
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=3)
    out = generate(target, [PROMPTS[0]], max_new_tokens=24, spec=spec, draft=draft)
    assert out.tokens[0] == plain.tokens[0]


def test_rows_finishing_early_on_eog(target, plain):
    # pick a token that row 0 produces mid-way: that row must stop there, others continue
    eog_tok = plain.tokens[0][5]
    model = with_eog(target, [eog_tok])
    ref = generate(model, PROMPTS, max_new_tokens=24)
    assert ref.finish_reasons[0] == "stop"
    assert ref.tokens[0] == plain.tokens[0][: plain.tokens[0].index(eog_tok)]
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=3)
    out = generate(model, PROMPTS, max_new_tokens=24, spec=spec, draft=noisy_copy(model, 0.3))
    assert out.tokens == ref.tokens
    assert out.finish_reasons == ref.finish_reasons


def test_self_draft_accepts_everything(target, plain):
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=3)
    out = generate(target, PROMPTS, max_new_tokens=[24, 24, 10, 24], spec=spec, draft=target)
    assert out.tokens == plain.tokens
    stats = out.stats.to_dict()
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    per_pos = stats["accepted_per_position"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))


def test_generation_compiles_once_across_sampling_params(target):
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=3)
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


def test_executable_cache_is_bounded_and_keeps_the_recently_used(
    target, monkeypatch, no_compile_cache
):
    """Executables pin machine-code mappings; the cache keeps the most recently used few, and
    a shape evicted from it is compiled again (compile_count counts every compile)."""
    monkeypatch.setattr(executables, "_COMPILED", {})
    monkeypatch.setattr(
        executables, "_COMPILED_MAX", 2
    )  # one generate = prefill + loop executables
    before = api.compile_count()
    generate(target, PROMPTS[:1], max_new_tokens=4, n_ctx=64)
    generate(target, PROMPTS[:1], max_new_tokens=4, n_ctx=64)  # both hits
    assert api.compile_count() == before + 2 and len(executables._COMPILED) == 2
    generate(target, PROMPTS[:1], max_new_tokens=4, n_ctx=96)  # evicts the n_ctx=64 pair
    assert api.compile_count() == before + 4 and len(executables._COMPILED) == 2
    generate(target, PROMPTS[:1], max_new_tokens=4, n_ctx=64)
    assert api.compile_count() == before + 6 and len(executables._COMPILED) == 2


def test_plain_sampling_replays_exactly_and_batch_independent(target):
    a = generate(target, PROMPTS, max_new_tokens=16, temperature=0.9, seed=[1, 2, 3, 4])
    b = generate(target, PROMPTS, max_new_tokens=16, temperature=0.9, seed=[1, 2, 3, 4])
    assert a.tokens == b.tokens
    alone = generate(target, [PROMPTS[2]], max_new_tokens=16, temperature=0.9, seed=3)
    assert alone.tokens[0] == a.tokens[2][:16]


def test_match_verification_reproduces_sampled_stream(target):
    """draft-and-match must not change a seeded sampled stream (llama.cpp's server test)."""
    plain = generate(target, PROMPTS[:2], max_new_tokens=16, temperature=0.8, top_k=5, seed=42)
    spec = SpecConfig(
        types=("ngram-simple",), adaptive=False, ngram_simple_size_n=1, ngram_simple_size_m=4
    )
    out = generate(
        target, PROMPTS[:2], max_new_tokens=16, temperature=0.8, top_k=5, seed=42, spec=spec
    )
    assert out.tokens == plain.tokens


def test_step_does_not_retrace_across_rounds(target):
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=3)
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
            cost=adaptive.CostModel.off(),
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
        generate(
            target,
            [[1, 2]],
            max_new_tokens=4,
            spec=SpecConfig(types=("draft-simple",), adaptive=False),
        )
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
            spec=SpecConfig(types=("draft-simple",), adaptive=False),
            draft=other,
        )


def test_context_end_stops_rows(target):
    # as llama.cpp's completion tool and server (no context shift): n_ctx - L tokens, the last
    # one at position 31, the last position the context has
    out = generate(target, [list(range(1, 20))], max_new_tokens=100, n_ctx=32)
    assert out.finish_reasons == ["context"]
    assert len(out.tokens[0]) == 32 - 19
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=8)
    fast = generate(
        target, [list(range(1, 20))], max_new_tokens=100, n_ctx=32, spec=spec, draft=target
    )
    assert fast.tokens == out.tokens  # the draft budget kept every verify batch inside n_ctx


# --------------------------------------------------------------------------------------------
# rejection sampling through the whole engine: the exact joint of two drafted positions


def _chi2_pooled(cells: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson statistic (cells expecting < 5 samples pooled into one) and its 1 - 1e-4
    quantile (Wilson-Hilferty: within 1% of the exact one for these degrees of freedom)."""
    counts = np.bincount(cells, minlength=len(probs)).astype(np.float64)
    expected = probs * len(cells)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert counts[probs == 0].sum() == 0, "a zero-probability sequence was generated"
    df = len(exp) - 1
    z = 3.719  # standard normal quantile at 1 - 1e-4
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return float(((obs - exp) ** 2 / exp).sum()), float(crit)


def test_rejection_sampling_engine_preserves_the_joint_of_drafted_positions(monkeypatch):
    """At T=1 with draft-simple (n_max 2) the first three generated tokens t1 (prefill),
    t2 and t3 (the two drafted positions of round one) follow the target's exact joint
    p(t1) p(t2 | t1) p(t3 | t1, t2), enumerated over V = 10 with `specjax.forward`. Rows are
    independent samples: every random draw is keyed by (seed, position), one seed per row.

    Power, in the same run (one compile): rows with seeds >= BROKEN_SEED get a verifier that
    tests the second drafted token against the first position's p; their sample fails. The
    other rows' verify result is the unmodified `verify._rejection` output, selected per row.
    """
    from specjax.decode import verify

    vocab, prompt, n = 10, [1, 2, 3], 3000
    base = tiny_model(3, vocab_size=vocab, n_layers=1)
    # larger weights: distributions far from uniform and from the draft's, so errors show
    model = dataclasses.replace(
        base, params=jax.tree.map(lambda x: x * 15 if x.ndim > 1 else x, base.params)
    )
    draft = noisy_copy(model, 1.0, seed=4)

    # one forward over every continuation (a, b): its logits after the prompt, after a, after b
    rows = np.asarray([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
    positions = np.tile(np.arange(rows.shape[1]), (len(rows), 1))
    logits, _ = api.forward(model, rows, positions, model.new_cache(len(rows), 8))
    probs = np.asarray(jax.nn.softmax(np.asarray(logits, np.float64), axis=-1))
    probs = probs.reshape(vocab, vocab, rows.shape[1], vocab)
    p1, p2, p3 = probs[0, 0, 2], probs[:, 0, 3], probs[:, :, 4]  # p(t1), p(t2|a), p(t3|a,b)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)
    joint_drafted = joint.reshape(vocab, -1).sum(axis=0)  # (t2, t3)

    broken_seed = 1 << 20
    rejection = verify._rejection

    def rejection_broken_for_marked_rows(target, draft_K, valid_K, q_KV, seed):
        good = rejection(target, draft_K, valid_K, q_KV, seed)
        p = target.ratio_probs_TV
        wrong_row = dataclasses.replace(target, ratio_probs_TV=p.at[1].set(p[0]))
        bad = rejection(wrong_row, draft_K, valid_K, q_KV, seed)
        return jax.tree.map(lambda b, g: jnp.where(seed >= broken_seed, b, g), bad, good)

    monkeypatch.setattr(verify, "_rejection", rejection_broken_for_marked_rows)
    monkeypatch.setattr(executables, "_COMPILED", {})
    jax.clear_caches()
    try:
        out = generate(
            model,
            [prompt] * (2 * n),
            max_new_tokens=4,  # budget min(n_max, 4 - 1 - 1) = 2 drafted positions in round one
            temperature=1.0,
            seed=[*range(n), *range(broken_seed, broken_seed + n)],
            spec=SpecConfig(
                types=("draft-simple",),
                adaptive=False,
                draft_n_max=2,
                draft_sampling="probabilistic",
            ),
            draft=draft,
        )
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # nothing traced with the broken verifier survives the test
    t = np.asarray([row[:3] for row in out.tokens])
    cells = (t[:, 0] * vocab + t[:, 1]) * vocab + t[:, 2]
    good, bad = cells[:n], cells[n:]
    # both drafted positions were drafted, accepted and rejected
    per_pos = out.stats.to_dict()["accepted_per_position"]  # static width K >= 2
    assert all(0 < a < 2 * n for a in per_pos[:2]) and not any(per_pos[2:])
    for sample, target_probs in ((good, joint), (good % vocab**2, joint_drafted)):
        stat, crit = _chi2_pooled(sample, target_probs)
        assert stat < crit, (stat, crit)
    for sample, target_probs in ((bad, joint), (bad % vocab**2, joint_drafted)):
        stat, crit = _chi2_pooled(sample, target_probs)
        assert stat > crit, (stat, crit)
