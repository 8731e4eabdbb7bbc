"""draft-mtp: the target's own NextN/MTP block(s) as the drafter (llama.cpp section 5.3,
`common_speculative_impl_draft_mtp`, standard and chain-heads modes).

The block (specjax.models.qwen35_mtp) reads pairs: its row at position p is `(x_p, h_{p-1})`,
the token at p with the target's `h_nextn` of position p - 1 (final-normed hidden, exported by
the target forward under `TargetBatch.hidden[H_NEXTN]`). The last h of a batch pairs with the
first token of the NEXT batch, so it is carried as explicit per-row state:

    pending_h [B, D], pending_pos [B]   h of the row at pending_pos (-1 = none yet)
    verify_h [B, S, D], verify_pos_first [B], verify_rows [B]
                                         the target's h rows of the last `process`

* `process(batch)`: per row with evaluated tokens `[beg, end]`: the first token is paired with
  `pending_h` (upstream); token k > beg is paired with the target h of row k - 1. Every head
  runs the batch and its K/V is written at the batch positions (chain heads: each head its own
  layer, as upstream's per-head `seq_rm` + decode). Then `verify_h = h[beg..end]`,
  `pending_h = h[end]`, `pending_pos = pos[end]`.
* `accept(n)`: `i = min(n, rows - 1)`; `pending_h = verify_h[i]`, `pending_pos =
  verify_pos_first + i`.
* `draft`, standard mode (one head): row 0 is `(id_last, pending_h)` at `pos0 = length`; step
  i: top-10 softmax of the row's logits, take the argmax; stop when its probability is <
  p_min; append; stop at the draft n_max; else the next row is `(token, h')` at pos0 + i + 1,
  h' the block's own output h of the previous row. Drafted rows live in a scratch and never
  enter the cache (upstream removes them: `seq_rm(draft, pos_max + 1, -1)`). Drafts shorter
  than n_min are cleared.
* chain-heads mode (more than one nextn block): n_max is clamped to the number of heads; step
  i runs head i over the whole prefix `[id_last, r_1..r_i]` at `pos0 + t` with h rows
  `[pending_h, h'_1..h'_i]` (h'_j from step j - 1) and reads the logits of its last row.
* `rollback(keep)`: `seq_rm(row, keep, -1)` on the block cache (the pending pair stays).
* `get_state` / `set_state`: a per-row blob, little-endian int32 `pending_pos` followed by D
  float32 of `pending_h` (the layout of EAGLE-3's blob); `get_state` returns None when
  `pending_pos < 0`, `set_state` ignores a blob of the wrong size. `spec_state` /
  `set_spec_state` are their traced form for every row: a checkpoint's `data_spec`. A
  checkpointed round (its `process` ran, its `accept` never comes) is undone by restoring the
  pre-round pairing from it, so the replay batch pairs its first token with the h it was paired
  with before. (Upstream's MTP keeps no blob: after a checkpoint restore it pairs the replay
  with the rejected round's last h, and drafts worse until the next accept.)

Greedy only: drafts are the argmax of the top-10 (the draft sampler upstream uses at any
temperature is top_k(10) then the argmax at p_min 0). Pure functions over the state pytree.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.drafters.base import (
    Drafter,
    DraftInput,
    DraftOutput,
    TargetBatch,
    TokenHistory,
    empty_draft,
    put_scratch_kv,
)
from specjax.drafters.draft_tokens import DRAFT_TOP_K, keep_draft_token, pick_draft_token
from specjax.drafters.feature_head import PendingBoundary, batch_span
from specjax.memory.kv import KVCache, keep_prefix
from specjax.memory.target import H_NEXTN  # (the id the target hands h_nextn under)
from specjax.models import qwen35
from specjax.models.llama import ExtraKV, commit_kv
from specjax.models.qwen35_mtp import new_nextn_cache, nextn_forward
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array, Params

if TYPE_CHECKING:
    from specjax.config import SpecConfig


@pytree_dataclass
class MtpState:
    cache: KVCache  # one layer per head
    pending_h: Array  # [B, D] float32
    pending_pos: Array  # [B] int32, -1 = none yet
    verify_h: Array  # [B, S, D] float32, rows 0..verify_rows-1 valid
    verify_pos_first: Array  # [B] int32
    verify_rows: Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class MtpDrafter(PendingBoundary, Drafter):
    name: ClassVar[str] = "draft-mtp"
    PENDING: ClassVar[str] = "pending_h"
    VERIFY: ClassVar[str] = "verify_h"
    #: reads no trunk layer by id (`hidden_layers` (), the engine's llama path);
    #: `reads_nextn` asks the hybrid engine for the target's h_nextn under H_NEXTN instead
    reads_nextn: ClassVar[bool] = True
    reads_target_hidden: ClassVar[bool] = True

    config: qwen35.Qwen35Config
    #: the longest draft (chain heads: already clamped to the head count)
    max_draft_len: int = dataclasses.field()
    top_k: int = DRAFT_TOP_K

    @classmethod
    def from_spec(cls, spec: SpecConfig, target: Any, draft: Any) -> tuple[Drafter, Any]:
        """The target's own nextn block(s) (upstream creates the MTP context on the target
        model when no draft path is given; a separate draft GGUF holding the block also
        works)."""
        source = target if draft is None else draft
        cfg = source.config
        if getattr(cfg, "arch", None) != "qwen35" or target.config.arch != "qwen35":
            raise ValueError(
                "draft-mtp runs the nextn block of a qwen35 model; got target "
                f"{getattr(target.config, 'arch', '?')!r}, draft {getattr(cfg, 'arch', '?')!r}"
            )
        if cfg.n_nextn < 1:
            raise ValueError(
                "draft-mtp needs a model with a nextn (MTP) block; "
                f"{'the target' if draft is None else 'the draft'} has none"
            )
        if cfg.D != target.config.D or cfg.V != target.config.V:
            raise ValueError(
                f"MTP block width/vocabulary ({cfg.D}, {cfg.V}) differ from the target's "
                f"({target.config.D}, {target.config.V})"
            )
        # the drafter stops at draft n_max (upstream); an explicit k_max caps it
        n_max = spec.draft_n_max if spec.k_max is None else min(spec.draft_n_max, spec.k_max)
        if cfg.n_nextn > 1:  # chain heads: one draft step per head (upstream clamps n_max)
            n_max = min(n_max, cfg.n_nextn)
        return cls(config=cfg, max_draft_len=max(1, n_max)), source.params

    def __post_init__(self) -> None:
        if self.config.n_nextn < 1:
            raise ValueError("draft-mtp needs a model with a nextn (MTP) block; it has none")
        if self.max_draft_len < 1:
            raise ValueError(f"draft-mtp max_draft_len must be >= 1, got {self.max_draft_len}")
        if self.chain_heads and self.max_draft_len > self.n_heads:
            raise ValueError(
                f"chain-heads draft-mtp drafts at most {self.n_heads} tokens (one per head), "
                f"got max_draft_len {self.max_draft_len}"
            )

    @property
    def n_heads(self) -> int:
        return self.config.n_nextn

    @property
    def chain_heads(self) -> bool:
        return self.n_heads > 1

    def init(self, batch: int, capacity: int) -> MtpState:
        D = self.config.D
        return MtpState(
            cache=new_nextn_cache(self.config, batch, capacity),
            pending_h=jnp.zeros((batch, D), jnp.float32),
            pending_pos=jnp.full((batch,), -1, jnp.int32),
            verify_h=jnp.zeros((batch, capacity, D), jnp.float32),
            verify_pos_first=jnp.full((batch,), -1, jnp.int32),
            verify_rows=jnp.zeros((batch,), jnp.int32),
        )

    def begin(self, state: MtpState, history: TokenHistory) -> MtpState:
        del history  # upstream only warns when process() missed a prefill chunk
        return state

    # ----------------------------------------------------------------------------- process
    def process(self, params: Params, state: MtpState, batch: TargetBatch) -> MtpState:
        cfg = self.config
        tokens, pos = batch.tokens, batch.positions
        T = tokens.shape[1]
        h = batch.hidden[H_NEXTN].astype(jnp.float32)  # [B, T, D]
        span = batch_span(batch)
        beg = span.beg
        first_h = state.pending_h
        shifted = jnp.concatenate([first_h[:, None], h[:, :-1]], axis=1)
        col = jnp.arange(T)[None, :]
        h_in = jnp.where((col == beg[:, None])[..., None], first_h[:, None], shifted)
        ks, vs, after = [], [], None
        for j in range(self.n_heads):
            out = nextn_forward(cfg, params, j, tokens, h_in.astype(cfg.dtype), pos, state.cache)
            ks.append(out.k)
            vs.append(out.v)
            after = out.hidden if after is None else after + out.hidden
        cache = commit_kv(state.cache, pos, tuple(ks), tuple(vs), after=after)

        return self.snapshot(state, span, h, cache=cache)

    # (accept: `PendingBoundary`)
    def rollback(self, state: MtpState, keep: Array) -> MtpState:
        return replace(state, cache=keep_prefix(state.cache, keep))

    # ------------------------------------------------------------------------------- draft
    def draft(
        self, params: Params, state: MtpState, inp: DraftInput, k_max: int
    ) -> tuple[MtpState, DraftOutput]:
        B = inp.last_token.shape[0]
        drafting = inp.drafting & (state.pending_pos >= 0)
        n_max = jnp.asarray(self.max_draft_len if inp.draft_n_max is None else inp.draft_n_max)
        limit = jnp.clip(jnp.minimum(n_max, self.max_draft_len), 1, k_max)  # first always taken
        run = self._draft_chain if self.chain_heads else self._draft_standard

        def go(state: MtpState) -> tuple[MtpState, DraftOutput]:
            tokens, valid, n = run(params, state, inp, drafting, limit, k_max)
            valid = valid & (n >= inp.n_min)[:, None]
            return state, DraftOutput(tokens=tokens, valid=valid)

        def skip(state: MtpState) -> tuple[MtpState, DraftOutput]:
            return state, empty_draft(B, k_max)

        return jax.lax.cond(jnp.any(drafting), go, skip, state)

    def _pick(
        self, i: Any, logits: Array, alive: Array, n: Array, tokens: Array, valid: Array,
        p_min: Array, limit: Array,
    ) -> tuple[Array, Array, Array, Array, Array]:  # fmt: skip
        """Top-10 softmax, argmax; keep it unless p < p_min; stop at `limit` tokens
        (`draft_tokens.pick_draft_token` / `keep_draft_token`)."""
        pick = pick_draft_token(logits, self.top_k)
        alive, n, tokens, valid = keep_draft_token(i, pick, alive, n, tokens, valid, p_min, limit)
        return pick.token, alive, n, tokens, valid

    def _draft_standard(
        self, params: Params, state: MtpState, inp: DraftInput, drafting: Array, limit: Array,
        k_max: int,
    ) -> tuple[Array, Array, Array]:  # fmt: skip
        cfg = self.config
        B = drafting.shape[0]
        pos0 = inp.history.length.astype(jnp.int32)
        shape = (B, cfg.G, k_max, cfg.E)
        dtype = state.cache.k[0].dtype
        scratch0 = ExtraKV(
            k=(jnp.zeros(shape, dtype),),
            v=(jnp.zeros(shape, dtype),),
            pos=jnp.full((B, k_max), -1, jnp.int32),
        )

        def cond(carry: tuple[Any, ...]) -> Array:
            i, _, _, _, alive, _, _, _ = carry
            return (i < k_max) & jnp.any(alive)

        def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            i, scratch, tok, h, alive, n, tokens, valid = carry
            p = jnp.where(alive, pos0 + i, -1)
            o = nextn_forward(
                cfg, params, 0, tok[:, None], h[:, None].astype(cfg.dtype), p[:, None],
                state.cache, extra=scratch,
            )  # fmt: skip
            scratch = ExtraKV(
                k=(put_scratch_kv(scratch.k[0], i, o.k),),
                v=(put_scratch_kv(scratch.v[0], i, o.v),),
                pos=jax.lax.dynamic_update_slice_in_dim(scratch.pos, p[:, None], i, 1),
            )
            tok, alive, n, tokens, valid = self._pick(
                i, o.logits[:, 0], alive, n, tokens, valid, inp.p_min, limit
            )
            return i + 1, scratch, tok, o.hidden[:, 0].astype(jnp.float32), alive, n, tokens, valid

        init = (
            jnp.zeros((), jnp.int32),
            scratch0,
            inp.last_token.astype(jnp.int32),
            state.pending_h,
            drafting,
            jnp.zeros((B,), jnp.int32),
            jnp.zeros((B, k_max), jnp.int32),
            jnp.zeros((B, k_max), bool),
        )
        _, _, _, _, _, n, tokens, valid = jax.lax.while_loop(cond, body, init)
        return tokens, valid, n

    def _draft_chain(
        self, params: Params, state: MtpState, inp: DraftInput, drafting: Array, limit: Array,
        k_max: int,
    ) -> tuple[Array, Array, Array]:  # fmt: skip
        cfg = self.config
        B = drafting.shape[0]
        W = self.max_draft_len  # rows of the longest prefix (static)
        pos0 = inp.history.length.astype(jnp.int32)
        seq = jnp.zeros((B, W), jnp.int32).at[:, 0].set(inp.last_token.astype(jnp.int32))
        hs = jnp.zeros((B, W, cfg.D), jnp.float32).at[:, 0].set(state.pending_h)
        alive, n = drafting, jnp.zeros((B,), jnp.int32)
        tokens, valid = jnp.zeros((B, k_max), jnp.int32), jnp.zeros((B, k_max), bool)
        for i in range(min(W, k_max)):  # step i: head i over the prefix rows 0..i
            rows = jnp.arange(W)[None, :] <= i
            p = jnp.where(alive[:, None] & rows, pos0[:, None] + jnp.arange(W)[None, :], -1)
            o = nextn_forward(cfg, params, i, seq, hs.astype(cfg.dtype), p, state.cache)
            tok, alive, n, tokens, valid = self._pick(
                i, o.logits[:, i], alive, n, tokens, valid, inp.p_min, limit
            )
            if i + 1 < W:
                seq = seq.at[:, i + 1].set(tok)
                hs = hs.at[:, i + 1].set(o.hidden[:, i].astype(jnp.float32))
        return tokens, valid, n

    # ------------------------------------------------------------------------ checkpoints
    # (get_state, set_state, spec_state, set_spec_state: `PendingBoundary`)
