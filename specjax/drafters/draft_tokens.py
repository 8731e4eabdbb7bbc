"""The draft-token step of the model drafters (draft-simple, draft-eagle3, draft-mtp, and
draft-dflash / draft-dspark over a whole block), as llama.cpp's `common_speculative` drafts:

* `pick_draft_token`: the top-k (10) of a row's logits and their softmax; the draft is the
  top candidate, its probability the one `p_min` is tested against. In probabilistic mode
  (`--spec-draft-sampling probabilistic`) rows at temperature > 0 sample the draft from the
  tempered top-k (one key per row) and test the tempered top probability; the tempered top-k
  scattered into a full-vocabulary row is the q of rejection sampling.
* `keep_draft_token`: the greedy chain's bookkeeping: slot i keeps the token while the row is
  alive and its probability is >= p_min; the row stops at the first token it drops or at
  `limit` kept tokens.

Invariants: pure functions of their arguments; a dead row writes token 0, valid False and a
zero q row; the results are those of the drafters' former copies bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.drafters.base import DraftOutput, empty_draft
from specjax.types import Array, PRNGKey

#: llama.cpp's top-k of a drafted row (`common_speculative`'s sampler).
DRAFT_TOP_K = 10


class DraftPick(NamedTuple):
    token: Array  # [...] int32, the draft
    prob: Array  # [...] float32, the probability the p_min test reads
    top_vals: Array  # [..., K] the top-k logits
    q: Array | None  # [B, V] float32 rejection-sampling q (probabilistic mode), else None


def pick_draft_token(
    logits: Array,
    top_k: int,
    temperature_B: Array | None = None,
    keys: PRNGKey | None = None,
    q_width: int | None = None,
) -> DraftPick:
    """The draft token of each row of `logits` [..., V]: the top of its top-k (`top_k`
    clamped to V, as upstream's sampler). With `temperature_B` and `keys` ([B] rows of
    [B, V] logits): rows at temperature > 0 sample from the tempered top-k instead, and q
    rows are `q_width` wide (default V; the target's vocabulary when the logits are a
    draft model's shared part)."""
    top_vals, top_ids = sampling.small_top_k(logits, min(top_k, logits.shape[-1]))
    probs = jax.nn.softmax(top_vals, axis=-1)
    token = top_ids[..., 0]
    q = None
    if temperature_B is not None:
        assert keys is not None, "probabilistic drafting needs a key per row"
        B, V = logits.shape
        V = V if q_width is None else q_width
        sampled_mode = temperature_B > 0
        t = jnp.where(sampled_mode, temperature_B, 1.0)[:, None]
        tempered = jax.nn.softmax(top_vals / t, axis=-1)
        choice = jax.vmap(jax.random.categorical)(keys, jnp.log(tempered))
        sampled = jnp.take_along_axis(top_ids, choice[:, None], axis=1)[:, 0]
        token = jnp.where(sampled_mode, sampled, token)
        probs = jnp.where(sampled_mode[:, None], tempered, probs)
        q = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], top_ids].set(tempered)
    return DraftPick(token.astype(jnp.int32), probs[..., 0], top_vals, q)


def keep_draft_token(
    i: Array | int,
    pick: DraftPick,
    alive: Array,
    n: Array,
    tokens: Array,
    valid: Array,
    p_min: Array,
    limit: Array,
) -> tuple[Array, Array, Array, Array]:
    """Slot i of the [B, K] draft: (alive, n, tokens, valid) after the row keeps `pick`'s
    token (alive and its probability >= p_min) or stops."""
    keep = alive & (pick.prob >= p_min)
    tokens = jax.lax.dynamic_update_slice_in_dim(
        tokens, jnp.where(keep, pick.token, 0)[:, None], i, 1
    )
    valid = jax.lax.dynamic_update_slice_in_dim(valid, keep[:, None], i, 1)
    n = n + keep.astype(jnp.int32)
    return keep & (n < limit), n, tokens, valid


def empty_draft_q(B: int, k_max: int, V: int, probabilistic: bool) -> DraftOutput:
    """`empty_draft` with a zero q [B, k_max, V] in probabilistic mode."""
    out = empty_draft(B, k_max)
    if probabilistic:
        out = DraftOutput(tokens=out.tokens, valid=out.valid, q=zero_q(B, k_max, V, True))
    return out


def zero_q(B: int, k_max: int, V: int, probabilistic: bool) -> Array:
    """The draft loop's q carry: [B, k_max, V] zeros in probabilistic mode, else a scalar."""
    if probabilistic:
        return jnp.zeros((B, k_max, V), jnp.float32)
    return jnp.zeros((), jnp.float32)


def record_q(i: Array | int, pick: DraftPick, alive: Array, q_BKV: Array) -> Array:
    """Slot i of the [B, K, V] rejection-sampling q: the pick's q on alive rows, else 0."""
    assert pick.q is not None
    return q_BKV.at[:, i].set(jnp.where(alive[:, None], pick.q, 0.0))
