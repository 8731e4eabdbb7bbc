"""`specjax.Generator`: drafter state that outlives a call (llama.cpp's server slots).

ngram-mod's pool persists across requests upstream. Request 1 holds a prompt P followed by
the target's own greedy continuation C of P; request 2 is P. With the Generator, request 2
drafts C from the pool request 1 filled and the drafts are accepted; a fresh `generate` of
request 2 drafts nothing (its pool only holds P, and it ingests generated tokens 32 at a
time). Both equal plain greedy decoding (an independent run without drafters), and request 2
compiles nothing. draft-simple keeps no learned state: after another request its output and
statistics equal a fresh run's (the carried draft cache is emptied per request).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import specjax
from specjax import api
from specjax.config import SpecConfig
from specjax.decode import executables
from specjax.testing import count_compiles, noisy_copy, tiny_model

N_CTX, NEW = 128, 15


def spec_config(**kw: object) -> SpecConfig:
    """llama.cpp's fixed draft budget: no draft governor where specjax has one."""
    if "adaptive" in {f.name for f in dataclasses.fields(SpecConfig)}:
        kw.setdefault("adaptive", False)
    return SpecConfig(**kw)  # type: ignore[arg-type]


def mod_spec(**kw: object) -> SpecConfig:
    """ngram-mod over the tiny model's streams: 4-grams, drafts of 2-8 tokens, a small pool;
    no draft governor unless `adaptive=True`."""
    base: dict[str, object] = dict(
        types=("ngram-mod",),
        ngram_mod_n_match=4,
        ngram_mod_n_min=2,
        ngram_mod_n_max=8,
        ngram_mod_pool_size=1 << 12,
    )
    return spec_config(**{**base, **kw})


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    p = [int(x) for x in rng.permutation(np.arange(3, 97))[:17]]
    q = [int(x) for x in rng.permutation(np.arange(3, 97))[:20]]
    return p, q


@pytest.mark.slow  # suite time: per-request state is covered by test_draft_simple_state_is_per_request
def test_ngram_mod_pool_outlives_a_request(target, prompts):
    p, q = prompts
    plain = specjax.generate(target, [p, q], max_new_tokens=NEW)
    c = plain.tokens[0]
    spec = mod_spec()
    fresh = specjax.generate(target, [p, q], max_new_tokens=NEW, spec=spec, n_ctx=N_CTX)
    assert fresh.tokens == plain.tokens
    assert fresh.stats.to_dict()["num_draft_tokens"] == 0

    gen = specjax.Generator(target, spec=spec, n_ctx=N_CTX, batch=2)
    first = gen.generate([p + c], max_new_tokens=NEW)  # one idle slot; same T bucket (32)
    assert len(first.tokens) == 1 and first.timings["prompt_tokens"] == len(p + c)
    before = api.compile_count()
    with count_compiles() as events:
        second = gen.generate([p, q], max_new_tokens=NEW)
    assert api.compile_count() == before and events == []
    assert second.tokens == plain.tokens
    stats = second.stats.to_dict()
    assert stats["num_accepted_tokens"] >= NEW // 2
    assert stats["drafters"]["ngram-mod"]["n_call_begin"] == 2  # the two requests, not idle

    gen.reset()
    again = gen.generate([p, q], max_new_tokens=NEW)
    assert again.stats.to_dict()["num_draft_tokens"] == 0


def test_draft_simple_state_is_per_request(target, prompts):
    p, q = prompts
    draft = noisy_copy(target, 0.3)
    spec = spec_config(types=("draft-simple",), draft_n_max=4)
    fresh = specjax.generate(
        target, [q, p], max_new_tokens=NEW, spec=spec, draft=draft, n_ctx=N_CTX
    )
    gen = specjax.Generator(target, spec=spec, draft=draft, n_ctx=N_CTX, batch=2)
    gen.generate([p[:5] + q, q[:3] + p + p[:8]], max_new_tokens=NEW)
    out = gen.generate([q, p], max_new_tokens=NEW)
    assert out.tokens == fresh.tokens
    assert out.stats.to_dict() == fresh.stats.to_dict()
    assert fresh.stats.to_dict()["num_draft_tokens"] > 0


def test_generator_errors(target):
    gen = specjax.Generator(target, n_ctx=64, batch=2)
    with pytest.raises(ValueError, match="3 prompts for a Generator of batch 2"):
        gen.generate([[1], [2], [3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        specjax.Generator(target, batch=0)
    with pytest.raises(ValueError, match="does not fit a context of 64"):
        gen.generate([list(range(1, 70))], max_new_tokens=2)
    # the model, drafters, context and stream are the Generator's, not a request's
    with pytest.raises(TypeError, match=r"\['n_ctx', 'stream'\] that are not per request"):
        gen.generate([[1]], max_new_tokens=2, n_ctx=32, stream=print)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="max_new_tokens"):
        gen.generate([[1]], temperature=0.5)  # type: ignore[call-arg]


def test_generator_prefills_in_n_ubatch_chunks(target, prompts, monkeypatch):
    """`Generator(n_ubatch=...)` reaches the engine as `generate`'s does (llama.cpp's -ub) and
    the chunked prefill gives plain decoding's tokens; bad values fail at construction."""
    with pytest.raises(ValueError, match=r"n_ubatch must be an integer >= 0.*got -1"):
        specjax.Generator(target, n_ubatch=-1)
    seen: list[int] = []
    real = api.eng.Engine

    def spy(*args, **kwargs):
        seen.append(kwargs.get("n_ubatch", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(api.eng, "Engine", spy)
    p, _ = prompts
    want = specjax.generate(target, [p], max_new_tokens=6, n_ctx=64).tokens
    gen = specjax.Generator(target, n_ctx=64, n_ubatch=5)
    assert gen.generate([p], max_new_tokens=6).tokens == want
    assert seen == [0, 5]


def test_carried_pool_is_updated_in_place(target, prompts, monkeypatch):
    """A Generator's states are donated to the request's prefill: ngram-mod's pool keeps its
    buffer across requests (copying it cost 221 page faults a request at the default 32 MB,
    benchmarks/results/requests-before.json). A request that fails after the prefill consumed the states leaves
    fresh ones (as `reset`), and the next request runs and equals plain decoding."""
    p, q = prompts
    spec = mod_spec()
    gen = specjax.Generator(target, spec=spec, n_ctx=N_CTX, batch=2)
    gen.generate([p, q], max_new_tokens=4)  # compiles; the states now come from a request
    pool = gen.states[0].pool
    where = pool.unsafe_buffer_pointer()
    out = gen.generate([q, p], max_new_tokens=4)
    assert pool.is_deleted() and gen.states[0].pool.unsafe_buffer_pointer() == where
    assert out.drafter_states["ngram-mod"] is gen.states[0]

    def fail(cache):
        raise RuntimeError("after the prefill")

    monkeypatch.setattr(api, "check_overflow", fail)
    with pytest.raises(RuntimeError, match="after the prefill"):
        gen.generate([p, q], max_new_tokens=4)
    monkeypatch.undo()
    assert not any(x.is_deleted() for x in jax.tree.leaves(gen.states))
    assert int(gen.states[0].used) == 0  # fresh
    want = specjax.generate(target, [p, q], max_new_tokens=4, n_ctx=N_CTX).tokens
    assert gen.generate([p, q], max_new_tokens=4).tokens == want


def test_one_shot_results_pin_no_drafter_state_unless_asked(target, prompts):
    """A kept `generate` result holds its drafters' final states only when asked for
    (`return_drafter_states=True`): each would pin device memory (ngram-mod's pool, 32 MB at
    the default size: 20 kept results grew the process by ~1.4 GB). A Generator's results
    always hold its states (its own buffers: no extra memory)."""
    p, q = prompts
    spec = mod_spec()
    kw = dict(max_new_tokens=4, spec=spec, n_ctx=N_CTX)
    kept = specjax.generate(target, [p, q], **kw)
    asked = specjax.generate(target, [p, q], **kw, return_drafter_states=True)
    assert kept.drafter_states == {} and kept.tokens == asked.tokens
    assert asked.drafter_states["ngram-mod"].pool.shape == (1 << 12,)
    gen = specjax.Generator(target, spec=spec, n_ctx=N_CTX, batch=2)
    assert gen.generate([p, q], max_new_tokens=4).drafter_states["ngram-mod"] is gen.states[0]


def test_one_shot_calls_reuse_the_last_calls_pool_as_fresh(target, prompts):
    """One-shot `generate` calls of a chain with ngram-mod hand their final states to the next
    call of the same chain, B and S (`executables._SPARES`), which renews them: the pool's buffer is
    reused (no 32 MB allocated and filled per call), and nothing it held leaks. The first
    call's prompt P + C fills the pool with the continuation C that a Generator would then
    draft for P; a one-shot call on P after it drafts nothing, as a fresh run does, and its
    statistics equal a fresh process's (`clear_compiled` drops the spares)."""
    p, q = prompts
    c = specjax.generate(target, [p], max_new_tokens=NEW).tokens[0]
    spec = mod_spec()
    kw = dict(max_new_tokens=NEW, spec=spec, n_ctx=N_CTX)
    api.clear_compiled()
    fresh = specjax.generate(target, [p, q], **kw)
    api.clear_compiled()
    specjax.generate(target, [p + c, q], **kw)
    ((spare,),) = executables._SPARES.values()
    where = spare.pool.unsafe_buffer_pointer()
    again = specjax.generate(target, [p, q], **kw)
    ((spare,),) = executables._SPARES.values()
    assert spare.pool.unsafe_buffer_pointer() == where
    assert again.tokens == fresh.tokens
    assert again.stats.to_dict() == fresh.stats.to_dict()
    assert fresh.stats.to_dict()["num_draft_tokens"] == 0
    # a call that returns its states neither takes the spare nor leaves its own
    kept = specjax.generate(target, [p, q], **kw, return_drafter_states=True)
    ((spare,),) = executables._SPARES.values()
    assert spare.pool.unsafe_buffer_pointer() == where
    assert kept.drafter_states["ngram-mod"].pool.unsafe_buffer_pointer() != where


def test_a_generator_keeps_its_lookup_table_beside_the_pool(target, prompts):
    """With the draft governor on, ngram-mod is asked only where the n-gram ending at a row's
    last token may be in its pool (`specjax.drafters.lookup_index`). A Generator keeps the table its
    last request ended with beside the pool, so a request asks where a one-shot call would,
    plus where earlier requests' n-grams are: the first request (a fresh pool) has a one-shot
    call's statistics exactly, and the next finds the continuation the first one taught (a
    table rebuilt from the prompt alone would not ask there). A carried pool's table used to
    start full: every row askable, every round."""
    p, q = prompts
    plain = specjax.generate(target, [p, q], max_new_tokens=NEW)
    c = plain.tokens[0]
    spec = mod_spec(adaptive=True)
    gen = specjax.Generator(target, spec=spec, n_ctx=N_CTX, batch=2)
    first = gen.generate([p + c, q], max_new_tokens=NEW)
    one = specjax.generate(target, [p + c, q], max_new_tokens=NEW, spec=spec, n_ctx=N_CTX)
    assert first.tokens == one.tokens
    assert first.stats.to_dict() == one.stats.to_dict()
    second = gen.generate([p, q], max_new_tokens=NEW)
    assert second.tokens == plain.tokens
    assert second.stats.to_dict()["num_accepted_tokens"] >= NEW // 2
