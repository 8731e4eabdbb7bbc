"""Sampling at temperature > 0 on the qwen35 hybrid target (specjax.decode.engine over the hybrid memory): plain
sampling equals an independent host loop (the whole sequence re-evaluated from scratch each
step, the token at position p drawn with `make_key(seed, p, ROLE_SAMPLE)`), and speculative
sampling equals plain sampling token for token with the same per-row seeds on the FULL path
(checkpoint + replay: the replayed tokens accepted untested, the continuation drawn with its
position's key, so the sampler is restored with the checkpoint) and the RS path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, sampling
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.models import qwen35 as q
from specjax.testing import tiny_qwen35_config

CFG = tiny_qwen35_config(vocab_size=8, max_position=256)
N_NEW = 24
SEEDS = [11, 12, 13, 14]
TEMP = 0.8
SIMPLE = SpecConfig(types=("ngram-simple",), ngram_simple_size_n=2, ngram_simple_size_m=8, k_max=8)


@functools.lru_cache(maxsize=1)
def _model() -> api.Model:
    return api.Model(config=CFG, params=q.init_params(CFG, jax.random.PRNGKey(1), std=0.2))


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(0)
    return [[int(t) for t in rng.randint(0, CFG.V, size=n)] for n in (5, 12, 20, 9)]


@functools.lru_cache(maxsize=1)
def _plain() -> list[list[int]]:
    res = generate(
        _model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, temperature=TEMP, seed=SEEDS
    )
    return res.tokens


@pytest.mark.slow  # 30-50 s on 2 shared cores: 48 from-scratch forwards
def test_plain_sampling_equals_a_host_loop_from_scratch() -> None:
    model = _model()
    T = 64

    @jax.jit
    def last_logits(tokens: jax.Array, n: jax.Array) -> jax.Array:
        pos = jnp.where(jnp.arange(T) < n, jnp.arange(T), -1)[None]
        state = q.new_state(CFG, 1, T)
        out = q.forward(CFG, model.params, tokens[None], pos, state, cache_empty=True)
        return out.logits[0, n - 1]

    for b in (0, 3):
        seq = list(_prompts()[b])
        params = sampling.SamplingParams.create(
            temperature=TEMP, top_k=0, top_p=1.0, min_p=0.0, seed=SEEDS[b]
        )
        for _ in range(N_NEW):
            toks = jnp.asarray(seq + [0] * (T - len(seq)), jnp.int32)
            key = sampling.make_key(SEEDS[b], len(seq), sampling.ROLE_SAMPLE)
            seq.append(int(sampling.sample_token(last_logits(toks, len(seq)), params, key)))
        assert _plain()[b] == seq[len(_prompts()[b]) :]
    greedy = generate(model, _prompts()[:1], max_new_tokens=N_NEW, n_ctx=128).tokens
    assert greedy[0] != _plain()[0]  # the draws are not argmax


@pytest.mark.parametrize(
    "n_rs_seq", [0, pytest.param(4, marks=pytest.mark.slow)], ids=["FULL", "RS"]
)
def test_speculative_sampling_equals_plain_sampling(n_rs_seq: int) -> None:
    res = generate(
        _model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, temperature=TEMP, seed=SEEDS,
        spec=SIMPLE, n_rs_seq=n_rs_seq,
    )  # fmt: skip
    assert res.tokens == _plain()
    rb = res.stats.to_dict()["rollback"]
    assert rb["checkpoint"] > 0 and rb["replay"] == rb["checkpoint"]
    assert (rb["rs_plane"] > 0) == (n_rs_seq > 0)
    assert res.stats.to_dict()["num_accepted_tokens"] > 0
