"""The speculative engine: prefill, one speculative step, and the on-device generation loop.

One engine for every target: what differs between targets is their memory, reached only
through `Engine.memory` (`specjax.memory.target`: an attention-only model's KV cache, PART;
with sliding-window layers, their cells in a ring, PART; a qwen35 hybrid's KV cache +
recurrent state, RS or FULL). Plain decoding, speculative
decoding, streaming, continuous batching (`specjax.jobs.continuous`) and batch jobs all run this
prefill and this round.

One round, for every row b at once (llama.cpp's server flow, sections 4 and 7 of the spec):

    history[b, :length[b]]   tokens in target memory (positions 0..length-1)
    last_token[b]            id_last: sampled, emitted, NOT yet in memory (position length)

    1 budget   n_draft_max = min(S - length - 2, remaining - 1), clipped to [0, K] (each
               drafter stops at its own n_max); the draft governor (specjax.decode.governor) may
               shorten it, or set it to 0, when drafting does not pay under its cost model,
               and sets it to 0 for a row a chain of lookup drafters cannot draft for
               (`specjax.drafters.lookup_index`: the n-gram ending at id_last never occurred before)
    2 relay    drafters in llama.cpp's fixed priority; the first with a draft wins the row.
               A chain whose drafters all declare `idle_noop` or `idle_record` is not asked
               in a round in which no row may draft (the governor turned it off); of its
               calls only the recorders' `record` runs in such a round (step 6)
    3 verify   target forward on [id_last, d_1..d_K] at positions length + 0..K; invalid
               slots are padding (-1). Width is bucketed (`Engine.verify_widths`, one loop
               run 0 or 1 times per width, holding that width's forward, acceptance and cache
               write), so a round without drafts costs a 1-token forward and nothing wider.
               For a chain whose drafters all declare `quiet_without_draft` (model-free), a
               round whose relay found no draft for any row is finished as an off round
               (1-token verify, no K-wide arrays; of step 6 only the relay's statistics and
               the governor's estimates move), and a round with drafts never compiles the
               width-1 verify
    4 accept   per row: synthetic -> replay -> rejection (temp > 0, q present) -> match;
               a replay row (below) accepts its replayed tokens untested
    5 commit   the memory keeps positions < length + n_acc + 1 (`TargetMemory.settle`:
               seq_rm on a KV cache, an RS plane, or, for a hybrid row whose draft was
               longer than its planes, the pre-round checkpoint restored: that row commits
               nothing and its accepted tokens [d_1..d_nacc, c] are its next round's draft,
               the replay, for which it does not draft); seq_rm on drafter memory, emit
               d_1..d_nacc + next token, stop at EOG / n_predict / context end (the last
               emitted token sits at position S - 1, as in llama.cpp)
    6 feedback drafter.process(verify batch), accept(n_acc, is_other), rollback (a
               restored row's drafter checkpoint data set back, no accept), statistics
               and the governor's estimates; in a round no row may draft, for
               an idle chain only `record(verify batch)` of the drafters that declare
               `idle_record` (they apply it at their next process or draft)

Plain decoding is the same step with no drafters (K = 0): one compiled code path, so
"speculative greedy == plain greedy" compares like with like. Everything above runs inside
one jitted `lax.while_loop`; the host only sees the final state.

RNG: the token emitted at absolute position p is drawn with make_key(seed, p, role), so a
row gives the same output alone or in a batch, and replays are exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.control import put_prefix, run_once
from specjax.decode import governor as adaptive
from specjax.decode import stats as stats_mod
from specjax.decode import verify
from specjax.drafters import lookup_index
from specjax.drafters.base import (
    DraftInput,
    DraftOutput,
    TargetBatch,
    TokenHistory,
    hidden_by_layer,
    load_spec_state,
    take_spec_state,
)
from specjax.memory.target import (
    H_NEXTN,
    HybridTargetMemory,
    KVTargetMemory,
    SWATargetMemory,
    TargetMemory,
    uses_swa_cache,
)
from specjax.models.config import ModelConfig
from specjax.models.qwen35 import Qwen35Config
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array, Params

FINISH_NONE, FINISH_EOG, FINISH_LENGTH, FINISH_CONTEXT = 0, 1, 2, 3
FINISH_NAMES = {
    FINISH_NONE: "none",
    FINISH_EOG: "stop",
    FINISH_LENGTH: "length",
    FINISH_CONTEXT: "context",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Engine:
    """Everything static about a generation run (a jit static argument: hashable)."""

    #: The target model's config: a llama-family `ModelConfig` (attention-only memory) or a
    #: `Qwen35Config` (hybrid recurrent memory); `memory` is the interface the round uses.
    target: ModelConfig | Qwen35Config
    drafters: tuple[Any, ...] = ()  # in relay priority order
    k_max: int = 0
    capacity: int  # S: cache cells per row
    out_capacity: int  # O: output buffer per row
    eog_ids: tuple[int, ...] = ()
    penalty_window: int = 64
    synthetic: bool = False
    #: KV cache dtypes of the target (llama.cpp's `-ctk` / `-ctv`); None = the model's dtype.
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    #: Prefill chunk (llama.cpp's `n_ubatch`, `-ub`): the prompt is evaluated in chunks of
    #: this many tokens and every chunk is handed to the drafters' `process` (EAGLE-3's
    #: cross-ubatch bridge); 0 = the whole prompt in one forward.
    n_ubatch: int = 0
    #: The caps of `draft_caps` when given (None: from this engine's widths and drafters).
    reach_caps: tuple[int, ...] | None = None
    #: Recurrent snapshot planes of a hybrid target (llama.cpp's n_rs_seq): > 0 is the RS
    #: rollback level, 0 FULL. Unused by attention-only targets.
    n_rs_seq: int = 0
    #: llama.cpp's `--swa-full`: a gemma3 target keeps every cell of its sliding-window layers
    #: (False: those layers keep a ring of window + k_max cells, `SWATargetMemory`).
    swa_full: bool = False

    @property
    def memory(self) -> TargetMemory:
        """The target's memory: what differs between targets (`specjax.memory.target`)."""
        if isinstance(self.target, Qwen35Config):
            return HybridTargetMemory(self.target, self.n_rs_seq, self.cache_type_k)
        if uses_swa_cache(self.target) and not self.swa_full:
            return SWATargetMemory(
                self.target, self.k_max + 1, self.cache_type_k, self.cache_type_v
            )
        return KVTargetMemory(self.target, self.cache_type_k, self.cache_type_v)

    @property
    def max_rounds(self) -> int:
        """Rounds the loop runs at most: one token emitted each, or, for a memory that may
        restore a checkpoint, one round more per replay."""
        return self.out_capacity * (2 if self.memory.checkpoints else 1)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's hidden states the chain reads (layer ids; `H_NEXTN`: a qwen35
        target's h_nextn, for drafters that declare `reads_nextn`)."""
        layers: set[int] = set()
        for d in self.drafters:
            layers.update(d.hidden_layers)
            if d.reads_nextn:
                layers.add(H_NEXTN)
        return tuple(sorted(layers))

    @property
    def probabilistic(self) -> bool:
        return any(d.probabilistic for d in self.drafters)

    @property
    def lookup_n(self) -> int | None:
        """n of the chain's lookup index (`specjax.drafters.lookup_index`); None: no index."""
        return lookup_index.lookup_n(self.drafters)

    @property
    def lookup_gap(self) -> int:
        """g of the chain's lookup index (`specjax.drafters.lookup_index`)."""
        return lookup_index.lookup_gap(self.drafters)

    @property
    def lookup_shared(self) -> bool:
        """Whether the lookup index is one table for all rows (`lookup_index.shares_memory`)."""
        return lookup_index.shares_memory(self.drafters, self.capacity)

    def draft_caps(self) -> tuple[int, ...]:
        """The longest drafts a row's reach steps through (`adaptive.observe`): each verify
        width but 1, less the draft's first token (caps 4, 16, 64 at K = 64), without the caps
        shorter than every drafter of the chain drafts when it drafts at all
        (`min_draft_len`: ngram-mod's n_min; 1 for the others), which would only cut such
        drafts short. `reach_caps` set: those (a narrower variant of an engine keeps the
        engine's, `continuous.lean_step`)."""
        if self.reach_caps is not None:
            return self.reach_caps
        caps = tuple(w - 1 for w in self.verify_widths() if w > 1) or (0,)
        shortest = min((d.min_draft_len for d in self.drafters), default=1)
        return tuple(c for c in caps if c >= shortest) or caps[-1:]

    def verify_widths(self) -> tuple[int, ...]:
        """Verify-batch widths, each compiled once (1 = no draft in any row)."""
        widths = {1, self.k_max + 1}
        j = 4
        while j < self.k_max:
            widths.add(j + 1)
            j *= 4
        return tuple(sorted(widths))


@pytree_dataclass
class RunParams:
    """Per-call values: traced, so changing them never recompiles."""

    sampling: sampling.SamplingParams  # fields [B]
    max_new: Array  # [B] int32, n_predict
    n_max: Array  # [] int32, draft-model n_max (`--spec-draft-n-max`)
    n_min: Array  # [] int32
    p_min: Array  # [] float32
    synth_rates: Array  # [max(K,1)] float32 conditional acceptance rates (synthetic only)
    cost: adaptive.CostModel  # the draft governor's cost model (specjax.decode.governor)
    #: [] int32, the longest draft the chain can produce (`common_speculative_n_max`)
    chain_n_max: Array = dataclasses.field(default_factory=lambda: jnp.asarray(1 << 30))


@pytree_dataclass
class Replay:
    """Rows whose last round restored the checkpoint (`TargetMemory.checkpoints`): the
    accepted tokens [d_1..d_n, c] they replay as the next round's draft, accepted untested
    (llama.cpp's `server_accept_replay`)."""

    tokens: Array  # [B, K] int32
    length: Array  # [B] int32, 0 = nothing to replay
    winner: Array  # [B] int32, the drafter whose draft is replayed

    @staticmethod
    def create(batch: int, k: int) -> Replay:
        return Replay(
            tokens=jnp.zeros((batch, k), jnp.int32),
            length=jnp.zeros((batch,), jnp.int32),
            winner=jnp.full((batch,), -1, jnp.int32),
        )


@pytree_dataclass
class GenState:
    #: The target's memory (`Engine.memory`): a `KVCache`, a `SWACache`, or a qwen35
    #: `HybridMemory`.
    cache: Any
    history: Array  # [B, S] int32
    length: Array  # [B] int32
    last_token: Array  # [B] int32
    out_tokens: Array  # [B, O] int32
    out_len: Array  # [B] int32
    done: Array  # [B] bool
    finish: Array  # [B] int32
    drafter_states: tuple[Any, ...]
    impl_last: Array  # [B] int32, -1 = none
    stats: stats_mod.SpecStats
    governor: adaptive.Governor
    n_rounds: Array  # [] int32
    #: [B] int32 drafted tokens verified per row since the row's counter was reset, or None
    #: (not kept): continuous batching's per-request statistics (specjax.jobs.continuous)
    drafted: Array | None = None
    #: [G, M] bool, the n-grams the rows' streams hold (`specjax.drafters.lookup_index`), or None: the
    #: chain has no lookup index (`Engine.lookup_n`)
    lookup_seen: Array | None = None
    #: [B] bool, rows some drafter of the chain may find a draft for this round (the index
    #: read for the n-gram ending at last_token; False is exact): kept by whatever moves
    #: history or last_token. None with lookup_seen
    lookup_next: Array | None = None
    #: Rows to replay after a checkpoint restore; None: the memory never restores one
    replay: Replay | None = None


# ----------------------------------------------------------------------------------------
# prefill


def prefill(
    engine: Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    tokens_BT: Array,
    lengths_B: Array,
    run: RunParams,
    states: tuple[Any, ...] | None = None,
    start: tuple[Any, Array] | None = None,
    spare: tuple[Any, ...] | None = None,
    lookup_seen: Array | None = None,
) -> GenState:
    """Evaluate the prompts, sample the first token, prime the drafters.

    `states`: drafter states carried over from an earlier call with the same B and S (a
    server slot's drafter memory across requests, e.g. ngram-mod's pool; donated by
    `prefill_jit`); None = fresh `init(B, S)`. Carried states first drop every memory cell
    (`rollback` to 0: a new request, as the server's `seq_rm` of the slot); then `process`
    and `begin` run as for fresh states, so a drafter's `begin` decides what else a new
    request resets.

    `start`: (cache, n_cached [B]) from restored slots (`specjax.jobs.slots`): the cache already
    holds each row's positions 0..n_cached-1, only the rest of the prompt is evaluated (not
    chunked; drafters see the whole prompt, without hidden states).

    `spare` (with `states` None): the final drafter states of an earlier call with the same
    chain, B and S, donated; the drafters start from `renewed` ones: fresh states, as
    `init(B, S)` makes, in the spare's buffers where a drafter can (ngram-mod's pool: no
    32 MB allocated and filled per call).

    `lookup_seen` (with carried `states`): the lookup table (`GenState.lookup_seen`) the call that
    left them ended with, donated: the n-grams their shared memory may hold, to which the
    prompts' are added (None: unknown, every row stays askable; `prompt_lookup_index`).
    """
    B, T = tokens_BT.shape
    S, out_cap = engine.capacity, engine.out_capacity
    positions_BT = jnp.where(
        jnp.arange(T)[None, :] < lengths_B[:, None], jnp.arange(T)[None, :], -1
    )
    memory = engine.memory
    cache = memory.init(B, S)
    last_idx = jnp.maximum(lengths_B - 1, 0)
    carried = states is not None
    if states is None and spare is not None:
        states = renewed(engine, spare, B)
    elif states is None:
        states = tuple(d.init(B, S) for d in engine.drafters)
    else:
        no_cells = jnp.zeros((B,), jnp.int32)
        states = tuple(d.rollback(s, no_cells) for d, s in zip(engine.drafters, states))
    chunked = 0 < engine.n_ubatch < T and start is None
    hidden: tuple[Array, ...] = ()
    if start is not None:  # restored slots: evaluate the prompt after the cached prefix
        cache, n_cached = start
        s_tokens, s_pos, s_last = suffix(tokens_BT, lengths_B, n_cached)
        out = memory.forward(target_params, s_tokens, s_pos, cache, logit_index=s_last)
        cache, logits_BV = out.memory, out.logits[:, 0]
    elif chunked:
        cache, logits_BV, states = _prefill_chunked(
            engine, target_params, drafter_params, tokens_BT, positions_BT, lengths_B, cache, states
        )
    else:
        out = memory.forward(
            target_params,
            tokens_BT,
            positions_BT,
            cache,
            engine.hidden_layers,
            fresh=True,
            logit_index=last_idx,
        )
        cache, logits_BV, hidden = out.memory, out.logits[:, 0], out.hidden
    history = jnp.zeros((B, S), jnp.int32).at[:, :T].set(jnp.where(positions_BT >= 0, tokens_BT, 0))
    window = _history_window(history, lengths_B, engine.penalty_window)
    logits_BV = jax.vmap(sampling.apply_penalties)(
        logits_BV, window, window >= 0, run.sampling.repeat_penalty
    )
    keys = jax.vmap(sampling.make_key, in_axes=(0, 0, None))(
        run.sampling.seed, lengths_B, sampling.ROLE_SAMPLE
    )
    first = sampling.sample(logits_BV, run.sampling, keys)

    if not chunked:
        batch = TargetBatch(
            tokens=tokens_BT,
            positions=positions_BT,
            hidden=hidden_by_layer(engine.hidden_layers, hidden) if start is None else {},
            is_prompt=True,
        )
        states = tuple(
            d.process(p, s, batch) for d, p, s in zip(engine.drafters, drafter_params, states)
        )
    hist = TokenHistory(tokens=history, length=lengths_B)
    states = tuple(d.begin(s, hist) for d, s in zip(engine.drafters, states))
    out_tokens = jnp.zeros((B, out_cap), jnp.int32).at[:, 0].set(first)
    is_eog = _is_eog(engine, first)
    # llama.cpp stops when the context is full: the last token it emits sits at position S-1
    full = lengths_B >= S - 1
    done = is_eog | (run.max_new <= 1) | full
    finish = jnp.where(
        is_eog,
        FINISH_EOG,
        jnp.where(run.max_new <= 1, FINISH_LENGTH, jnp.where(full, FINISH_CONTEXT, FINISH_NONE)),
    )
    stats = stats_mod.SpecStats.create(len(engine.drafters), max(engine.k_max, 1))
    stats = stats_mod.record_begin(stats, jnp.ones((B,), bool))
    seen = prompt_lookup_index(engine, history, lengths_B, carried, lookup_seen)
    return GenState(
        cache=cache,
        history=history,
        length=lengths_B.astype(jnp.int32),
        last_token=first.astype(jnp.int32),
        out_tokens=out_tokens,
        out_len=jnp.ones((B,), jnp.int32),
        done=done,
        finish=finish.astype(jnp.int32),
        drafter_states=states,
        impl_last=jnp.full((B,), -1, jnp.int32),
        stats=stats,
        governor=adaptive.Governor.create(B),
        n_rounds=jnp.zeros((), jnp.int32),
        lookup_seen=seen,
        lookup_next=None
        if seen is None or engine.lookup_n is None
        else lookup_index.query(seen, history, lengths_B, first, engine.lookup_n),
        replay=Replay.create(B, engine.k_max) if memory.checkpoints else None,
    )


def suffix(tokens_BT: Array, lengths_B: Array, n_cached_B: Array) -> tuple[Array, Array, Array]:
    """The tokens a restored prefill still evaluates, shifted to the left: (tokens [B, T],
    positions [B, T] (-1 = padding), index of each row's last prompt token in them [B])."""
    T = tokens_BT.shape[1]
    idx = n_cached_B[:, None] + jnp.arange(T)[None]
    toks = jnp.take_along_axis(tokens_BT, jnp.clip(idx, 0, T - 1), axis=1)
    pos = jnp.where(idx < lengths_B[:, None], idx, -1)
    return jnp.where(pos >= 0, toks, 0), pos, lengths_B - n_cached_B - 1


def init_states(engine: Engine, lengths_B: Array) -> tuple[Any, ...]:
    """Fresh drafter states for the rows of `lengths_B` (its shape gives B): a first `spare`
    for `prefill` (`specjax.api`'s recycled states)."""
    return tuple(d.init(lengths_B.shape[0], engine.capacity) for d in engine.drafters)


def renewed(engine: Engine, spare: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    """Fresh drafter states (what `init(batch, S)` gives) from states of those shapes: a
    drafter with `renew(state)` makes them in the old state's buffers, the others anew."""
    return tuple(
        d.renew(s) if d.can_renew else d.init(batch, engine.capacity)
        for d, s in zip(engine.drafters, spare, strict=True)
    )


def prompt_lookup_index(
    engine: Engine,
    history_BS: Array,
    lengths_B: Array,
    carried: bool = False,
    seen: Array | None = None,
) -> Array | None:
    """The lookup index (`specjax.drafters.lookup_index`) of rows starting on these prompts, or None
    (the chain has none). `carried` (static): the drafter states come from an earlier call;
    memory they share across requests may hold any n-gram, so a shared table starts full,
    or from `seen`, the table that call ended with (its n-grams and the prompts')."""
    n = engine.lookup_n
    if n is None:
        return None
    shared = engine.lookup_shared
    shape = lookup_index.table_shape(history_BS.shape[0], engine.capacity, shared)
    if carried and shared and seen is None:
        return jnp.ones(shape, bool)
    table = seen if carried and shared else None
    return lookup_index.build(history_BS, lengths_B, n, shape, engine.lookup_gap, table)


def _prefill_chunked(
    engine: Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    tokens_BT: Array,
    positions_BT: Array,
    lengths_B: Array,
    cache: Any,
    states: tuple[Any, ...],
) -> tuple[Any, Array, tuple[Any, ...]]:
    """The prompt in chunks of `engine.n_ubatch` tokens (a scan): each chunk's forward reads
    the cache the earlier chunks wrote, and each chunk is `process`ed by every drafter, as
    llama.cpp's server processes a prompt batch by batch. Returns the cache, the logits of
    every row's last prompt token [B, V] and the processed drafter states."""
    B, T = tokens_BT.shape
    U = engine.n_ubatch
    n = -(-T // U)
    pad = n * U - T
    tok_nBU = jnp.pad(tokens_BT, ((0, 0), (0, pad))).reshape(B, n, U).transpose(1, 0, 2)
    pos_nBU = jnp.pad(positions_BT, ((0, 0), (0, pad)), constant_values=-1)
    pos_nBU = pos_nBU.reshape(B, n, U).transpose(1, 0, 2)
    last = jnp.maximum(lengths_B - 1, 0)

    def body(carry, xs):
        cache, logits_BV, states = carry
        c, tok_BU, pos_BU = xs
        idx = jnp.clip(last - c * U, 0, U - 1)
        out = engine.memory.forward(
            target_params, tok_BU, pos_BU, cache, engine.hidden_layers, logit_index=idx
        )
        cache = out.memory
        here = (last >= c * U) & (last < (c + 1) * U)
        logits_BV = jnp.where(here[:, None], out.logits[:, 0], logits_BV)
        batch = TargetBatch(
            tokens=tok_BU,
            positions=pos_BU,
            hidden=hidden_by_layer(engine.hidden_layers, out.hidden),
            is_prompt=True,
        )
        states = tuple(
            d.process(p, s, batch) for d, p, s in zip(engine.drafters, drafter_params, states)
        )
        return (cache, logits_BV, states), None

    logits0 = jnp.zeros((B, engine.target.V), jnp.float32)
    (cache, logits_BV, states), _ = jax.lax.scan(
        body, (cache, logits0, states), (jnp.arange(n, dtype=jnp.int32), tok_nBU, pos_nBU)
    )
    return cache, logits_BV, states


# ----------------------------------------------------------------------------------------
# one speculative step


def _is_eog(engine: Engine, tokens: Array) -> Array:
    if not engine.eog_ids:
        return jnp.zeros(tokens.shape, bool)
    ids = jnp.asarray(engine.eog_ids, jnp.int32).reshape((1,) * tokens.ndim + (-1,))
    return jnp.any(tokens[..., None] == ids, axis=-1)


def _history_window(history: Array, end_B: Array, width: int) -> Array:
    """Tokens at positions end-W..end-1 of each row ([B, W], -1 where the position is < 0)."""
    idx_BW = end_B[:, None] - width + jnp.arange(width)[None, :]
    return jnp.where(idx_BW >= 0, jnp.take_along_axis(history, jnp.maximum(idx_BW, 0), axis=1), -1)


def _recent_tokens(engine: Engine, history: Array, length_B: Array, last_B: Array) -> Array:
    """The sampler's ring of recent accepted tokens, ending with id_last ([B, W], -1 = empty)."""
    past = _history_window(history, length_B, engine.penalty_window - 1)
    return jnp.concatenate([past, last_B[:, None]], axis=1)


def _eog_mask(engine: Engine) -> Array:
    mask = jnp.zeros((engine.target.V,), bool)
    if engine.eog_ids:
        mask = mask.at[jnp.asarray(engine.eog_ids, jnp.int32)].set(True)
    return mask


def _no_draft(engine: Engine, B: int, K: int | None = None) -> tuple[Any, ...]:
    """The relay's result when no drafter wins a row: (tokens, valid, q, has_q, winner), with
    K draft columns (default `engine.k_max`)."""
    K = engine.k_max if K is None else K
    return (
        jnp.zeros((B, K), jnp.int32),
        jnp.zeros((B, K), bool),
        jnp.zeros((B, K, engine.target.V), jnp.float32) if engine.probabilistic else None,
        jnp.zeros((B,), bool),
        jnp.full((B,), -1, jnp.int32),
    )


def _relay(engine: Engine, drafter_params, state: GenState, budget_B: Array, run: RunParams):
    """llama.cpp's `common_speculative_draft`: fixed priority, first non-empty draft wins."""
    B, K = state.length.shape[0], engine.k_max
    hist = TokenHistory(tokens=state.history, length=state.length)
    tokens, valid, q, has_q, winner = _no_draft(engine, B)
    remaining = budget_B > 0
    new_states = []
    for i, (d, p, s) in enumerate(zip(engine.drafters, drafter_params, state.drafter_states)):
        inp = DraftInput(
            history=hist,
            last_token=state.last_token,
            n_max=budget_B,
            drafting=remaining,
            n_min=run.n_min,
            p_min=run.p_min,
            temperature=run.sampling.temperature,
            seed=run.sampling.seed,
            draft_n_max=run.n_max,
        )
        s, out = d.draft(p, s, inp, K)
        won = remaining & out.valid[:, 0]
        truncated = out.valid & (jnp.arange(K)[None, :] < budget_B[:, None])
        tokens = jnp.where(won[:, None], out.tokens, tokens)
        valid = jnp.where(won[:, None], truncated, valid)
        if q is not None and out.q is not None:
            q = jnp.where(won[:, None, None], out.q, q)
            has_q = jnp.where(won, True, has_q)
        winner = jnp.where(won, i, winner)
        remaining = remaining & ~won
        new_states.append(s)
    return tokens, valid, q, has_q, winner, tuple(new_states)


def _verify_round(
    engine: Engine,
    target_params: Params,
    cache: Any,
    v_tokens: Array,
    v_pos: Array,
    draft: DraftOutput,
    draft_len_B: Array,
    has_q_B: Array,
    state: GenState,
    run: RunParams,
    narrowest: bool = False,
    drafted: bool = False,
    replay_B: Array | None = None,
) -> tuple[Any, Array, Array, tuple[Array, ...]]:
    """Steps 3-4: target forward over the verify batch and acceptance, at the narrowest
    compiled width (`engine.verify_widths()`) that holds every row's draft (`narrowest`,
    static: the caller knows no row drafted, so width 1 runs without a loop around it;
    `drafted`, static: the caller knows some row drafted, so width 1 is never compiled).

    Each width is its own loop run 0 or 1 times, holding the forward, the acceptance and the
    cache write at that width: a round in which no row drafted costs a 1-token forward and
    nothing of width K + 1 (with ngram-mod's K = 64, padding logits and K/V to 65 columns
    cost ~25% of a plain round). Returns (cache with the verify batch written, n_accepted [B],
    next_token [B], hidden: one [B, K + 1, D] per `engine.hidden_layers`, zero past the
    width). `replay_B` [B]: rows replaying a checkpointed round's accepted tokens, which are
    accepted untested (None: the memory never restores a checkpoint).
    """
    B, T = v_tokens.shape
    K = T - 1
    recent = _recent_tokens(engine, state.history, state.length, state.last_token)
    D = engine.target.D

    def at_width(width: int) -> Callable[[Any], Any]:
        @jax.named_scope(f"verify{width}")
        def run_width(carry: Any) -> Any:
            cache, _, _, hidden0 = carry
            out = engine.memory.forward(
                target_params, v_tokens[:, :width], v_pos[:, :width], cache, engine.hidden_layers
            )
            logits = out.logits
            k = width - 1
            narrow = DraftOutput(
                tokens=draft.tokens[:, :k],
                valid=draft.valid[:, :k],
                q=None if draft.q is None else draft.q[:, :k],
            )

            def sampled(logits: Array) -> verify.VerifyResult:
                return verify.verify_rows(
                    logits,
                    narrow,
                    run.sampling,
                    state.length,
                    has_q_B=has_q_B if draft.q is not None else None,
                    synth_rates_K=run.synth_rates[:k] if engine.synthetic else None,
                    eog_V=_eog_mask(engine) if engine.synthetic else None,
                    recent_BW=recent,
                    recent_valid_BW=recent >= 0,
                    replay_B=replay_B,
                )

            if engine.synthetic:
                with jax.named_scope("accept"):
                    result = sampled(logits)
            else:
                # Greedy batches skip building sampling distributions.
                all_greedy = jnp.all(run.sampling.temperature <= 0) & jnp.all(
                    run.sampling.repeat_penalty == 1.0
                )
                with jax.named_scope("accept"):
                    greedy = verify.first_argmax(logits)
                    result = jax.lax.cond(
                        all_greedy,
                        lambda _: _replayed(verify.verify_greedy(greedy, narrow), greedy),
                        sampled,
                        logits,
                    )
            cache = out.memory
            hidden = tuple(
                put_prefix(h0, h.astype(h0.dtype), axis=1) for h0, h in zip(hidden0, out.hidden)
            )
            n_acc = result.n_accepted.astype(jnp.int32)
            return cache, n_acc, result.next_token.astype(jnp.int32), hidden

        return run_width

    def _replayed(result: verify.VerifyResult, greedy_BT: Array) -> verify.VerifyResult:
        """A greedy batch's replay rows: every replayed token accepted untested."""
        if replay_B is None:
            return result
        n_acc = jnp.where(replay_B, draft_len_B, result.n_accepted)
        next_token = jnp.take_along_axis(greedy_BT, n_acc[:, None], axis=1)[:, 0]
        return replace(result, n_accepted=n_acc, next_token=next_token)

    widths = engine.verify_widths()
    zeros_B = jnp.zeros((B,), jnp.int32)
    hidden0 = tuple(jnp.zeros((B, T, D), jnp.float32) for _ in engine.hidden_layers)
    carry = (cache, zeros_B, zeros_B, hidden0)
    if narrowest:
        return at_width(widths[0])(carry)
    if drafted:
        widths = widths[1:]
    if len(widths) == 1:
        return at_width(widths[0])(carry)
    assert widths[-1] == K + 1
    index = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < jnp.max(draft_len_B) + 1)
    carry = run_once(index == 0, at_width(widths[0]), carry)
    if len(widths) == 2:
        return run_once(index == 1, at_width(widths[1]), carry)

    def wider(carry: Any) -> Any:
        for i, width in enumerate(widths[1:], start=1):
            carry = run_once(index == i, at_width(width), carry)
        return carry

    # Each loop's condition is a nested computation XLA runs on its own (~10 us on CPU): a
    # round without a draft evaluates one condition for all the wider widths, not one each.
    return run_once(index > 0, wider, carry)


def draft_budget(
    engine: Engine, state: GenState, run: RunParams
) -> tuple[Array, adaptive.Governor]:
    """Step 1 of a round: every row's draft budget [B] (0 = no drafting) and the governor
    with its counters updated (`spec_step`'s `plan`)."""
    active = ~state.done
    budget = jnp.where(active, jnp.clip(_headroom(engine, state, run), 0, engine.k_max), 0)
    governor = state.governor
    if engine.drafters:
        # The governor weighs lengths the chain can really draft (upstream's n_max, traced;
        # K is only the static width); when it does not shorten, the budget stays as it was.
        reachable = jnp.minimum(budget, run.chain_n_max)
        governed, governor = adaptive.choose_budget(
            governor,
            run.cost,
            reachable,
            active,
            engine.k_max,
            engine.verify_widths(),
            possible_B=state.lookup_next,
            caps=engine.draft_caps(),
        )
        budget = jnp.where(governed < reachable, governed, budget)
    return budget, governor


def _headroom(engine: Engine, state: GenState, run: RunParams) -> Array:
    """Per row [B]: drafted tokens that still fit the cache and the row's n_predict (the
    budget before the width K and the governor); one less after each 1-token round."""
    return jnp.minimum(engine.capacity - state.length - 2, run.max_new - state.out_len - 1)


def spec_step(
    engine: Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: GenState,
    run: RunParams,
    plan: tuple[Array, adaptive.Governor] | None = None,
    off: bool = False,
) -> GenState:
    """One draft -> verify -> accept -> commit round for every row.

    `plan`: `draft_budget(engine', state, run)` computed by the caller (possibly for an
    engine of another width K'); None = computed here. `off` (static): the caller knows that
    no row may draft this round (every budget is 0) and that the chain's idle calls may be
    skipped (`idle_rounds_are_plain`): the round is built without the drafter calls and with
    the 1-token verify at top level, no loop around either. It does what the same round does
    with `off=False`, where those loops run 0 times and the verify loop at width 1 once.

    For a chain whose drafters change nothing after a round without drafts
    (`empty_rounds_are_plain`), a round in which the relay found no draft for any row is
    finished as an off round too, after the governor and the statistics have counted it."""
    state, pending = spec_round(engine, target_params, drafter_params, state, run, plan, off)
    if pending is None:
        return state

    return run_once(
        pending, lambda s: pending_step(engine, target_params, drafter_params, s, run), state
    )


def pending_step(
    engine: Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: GenState,
    run: RunParams,
) -> GenState:
    """The 1-token step `spec_round` left pending: an off round (`spec_step(off=True)`)."""
    no_budget = jnp.zeros_like(state.length)
    plan = (no_budget, state.governor)
    return spec_step(engine, target_params, drafter_params, state, run, plan, off=True)


def spec_round(
    engine: Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: GenState,
    run: RunParams,
    plan: tuple[Array, adaptive.Governor] | None,
    off: bool,
) -> tuple[GenState, Array | None]:
    """`spec_step` up to a round's 1-token step: (state, pending). pending is None when the
    round is complete (an off round, or a chain that is not `empty_rounds_are_plain`);
    otherwise [] bool: the relay found no draft for any row, the governor and the statistics
    have counted the round (misses observed), and its 1-token step, an off round's
    (`pending_step`), is still to run. The generation loop runs it in its off rounds' loop
    and `continuous.lean_step` after its width variants: one copy of the 1-token round in
    the compiled program for the rounds drafting is off and the rounds nothing was found
    (with the asked round finishing in a copy of its own, a governed run over text the
    drafter cannot match ran 5-8% slower on XLA CPU at about the same kernel count: the copy
    only rare rounds run is cold in the caches; benchmarks/rounds.py ab measured it)."""
    B = state.length.shape[0]
    # Draft columns of this round's arrays: none in an off round, whose verify batch is the
    # 1-token one (K-wide arrays there only add small kernels to a round that should cost
    # what a plain one costs; benchmarks/rounds.py idle counts them).
    K = 0 if off else engine.k_max
    active = ~state.done
    with jax.named_scope("plan"):
        budget, governor = draft_budget(engine, state, run) if plan is None else plan
    replaying = None
    if state.replay is not None:  # rows replaying a checkpointed round do not draft
        replaying = active & (state.replay.length > 0)
        budget = jnp.where(replaying, 0, budget)
    # the drafters' per-row checkpoint data as the round starts (restored with the target's)
    saved = (
        tuple(take_spec_state(d, s) for d, s in zip(engine.drafters, state.drafter_states))
        if engine.memory.checkpoints
        else None
    )

    # A chain of `idle_noop` / `idle_record` drafters is not asked in a round in which no
    # row may draft (the governor turned it off, or every row is at its end): the round then
    # costs what a plain round costs, with the recorders' `record` of its verify batch
    # (`_finish_round`). Loops run 0 or 1 times keep the drafter states in place.
    skip_idle = idle_rounds_are_plain(engine)
    asking = jnp.any(budget > 0)
    if off and not skip_idle:
        raise ValueError(
            "an off round needs a chain whose drafters all declare idle_noop or idle_record"
        )
    if engine.drafters:

        @jax.named_scope("relay")
        def relay(dstates: tuple[Any, ...]) -> Any:
            asked = replace(state, drafter_states=dstates)
            return _relay(engine, drafter_params, asked, budget, run)

        if off:
            relayed = (*_no_draft(engine, B, K), state.drafter_states)
        elif skip_idle:
            nobody = (*_no_draft(engine, B), state.drafter_states)
            relayed = run_once(asking, lambda c: relay(c[-1]), nobody)
        else:
            relayed = relay(state.drafter_states)
        d_tokens, d_valid, q, has_q, winner, dstates = relayed
        stats = state.stats
        if not off:  # (in an off round no row asks: the counters would not move)
            with jax.named_scope("bookkeeping"):
                stats = stats_mod.record_draft(
                    stats, winner, jnp.sum(d_valid, axis=1).astype(jnp.int32), budget > 0
                )
    else:
        d_tokens = jnp.zeros((B, K), jnp.int32)
        d_valid = jnp.zeros((B, K), bool)
        q, has_q, winner, dstates, stats = (
            None,
            jnp.zeros((B,), bool),
            state.impl_last,
            (),
            state.stats,
        )
    if replaying is not None and state.replay is not None:  # the replay is the row's draft
        replay = state.replay
        d_tokens = jnp.where(replaying[:, None], replay.tokens, d_tokens)
        d_valid = jnp.where(
            replaying[:, None], jnp.arange(K)[None, :] < replay.length[:, None], d_valid
        )
        winner = jnp.where(replaying, replay.winner, winner)
        has_q = has_q & ~replaying
    relay_out = _Relayed(
        draft=DraftOutput(tokens=d_tokens, valid=d_valid, q=q),
        has_q=has_q,
        winner=winner,
        budget=budget,
        replaying=replaying,
        saved=saved,
    )
    state = replace(state, drafter_states=dstates, stats=stats, governor=governor)
    if off or not empty_rounds_are_plain(engine):
        finished = _finish_round(engine, target_params, drafter_params, state, run, relay_out, off)
        return finished, None

    # A round in which no row got a draft is finished as an off round (its verify the 1-token
    # forward, no K-wide arrays, no feedback: the chain's drafters leave their states as they
    # are when nothing was drafted), after the governor has seen the misses; the caller runs
    # that step. A round with drafts is never verified at width 1 (a loop run 0 or 1 times).
    found = jnp.any(d_valid)

    def drafts_found(s: GenState) -> GenState:
        return _finish_round(engine, target_params, drafter_params, s, run, relay_out, drafted=True)

    finished = run_once(found, drafts_found, state)
    with jax.named_scope("bookkeeping"):  # (elementwise on [B]: no loop of its own)
        zeros_B = jnp.zeros((B,), jnp.int32)
        missed = adaptive.observe(governor, active & (budget > 0), zeros_B, zeros_B)
        governor = jax.tree.map(lambda a, b: jnp.where(found, a, b), finished.governor, missed)
    return replace(finished, governor=governor), ~found


@pytree_dataclass
class _Relayed:
    """What a round's relay produced, handed to the rest of the round."""

    draft: DraftOutput  # [B, K] tokens and validity, q [B, K, V] or None
    has_q: Array  # [B] bool
    winner: Array  # [B] int32, chain index of the row's drafter, -1 = none
    budget: Array  # [B] int32, the round's draft budget (some row > 0: the chain was called)
    #: [B] bool, rows whose draft is a replay (None: the memory never restores a checkpoint)
    replaying: Array | None = None
    #: the drafters' per-row checkpoint data at the round's start (`take_spec_state`), or None
    saved: tuple[Any, ...] | None = None


def _finish_round(
    engine: Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: GenState,
    run: RunParams,
    relayed: _Relayed,
    off: bool = False,
    drafted: bool = False,
) -> GenState:
    """Steps 3-6 of `spec_step` after the relay: verify, accept, commit, feedback. `state`
    holds the drafter states, statistics and governor the relay and plan left; `drafted`
    (static): the caller knows some row drafted (the verify never runs at width 1)."""
    B, S = state.length.shape[0], engine.capacity
    K = 0 if off else engine.k_max
    out_cap = engine.out_capacity
    active = ~state.done
    remaining_new = run.max_new - state.out_len
    draft, has_q, winner, budget = relayed.draft, relayed.has_q, relayed.winner, relayed.budget
    replaying = relayed.replaying
    d_tokens, d_valid = draft.tokens, draft.valid
    dstates, stats, governor = state.drafter_states, state.stats, state.governor
    skip_idle = idle_rounds_are_plain(engine)

    draft_len = jnp.sum(d_valid, axis=1).astype(jnp.int32)
    had_draft = draft_len > 0

    v_tokens = jnp.concatenate([state.last_token[:, None], d_tokens], axis=1)  # [B, K+1]
    v_valid = jnp.concatenate([active[:, None], d_valid & active[:, None]], axis=1)
    v_pos = jnp.where(v_valid, state.length[:, None] + jnp.arange(K + 1)[None, :], -1)
    # the PARTIAL_ONLY checkpoint, before the verify (None for most memories and K)
    saved, cache = engine.memory.checkpoint(state.cache, K) if K > 0 else (None, state.cache)
    cache, n_acc, next_token, hidden = _verify_round(
        engine, target_params, cache, v_tokens, v_pos, draft, draft_len, has_q, state, run,
        narrowest=off, drafted=drafted, replay_B=replaying,
    )  # fmt: skip
    n_acc = jnp.where(active, n_acc, 0)

    with jax.named_scope("commit"):
        # commit: keep id_last + accepted drafts in memory, drop the rejected cells (or, for
        # a row whose memory restored its checkpoint, commit nothing: it replays)
        keep = state.length + n_acc + 1
        checkpoint, paths = None, None
        if K > 0:  # (static) a 1-token round wrote only position `length`, which it keeps:
            # before a round no cell holds a position >= length (prefill, restored slots and
            # every commit leave none), so there is nothing to drop, and an O(S) pass over
            # every row's cells is saved in each plain and off round
            cache, checkpoint, paths = engine.memory.settle(
                saved, cache, state.length, draft_len, n_acc, active, replaying
            )
        commit = active if checkpoint is None else active & ~checkpoint
        rows_BT = jnp.arange(B)[:, None] + jnp.zeros((1, K + 1), jnp.int32)
        hist_pos = state.length[:, None] + jnp.arange(K + 1)[None, :]
        write_ok = commit[:, None] & (jnp.arange(K + 1)[None, :] <= n_acc[:, None])
        history = state.history.at[rows_BT, jnp.where(write_ok, hist_pos, S)].set(
            v_tokens, mode="drop"
        )

        # emit d_1..d_nacc, next_token; stop at EOG / n_predict
        emitted = jnp.concatenate([d_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
        emitted = jnp.where(
            jnp.arange(K + 1)[None, :] == n_acc[:, None], next_token[:, None], emitted
        )
        n_emit = jnp.where(commit, n_acc + 1, 0)
        eog = _is_eog(engine, emitted) & (jnp.arange(K + 1)[None, :] < n_emit[:, None])
        first_eog = jnp.argmax(eog, axis=1)
        hit_eog = jnp.any(eog, axis=1)
        n_emit = jnp.where(hit_eog, first_eog + 1, n_emit)
        n_emit = jnp.minimum(n_emit, remaining_new)
        out_idx = state.out_len[:, None] + jnp.arange(K + 1)[None, :]
        out_ok = jnp.arange(K + 1)[None, :] < n_emit[:, None]
        out_tokens = state.out_tokens.at[rows_BT, jnp.where(out_ok, out_idx, out_cap)].set(
            emitted, mode="drop"
        )
        out_len = state.out_len + n_emit
        new_length = jnp.where(commit, keep, state.length)
        eog_stop = hit_eog & (first_eog < n_emit)
        len_stop = out_len >= run.max_new
        ctx_stop = new_length >= S - 1  # the emitted next token sits at position S - 1
        newly_done = commit & (eog_stop | len_stop | ctx_stop)
        last_token = jnp.where(commit, next_token, state.last_token)
        lookup_seen, lookup_next = state.lookup_seen, state.lookup_next
        if lookup_seen is not None and engine.lookup_n is not None:
            # the n-grams a lookup may now use, and the index's answer for the next round
            lookup_seen, lookup_next = lookup_index.advance(
                lookup_seen,
                history,
                state.length - engine.lookup_gap,
                jnp.where(commit, n_acc + 1, 0),
                new_length,
                last_token,
                engine.lookup_n,
                K + 1,
            )
        finish = jnp.where(
            newly_done,
            jnp.where(eog_stop, FINISH_EOG, jnp.where(len_stop, FINISH_LENGTH, FINISH_CONTEXT)),
            state.finish,
        )

    # drafter feedback: process the verify batch, accept, trim their memory
    if engine.drafters:
        batch = TargetBatch(
            tokens=v_tokens, positions=v_pos, hidden=hidden_by_layer(engine.hidden_layers, hidden)
        )

        @jax.named_scope("feedback")
        def feedback(dstates: tuple[Any, ...]) -> tuple[Any, ...]:
            new_states = []
            for i, (d, p, s) in enumerate(zip(engine.drafters, drafter_params, dstates)):
                s = d.process(p, s, batch)
                s = d.accept(s, n_acc, winner != i, had_draft & commit)
                s = d.rollback(s, new_length)
                if checkpoint is not None and relayed.saved is not None:
                    # a restored row's drafter data goes back with the target's checkpoint
                    s = load_spec_state(d, s, relayed.saved[i], checkpoint)
                new_states.append(s)
            return tuple(new_states)

        @jax.named_scope("record")
        def record(dstates: tuple[Any, ...]) -> tuple[Any, ...]:
            """An idle round's feedback: the recorders keep the verify batch for later (its
            rows have no draft), the others' states would not move."""
            return tuple(
                d.record(p, s, batch) if d.idle_record else s
                for d, p, s in zip(engine.drafters, drafter_params, dstates)
            )

        recorders = any(d.idle_record for d in engine.drafters)
        if drafted or not skip_idle:
            dstates = feedback(dstates)
        elif off:  # (an off round verifies no draft: only a recorder's state moves)
            dstates = record(dstates) if recorders else dstates
        else:
            asking = jnp.any(budget > 0)
            dstates = run_once(asking, feedback, dstates)
            if recorders:
                dstates = run_once(~asking, record, dstates)
        # (nor would the counters; the caller of an off round advances the governor)
        with jax.named_scope("bookkeeping"):
            if not off:
                stats = stats_mod.record_accept(stats, winner, n_acc, had_draft & commit, replaying)
                if paths is not None:
                    stats = stats_mod.add_rollback(stats, paths)
                governor = adaptive.observe(
                    governor, active & (budget > 0), draft_len, n_acc, engine.draft_caps()
                )
        impl_last = jnp.where(had_draft, winner, state.impl_last)
    else:
        impl_last = state.impl_last

    replay = state.replay
    if replay is not None and checkpoint is not None and replaying is not None:
        # a restored row's accepted list [d_1..d_nacc, c] is its next round's draft
        replay = Replay(
            tokens=jnp.where(checkpoint[:, None], emitted[:, :K], replay.tokens),
            length=jnp.where(checkpoint, n_acc + 1, jnp.where(replaying, 0, replay.length)).astype(
                jnp.int32
            ),
            winner=jnp.where(checkpoint, winner, replay.winner),
        )

    return GenState(
        cache=cache,
        history=history,
        length=new_length,
        last_token=last_token,
        out_tokens=out_tokens,
        out_len=out_len,
        done=state.done | newly_done,
        finish=finish.astype(jnp.int32),
        drafter_states=dstates,
        impl_last=impl_last,
        stats=stats,
        governor=governor,
        n_rounds=state.n_rounds + 1,
        drafted=None if state.drafted is None else state.drafted + draft_len,
        lookup_seen=lookup_seen,
        lookup_next=lookup_next,
        replay=replay,
    )


def empty_rounds_are_plain(engine: Engine) -> bool:
    """Whether `spec_step` may finish a round in which the relay found no draft as an off
    round: the chain's idle calls may be skipped (`idle_rounds_are_plain`) and every drafter
    declares `quiet_without_draft` (its `process`, `accept` and `rollback` leave its state as
    it is in a round in which no row got a draft)."""
    return idle_rounds_are_plain(engine) and all(d.quiet_without_draft for d in engine.drafters)


def idle_rounds_are_plain(engine: Engine) -> bool:
    """Whether `spec_step` may skip the drafter calls in a round in which no row may draft:
    every drafter of the chain declares `idle_noop` (a round in which it drafts nothing
    leaves its state as it is) or `idle_record` (it only keeps the verify batch for later:
    `record`, the one call such a round makes; see `specjax.drafters.base`)."""
    if engine.memory.checkpoints:  # (a replaying row verifies though nobody drafts)
        return False
    return bool(engine.drafters) and all(d.idle_noop or d.idle_record for d in engine.drafters)


def generate_loop(
    engine: Engine,
    target_params: Params,
    drafter_params: tuple[Any, ...],
    state: GenState,
    run: RunParams,
) -> GenState:
    """Run `spec_step` until every row is done, entirely on device.

    After each round, while the governor lets no row draft (and the chain's idle calls may be
    skipped), the rounds run in an inner loop as `spec_step(off=True)`: the same rounds, with
    ~5 fewer nested loop evaluations each (each a computation XLA CPU launches on its own)
    and no governor work (the run of off rounds is planned once), so a stretch in which
    drafting is off costs about what plain decoding costs.

    For a model-free chain (`empty_rounds_are_plain`), a round whose relay found no draft
    for any row takes its 1-token step in that same inner loop (`spec_round`'s pending
    step): one copy of the 1-token round in the compiled program (why: `spec_round`)."""

    def cond(s: GenState) -> Array:
        return jnp.any(~s.done) & (s.n_rounds < engine.max_rounds)

    def body(s: GenState) -> GenState:
        return spec_step(engine, target_params, drafter_params, s, run)

    if not idle_rounds_are_plain(engine):
        return jax.lax.while_loop(cond, body, state)

    # Every round's plan is computed once, after the round before it, and carried: its budget
    # beside the state, its governor (counters updated) in the state's place, so that the
    # loops carry one governor, not two (each small loop-carried array can cost a copy per
    # round, a kernel of its own on XLA CPU). `pending`: the round just run found no draft
    # for any row and its 1-token step is still to run (`spec_round`), in the off rounds'
    # loop, so that the program holds one copy of that step.
    Carry = tuple[GenState, Array, Array]
    no_budget = jnp.zeros_like(state.length)

    @jax.named_scope("plan")
    def planned(s: GenState) -> tuple[GenState, Array]:
        budget, governor = draft_budget(engine, s, run)
        return replace(s, governor=governor), budget

    def off_cond(c: Carry) -> Array:
        s, budget, pending = c
        return pending | (cond(s) & ~jnp.any(budget > 0))

    @jax.named_scope("off_rounds")
    def off_rounds(c: Carry) -> Carry:
        """A run of off rounds planned once: a pending round's step or the planned round,
        then as many as the governor's choice stays 0 (`adaptive.rounds_off_ahead`; none
        after a pending step, whose next round is planned after it), and after those, for a
        chain with a lookup index, while no active row could draft (`lookup_next`: the
        choice is 0 whatever the estimates), while no row finishes. Its rounds do no
        governor work; `adaptive.advance` adds them up after the run (a pending round's own
        were done with its relay)."""
        s, _, pending = c
        active = ~s.done
        headroom = jnp.where(active, _headroom(engine, s, run), 0)
        reachable = jnp.minimum(jnp.clip(headroom, 0, engine.k_max), run.chain_n_max)
        ahead = run_once(  # (a pending round's estimates move after it: planned after it)
            ~pending,
            lambda _: adaptive.rounds_off_ahead(
                s.governor,
                run.cost,
                reachable,
                active,
                engine.k_max,
                engine.verify_widths(),
                caps=engine.draft_caps(),
            ),
            jnp.zeros((), jnp.int32),
        )
        n_done = jnp.sum(s.done)

        def more(c: tuple[GenState, Array]) -> Array:
            s, n = c
            off = n <= ahead
            could = s.lookup_next
            if could is not None:  # (beyond the plan: no row the chain could draft for)
                off = off | (run.cost.enabled & ~jnp.any(could & ~s.done))
            return (n == 0) | (off & cond(s) & (jnp.sum(s.done) == n_done))

        def one(c: tuple[GenState, Array]) -> tuple[GenState, Array]:
            s, n = c
            return pending_step(engine, target_params, drafter_params, s, run), n + 1

        s, n = jax.lax.while_loop(more, one, (s, jnp.zeros((), jnp.int32)))
        # rounds after the planned one that `draft_budget` would have counted (some row with
        # budget left: round j of the run while j < the row's headroom; 0 when n_max is 0)
        counted = jnp.clip(jnp.max(headroom) - 1, 0, n - 1)
        counted = jnp.where((run.chain_n_max > 0) & (engine.k_max > 0), counted, 0)
        governor = adaptive.advance(s.governor, n - pending.astype(jnp.int32), counted)
        return (*planned(replace(s, governor=governor)), jnp.zeros((), bool))

    def round_then_off_rounds(c: Carry) -> Carry:
        s, budget, _ = c
        s, pending = spec_round(
            engine, target_params, drafter_params, s, run, (budget, s.governor), off=False
        )
        if pending is None:  # (a chain that is not `empty_rounds_are_plain`: never pending)
            c = (*planned(s), jnp.zeros((), bool))
        else:  # the next round's plan, unless this one's step is pending (planned after it)
            c = run_once(~pending, lambda c: (*planned(c[0]), c[2]), (s, no_budget, pending))
        return jax.lax.while_loop(off_cond, off_rounds, c)

    # The first round is a full one even when its plan drafts nothing (the same round, a few
    # loop evaluations dearer): a stretch before it would be a second copy of the off round
    # in the compiled program.
    first = (*planned(state), jnp.zeros((), bool))
    return jax.lax.while_loop(lambda c: cond(c[0]), round_then_off_rounds, first)[0]


# Carried and spare drafter states are donated: ngram-mod's pool (32 MB at the default size)
# is then updated in place across a Generator's requests, and renewed in place across
# `generate` calls, instead of copied or allocated and filled again.
prefill_jit = jax.jit(
    prefill, static_argnames=("engine",), donate_argnames=("states", "spare", "lookup_seen")
)
init_states_jit = jax.jit(init_states, static_argnames=("engine",))
step_jit = jax.jit(spec_step, static_argnames=("engine",), donate_argnames=("state",))
generate_loop_jit = jax.jit(generate_loop, static_argnames=("engine",), donate_argnames=("state",))
