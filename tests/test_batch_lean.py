"""Rounds in which the governor lets no row draft: `engine.spec_step` runs them as plain
rounds without drafter calls for chains of `idle_noop` drafters, and `continuous.lean_step`
runs the other chains' drafters at width 2 instead of K + 1; both must leave exactly the
state of the wide round that calls every drafter.

The independent source is that wide round: `engine.spec_step` with the same drafters marked
not `idle_noop` (every drafter is called every round, as before the skip existed). After the
same rounds from the same state, every leaf of the two states (KV cache, history, outputs,
drafter states, statistics, governor) must be bit-identical.
Chains: ngram-mod + draft-simple (the benchmark's), and draft-eagle3, whose `process` reads
every verify batch's hidden states, so a lean round that skipped or mangled the drafter
feedback would show in its state.

Feature drafters (draft-eagle3, draft-dflash) declare `idle_record`: in a round no row may
draft they log the verify batch and apply it at their next `process` or `draft`. Their
reference is the same wide round with `process` called every round; the two states are
compared after both drafters applied their logs (`settled`), and the drafts made after a
stretch longer than the log must be the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.api import Model
from specjax.config import SpecConfig
from specjax.decode import engine as eng
from specjax.decode import governor as adaptive
from specjax.drafters import dflash as dflash_drafter
from specjax.drafters import eagle3 as eagle3_drafter
from specjax.drafters.dflash import DFlashState
from specjax.drafters.eagle3 import Eagle3State
from specjax.drafters.registry import build_drafters
from specjax.jobs import continuous as cont
from specjax.models import eagle3 as e3
from specjax.pytree import replace
from specjax.testing import noisy_copy, tiny_block_head, tiny_model

B, S, OUT, ROUNDS = 3, 96, 48, 5
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [20, 21, 22], [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def target() -> Model:
    return tiny_model(0)


def eagle3_head(target: Model) -> Model:
    tc = target.config
    cfg = e3.Eagle3Config(
        vocab_size=tc.V,
        dim=tc.D,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        target_hidden=tc.D,
        target_layers=(0, 1, tc.L),
        own_lm_head=True,
    )
    return Model(config=cfg, params=e3.init_params(cfg, jax.random.key(3)), tokenizer=None)


def run_params(cost: adaptive.CostModel, temperature: float) -> eng.RunParams:
    # row 1 finishes within the rounds
    return testing.run_params([40, 3, 40], temperature=temperature, seed=7, cost=cost)


def small_ngrams(types: tuple[str, ...], **overrides: object) -> SpecConfig:
    """The n-gram drafters at sizes the module's short outputs repeat (2-grams, 4 tokens
    copied, ngram-mod drafting up to 8 from a small pool)."""
    sizes: dict[str, object] = dict(
        ngram_simple_size_n=2,
        ngram_simple_size_m=4,
        ngram_map_k_size_n=2,
        ngram_map_k_size_m=4,
        ngram_map_k4v_size_n=2,
        ngram_map_k4v_size_m=4,
        ngram_mod_n_match=2,
        ngram_mod_n_min=1,
        ngram_mod_n_max=8,
        ngram_mod_pool_size=1 << 10,
    )
    return SpecConfig(types=types, **{**sizes, **overrides})


def never_pays() -> adaptive.CostModel:
    """A governor that turns every round off (a huge fixed cost per drafting round)."""
    return adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(0.1, jnp.float32),
        draft_step=jnp.asarray(0.1, jnp.float32),
        call=jnp.asarray(1e6, jnp.float32),
    )


def throttles() -> adaptive.CostModel:
    """A governor whose best draft length for these rows is short (2 at its prior)."""
    return adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(0.2, jnp.float32),
        draft_step=jnp.asarray(0.0, jnp.float32),
        call=jnp.asarray(0.0, jnp.float32),
    )


def prompt_arrays() -> tuple[jax.Array, jax.Array]:
    """PROMPTS as the engine's [B, 11] token array (zero-padded) and [B] lengths."""
    tokens = np.zeros((B, 11), np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, : len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in PROMPTS], jnp.int32)


@jax.jit
def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def off_step(engine, params, dparams, state, run):
    """`engine.generate_loop`'s round inside a stretch in which no row may draft, and the
    loop's governor update for it after the stretch (`adaptive.advance`: one idle round; the
    round was counted by its plan)."""
    state = eng.spec_step(engine, params, dparams, state, run, off=True)
    return dataclasses.replace(state, governor=adaptive.advance(state.governor, 1, 0))


STEPS = {
    eng.spec_step: eng.step_jit,
    cont.lean_step: jax.jit(cont.lean_step, static_argnums=0),
    off_step: jax.jit(off_step, static_argnums=0),
}


def eager(engine: eng.Engine) -> eng.Engine:
    """The engine with its drafters marked neither `idle_noop` nor `idle_record`: called in
    every round (`process` of every verify batch)."""
    drafters = []
    for d in engine.drafters:
        flags = {"idle_noop": False, "idle_record": False}
        cls = type(f"Eager{type(d).__name__}", (type(d),), flags)
        clone = object.__new__(cls)
        clone.__dict__.update(d.__dict__)
        drafters.append(clone)
    return dataclasses.replace(engine, drafters=tuple(drafters))


def rounds(step, engine, params, dparams, state, run):
    fn = STEPS[step]
    for _ in range(ROUNDS):
        state = fn(engine, params, dparams, state, run)
    return state


def meaningful(state: eng.GenState) -> eng.GenState:
    """The state with documented garbage zeroed: EAGLE-3's `verify_g` rows at or beyond
    `verify_rows` (a verify batch of width T writes T rows, of which only the valid ones
    are ever read)."""
    ds = []
    for d in state.drafter_states:
        if isinstance(d, Eagle3State):
            S = d.verify_g.shape[1]
            keep = jnp.arange(S)[None, :, None] < d.verify_rows[:, None, None]
            d = replace(d, verify_g=jnp.where(keep, d.verify_g, 0.0))
            held = d.log_pos >= 0
            d = replace(
                d,
                log_tokens=jnp.where(held, d.log_tokens, 0),
                log_g=jnp.where(held[..., None], d.log_g, 0.0),
                log_n=jnp.where(jnp.any(held, axis=1), d.log_n, 0),
            )
        if isinstance(d, DFlashState):
            held = d.log_pos >= 0
            d = replace(
                d,
                log_feats=jnp.where(held[..., None], d.log_feats, 0.0),
                log_n=jnp.where(jnp.any(held, axis=1), d.log_n, 0),
            )
        ds.append(d)
    return replace(state, drafter_states=tuple(ds))


@functools.partial(jax.jit, static_argnums=0)
def _flush_all(drafters, dparams, states):
    return tuple(
        d.flush(p, s) if hasattr(d, "flush") else s for d, p, s in zip(drafters, dparams, states)
    )


def settled(engine: eng.Engine, dparams, state: eng.GenState) -> eng.GenState:
    """The state with every recording drafter's log applied (`flush`): what processing each
    round's batch leaves."""
    flushed = _flush_all(engine.drafters, dparams, state.drafter_states)
    return replace(state, drafter_states=flushed)


#: EAGLE-3's snapshot of the last `process` (`verify_*`): `record` leaves it, and only
#: `accept` reads it, after a `process` of its own round's batch (compared again after one).
SNAPSHOT = (".verify_g", ".verify_pos_first", ".verify_rows")


def assert_same_state(got: eng.GenState, want: eng.GenState, skip: tuple[str, ...] = ()) -> None:
    """Every leaf bit for bit, except the governor's float estimates: the round variants are
    different programs, and XLA may fuse (and contract into FMAs) their decayed averages
    differently (a last-bit difference seen with the suite's compiler flags). Its counters,
    and everything else, must match exactly. `skip`: leaves whose names end so are not
    compared."""
    got, want = meaningful(got), meaningful(want)
    flat_w, tree_w = jax.tree_util.tree_flatten_with_path(want)
    flat_g, tree_g = jax.tree_util.tree_flatten_with_path(got)
    assert tree_w == tree_g
    for (path, w), (_, g) in zip(flat_w, flat_g):
        name = jax.tree_util.keystr(path)
        if name.endswith(skip):
            continue
        w, g = np.asarray(w), np.asarray(g)
        if name.startswith(".governor.") and w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=0, err_msg=name)
        else:
            assert np.array_equal(g, w), name


@pytest.mark.parametrize(
    "chain, temperature, lean",
    [
        (("ngram-mod", "draft-simple"), 0.0, True),
        # every model-free drafter declares idle_noop: spec_step skips them in off rounds
        # (continuous.lean_step is checked with the chain above)
        pytest.param(  # suite time: ngram-mod's idle_noop runs in the off-stretch test below
            ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache"),
            0.0,
            False,
            marks=pytest.mark.slow,
        ),
        pytest.param(("draft-eagle3",), 0.8, True, marks=pytest.mark.slow),
    ],
)
def test_rounds_nobody_drafts_leave_the_state_spec_step_leaves(target, chain, temperature, lean):
    spec = small_ngrams(chain, draft_n_max=4)
    draft = eagle3_head(target) if "draft-eagle3" in chain else noisy_copy(target, 0.3)
    drafters, dparams = build_drafters(spec, target, draft)
    engine = eng.Engine(
        target=target.config,
        drafters=drafters,
        k_max=2 * cont.MID_K,  # wide rounds, and throttled ones that take the middle path
        capacity=S,
        out_capacity=OUT,
    )
    tokens, lengths = prompt_arrays()
    reference = eager(engine)  # calls every drafter every round
    run = run_params(never_pays(), temperature)
    on = run_params(adaptive.CostModel.off(), temperature)
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, run)
    # one drafting round first: the governor's estimates leave the prior (where relaxing
    # towards it would change nothing), so an off round that skipped the relaxing shows
    for _ in range(12):  # (model-free drafters need the output to repeat itself first)
        state = eng.step_jit(engine, target.params, dparams, state, on)
        gov = state.governor
        if not np.allclose(np.asarray(gov.acc_num / gov.acc_den), adaptive.PRIOR_ACCEPT):
            break
    assert not np.allclose(np.asarray(gov.acc_num / gov.acc_den), adaptive.PRIOR_ACCEPT)

    want = rounds(eng.spec_step, reference, target.params, dparams, _copy(state), run)
    # the governor turned every round off, and the rounds did run
    n_off = int(want.governor.n_off) - int(gov.n_off)
    assert n_off == int(want.governor.n_rounds) - int(gov.n_rounds) > 0
    assert int(jnp.sum(want.out_len)) > int(jnp.sum(state.out_len))
    # the generation loops' round, which skips the drafters of idle_noop chains
    # (draft-eagle3 records the rounds: compared once its log is applied)
    assert eng.idle_rounds_are_plain(engine)
    assert not eng.idle_rounds_are_plain(reference)

    def same(got: eng.GenState, want: eng.GenState) -> None:
        assert_same_state(settled(engine, dparams, got), want, skip=SNAPSHOT)

    got = rounds(eng.spec_step, engine, target.params, dparams, _copy(state), run)
    same(got, want)
    # the generation loop's off stretch: the same rounds
    got = rounds(off_step, engine, target.params, dparams, _copy(state), run)
    same(got, want)
    if not lean:
        return
    got = rounds(cont.lean_step, engine, target.params, dparams, _copy(state), run)
    same(got, want)

    # a chain that drafts every round goes the wide way: the same state as spec_step too
    want = rounds(eng.spec_step, reference, target.params, dparams, _copy(state), on)
    got = rounds(cont.lean_step, engine, target.params, dparams, _copy(state), on)
    assert int(jnp.sum(want.stats.n_draft_tokens)) > int(jnp.sum(state.stats.n_draft_tokens))
    same(got, want)

    # a governor that throttles drafts to <= MID_K tokens (the middle path, width MID_K + 1)
    mid = run_params(throttles(), temperature)
    want = rounds(eng.spec_step, reference, target.params, dparams, _copy(state), mid)
    got = rounds(cont.lean_step, engine, target.params, dparams, _copy(state), mid)
    assert int(want.governor.n_throttled) > int(state.governor.n_throttled)
    assert int(jnp.sum(want.stats.n_draft_tokens)) > int(jnp.sum(state.stats.n_draft_tokens))
    same(got, want)


@pytest.mark.parametrize(
    "chain, call", [(("ngram-mod", "draft-simple"), 0.0), (("ngram-simple", "ngram-mod"), 0.04)]
)
def test_generation_loop_with_off_stretches_equals_its_rounds_one_by_one(target, chain, call):
    """`engine.generate_loop` runs the rounds the governor turns off in an inner loop of
    `spec_step(off=True)`, and, for a model-free chain, the 1-token step of a round in which
    the relay found nothing in that same loop (`spec_round`'s pending step); the whole
    generation must leave the state that calling `spec_step` round by round leaves, with
    off rounds, drafting rounds and (model-free) rounds that found nothing all taken."""
    spec = small_ngrams(chain, ngram_mod_n_max=4, draft_n_max=4)
    drafters, dparams = build_drafters(spec, target, noisy_copy(target, 0.3))
    engine = eng.Engine(
        target=target.config, drafters=drafters, k_max=4, capacity=S, out_capacity=OUT
    )
    assert eng.idle_rounds_are_plain(engine)
    assert eng.empty_rounds_are_plain(engine) == ("draft-simple" not in chain)
    tokens, lengths = prompt_arrays()
    on = run_params(adaptive.CostModel.off(), 0.0)
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, on)
    for _ in range(3):  # drafts, partly rejected: the governor learns a low acceptance
        state = eng.step_jit(engine, target.params, dparams, state, on)
    # cheap drafting: the governor drafts where it expects acceptance and turns rounds off
    # elsewhere (and every round in which no row has budget left is off too); the n-gram
    # chain's calls priced so that it also turns rounds off after asking and finding nothing
    # (its lookup index says "could draft" from round ~8, its drafts come from round ~30:
    # priced at 0.1, the backoff left it unasked by then)
    cheap = adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(0.05, jnp.float32),
        draft_step=jnp.asarray(0.0, jnp.float32),
        call=jnp.asarray(call, jnp.float32),
    )
    run = run_params(cheap, 0.0)
    want = _copy(state)
    found_nothing = 0  # rounds in which the relay was called and no row got a draft
    while bool(jnp.any(~want.done)) and int(want.n_rounds) < OUT:
        before = (int(want.stats.n_call_draft[0]), int(want.stats.n_draft_tokens))
        want = eng.step_jit(engine, target.params, dparams, want, run)
        called = int(want.stats.n_call_draft[0]) > before[0]
        found_nothing += called and int(want.stats.n_draft_tokens) == before[1]
    got = eng.generate_loop_jit(engine, target.params, dparams, _copy(state), run)
    n_off = int(want.governor.n_off) - int(state.governor.n_off)
    assert 0 < n_off < int(want.governor.n_rounds) - int(state.governor.n_rounds)
    assert int(want.stats.n_draft_tokens) > int(state.stats.n_draft_tokens)
    assert found_nothing > 0 or not eng.empty_rounds_are_plain(engine)
    assert_same_state(got, want)


def test_lean_step_of_a_model_free_chain_leaves_the_state_spec_step_leaves(target):
    """For an n-gram chain (`empty_rounds_are_plain`), `continuous.lean_step` runs the
    1-token step of a round that drafted nothing once, after its wide and middle-width
    variants (`engine.spec_round`'s pending step). Round by round it must leave the state
    the reference (drafters called every round, every round a full `spec_step`) leaves, with
    rounds that drafted at either width, rounds whose relay found nothing, and off rounds."""
    spec = small_ngrams(("ngram-simple", "ngram-mod"))
    drafters, dparams = build_drafters(spec, target, None)
    out = S - 12  # (longer outputs than the module's: drafting starts late and runs fast)
    engine = eng.Engine(
        target=target.config, drafters=drafters, k_max=2 * cont.MID_K, capacity=S, out_capacity=out
    )
    assert eng.empty_rounds_are_plain(engine)
    reference = eager(engine)
    lean = STEPS[cont.lean_step]

    def long_run(cost: adaptive.CostModel) -> eng.RunParams:
        return replace(run_params(cost, 0.0), max_new=jnp.asarray([out, 3, out], jnp.int32))

    wide, mid, off = adaptive.CostModel.off(), throttles(), never_pays()
    tokens, lengths = prompt_arrays()
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, long_run(wide))
    # (budgets > MID_K take lean_step's wide variant, throttled ones <= MID_K its middle one)
    phases = [("wide", wide, 16), ("mid", mid, 6), ("wide", wide, 6), ("off", off, 3)]
    phases += [("mid", mid, 4), ("wide", wide, 4)]  # (the chain drafts from ~round 30 on)
    drafted = {"wide": 0, "mid": 0}
    found_nothing = {"wide": 0, "mid": 0}
    for name, cost, n_rounds in phases:
        run = long_run(cost)
        want, got = _copy(state), _copy(state)
        n_off = int(want.governor.n_off)
        for _ in range(n_rounds):
            before = (int(want.stats.n_call_draft[0]), int(want.stats.n_draft_tokens))
            want = eng.step_jit(reference, target.params, dparams, want, run)
            got = lean(engine, target.params, dparams, got, run)
            if name != "off":
                called = int(want.stats.n_call_draft[0]) > before[0]
                drafted[name] += int(want.stats.n_draft_tokens) - before[1]
                found_nothing[name] += called and int(want.stats.n_draft_tokens) == before[1]
        assert_same_state(got, want)
        if name == "off":
            assert int(want.governor.n_off) - n_off == n_rounds
        state = want
    assert drafted["mid"] > 0 and drafted["wide"] > 0
    assert found_nothing["mid"] > 0 and found_nothing["wide"] > 0


@pytest.mark.parametrize("kind", ["draft-eagle3", "draft-dflash"])
def test_feature_drafters_record_idle_rounds_and_then_draft_as_if_each_was_processed(target, kind):
    """A stretch of off rounds longer than the log (so `record` applies a full log itself),
    taken as the generation loop takes it (`spec_step(off=True)`), then rounds that draft:
    the state and the drafts must be those of the same rounds with `process` every round."""
    head = eagle3_head(target) if kind == "draft-eagle3" else tiny_block_head(target, block_size=5)
    drafters, dparams = build_drafters(SpecConfig(types=(kind,), draft_n_max=4), target, head)
    (drafter,) = drafters
    log_rows = (eagle3_drafter if kind == "draft-eagle3" else dflash_drafter).LOG_ROWS
    assert drafter.idle_record
    engine = eng.Engine(
        target=target.config, drafters=drafters, k_max=4, capacity=S, out_capacity=64
    )
    reference = eager(engine)
    assert eng.idle_rounds_are_plain(engine) and not eng.idle_rounds_are_plain(reference)
    max_new = [log_rows + 20, 3, log_rows + 20]  # row 1 finishes within the stretch
    off = testing.run_params(max_new, seed=7, cost=never_pays())
    on = testing.run_params(max_new, seed=7, cost=adaptive.CostModel.off())
    tokens, lengths = prompt_arrays()
    state = eng.prefill_jit(engine, target.params, dparams, tokens, lengths, on)
    state = eng.step_jit(engine, target.params, dparams, state, on)  # a boundary to carry

    idle = log_rows + 6
    # EAGLE-3's first round after a drafting one logs nothing: its boundary row is already in
    # the cache (written by `process` with the draft token after it), as upstream's bridge
    first = 1 if kind == "draft-eagle3" else 0
    want, got = _copy(state), _copy(state)
    step_off = STEPS[off_step]
    for i in range(idle):
        want = eng.step_jit(reference, target.params, dparams, want, off)
        got = step_off(engine, target.params, dparams, got, off)
        logged = got.drafter_states[0]
        if i + 1 - first == log_rows:  # the log is full: nothing of the stretch applied yet
            assert int(jnp.max(logged.log_n)) == log_rows
            assert int(jnp.max(logged.cache.pos)) < int(jnp.max(state.length))
    # the full log was applied by the round that found it full (a row that finished logs
    # nothing more); the reference's drafter logged nothing
    assert int(jnp.max(logged.log_n)) == (idle - first - 1) % log_rows + 1 < log_rows
    assert int(jnp.max(logged.cache.pos)) >= int(jnp.max(state.length)) + log_rows - 1
    assert int(jnp.max(want.drafter_states[0].log_n)) == 0
    assert_same_state(settled(engine, dparams, got), want, skip=SNAPSHOT)

    drafted = int(jnp.sum(want.stats.n_draft_tokens))
    for _ in range(3):  # drafting again: `draft` applies the log before it drafts
        want = eng.step_jit(reference, target.params, dparams, want, on)
        got = eng.step_jit(engine, target.params, dparams, got, on)
    assert int(jnp.sum(want.stats.n_draft_tokens)) > drafted
    assert int(want.stats.n_draft_accepted) < int(want.stats.n_draft_tokens)
    assert int(jnp.max(got.drafter_states[0].log_n)) == 0
    assert_same_state(got, want, skip=SNAPSHOT)
    if kind == "draft-eagle3":  # the snapshot of rows still decoding: their last `process`'s
        live = ~np.asarray(want.done)
        assert live.any()
        g, w = meaningful(got).drafter_states[0], meaningful(want).drafter_states[0]
        for name in SNAPSHOT:
            assert np.array_equal(
                np.asarray(getattr(g, name[1:]))[live], np.asarray(getattr(w, name[1:]))[live]
            ), name
