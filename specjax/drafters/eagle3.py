"""draft-eagle3: an EAGLE-3 head reading the target's features (llama.cpp section 5.2).

Input convention: at memory position P the head's decoder consumes `(t_{P+1}, g_P)` -- the
NEXT token with the feature of P -- so the last row of every target batch cannot be written
when the batch is processed: its token is not known yet. That deferred boundary is explicit
per-row state (upstream's `common_speculative_impl_draft_eagle3`):

    pending_g [B, D], pending_pos [B]   the deferred row's g and position (-1 = none)
    verify_g [B, R, D], verify_pos_first [B], verify_rows [B]
                                         snapshot of the last `process`, for `accept`

* `process(batch)`: g = fc(features of the target's `hidden_layers`) for every row; per row
  with evaluated tokens `[beg, end]`: (a) the cross-ubatch bridge -- when `pending_pos >= 0`,
  `pending_pos + 1 == pos[beg]` and `pending_pos` is above the head's highest cached
  position, write `(token[beg], pending_g)` at `pending_pos`; (b) write `(token[k+1], g[k])`
  at `pos[k]` for k in beg..end-1; (c) snapshot: `verify_pos_first = pos[beg]`,
  `pending_pos = pos[end]`, `verify_g = g[beg..end]`, `pending_g = g[end]`. Rows of a batch
  with no evaluated token are untouched. (The rows of rejected drafts are written too, as
  upstream; `rollback` and the seq_rm in `draft` drop them.) "Write" is the row's K/V
  (`_write_rows`): a row's K/V are a function of the row alone, and nothing reads the
  layer's output for a written row, so its attention and FFN are not computed.
* `accept(n)`: `i = min(n, rows - 1)`; `pending_pos = verify_pos_first + i`,
  `pending_g = verify_g[i]`.
* `draft`: rows asked to draft with `pending_pos >= 0`: `seq_rm(row, pending_pos, -1)`, write
  `(id_last, pending_g)` at `pending_pos` (kept in the cache), then step i = 0, 1, ...: top-10
  softmax of the row's logits, take the argmax; stop when its probability is < p_min (token
  not added); append; stop when the length reaches the draft model's n_max (`draft_n_max`,
  at least 1 token; the caller's budget `n_max` is NOT applied here -- the relay truncates,
  as upstream); else feed `(token, prenorm)` at `pending_pos + i + 1`. Drafts shorter than
  n_min are cleared. Drafted rows never stay in the cache (upstream removes them after
  drafting: `seq_rm(draft, pos_max + 1, -1)`): they live in a scratch, or on a TPU
  (`control.draft_steps_in_cache`) in the loop-carried cache, trimmed after the loop.
* `rollback(keep)`: `seq_rm(row, keep, -1)` on the head's cache only (the boundary stays).
* `record(batch)` (`idle_record`: a round in which the governor lets no row draft, the verify
  batch one token per row): the boundary moves as `process` moves it; the bridge row
  `(token[beg], pending_g)` at `pending_pos`, the one cache row such a batch writes, goes to
  a log (`log_*`, `LOG_ROWS` rows per row) instead of through the decoder layer. The next
  `process` or `draft` (or a `record` finding the log full) writes the logged rows' K/V in
  one batch first, as a prompt chunk; `rollback` drops logged rows >= keep. A run of rounds
  drafting is off for thus costs the head one fc product per round and one batched K/V
  product per `LOG_ROWS` rounds. `record` leaves the snapshot (`verify_*`) as it is: only
  `accept` reads it, and only after a `process` of its own round's batch (writing the
  [B, S, D] `verify_g` from `record` cost a copy of it a round on XLA CPU).
* `get_state` / `set_state`: upstream's blob, little-endian int32 `pending_pos` followed by
  D float32 of `pending_g`; `get_state` returns None when `pending_pos < 0`, `set_state`
  ignores a blob of the wrong size. (Upstream only stashes it for recurrent/hybrid targets,
  whose checkpoints lose the boundary; here it is always available.)
* Probabilistic mode (`--spec-draft-sampling probabilistic`), as draft-simple: rows at
  temperature > 0 sample their drafts from the tempered top-10 and return q for rejection
  sampling; rows at temperature 0 draft the argmax.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.config import DRAFT_K_MIN
from specjax.control import draft_steps_in_cache, run_once
from specjax.drafters.base import (
    Drafter,
    DraftInput,
    DraftOutput,
    TargetBatch,
    put_scratch_kv,
)
from specjax.drafters.draft_simple import DRAFT_SEED_XOR
from specjax.drafters.draft_tokens import (
    empty_draft_q,
    keep_draft_token,
    pick_draft_token,
    record_q,
    zero_q,
)
from specjax.drafters.feature_head import (
    LOG_ROWS,
    FeatureHeadDrafter,
    PendingBoundary,
    batch_span,
)
from specjax.memory.kv import KVCache, keep_prefix
from specjax.models import eagle3 as e3
from specjax.models.llama import ExtraKV, commit_kv, new_cache
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array

if TYPE_CHECKING:
    from specjax.config import SpecConfig


@pytree_dataclass
class Eagle3State:
    cache: KVCache  # the decoder layer's KV ([B, G, S, E], one layer)
    pending_g: Array  # [B, D] float32
    pending_pos: Array  # [B] int32, -1 = no boundary yet
    verify_g: Array  # [B, S, D] float32, rows 0..verify_rows-1 valid
    verify_pos_first: Array  # [B] int32
    verify_rows: Array  # [B] int32
    # decoder rows `record` kept for later (`LOG_ROWS` per row, position -1 = empty)
    log_tokens: Array  # [B, LOG_ROWS] int32
    log_g: Array  # [B, LOG_ROWS, D] float32
    log_pos: Array  # [B, LOG_ROWS] int32
    log_n: Array  # [B] int32, slots used (dropped rows included)


def _cond_run(pred: Array, body: Any, operands: Any) -> Any:
    """`body(operands)` if `pred`, else `operands` (a `lax.cond`)."""
    return jax.lax.cond(pred, body, lambda x: x, operands)


def _bridges(state: Eagle3State, has: Array, pos_beg: Array) -> Array:
    """[B] rows whose batch writes the cross-ubatch bridge `(token[beg], pending_g)` at
    `pending_pos`: the boundary is set, the batch starts right after it, and it is above
    every position the head holds (its cache and its log)."""
    held = jnp.maximum(jnp.max(state.cache.pos, axis=1), jnp.max(state.log_pos, axis=1))
    return (
        has
        & (state.pending_pos >= 0)
        & (state.pending_pos + 1 == pos_beg)
        & (state.pending_pos > held)
    )


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(PendingBoundary, FeatureHeadDrafter):
    name: ClassVar[str] = "draft-eagle3"
    #: a head step per drafted token (its `draft_step` priced from the head's size)
    prices: ClassVar[frozenset[str]] = frozenset({"draft_step"})
    head_module: ClassVar[Any] = e3
    KIND: ClassVar[str] = "EAGLE-3"
    PENDING: ClassVar[str] = "pending_g"
    VERIFY: ClassVar[str] = "verify_g"

    config: e3.Eagle3Config
    probabilistic: bool = False
    #: What one ask costs on CPU beyond the cost model's per-token `draft_step` (0.125 of a
    #: target step for code-eagle3), in plain rounds of the shipped target: the governor's
    #: price (`prices.chain_call_price`). benchmarks/governor.py ask --heads at gap 8 and n_max 4:
    #: 2.64 rounds an ask (benchmarks/results/governor-ask.json), less 4 x 0.125. A head
    #: step is ~100 small kernels (its decoder, the shared LM head, the top-k), each launch
    #: a few us on XLA CPU: on this target the ask outweighs what even accepted drafts win,
    #: so on CPU the governor leaves the drafter off.
    ask_steps: ClassVar[float] = 2.15

    @classmethod
    def from_spec(cls, spec: SpecConfig, target: Any, draft: Any) -> tuple[Drafter, Any]:
        """The drafter for an EAGLE-3 head, checked against the target; its parameters are
        the head's and the target's weights it shares."""
        arch = "eagle3 (expected 3 extract layers)"
        cfg: e3.Eagle3Config = cls.head_config(draft, target, e3.Eagle3Config, arch)
        tc = target.config
        if not cfg.own_embed and cfg.D != tc.D:
            raise ValueError(
                f"EAGLE-3 head of width {cfg.D} has no token embeddings and cannot use the "
                f"target's (width {tc.D})"
            )
        if target.tokenizer is not None and draft.tokenizer is not None:
            from specjax.drafters.draft_simple import check_vocab_compatible

            check_vocab_compatible(target.tokenizer, draft.tokenizer, tc.V, cfg.V)
        drafter = cls(
            config=cfg,
            hidden_layers=tuple(sorted(set(cfg.target_layers))),
            max_draft_len=max(spec.draft_n_max, DRAFT_K_MIN) if spec.k_max is None else spec.k_max,
            probabilistic=spec.draft_sampling == "probabilistic",
        )
        return drafter, cls.head_params(cfg, draft, target)

    def init(self, batch: int, capacity: int) -> Eagle3State:
        D = self.config.D
        return Eagle3State(
            cache=new_cache(self.config.layer_config, batch, capacity),
            pending_g=jnp.zeros((batch, D), jnp.float32),
            pending_pos=jnp.full((batch,), -1, jnp.int32),
            verify_g=jnp.zeros((batch, capacity, D), jnp.float32),
            verify_pos_first=jnp.full((batch,), -1, jnp.int32),
            verify_rows=jnp.zeros((batch,), jnp.int32),
            log_tokens=jnp.zeros((batch, LOG_ROWS), jnp.int32),
            log_g=jnp.zeros((batch, LOG_ROWS, D), jnp.float32),
            log_pos=jnp.full((batch, LOG_ROWS), -1, jnp.int32),
            log_n=jnp.zeros((batch,), jnp.int32),
        )

    # ----------------------------------------------------------------------------- process
    def process(self, params: Any, state: Eagle3State, batch: TargetBatch) -> Eagle3State:
        state = self.flush(params, state)
        cfg = self.config
        head = params["head"]
        tokens, pos = batch.tokens, batch.positions
        B, T = tokens.shape
        span = batch_span(batch)
        has, beg, end = span.has, span.beg, span.end
        feats = e3.gather_features(cfg, batch.hidden)
        g = e3.encode(cfg, head, feats).astype(jnp.float32)  # [B, T, D]

        bridge = _bridges(state, has, span.pos_beg)
        col = jnp.arange(T)[None, :]
        main = has[:, None] & (col >= beg[:, None]) & (col < end[:, None])
        next_tok = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
        bridge_tok = jnp.take_along_axis(tokens, beg[:, None], axis=1)
        dec_tok = jnp.concatenate([bridge_tok, next_tok], axis=1)
        dec_g = jnp.concatenate([state.pending_g[:, None], g], axis=1)
        dec_pos = jnp.concatenate(
            [
                jnp.where(bridge, state.pending_pos, -1)[:, None],
                jnp.where(main, pos, -1),
            ],
            axis=1,
        ).astype(jnp.int32)
        cache = self._write_rows(params, state.cache, dec_tok, dec_g, dec_pos)

        return self.snapshot(state, span, g, cache=cache)

    def _write_rows(
        self, params: Any, cache: KVCache, tokens: Array, g: Array, pos: Array
    ) -> KVCache:
        """The decoder rows `(tokens, g)` [B, T] written at `pos` (-1 = padding): their K/V
        only. A row's K/V are a function of the row alone, and nothing reads the layer's
        output for a written row, so its attention, output projection and FFN are skipped."""
        cfg = self.config
        qkv = e3.decoder_qkv(
            cfg, params["head"], params["shared"], tokens, g.astype(cfg.dtype), pos
        )
        k, v = qkv.k.astype(cache.k[0].dtype), qkv.v.astype(cache.v[0].dtype)
        return commit_kv(cache, pos, (k,), (v,))

    def flush(self, params: Any, state: Eagle3State) -> Eagle3State:
        """The logged rows' K/V written into the cache (a loop run 0 or 1 times: nothing
        when the log is empty), the log emptied."""
        return self.flush_log(
            state,
            lambda s: self._write_rows(params, s.cache, s.log_tokens, s.log_g, s.log_pos),
        )

    def record(self, params: Any, state: Eagle3State, batch: TargetBatch) -> Eagle3State:
        """`process` of a batch with at most one evaluated token per row (no draft), its one
        cache row logged (see the module docstring)."""
        cfg = self.config
        state = self.flush_if_full(params, state)
        has, beg, pos_beg, at_beg = self.first_row(batch)
        token = jnp.take_along_axis(batch.tokens, beg, axis=1)[:, 0]
        g = e3.encode(cfg, params["head"], e3.gather_features(cfg, at_beg))  # [B, 1, D]
        g = g.astype(jnp.float32)[:, 0]
        bridge = _bridges(state, has, pos_beg)
        slot = jnp.where(bridge, state.log_n, LOG_ROWS)  # LOG_ROWS: dropped
        rows = jnp.arange(has.shape[0])
        return replace(
            state,
            log_tokens=state.log_tokens.at[rows, slot].set(token, mode="drop"),
            log_g=state.log_g.at[rows, slot].set(state.pending_g, mode="drop"),
            log_pos=state.log_pos.at[rows, slot].set(state.pending_pos, mode="drop"),
            log_n=state.log_n + bridge.astype(jnp.int32),
            pending_g=jnp.where(has[:, None], g, state.pending_g),
            pending_pos=jnp.where(has, pos_beg, state.pending_pos).astype(jnp.int32),
        )

    # (accept: `PendingBoundary`)

    # ------------------------------------------------------------------------------- draft
    def draft(
        self, params: Any, state: Eagle3State, inp: DraftInput, k_max: int
    ) -> tuple[Eagle3State, DraftOutput]:
        cfg = self.config
        head, shared = params["head"], params["shared"]
        B = inp.last_token.shape[0]
        V = cfg.V
        drafting = inp.drafting & (state.pending_pos >= 0)

        def run(state: Eagle3State) -> tuple[Eagle3State, DraftOutput]:
            state = self.flush(params, state)
            seed = inp.seed if inp.seed is not None else jnp.zeros((B,), jnp.int32)
            draft_seed = jnp.bitwise_xor(seed.astype(jnp.uint32), jnp.uint32(DRAFT_SEED_XOR))
            n_max = inp.draft_n_max if inp.draft_n_max is not None else jnp.asarray(k_max)
            limit = jnp.clip(n_max, 1, k_max)  # the first token is always taken (upstream)
            S = state.cache.capacity
            big = jnp.full((B,), S + (1 << 20), jnp.int32)
            cache = keep_prefix(state.cache, jnp.where(drafting, state.pending_pos, big))
            seed_pos = jnp.where(drafting, state.pending_pos, -1)[:, None]
            out = e3.decoder_compute(
                cfg,
                head,
                shared,
                inp.last_token[:, None].astype(jnp.int32),
                state.pending_g[:, None].astype(cfg.dtype),
                seed_pos,
                cache,
            )
            cache = commit_kv(cache, seed_pos, out.k, out.v, after=out.logits)
            temp = inp.temperature.astype(jnp.float32)
            lc = cfg.layer_config
            shape = (B, lc.G, k_max, lc.E)
            # the drafted rows' K/V: a scratch beside the cache the loop reads, or on a TPU
            # the cache itself (`control.draft_steps_in_cache`), trimmed after the loop
            in_cache = draft_steps_in_cache()
            scratch0: Any = (
                cache
                if in_cache
                else ExtraKV(
                    k=(jnp.zeros(shape, cache.k[0].dtype),),
                    v=(jnp.zeros(shape, cache.v[0].dtype),),
                    pos=jnp.full((B, k_max), -1, jnp.int32),
                )
            )

            def sample(i: Array, logits: Array, alive: Array, n: Array, tokens, valid, q):
                if self.probabilistic:
                    keys = sampling.make_keys(
                        draft_seed, inp.history.length + i + 1, sampling.ROLE_DRAFT
                    )
                    pick = pick_draft_token(logits, self.top_k, temp, keys)
                    q = record_q(i, pick, alive, q)
                else:
                    pick = pick_draft_token(logits, self.top_k)
                alive, n, tokens, valid = keep_draft_token(
                    i, pick, alive, n, tokens, valid, inp.p_min, limit
                )
                return pick.token, alive, n, tokens, valid, q

            def cond(carry):
                i, _, _, _, alive, _, _, _, _ = carry
                return (i < k_max) & jnp.any(alive)

            def body(carry):
                i, scratch, logits, g, alive, n, tokens, valid, q = carry
                token, alive, n, tokens, valid, q = sample(i, logits, alive, n, tokens, valid, q)

                def step(operands):
                    scratch, _logits, g = operands
                    p = jnp.where(alive, state.pending_pos + i + 1, -1)
                    if in_cache:
                        o = e3.decoder_compute(
                            cfg, head, shared, token[:, None], g[:, None], p[:, None], scratch
                        )
                        scratch = commit_kv(scratch, p[:, None], o.k, o.v, after=o.logits)
                        return scratch, o.logits[:, 0], o.prenorm[:, 0]
                    o = e3.decoder_compute(
                        cfg,
                        head,
                        shared,
                        token[:, None],
                        g[:, None],
                        p[:, None],
                        cache,
                        extra=scratch,
                    )
                    scratch = ExtraKV(
                        k=(put_scratch_kv(scratch.k[0], i, o.k[0]),),
                        v=(put_scratch_kv(scratch.v[0], i, o.v[0]),),
                        pos=jax.lax.dynamic_update_slice_in_dim(scratch.pos, p[:, None], i, 1),
                    )
                    return scratch, o.logits[:, 0], o.prenorm[:, 0]

                # (a loop run 0 or 1 times where it carries the cache: a cond's branches
                # would copy it)
                skip_dead = run_once if in_cache else _cond_run
                scratch, logits, g = skip_dead(jnp.any(alive), step, (scratch, logits, g))
                return i + 1, scratch, logits, g, alive, n, tokens, valid, q

            q0 = zero_q(B, k_max, V, self.probabilistic)
            init = (
                jnp.zeros((), jnp.int32),
                scratch0,
                out.logits[:, 0],
                out.prenorm[:, 0],
                drafting,
                jnp.zeros((B,), jnp.int32),
                jnp.zeros((B, k_max), jnp.int32),
                jnp.zeros((B, k_max), bool),
                q0,
            )
            _, loop_cache, _, _, _, n, tokens, valid, q = jax.lax.while_loop(cond, body, init)
            valid = valid & (n >= inp.n_min)[:, None]
            if in_cache:  # the drafted rows leave the cache (upstream's seq_rm after drafting)
                cache = keep_prefix(loop_cache, jnp.where(drafting, state.pending_pos + 1, big))
            new_state = replace(state, cache=cache)
            return new_state, DraftOutput(
                tokens=tokens, valid=valid, q=q if self.probabilistic else None
            )

        def skip(state: Eagle3State) -> tuple[Eagle3State, DraftOutput]:
            out = empty_draft_q(B, k_max, V, self.probabilistic)
            return state, out

        # a loop run 0 or 1 times, not lax.cond: its branches would copy the state (the cache
        # and the [B, S, D] snapshot `verify_g`) in and out on every ask
        return run_once(jnp.any(drafting), lambda c: run(c[0]), skip(state))

    # ------------------------------------------------------------------------ checkpoints
    # (get_state, set_state, spec_state, set_spec_state: `PendingBoundary`)
