"""Target sampling: llama.cpp's chain order and semantics, stateless keys, traced parameters."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.sampling import (
    ROLE_ACCEPT,
    ROLE_DRAFT,
    ROLE_RESIDUAL,
    ROLE_SAMPLE,
    ROLE_SYNTH,
    SamplingParams,
    apply_penalties,
    make_key,
    make_keys,
    masked_target_probs,
    penalty_windows,
    sample,
    sample_token,
    small_top_k,
    target_probs,
    top_k_rounds,
    truncation_mask,
)

LOGITS = np.array([1.0, 3.0, 2.0, -1.0, 0.5], np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference_probs(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Straight transcription of llama.cpp's top_k -> top_p -> min_p -> temp -> dist."""
    logits = np.asarray(logits, np.float64)
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    cand = order[: top_k if top_k > 0 else len(order)]
    if top_p < 1.0:
        p = _softmax(logits[cand])
        cum, last = 0.0, len(cand)
        for i, pi in enumerate(p):
            cum += pi
            if cum >= top_p:
                last = i + 1
                break
        cand = cand[:last]
    if min_p > 0.0:
        lim = max(logits[cand]) + np.log(min_p)
        cand = [i for i in cand if logits[i] >= lim]
    out = np.zeros(len(logits))
    if temperature <= 0:
        out[cand[0]] = 1.0
        return out
    out[cand] = _softmax(logits[cand] / temperature)
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),  # everything off
        (0.8, 40, 0.95, 0.05),  # llama.cpp defaults
        (1.0, 2, 1.0, 0.0),  # top_k only
        (0.5, 0, 0.7, 0.0),  # top_p only
        (2.0, 0, 1.0, 0.3),  # min_p only
        (0.7, 0, 0.0, 0.0),  # top_p = 0 keeps the top token
        (0.0, 3, 0.9, 0.1),  # greedy
    ],
)
def test_target_probs_matches_reference_chain(temperature, top_k, top_p, min_p):
    params = SamplingParams.create(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = np.asarray(jax.jit(target_probs)(jnp.asarray(LOGITS), params))
    want = _reference_probs(LOGITS, temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got.dtype == np.float32


def test_top_p_uses_temperature_one_probabilities():
    # At temperature 1 the top token has mass ~0.62 < 0.7, so top_p keeps two tokens; a chain that
    # applied a low temperature first would see mass > 0.7 and keep only one.
    params = SamplingParams.create(temperature=0.1, top_k=0, top_p=0.7, min_p=0.0)
    got = np.asarray(jax.jit(target_probs)(jnp.asarray(LOGITS), params))
    assert np.count_nonzero(got) == 2
    assert got[1] > 0 and got[2] > 0


def test_apply_penalties_divides_positive_multiplies_nonpositive_once():
    logits = jnp.asarray([1.0, 3.0, 2.0, -1.0, 0.0, 4.0], jnp.float32)
    tokens = jnp.asarray([1, 3, 1, 4, 5], jnp.int32)
    valid = jnp.asarray([True, True, True, True, False])  # token 5 is outside the window
    got = apply_penalties(logits, tokens, valid, jnp.float32(2.0))
    np.testing.assert_array_equal(np.asarray(got), [1.0, 1.5, 2.0, -2.0, 0.0, 4.0])
    same = apply_penalties(logits, tokens, valid, jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(same), np.asarray(logits))


def test_penalty_windows_shift_in_draft_tokens():
    recent = jnp.asarray([7, 8, 9], jnp.int32)
    toks, valid = penalty_windows(
        recent, jnp.ones(3, bool), jnp.asarray([1, 2], jnp.int32), jnp.asarray([True, False])
    )
    np.testing.assert_array_equal(np.asarray(toks), [[7, 8, 9], [8, 9, 1], [9, 1, 2]])
    np.testing.assert_array_equal(np.asarray(valid)[1], [True, True, True])
    assert not bool(valid[2, 2])


def test_make_key_depends_on_seed_position_role_only():
    base = make_key(3, 10, ROLE_SAMPLE)
    roles = [ROLE_SAMPLE, ROLE_ACCEPT, ROLE_RESIDUAL, ROLE_DRAFT, ROLE_SYNTH]
    keys = {tuple(np.asarray(make_key(3, 10, r)).tolist()) for r in roles}
    keys |= {tuple(np.asarray(make_key(3, 11, ROLE_SAMPLE)).tolist())}
    keys |= {tuple(np.asarray(make_key(4, 10, ROLE_SAMPLE)).tolist())}
    assert len(keys) == 7
    np.testing.assert_array_equal(
        np.asarray(base), np.asarray(make_key(jnp.uint32(3), jnp.int32(10), ROLE_SAMPLE))
    )
    batched = make_keys(jnp.asarray([9, 3], jnp.uint32), jnp.asarray([0, 10]), ROLE_SAMPLE)
    np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(base))


def test_batched_sample_equals_single_rows_and_greedy_is_argmax():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 9)).astype(np.float32))
    params = SamplingParams.create(
        3,
        temperature=jnp.asarray([0.0, 0.9, 1.3]),
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=jnp.asarray([1, 2, 3]),
    )
    keys = make_keys(params.seed, jnp.asarray([5, 6, 7]), ROLE_SAMPLE)
    batched = np.asarray(jax.jit(sample)(logits, params, keys))
    one = jax.jit(sample_token)
    for b in range(3):
        row = jax.tree.map(lambda x, b=b: x[b], params)
        assert int(one(logits[b], row, keys[b])) == batched[b]
    assert batched[0] == int(np.argmax(np.asarray(logits[0])))


def test_an_all_greedy_batch_gives_the_rows_own_argmax_with_ties_to_the_lowest_id():
    """`sample` skips the truncation passes when every row is greedy; the tokens stay those of
    the per-row chain (`sample_token`), ties included: lowest id, as llama.cpp's argmax."""
    logits = jnp.asarray(
        [[0.5, 2.0, 2.0, -1.0], [3.0, -2.0, 3.0, 3.0], [-1.0, -1.0, -1.0, -1.0]], jnp.float32
    )
    params = SamplingParams.create(
        3, temperature=jnp.asarray([0.0, -1.0, 0.0]), top_k=2, top_p=0.5, min_p=0.2, seed=0
    )
    keys = make_keys(params.seed, jnp.asarray([1, 2, 3]), ROLE_SAMPLE)
    batched = np.asarray(jax.jit(sample)(logits, params, keys))
    assert batched.tolist() == [1, 0, 0]
    for b in range(3):
        row = jax.tree.map(lambda x, b=b: x[b], params)
        assert int(jax.jit(sample_token)(logits[b], row, keys[b])) == batched[b]


def test_sample_token_frequencies_follow_target_probs():
    params = SamplingParams.create(temperature=0.9, top_k=4, top_p=0.97, min_p=0.0)
    logits = jnp.asarray(LOGITS)
    keys = jax.vmap(make_key, in_axes=(None, 0, None))(7, jnp.arange(20000), ROLE_SAMPLE)
    toks = np.asarray(
        jax.jit(jax.vmap(sample_token, in_axes=(None, None, 0)))(logits, params, keys)
    )
    probs = np.asarray(jax.jit(target_probs)(logits, params), np.float64)
    counts = np.bincount(toks, minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    nz = probs > 0
    expected = probs[nz] * len(toks)
    stat = float(((counts[nz] - expected) ** 2 / expected).sum())
    assert stat < 21.108  # chi2(df=3) quantile at 1 - 1e-4


def test_grammar_mask_renormalises_and_falls_back_to_grammar_first():
    params = SamplingParams.create(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    logits = jnp.asarray(LOGITS)
    allowed = jnp.asarray([False, True, True, True, True])
    masked = jax.jit(masked_target_probs)
    p = np.asarray(masked(logits, params, allowed))
    np.testing.assert_allclose(p, _reference_probs(LOGITS, 1.0, 2, 1.0, 0.0), atol=1e-6)
    # top_k = 2 keeps tokens 1, 2; allow only 0 and 4 -> grammar applied before the chain
    allowed = jnp.asarray([True, False, False, False, True])
    p = np.asarray(masked(logits, params, allowed))
    want = np.zeros(5)
    want[[0, 4]] = _softmax(LOGITS[[0, 4]].astype(np.float64))
    np.testing.assert_allclose(p, want, atol=1e-6)


def test_create_broadcasts_and_sampling_traces_once():
    params = SamplingParams.create(4, temperature=0.5, seed=2**32 - 1)
    assert params.temperature.shape == (4,) and params.temperature.dtype == jnp.float32
    assert params.top_k.dtype == jnp.int32 and params.seed.dtype == jnp.uint32
    assert int(params.seed[0]) == 2**32 - 1

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logits, params, keys):
        return sample(logits, params, keys)

    logits = jnp.zeros((4, 6), jnp.float32)
    for temp in (0.0, 0.7, 1.5):
        p = SamplingParams.create(4, temperature=temp, top_k=int(temp * 2), seed=int(temp * 10))
        step(logits, p, make_keys(p.seed, jnp.arange(4), ROLE_SAMPLE))


def test_host_params_equal_create_and_share_its_trace():
    """`SamplingParams.host` (NumPy leaves, what `generate` hands its executables) holds what
    `create` does, per row and seed modulo 2**32, and a step traced with one traces for the
    other."""
    kw = dict(temperature=[0.0, 0.7], top_k=[0, 40], top_p=[1.0, 0.9], min_p=[0.05, 0.0])
    seeds = np.asarray([2**32 + 5, 2**31 + 1])
    host = SamplingParams.host(2, repeat_penalty=[1.0, 1.1], seed=seeds, **kw)
    made = SamplingParams.create(
        2, repeat_penalty=jnp.asarray([1.0, 1.1]), seed=jnp.asarray([5, 2**31 + 1], jnp.uint32),
        **{k: jnp.asarray(v) for k, v in kw.items()},
    )  # fmt: skip
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(made)):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, np.asarray(b))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logits, params, keys):
        return sample(logits, params, keys)

    logits = jnp.zeros((2, 6), jnp.float32)
    for p in (made, host):
        step(logits, p, make_keys(p.seed, jnp.arange(2), ROLE_SAMPLE))


@pytest.mark.parametrize("top_k", [small_top_k, top_k_rounds], ids=["small_top_k", "xla_rounds"])
@pytest.mark.parametrize("k", [1, 10, 50])
def test_small_top_k_is_a_stable_descending_sort_prefix(k, top_k):
    rng = np.random.default_rng(k)
    x = rng.integers(0, 6, size=(3, 50)).astype(np.float32)  # many ties
    x[1, rng.choice(50, 20, replace=False)] = -np.inf  # masked vocabulary entries
    values, indices = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), k)
    want = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # NumPy oracle: ties by lower index
    np.testing.assert_array_equal(np.asarray(indices), want)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, want, -1))
    with pytest.raises(ValueError, match="k must be in"):
        top_k(jnp.asarray(x), 51)


# Integer-valued logits make ties common (the stable order decides them); -0.0 ties 0.0 and
# -inf is a grammar-masked token. top_p from a few values away from exact cumulative masses.
_TIED_LOGITS = st.lists(
    st.sampled_from([-3.0, -1.0, -0.0, 0.0, 1.0, 2.0, 2.5, -np.inf]), min_size=2, max_size=40
).filter(lambda xs: any(np.isfinite(xs)))


@settings(max_examples=120, deadline=None)
@given(
    logits=_TIED_LOGITS,
    top_k=st.sampled_from([0, 1, 2, 3, 7, 40, 100]),
    top_p=st.sampled_from([0.0, 0.33, 0.61, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_sort_free_truncation_equals_the_stable_sort_chain(logits, top_k, top_p, min_p):
    """`truncation_mask` finds its cuts by bisection, not by sorting: its kept set must be the
    reference chain's (a stable sort in float64), ties and all."""
    x = np.asarray(logits, np.float32)
    params = SamplingParams.create(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    padded = np.full(40, -np.inf, np.float32)  # one compiled shape; -inf ranks last, p = 0
    padded[: len(x)] = x
    got = np.asarray(_JIT_MASK(jnp.asarray(padded), params))[: len(x)]
    got = got & np.isfinite(x)  # a kept -inf token has probability 0 anyway
    want = _reference_probs(x, 1.0, top_k, top_p, min_p) > 0
    np.testing.assert_array_equal(got, want)


_JIT_MASK = jax.jit(truncation_mask)
