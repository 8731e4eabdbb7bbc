"""draft-dflash / draft-dspark: block drafting from target features (llama.cpp section 5.4).

One implementation for both types (upstream's `common_speculative_impl_draft_dflash`); the
state is the head's KV cache only (`accept` is a no-op, there is no deferred boundary):

* `process(batch)`: for every evaluated row of the batch (prompt chunk or verify batch, the
  rejected rows included, as upstream) `g = encode(features)` and K/V of every layer computed
  from `g` are written into the head's cache at the row's real position (KV injection).
* `draft`: for rows asked to draft, one forward of the block `[id_last, MASK x (n_block - 1)]`
  at positions `n_past + j` over the injected context (positions < n_past) and the whole
  block without a causal mask. `n_block = n + 1` for DFlash and DSpark without
  `sample_from_anchor`, `n` for DSpark with it, where `n` is the draft model's n_max
  (`draft_n_max`, NOT the caller's budget: the relay truncates) clamped to `max_draft`.
  - DFlash: block rows 1..n_block-1 in order; the top-10 softmax's top candidate; stop at
    the first probability < p_min.
  - DSpark: rows from 0 (anchor) or 1; with p_min > 0 stop when the row's confidence is
    < p_min (no probability check); the logits carry the Markov bias.
  - drafts shorter than n_min (clamped like n_max) are cleared.
  The block's K/V are never written to the cache (upstream writes then removes them).
* `rollback(keep)`: `seq_rm(row, keep, -1)` on the head's cache (upstream's caller trims the
  draft context to n_past after verification; the verify batch re-injects real features).
* `get_state` / `set_state`: upstream has none for this drafter (None / ignored).
* `record(batch)` (`idle_record`: a round in which the governor lets no row draft, one
  evaluated token per row): the row's features and position go to a log (`LOG_ROWS` per
  row) instead of through `fc` and the K/V projections; the next `process` or `draft` (or a
  `record` finding the log full) injects the logged rows in one batch first, and `rollback`
  drops logged rows >= keep. Injection is per row (no attention), so the cache is the one
  `process` of each batch leaves, cell for cell.

Invariant: the draft for a row reads only cache cells at positions < n_past (the block sees
no stale injected rows even when a caller skipped `rollback`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import jax.numpy as jnp

from specjax.control import run_once
from specjax.drafters.base import (
    Drafter,
    DraftInput,
    DraftOutput,
    TargetBatch,
    empty_draft,
)
from specjax.drafters.draft_tokens import pick_draft_token
from specjax.drafters.feature_head import LOG_ROWS, FeatureHeadDrafter
from specjax.memory.kv import KVCache, keep_prefix
from specjax.models import dflash as df
from specjax.models.llama import commit_kv, new_cache
from specjax.pytree import pytree_dataclass
from specjax.types import Array

if TYPE_CHECKING:
    from specjax.config import SpecConfig


@pytree_dataclass
class DFlashState:
    cache: KVCache  # the head's KV ([B, G, S, E] per layer)
    # rows `record` kept for later (`LOG_ROWS` per row, position -1 = empty)
    log_feats: Array  # [B, LOG_ROWS, F] float32, the target's features (`gather_features`)
    log_pos: Array  # [B, LOG_ROWS] int32
    log_n: Array  # [B] int32, slots used (dropped rows included)


def clamp_draft_sizes(
    config: df.DFlashConfig, dspark: bool, n_max: int, n_min: int
) -> tuple[int, int, str | None]:
    """Upstream's constructor clamp: (n_max, n_min, warning or None)."""
    limit = config.max_draft(dspark)
    if n_max > limit or n_min > limit:
        msg = (
            f"requested draft size (n_max={n_max}, n_min={n_min}) exceeds the trained block "
            f"size {config.block_size} -- clamping to {limit}"
        )
        return min(n_max, limit), min(n_min, limit), msg
    return n_max, n_min, None


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(FeatureHeadDrafter):
    name: ClassVar[str] = "draft-dflash"
    head_module: ClassVar[Any] = df
    KIND: ClassVar[str] = "DFlash"

    config: df.DFlashConfig
    #: (max_draft_len: the block width is max_draft_len (+ 1 without the anchor))
    dspark: bool = False
    #: What one ask (one block forward) costs on CPU, in plain rounds of the shipped target:
    #: the governor's price (`prices.chain_call_price`; the cost model has no per-token draft
    #: step for block drafters). benchmarks/governor.py ask --heads at gap 8, n_max 4, the
    #: shipped DFlash head (block 8): 1.25 rounds (benchmarks/results/governor-ask.json).
    ask_steps: ClassVar[float] = 1.25

    @classmethod
    def from_spec(cls, spec: SpecConfig, target: Any, draft: Any) -> tuple[Drafter, Any]:
        """The drafter for a DFlash head (`DSparkDrafter`: a DSpark head), checked against
        the target; its parameters are the head's and the target's weights it shares."""
        dspark = cls.dspark  # (the field's default: each class's own kind)
        kind = cls.name
        cfg: df.DFlashConfig = cls.head_config(draft, target, df.DFlashConfig, "dflash")
        if dspark and not cfg.is_dspark:
            raise ValueError(f"{kind} needs a DSpark head (markov_w1/markov_w2); this is DFlash")
        if dspark and spec.draft_p_min > 0 and not cfg.has_confidence:
            raise ValueError("DSpark draft has no confidence head: please set --spec-draft-p-min 0")
        tc = target.config
        if (not cfg.own_embed or not cfg.own_lm_head) and cfg.D != tc.D:
            raise ValueError(
                f"DFlash head of width {cfg.D} shares the target's embeddings / LM head "
                f"(width {tc.D})"
            )
        drafter, warning = make_drafter(cfg, dspark, spec.draft_n_max, spec.draft_n_min, spec.k_max)
        if warning is not None:
            warnings.warn(f"{kind}: {warning}", stacklevel=3)
        return drafter, cls.head_params(cfg, draft, target)

    def __post_init__(self) -> None:
        limit = self.config.max_draft(self.dspark)
        if not 1 <= self.max_draft_len <= limit:
            raise ValueError(
                f"max_draft_len must be in 1..{limit} (block_size {self.config.block_size}), "
                f"got {self.max_draft_len}"
            )

    @property
    def anchor(self) -> bool:
        """DSpark with `sample_from_anchor`: the draft starts at block row 0."""
        return self.dspark and self.config.sample_from_anchor

    @property
    def block_width(self) -> int:
        return self.max_draft_len + (0 if self.anchor else 1)

    def init(self, batch: int, capacity: int) -> DFlashState:
        return DFlashState(
            cache=new_cache(self.config.layer_config, batch, capacity),
            log_feats=jnp.zeros((batch, LOG_ROWS, self.config.n_embd_enc), jnp.float32),
            log_pos=jnp.full((batch, LOG_ROWS), -1, jnp.int32),
            log_n=jnp.zeros((batch,), jnp.int32),
        )

    def process(self, params: Any, state: DFlashState, batch: TargetBatch) -> DFlashState:
        state = self.flush(params, state)
        feats = df.gather_features(self.config, batch.hidden)
        cache = self._inject(params, state.cache, feats, batch.positions.astype(jnp.int32))
        return dataclasses.replace(state, cache=cache)

    def _inject(self, params: Any, cache: KVCache, feats: Array, pos: Array) -> KVCache:
        """The KV injection of rows `feats` [B, T, F] at `pos` [B, T] (-1 = padding)."""
        cfg, head = self.config, params["head"]
        g = df.encode(cfg, head, feats)
        kv = df.inject_kv(cfg, head, g, pos, cache)
        return commit_kv(cache, pos, kv.k, kv.v, after=g)

    def flush(self, params: Any, state: DFlashState) -> DFlashState:
        """The logged rows injected (a loop run 0 or 1 times: nothing when the log is
        empty), the log emptied."""

        return self.flush_log(
            state, lambda s: self._inject(params, s.cache, s.log_feats, s.log_pos)
        )

    def record(self, params: Any, state: DFlashState, batch: TargetBatch) -> DFlashState:
        """`process` of a batch with at most one evaluated token per row (no draft),
        deferred: the row's features logged (see the module docstring)."""
        state = self.flush_if_full(params, state)
        has, _, pos_beg, at_beg = self.first_row(batch)
        feats = df.gather_features(self.config, at_beg)[:, 0].astype(jnp.float32)  # [B, F]
        slot = jnp.where(has, state.log_n, LOG_ROWS)  # LOG_ROWS: dropped
        rows = jnp.arange(has.shape[0])
        return dataclasses.replace(
            state,
            log_feats=state.log_feats.at[rows, slot].set(feats, mode="drop"),
            log_pos=state.log_pos.at[rows, slot].set(pos_beg, mode="drop"),
            log_n=state.log_n + has.astype(jnp.int32),
        )

    def accept(
        self, state: DFlashState, n_accepted: Array, is_other: Array, active: Array
    ) -> DFlashState:
        del n_accepted, is_other, active  # upstream: no-op
        return state

    def block_inputs(self, inp: DraftInput, k_max: int) -> tuple[Array, Array, Array, Array]:
        """(tokens [B, W], positions, mask positions, n_draft [B]) of the drafting rows'
        blocks; rows not drafting and cells past n_block are padding (position -1)."""
        B = inp.last_token.shape[0]
        W = self.block_width
        n_max = inp.draft_n_max if inp.draft_n_max is not None else jnp.asarray(k_max)
        n_draft = jnp.clip(n_max, 0, min(self.max_draft_len, k_max)).astype(jnp.int32)
        n_block = n_draft + (0 if self.anchor else 1)
        n_block = jnp.where(inp.drafting, n_block, 0)
        j = jnp.arange(W, dtype=jnp.int32)[None, :]
        tokens = jnp.where(j == 0, inp.last_token[:, None], self.config.mask_token_id)
        n_past = inp.history.length.astype(jnp.int32)[:, None]
        live = j < n_block[:, None]
        positions = jnp.where(live, n_past + j, -1)
        mask_pos = jnp.where(live, n_past + n_block[:, None] - 1, -1)
        return tokens.astype(jnp.int32), positions, mask_pos, jnp.broadcast_to(n_draft, (B,))

    def draft(
        self, params: Any, state: DFlashState, inp: DraftInput, k_max: int
    ) -> tuple[DFlashState, DraftOutput]:
        cfg = self.config
        B = inp.last_token.shape[0]
        drafting = inp.drafting

        def run(state: DFlashState) -> tuple[DFlashState, DraftOutput]:
            state = self.flush(params, state)
            tokens, positions, mask_pos, n_draft = self.block_inputs(inp, k_max)
            big = jnp.full((B,), state.cache.capacity + (1 << 20), jnp.int32)
            cache = keep_prefix(state.cache, jnp.where(drafting, inp.history.length, big))
            out = df.block_forward(
                cfg, params["head"], params["shared"], tokens, positions, mask_pos, cache
            )
            beg = 0 if self.anchor else 1
            logits = out.logits[:, beg:]  # [B, n, V]: draft index i = block row beg + i
            n = logits.shape[1]
            pick = pick_draft_token(logits, self.top_k)
            probs, ids = pick.prob, pick.token
            i = jnp.arange(n)[None, :]
            ok = i < n_draft[:, None]
            if self.dspark:
                if out.conf is not None:
                    conf = out.conf[:, beg:]
                    ok = ok & ((inp.p_min <= 0) | (conf >= inp.p_min))
            else:
                ok = ok & (probs >= inp.p_min)
            valid = jnp.cumprod(ok.astype(jnp.int32), axis=1).astype(bool) & drafting[:, None]
            length = jnp.sum(valid, axis=1)
            min_len = jnp.minimum(inp.n_min, cfg.max_draft(self.dspark))
            valid = valid & (length >= min_len)[:, None]
            pad = k_max - n
            tok_K = jnp.pad(jnp.where(valid, ids, 0), ((0, 0), (0, pad)))
            valid_K = jnp.pad(valid, ((0, 0), (0, pad)))
            return state, DraftOutput(tokens=tok_K, valid=valid_K)

        def skip(state: DFlashState) -> tuple[DFlashState, DraftOutput]:
            return state, empty_draft(B, k_max)

        # a loop run 0 or 1 times, not lax.cond: its branches would copy the state in and out
        return run_once(jnp.any(drafting), lambda c: run(c[0]), skip(state))

    def get_state(self, state: DFlashState, row: int) -> bytes | None:
        del state, row  # upstream keeps no boundary for this drafter
        return None

    def set_state(self, state: DFlashState, row: int, blob: bytes) -> DFlashState:
        del row, blob
        return state


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(DFlashDrafter):
    name: ClassVar[str] = "draft-dspark"
    dspark: bool = True


def make_drafter(
    config: df.DFlashConfig, dspark: bool, n_max: int, n_min: int, k_max: int | None
) -> tuple[DFlashDrafter, str | None]:
    """The drafter for a head, with upstream's clamp of n_max / n_min (and its warning)."""
    _, _, warning = clamp_draft_sizes(config, dspark, n_max, n_min)
    limit = config.max_draft(dspark)
    width = limit if k_max is None else max(1, min(k_max, limit))
    cls = DSparkDrafter if dspark else DFlashDrafter
    drafter = cls(
        config=config, hidden_layers=tuple(sorted(set(config.target_layers))), max_draft_len=width
    )
    # n_max / n_min themselves are traced per call (DraftInput), clamped again in `draft`
    return drafter, warning
