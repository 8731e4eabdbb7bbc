"""draft-simple: a separate small draft model with its own KV cache (llama.cpp section 5.1).

Invariants:
* The draft cache mirrors the target's memory: `process` evaluates every target batch
  (prompt and verify rows alike) on the draft model, and `rollback` trims it exactly as the
  target is trimmed. Between rounds it holds positions 0..length-1 of every row.
* `draft` runs the whole k-step loop on device (`lax.scan` over K) and returns the state it
  was given: its own drafted cells are discarded, as llama.cpp's
  `seq_rm(ctx_dft, pos_max + 1, -1)` after drafting does; `process` re-mirrors the verify
  batch.
* Drafting samples from a softmax over the top-10 draft logits at temperature 1 and takes
  the argmax; a row stops when that top probability is < p_min (token not added) or its
  length reaches its budget; drafts shorter than n_min are cleared.
* Probabilistic mode (static flag, used when the target samples at temperature > 0): the
  top-10 distribution is tempered with the target's temperature, the drafted token is
  sampled from it with a key from `seed ^ 0x85ebca6b` (llama.cpp's `spec_retune`), and q
  (that distribution over the full vocabulary) is returned for rejection sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.cache import KVCache, keep_prefix
from specjax.drafters.base import DraftInput, DraftOutput, TargetBatch, TokenHistory, empty_draft
from specjax.errors import VocabMismatchError
from specjax.models.config import ModelConfig
from specjax.models.llama import forward_fn, new_cache
from specjax.pytree import pytree_dataclass
from specjax.types import Array, Params

#: llama.cpp's constants in `common_speculative_are_compatible`.
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5
#: `spec_retune` mixes the target seed so draft and target RNG streams differ.
DRAFT_SEED_XOR = 0x85EBCA6B
DRAFT_TOP_K = 10


@pytree_dataclass
class DraftSimpleState:
    cache: KVCache


@dataclasses.dataclass(frozen=True)
class DraftSimple:
    name: ClassVar[str] = "draft-simple"
    hidden_layers: ClassVar[tuple[int, ...]] = ()

    config: ModelConfig
    target_vocab: int
    probabilistic: bool = False
    top_k: int = DRAFT_TOP_K

    def init(self, batch: int, capacity: int) -> DraftSimpleState:
        return DraftSimpleState(cache=new_cache(self.config, batch, capacity))

    def begin(self, state: DraftSimpleState, history: TokenHistory) -> DraftSimpleState:
        del history
        return state

    def process(
        self, params: Params, state: DraftSimpleState, batch: TargetBatch
    ) -> DraftSimpleState:
        out = forward_fn(self.config, params, batch.tokens, batch.positions, state.cache)
        return DraftSimpleState(cache=out.cache)

    def accept(
        self, state: DraftSimpleState, n_accepted: Array, is_other: Array, active: Array
    ) -> DraftSimpleState:
        del n_accepted, is_other, active
        return state

    def rollback(self, state: DraftSimpleState, keep: Array) -> DraftSimpleState:
        return DraftSimpleState(cache=keep_prefix(state.cache, keep))

    def draft(
        self, params: Params, state: DraftSimpleState, inp: DraftInput, k_max: int
    ) -> tuple[DraftSimpleState, DraftOutput]:
        B = inp.last_token.shape[0]
        V = self.target_vocab
        n_shared = min(V, self.config.V)

        def run(_: Any) -> DraftOutput:
            seed = inp.seed if inp.seed is not None else jnp.zeros((B,), jnp.int32)
            draft_seed = jnp.bitwise_xor(seed.astype(jnp.uint32), jnp.uint32(DRAFT_SEED_XOR))
            limit = jnp.minimum(inp.n_max, k_max)
            if inp.draft_n_max is not None:
                limit = jnp.minimum(limit, inp.draft_n_max)
            temp = inp.temperature.astype(jnp.float32)
            rows = jnp.arange(B)

            def cond(carry):
                i, _, _, alive, _, _, _, _ = carry
                return (i < k_max) & jnp.any(alive)

            def body(carry):
                i, cache, tok, alive, n, tokens, valid, q = carry
                pos = jnp.where(alive, inp.history.length + i, -1)
                out = forward_fn(self.config, params, tok[:, None], pos[:, None], cache)
                logits = out.logits[:, 0, :n_shared]
                top_vals, top_ids = jax.lax.top_k(logits, self.top_k)
                probs = jax.nn.softmax(top_vals, axis=-1)
                token = top_ids[:, 0]
                if self.probabilistic:
                    sampled_mode = temp > 0
                    t = jnp.where(sampled_mode, temp, 1.0)[:, None]
                    tempered = jax.nn.softmax(top_vals / t, axis=-1)
                    keys = sampling.make_keys(
                        draft_seed, inp.history.length + i + 1, sampling.ROLE_DRAFT
                    )
                    choice = jax.vmap(jax.random.categorical)(keys, jnp.log(tempered))
                    sampled = jnp.take_along_axis(top_ids, choice[:, None], axis=1)[:, 0]
                    token = jnp.where(sampled_mode, sampled, token)
                    probs = jnp.where(sampled_mode[:, None], tempered, probs)
                    q_row = jnp.zeros((B, V), jnp.float32).at[rows[:, None], top_ids].set(tempered)
                    q = q.at[:, i].set(jnp.where(alive[:, None], q_row, 0.0))
                keep = alive & (probs[:, 0] >= inp.p_min)
                tokens = tokens.at[:, i].set(jnp.where(keep, token, 0).astype(jnp.int32))
                valid = valid.at[:, i].set(keep)
                n = n + keep.astype(jnp.int32)
                alive = keep & (n < limit)
                return i + 1, out.cache, token.astype(jnp.int32), alive, n, tokens, valid, q

            q0 = (
                jnp.zeros((B, k_max, V), jnp.float32)
                if self.probabilistic
                else jnp.zeros((), jnp.float32)
            )
            init = (
                jnp.zeros((), jnp.int32),
                state.cache,
                inp.last_token.astype(jnp.int32),
                inp.drafting & (limit > 0),
                jnp.zeros((B,), jnp.int32),
                jnp.zeros((B, k_max), jnp.int32),
                jnp.zeros((B, k_max), bool),
                q0,
            )
            _, _, _, _, n, tokens, valid, q = jax.lax.while_loop(cond, body, init)
            valid = valid & (n >= jnp.maximum(inp.n_min, 1))[:, None]
            return DraftOutput(tokens=tokens, valid=valid, q=q if self.probabilistic else None)

        def skip(_: Any) -> DraftOutput:
            out = empty_draft(B, k_max)
            if self.probabilistic:
                out = DraftOutput(
                    tokens=out.tokens, valid=out.valid, q=jnp.zeros((B, k_max, V), jnp.float32)
                )
            return out

        result = jax.lax.cond(jnp.any(inp.drafting), run, skip, None)
        return state, result


def check_vocab_compatible(
    target_tok: Any, draft_tok: Any, n_vocab_tgt: int, n_vocab_dft: int
) -> None:
    """llama.cpp's `common_speculative_are_compatible`; raises VocabMismatchError with the reason."""
    if getattr(target_tok, "vocab_type", None) != getattr(draft_tok, "vocab_type", None):
        raise VocabMismatchError(
            f"draft vocab type {getattr(draft_tok, 'vocab_type', None)!r} differs from the "
            f"target's {getattr(target_tok, 'vocab_type', None)!r}"
        )
    for special in ("bos", "eos"):
        add_t = bool(getattr(target_tok, f"add_{special}", False))
        add_d = bool(getattr(draft_tok, f"add_{special}", False))
        id_t = getattr(target_tok, f"{special}_id", None)
        id_d = getattr(draft_tok, f"{special}_id", None)
        if add_t != add_d or (add_t and id_t != id_d):
            raise VocabMismatchError(
                f"draft {special.upper()} settings (add={add_d}, id={id_d}) differ from the "
                f"target's (add={add_t}, id={id_t})"
            )
    if abs(n_vocab_tgt - n_vocab_dft) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        raise VocabMismatchError(
            f"draft vocab size {n_vocab_dft} differs from the target's {n_vocab_tgt} by more "
            f"than {SPEC_VOCAB_MAX_SIZE_DIFFERENCE}"
        )
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(n_vocab_tgt, n_vocab_dft)):
        t, d = target_tok.token_text(i), draft_tok.token_text(i)
        if t != d:
            raise VocabMismatchError(
                f"draft token {i} is {d!r} but the target's token {i} is {t!r}"
            )
