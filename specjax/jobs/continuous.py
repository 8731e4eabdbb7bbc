"""Continuous batching on device: slots that take a new request while the others keep going.

A job holds `B` slots (llama.cpp's `-np`), one `GenState` row each. Three jitted entry
points, all of fixed shapes, so a whole job compiles each once:

    init_slots      every slot idle (done, empty memory, fresh drafter states)
    prefill_chunk   C prompt tokens of ONE slot (traced slot index, start, count, final):
                    the slot's row of the target cache and of every per-row drafter leaf is
                    sliced out, evaluated at batch 1, and written back; the other rows are
                    untouched. The first chunk (start 0) drops the row's memory (llama.cpp's
                    `seq_rm` of the slot); the final chunk samples the first token, runs the
                    drafters' `begin` and makes the row active.
    run_segment     `engine.spec_step` rounds (speculation per row, every drafter) until a
                    busy slot finishes, every row is done, or `max_rounds` rounds ran; the
                    host then collects finished rows and prefills the next requests into them.
                    A round in which the governor lets no row draft is a plain round with
                    no drafter calls when every drafter of the chain declares `idle_noop`
                    or `idle_record` (recorders only log the round: `engine.spec_step`
                    does that), else runs its drafters at width 2, not
                    K + 1 (`lean_step`; the same state as `spec_step`); one whose budgets
                    are all <= MID_K at width MID_K + 1.

Invariants:
* A row being prefilled is `done`, so decode rounds skip it; it becomes active only with
  its final chunk.
* A request's tokens depend only on the request and the model: its prefill runs at batch 1
  in chunks of the static size C at positions 0.., whatever slot it lands in; decode rounds
  compute each row independently of the others (attention and sampling are per row; the RNG
  key of the token at absolute position p is make_key(seed, p, role)); drafts only change
  which tokens are verified, never which are emitted (match verification; rejection
  sampling of probabilistic drafts would break this, so the host refuses it).
* Drafter state leaves are per row when their leading axis follows the batch size
  (`init(2, S)` vs `init(3, S)`), else shared by all slots (ngram-mod's pool): shared leaves
  keep learning across requests, as llama.cpp's server keeps a slot's drafters.
* A drafter with `lazy_prompt` (draft-simple) does not evaluate the prompt at prefill: it
  catches up from the token history the first time the governor lets its row draft, so a
  request the governor never drafts for costs no draft-model forward at all.
* `SlotStats` counts per row, for the request in the slot: verify rounds (target forwards),
  drafted tokens (the draft each round verified; `GenState.drafted` per row) and accepted
  draft tokens (length grows by accepted + 1 per round).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.decode import engine as eng
from specjax.decode import governor as adaptive
from specjax.decode import stats as stats_mod
from specjax.drafters import lookup_index
from specjax.drafters.base import TargetBatch, TokenHistory, hidden_by_layer, per_row_leaves
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array, Params


@pytree_dataclass
class SlotStats:
    rounds: Array  # [B] int32 verify rounds of the row's current request
    accepted: Array  # [B] int32 accepted draft tokens of the row's current request
    drafted: Array  # [B] int32 drafted (and verified) tokens of the row's current request


def _take(tree: Any, flags: list[bool], slot: Array) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    out = [jax.lax.dynamic_slice_in_dim(x, slot, 1, 0) if f else x for x, f in zip(leaves, flags)]
    return jax.tree.unflatten(treedef, out)


def _put(tree: Any, sub: Any, flags: list[bool], slot: Array) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    subs = jax.tree.leaves(sub)
    out = [
        jax.lax.dynamic_update_slice_in_dim(x, y, slot, 0) if f else y
        for x, y, f in zip(leaves, subs, flags)
    ]
    return jax.tree.unflatten(treedef, out)


def _row(x: Array, slot: Array) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, slot, 1, 0)


def _set_row(x: Array, slot: Array, value: Array) -> Array:
    return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), slot, 0)


def init_slots(engine: eng.Engine, batch: int) -> tuple[eng.GenState, SlotStats]:
    """`batch` idle slots: empty memory, done, fresh drafter states."""
    B, S, out_cap = batch, engine.capacity, engine.out_capacity
    zeros = jnp.zeros((B,), jnp.int32)
    state = eng.GenState(
        cache=engine.memory.init(B, S),
        history=jnp.zeros((B, S), jnp.int32),
        length=zeros,
        last_token=zeros,
        out_tokens=jnp.zeros((B, out_cap), jnp.int32),
        out_len=zeros,
        done=jnp.ones((B,), bool),
        finish=zeros,
        drafter_states=tuple(d.init(B, S) for d in engine.drafters),
        impl_last=jnp.full((B,), -1, jnp.int32),
        stats=stats_mod.SpecStats.create(len(engine.drafters), max(engine.k_max, 1)),
        governor=adaptive.Governor.create(B),
        n_rounds=jnp.zeros((), jnp.int32),
        drafted=zeros,
        lookup_seen=None
        if engine.lookup_n is None
        else jnp.zeros(lookup_index.table_shape(B, S, engine.lookup_shared), bool),
        lookup_next=None if engine.lookup_n is None else jnp.zeros((B,), bool),
        replay=eng.Replay.create(B, engine.k_max) if engine.memory.checkpoints else None,
    )
    return state, SlotStats(rounds=zeros, accepted=zeros, drafted=zeros)


def prefill_chunk(
    engine: eng.Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: eng.GenState,
    slot_stats: SlotStats,
    slot: Array,
    tokens_C: Array,
    start: Array,
    n_valid: Array,
    final: Array,
    run: eng.RunParams,
) -> tuple[eng.GenState, SlotStats]:
    """Evaluate prompt tokens `tokens_C[:n_valid]` at positions start.. in slot `slot`.

    `start == 0` begins a new request in the slot (its memory and per-row drafter memory are
    dropped first); `final` marks the prompt's last chunk: the first token is sampled from
    its last logits (key make_key(seed, prompt length, SAMPLE), as `engine.prefill`), the
    drafters' `begin` runs and the row turns active unless that token already ends it.
    """
    (C,) = tokens_C.shape
    S = engine.capacity
    zero_1 = jnp.zeros((1,), jnp.int32)
    slot = slot.astype(jnp.int32)
    start = start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    length = start + n_valid

    # the slot's row of the target memory, minus cells at positions >= start
    memory = engine.memory
    row = memory.drop_from(memory.take_row(state.cache, slot), start[None])
    idx_C = jnp.arange(C, dtype=jnp.int32)
    positions_1C = jnp.where(idx_C < n_valid, start + idx_C, -1)[None, :]
    tokens_1C = tokens_C[None, :].astype(jnp.int32)
    out = memory.forward(
        target_params,
        tokens_1C,
        positions_1C,
        row,
        engine.hidden_layers,
        logit_index=jnp.maximum(n_valid - 1, 0)[None],
    )
    cache = memory.put_row(state.cache, slot, out.memory)

    # the slot's token history: cleared at start 0, the chunk written at its positions
    hist_1S = _row(state.history, slot)
    hist_1S = jnp.where(jnp.arange(S)[None, :] < start, hist_1S, 0)
    hist_1S = hist_1S.at[0, jnp.where(idx_C < n_valid, start + idx_C, S)].set(
        tokens_C.astype(jnp.int32), mode="drop"
    )
    history = _set_row(state.history, slot, hist_1S)
    length_1 = length[None]

    # drafters: rows sliced out (shared leaves whole), memory >= start dropped, chunk processed
    batch_1 = TargetBatch(
        tokens=tokens_1C,
        positions=positions_1C,
        hidden=hidden_by_layer(engine.hidden_layers, out.hidden),
        is_prompt=True,
    )
    hist_1 = TokenHistory(tokens=hist_1S, length=length_1)
    dstates = []
    for d, p, s in zip(engine.drafters, drafter_params, state.drafter_states):
        flags = per_row_leaves(d, S)
        s1 = _take(s, flags, slot)
        s1 = d.rollback(s1, start[None])
        if not d.lazy_prompt:  # else the drafter catches up when it drafts
            s1 = d.process(p, s1, batch_1)
        # `begin` only with the final chunk (a cond: ngram-mod's ingestion is not cheap)
        s1 = jax.lax.cond(final, lambda s, d=d: d.begin(s, hist_1), lambda s: s, s1)
        dstates.append(_put(s, s1, flags, slot))

    # the first generated token (used only when `final`)
    samp_1 = jax.tree.map(lambda x: _row(x, slot), run.sampling)
    logits_1V = out.logits[:, 0]
    window = eng._history_window(hist_1S, length_1, engine.penalty_window)
    logits_1V = jax.vmap(sampling.apply_penalties)(
        logits_1V, window, window >= 0, samp_1.repeat_penalty
    )
    keys = sampling.make_keys(samp_1.seed, length_1, sampling.ROLE_SAMPLE)
    first = sampling.sample(logits_1V, samp_1, keys).astype(jnp.int32)[0]
    max_new = run.max_new[slot]
    is_eog = eng._is_eog(engine, first)
    full = length >= S - 1
    finished = is_eog | (max_new <= 1) | full
    finish = jnp.where(
        is_eog,
        eng.FINISH_EOG,
        jnp.where(max_new <= 1, eng.FINISH_LENGTH, jnp.where(full, eng.FINISH_CONTEXT, 0)),
    )

    def pick(new: Array | int | bool, old: Array | int | bool) -> Array:
        return jnp.where(final, new, old)

    out_cap = engine.out_capacity
    out_row = jnp.zeros((1, out_cap), jnp.int32).at[0, 0].set(first)
    gov = state.governor
    fresh = adaptive.Governor.create(1)
    governor = replace(
        gov,
        hit_num=_set_row(gov.hit_num, slot, fresh.hit_num),
        hit_den=_set_row(gov.hit_den, slot, fresh.hit_den),
        acc_num=_set_row(gov.acc_num, slot, fresh.acc_num),
        acc_den=_set_row(gov.acc_den, slot, fresh.acc_den),
        idle=_set_row(gov.idle, slot, fresh.idle),
        miss_streak=_set_row(gov.miss_streak, slot, fresh.miss_streak),
        reach=_set_row(gov.reach, slot, fresh.reach),
    )
    new_state = replace(
        state,
        cache=cache,
        history=history,
        length=_set_row(state.length, slot, length_1),
        last_token=_set_row(state.last_token, slot, pick(first, state.last_token[slot])[None]),
        out_tokens=_set_row(
            state.out_tokens, slot, jnp.where(final, out_row, _row(state.out_tokens, slot))
        ),
        out_len=_set_row(state.out_len, slot, pick(1, 0)[None]),
        done=_set_row(state.done, slot, pick(finished, True)[None]),
        finish=_set_row(state.finish, slot, pick(finish, 0)[None]),
        drafter_states=tuple(dstates),
        impl_last=_set_row(state.impl_last, slot, jnp.full((1,), -1, jnp.int32)),
        stats=stats_mod.record_begin(state.stats, final[None]) if engine.drafters else state.stats,
        governor=governor,
        **_index_chunk(engine, state, hist_1S, slot, start, n_valid, first, C),
        replay=None
        if state.replay is None  # (a new request replays nothing)
        else replace(state.replay, length=_set_row(state.replay.length, slot, zero_1)),
    )
    zero = jnp.zeros((1,), jnp.int32)
    slot_stats = SlotStats(
        rounds=_set_row(slot_stats.rounds, slot, zero),
        accepted=_set_row(slot_stats.accepted, slot, zero),
        drafted=_set_row(slot_stats.drafted, slot, zero),
    )
    return new_state, slot_stats


def _index_chunk(
    engine: eng.Engine,
    state: eng.GenState,
    hist_1S: Array,
    slot: Array,
    start: Array,
    n_valid: Array,
    first_token: Array,
    width: int,
) -> dict[str, Array]:
    """The lookup index (`specjax.drafters.lookup_index`) after a prompt chunk of slot `slot`: the
    n-grams ending at the chunk's positions, less the chain's gap, added to the slot's row
    (cleared first when the chunk begins a request), or to the one shared table, which keeps
    every request's; and the slot's `lookup_next` (read when the chunk is the final one)."""
    n, table = engine.lookup_n, state.lookup_seen
    if table is None or n is None or state.lookup_next is None:
        return {}
    first = (start - engine.lookup_gap)[None]
    length_1 = (start + n_valid)[None]
    if engine.lookup_shared:
        table = lookup_index.insert(table, hist_1S, first, n_valid[None], n, width)
        row = table
    else:
        row = _row(table, slot) & (start > 0)
        row = lookup_index.insert(row, hist_1S, first, n_valid[None], n, width)
        table = _set_row(table, slot, row)
    could = lookup_index.query(row, hist_1S, length_1, first_token[None], n)
    return dict(lookup_seen=table, lookup_next=_set_row(state.lookup_next, slot, could))


#: Draft width of the middle path of `lean_step`: rounds whose budgets are all <= MID_K (the
#: governor throttled them, or rows near their end) run at width MID_K + 1, not K + 1.
MID_K = 4


def lean_step(
    engine: eng.Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: eng.GenState,
    run: eng.RunParams,
) -> eng.GenState:
    """`engine.spec_step`, with narrower drafter calls in rounds the governor restricts.

    The budget (and the governor's choice) is planned first. When every row's budget is 0
    and the chain is not one `spec_step` skips by itself in such rounds (a drafter with
    neither `idle_noop` nor `idle_record`, e.g. draft-mtp, whose `process` runs its block over
    every verify batch), the
    round runs with `k_max = 1`: the same drafter calls (none drafts), the same feedback and
    statistics, over a verify batch of width 2 instead of K + 1. A round whose budgets are
    all <= MID_K (the governor throttled it) runs at K' = MID_K. Same state out, bit for bit
    (tests/test_batch_lean.py).
    """
    plan = eng.draft_budget(engine, state, run)
    if not engine.drafters or engine.k_max <= 1:
        return eng.spec_step(engine, target_params, drafter_params, state, run, plan)
    # (the narrower variants keep the engine's reach caps: the same governor updates)
    narrow = dataclasses.replace(engine, k_max=1, reach_caps=engine.draft_caps())

    def wide(s: eng.GenState) -> eng.GenState:
        return eng.spec_step(engine, target_params, drafter_params, s, run, plan)

    # spec_step runs a round nobody may draft in as a plain round for such chains
    idle = eng.idle_rounds_are_plain(engine)

    def lean(s: eng.GenState) -> eng.GenState:
        return eng.spec_step(narrow, target_params, drafter_params, s, run, plan)

    # Loops run 0 or 1 times, not lax.cond: a cond's branches would copy the KV caches and
    # ngram-mod's pool every round instead of updating them in place.
    once = eng.run_once

    need = jnp.max(plan[0])
    drafting = need > 0
    if engine.k_max <= MID_K:
        return wide(state) if idle else once(~drafting, lean, once(drafting, wide, state))
    medium = dataclasses.replace(engine, k_max=MID_K, reach_caps=engine.draft_caps())

    def mid(s: eng.GenState) -> eng.GenState:
        return eng.spec_step(medium, target_params, drafter_params, s, run, plan)

    short = need <= MID_K
    if idle and eng.empty_rounds_are_plain(engine):
        # A round in which nothing was drafted (none asked, or the relay found nothing) takes
        # its 1-token step after both width variants: one copy of it in the program
        # (`engine.spec_round`), warm in the caches when a rare asked round needs it.
        def round_at(e: eng.Engine) -> Callable[[Any], Any]:
            def at(c: tuple[eng.GenState, Array]) -> tuple[eng.GenState, Array]:
                s, pending = eng.spec_round(
                    e, target_params, drafter_params, c[0], run, plan, False
                )
                assert pending is not None  # (an empty_rounds_are_plain chain)
                return s, pending

            return at

        c = (state, jnp.zeros((), bool))
        c = once(drafting & short, round_at(medium), once(~(drafting & short), round_at(engine), c))

        def pending_step(s: eng.GenState) -> eng.GenState:
            return eng.pending_step(engine, target_params, drafter_params, s, run)

        return once(c[1], pending_step, c[0])
    if idle:
        return once(drafting & short, mid, once(~(drafting & short), wide, state))
    state = once(drafting & ~short, wide, state)
    state = once(drafting & short, mid, state)
    return once(~drafting, lean, state)


def run_segment(
    engine: eng.Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: eng.GenState,
    slot_stats: SlotStats,
    run: eng.RunParams,
    busy_B: Array,
    max_rounds: Array,
) -> tuple[eng.GenState, SlotStats, Array]:
    """Speculative rounds until a busy slot is done, all rows are done, or `max_rounds` ran.

    `busy_B [B]`: slots whose request the host has not collected yet; the loop returns at
    once when one of them is done (e.g. finished by its first token). Returns the state, the
    per-slot counters and the number of rounds run.
    """

    def cond(carry: tuple[eng.GenState, SlotStats, Array]) -> Array:
        s, _, i = carry
        return jnp.any(~s.done) & (i < max_rounds) & ~jnp.any(s.done & busy_B)

    def body(carry: tuple[eng.GenState, SlotStats, Array]) -> tuple[eng.GenState, SlotStats, Array]:
        s, st, i = carry
        active = ~s.done
        new = lean_step(engine, target_params, drafter_params, s, run)
        acc = jnp.where(active, new.length - s.length - 1, 0)
        assert new.drafted is not None and s.drafted is not None
        st = SlotStats(
            rounds=st.rounds + active.astype(jnp.int32),
            accepted=st.accepted + acc,
            drafted=st.drafted + new.drafted - s.drafted,
        )
        return new, st, i + 1

    return jax.lax.while_loop(cond, body, (state, slot_stats, jnp.zeros((), jnp.int32)))


init_slots_jit = jax.jit(init_slots, static_argnames=("engine", "batch"))
prefill_chunk_jit = jax.jit(
    prefill_chunk, static_argnames=("engine",), donate_argnames=("state", "slot_stats")
)
run_segment_jit = jax.jit(
    run_segment, static_argnames=("engine",), donate_argnames=("state", "slot_stats")
)


def run_rounds(
    engine: eng.Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: eng.GenState,
    run: eng.RunParams,
    n_rounds: Array,
) -> eng.GenState:
    """`engine.generate_loop` in segments: its rounds until about `n_rounds` more have run
    (or every row is done, or `max_rounds`), so the host can read the state (streaming)
    or stop (an interrupt) between calls. Calls one after another give the same state as
    one `generate_loop` call: the same tokens, statistics and governor counters.

    How: the loop stops where `GenState.n_rounds` reaches `engine.max_rounds`, a count it
    only compares, so the segment lends it an offset that makes the segment's stop read as
    that limit (and takes it back after). A governed loop (`idle_rounds_are_plain` chains)
    leaves its state planned for the next round (`draft_budget`: the governor's round
    counters already count it) and plans again as it starts; a segment after the first
    takes that round's counts back before it starts, so the round is counted once. Inside
    an off-rounds stretch a segment's stop ends the stretch early, as a finishing row does
    in one call: the rounds after it are planned one by one, with the same choices (the
    stretch is only those the governor's choice stays 0 in). A pending 1-token step still
    runs, so a segment may run one round past `n_rounds`.
    """
    limit = jnp.asarray(engine.max_rounds, jnp.int32)
    stop = jnp.minimum(limit, state.n_rounds + jnp.maximum(n_rounds, 1))
    offset = limit - stop
    governor = state.governor
    if engine.drafters and eng.idle_rounds_are_plain(engine):
        # a state that a segment left is planned for its next round: take the plan's counts back
        _, again = eng.draft_budget(engine, state, run)
        planned = state.n_rounds > 0
        governor = replace(
            governor,
            n_rounds=governor.n_rounds - jnp.where(planned, again.n_rounds - governor.n_rounds, 0),
            n_throttled=governor.n_throttled
            - jnp.where(planned, again.n_throttled - governor.n_throttled, 0),
            n_off=governor.n_off - jnp.where(planned, again.n_off - governor.n_off, 0),
        )
    shifted = replace(state, n_rounds=state.n_rounds + offset, governor=governor)
    out = eng.generate_loop(engine, target_params, drafter_params, shifted, run)
    return replace(out, n_rounds=out.n_rounds - offset)


run_rounds_jit = jax.jit(run_rounds, static_argnames=("engine",), donate_argnames=("state",))
