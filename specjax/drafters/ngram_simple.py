"""ngram-simple (llama.cpp `common_ngram_simple_draft`, spec 5.5): stateless prompt lookup.

For a row with history `t[0:L]` (L = `history.length`) and `sampled = last_token`:
* no draft unless `L > n + m + 1`;
* pattern = `t[L-n+1:L] + [sampled]` (length n); the match is the LARGEST `j` in `[1, L-n-1]`
  with `t[j:j+n] == pattern` (position 0 is never a match);
* `copy = min(m, L - (j + n))`; no draft if `copy < n` (upstream compares with n, not m);
* draft = `t[j+n : j+n+copy]`, truncated to the static `k_max` (the relay truncates to the
  row's `n_max` afterwards).

All of it is one vectorised pass: a sliding-window equality over the history (n compares of
shifted views), then a masked max. The pass covers the smallest prefix in a ladder of widths
(64, 256, 1024, ... x4, then S; `lax.switch`) that holds every row's history, so its cost
follows the used context, not the capacity; while no row's history is longer than n + m + 1
there is no pass at all, and the compares stop once no window can match (upstream returns
early in both cases too). No state, so `begin/process/accept/rollback` are
no-ops.

This module also holds the small window helpers the other n-gram drafters share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from specjax.drafters.base import (
    DraftInput,
    DraftOutput,
    ModelFreeDrafter,
    TokenHistory,
    empty_draft,
)
from specjax.pytree import pytree_dataclass
from specjax.types import Array

# ---------------------------------------------------------------------------------------------
# shared helpers (one row; tokens are int32 [S])
# ---------------------------------------------------------------------------------------------


def pad_tokens(tokens_S: Array, extra: int) -> Array:
    """`tokens` followed by `extra` zeros, so every static-size window read stays in bounds."""
    return jnp.concatenate([tokens_S.astype(jnp.int32), jnp.zeros((extra,), jnp.int32)])


def window_equal(pad_P: Array, pattern_N: Array, count: int, offset: int = 0) -> Array:
    """`[count]` bool: `pad[j+offset : j+offset+N] == pattern` for every start j < count.

    `pad` must hold at least `count + offset + N` cells. Computed as up to N shifted compares,
    from the pattern's last token back: the loop stops once no start can match any more, so a
    search that finds nothing costs a few compares, not N (N is 1024 for some users).
    """
    n = pattern_N.shape[0]

    def body(c: tuple[Array, Array]) -> tuple[Array, Array]:
        k, eq = c
        view = lax.dynamic_slice(pad_P, (k + offset,), (count,))
        return k - 1, eq & (view == pattern_N[k])

    init = (jnp.int32(n - 1), jnp.ones((count,), bool))
    return lax.while_loop(lambda c: (c[0] >= 0) & jnp.any(c[1]), body, init)[1]


def last_pattern(pad_P: Array, length: Array, sampled: Array, n: int) -> Array:
    """`[n]` int32: the last `n-1` history tokens followed by `sampled` (needs length >= n-1)."""
    idx = jnp.clip(length - n + 1 + jnp.arange(n, dtype=jnp.int32), 0, pad_P.shape[0] - 1)
    key = pad_P[idx]
    return jnp.where(jnp.arange(n) == n - 1, sampled.astype(jnp.int32), key)


def slice_draft(pad_P: Array, start: Array, n_draft: Array, k_max: int) -> DraftOutput:
    """A one-row draft `pad[start : start+n_draft]` truncated to `k_max` (n_draft may be <= 0)."""
    toks = lax.dynamic_slice(pad_P, (start,), (k_max,))
    valid = jnp.arange(k_max, dtype=jnp.int32) < n_draft
    return DraftOutput(tokens=jnp.where(valid, toks, 0), valid=valid)


# ---------------------------------------------------------------------------------------------
# drafter
# ---------------------------------------------------------------------------------------------


@pytree_dataclass
class NgramSimpleState:
    """ngram-simple keeps no state (an empty pytree)."""


@dataclass(frozen=True)
class NgramSimple(ModelFreeDrafter):
    """llama.cpp `ngram-simple` (`--spec-ngram-simple-size-n/-size-m`)."""

    name: ClassVar[str] = "ngram-simple"
    #: No state: a round the governor turns off may skip the call (`engine.spec_step`).
    idle_noop: ClassVar[bool] = True
    ask_steps: ClassVar[float] = 0.07
    spec_options: ClassVar[tuple[str, ...]] = ("size_n", "size_m")
    size_n: int = 12
    size_m: int = 48

    def __post_init__(self) -> None:
        if self.size_n < 1 or self.size_m < 1:
            raise ValueError("ngram-simple: size_n and size_m must be >= 1")

    def init(self, batch: int, capacity: int) -> NgramSimpleState:
        del batch, capacity
        return NgramSimpleState()

    def begin(
        self, state: NgramSimpleState, history: TokenHistory, rows: Array | None = None
    ) -> NgramSimpleState:
        del history, rows
        return state

    def lookup_size(self) -> int:
        return self.size_n

    def lookup_gap(self) -> int:
        # the match ends at p = j + n - 1 and needs copy = L - (j + n) >= n: p <= L - 1 - n
        return self.size_n

    def draft(
        self, params: Any, state: NgramSimpleState, inp: DraftInput, k_max: int
    ) -> tuple[NgramSimpleState, DraftOutput]:
        del params
        n, m = self.size_n, self.size_m
        S = inp.history.tokens.shape[1]

        def scan(width: int) -> Any:
            def run(tokens_BW: Array) -> DraftOutput:
                def row(tokens: Array, length: Array, sampled: Array, drafting: Array) -> Any:
                    pad = pad_tokens(tokens, n + m + k_max + 1)
                    pattern = last_pattern(pad, length, sampled, n)
                    eq = window_equal(pad, pattern, width)
                    pos = jnp.arange(width, dtype=jnp.int32)
                    cand = eq & (pos >= 1) & (pos <= length - n - 1)
                    j = jnp.max(jnp.where(cand, pos, 0))
                    copy = jnp.minimum(m, length - (j + n))
                    ok = drafting & (length > n + m + 1) & (j > 0) & (copy >= n)
                    return slice_draft(pad, j + n, jnp.where(ok, copy, 0), k_max)

                return jax.vmap(row)(tokens_BW, inp.history.length, inp.last_token, inp.drafting)

            return lambda tokens_BS: run(tokens_BS[:, :width])

        # scan only the used prefix: the smallest width in the ladder holding every row's
        # history; no scan at all while no row's history is long enough to draft from
        widths = scan_widths(S)
        need = jnp.max(inp.history.length) + 1
        index = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < need)
        can_draft = jnp.any(inp.drafting & (inp.history.length > n + m + 1))
        nothing = empty_draft(inp.history.tokens.shape[0], k_max)
        branches = [lambda _: nothing] + [scan(w) for w in widths]
        out = lax.switch(jnp.where(can_draft, index + 1, 0), branches, inp.history.tokens)
        return state, out


def scan_widths(capacity: int) -> tuple[int, ...]:
    """History prefixes ngram-simple may scan: 64, 256, 1024, ... (x4), then the capacity."""
    widths = []
    w = 64
    while w < capacity:
        widths.append(w)
        w *= 4
    return (*widths, capacity)
