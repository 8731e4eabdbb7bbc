"""Host checks of a request, before anything is traced.

What `specjax.generate`, `Generator` and batch jobs take from a caller is checked and put in
the form the engine takes here: prompts tokenized (`_tokenize_prompts`) and their ids checked
against the vocabulary, per-row `max_new_tokens` / seeds / sampling values checked and
normalised as llama.cpp does (`_n_predict`, `_per_row`, `_sampling_args`), the static sizes
picked from a few buckets so repeated calls reuse compiled code (`prompt_bucket`,
`build_engine_inputs`), and stop strings applied to a finished row (`_apply_stop`). Errors are
ValueErrors that name the numbers.

`model` arguments are `specjax.Model`s (typed `Any`: this module sits below `specjax.api`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from specjax.types import Array


def _check_token_range(tokens: np.ndarray, vocab: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = int(tokens.max()) if tokens.max() >= vocab else int(tokens.min())
        raise ValueError(f"token id {bad} is out of range for a vocabulary of {vocab}")


def _bucket(n: int, minimum: int) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


def prompt_bucket(n: int) -> int:
    """The static prompt width for a longest prompt of `n` tokens: powers of two from 16,
    with a half step (1.5x) between them from 128 on, where the forward's cost follows the
    width (a 360-token prompt pays for 384 tokens, not 512)."""
    size = _bucket(n, 16)
    if size >= 256 and n <= size * 3 // 4:
        return size * 3 // 4
    return size


def _apply_stop(
    model: Any, ids: list[int], text: str, stop: Sequence[str]
) -> tuple[list[int], str, bool]:
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if not hits:
        return ids, text, False
    cut = min(hits)
    for k in range(1, len(ids) + 1):  # the first token prefix that contains a stop string
        prefix = model.decode(ids[:k])
        if any(s and s in prefix for s in stop):
            return ids[:k], text[:cut], True
    return ids, text[:cut], True


def _per_row(value: Any, batch: int, name: str) -> np.ndarray:
    arr = np.asarray(value, np.int64)
    if arr.ndim == 0:
        return np.full((batch,), int(arr), np.int64)
    if arr.shape != (batch,):
        raise ValueError(f"{name} has {arr.size} values for {batch} prompts")
    return arr


def _n_predict(value: Any, batch: int) -> np.ndarray:
    """Per-row max_new_tokens as llama.cpp's n_predict: >= 1 tokens, or -1 (and -2, which
    llama-completion names "until context filled") = until the context is full. Returns -1
    for those rows; 0 and other negatives raise."""
    arr = _per_row(value, batch, "max_new_tokens")
    bad = arr[(arr == 0) | (arr < -2)]
    if bad.size:
        raise ValueError(
            f"max_new_tokens must be >= 1, or -1 to generate until the context is full; "
            f"got {int(bad[0])}"
        )
    return np.where(arr < 0, -1, arr)


def _sampling_args(
    batch: int, temperature: Any, top_k: Any, top_p: Any, min_p: Any, repeat_penalty: Any
) -> dict[str, np.ndarray]:
    """Sampling parameters (scalars or one per prompt) checked and normalised as llama.cpp.

    Values llama.cpp's samplers read as "off" are clamped to the off value, which behaves the
    same: temperature < 0 -> 0 (its --temp clamps; <= 0 is greedy), top_k < 0 -> 0 (<= 0 is
    off), top_p > 1 -> 1 (>= 1 is off), min_p < 0 -> 0 (<= 0 is off). top_p <= 0 keeps the
    single most likely token, as upstream's top-p does. Values llama.cpp refuses raise:
    a repeat penalty that is not finite and > 0 (its --repeat-penalty check), NaN anywhere.
    min_p > 1 raises too: upstream's min-p then keeps only the most likely token (greedy),
    which is surely not what was meant; say temperature 0 for that.
    """

    def values(name: str, value: Any) -> np.ndarray:
        try:
            arr = np.asarray(value, np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if arr.ndim == 0:
            arr = np.full((batch,), float(arr))
        if arr.shape != (batch,):
            raise ValueError(f"{name} has {arr.size} values for {batch} prompts")
        if np.isnan(arr).any():
            raise ValueError(f"{name} must be a number, got nan")
        return arr

    temp = values("temperature", temperature)
    k = values("top_k", top_k)
    if not np.all(np.isfinite(k) & (k == np.round(k))):
        raise ValueError(f"top_k must be an integer, got {k[~(k == np.round(k))][0]}")
    p = values("top_p", top_p)
    mp = values("min_p", min_p)
    if (mp > 1).any():
        raise ValueError(
            f"min_p must be in [0, 1], got {mp[mp > 1][0]} (above 1 llama.cpp keeps only the "
            "most likely token: use temperature 0 for greedy decoding)"
        )
    rp = values("repeat_penalty", repeat_penalty)
    rp32 = rp.astype(np.float32)  # the penalty divides float32 logits
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.float32(1.0) / np.where(rp32 > 0, rp32, np.float32(1.0))
    bad_rp = ~(np.isfinite(rp32) & (rp32 > 0) & np.isfinite(inverse))
    if bad_rp.any():
        raise ValueError(
            f"repeat_penalty must be finite and greater than 0 (1 = off), got {rp[bad_rp][0]}"
        )
    return {
        "temperature": np.maximum(temp, 0.0).astype(np.float32),
        "top_k": np.maximum(k, 0).astype(np.int32),
        "top_p": np.minimum(p, 1.0).astype(np.float32),
        "min_p": np.maximum(mp, 0.0).astype(np.float32),
        "repeat_penalty": rp.astype(np.float32),
    }


def _tokenize_prompts(model: Any, prompts: Any) -> list[list[int]]:
    """Text prompts through `Model.encode` (BOS/EOS as the model's metadata says, as
    llama.cpp); token-id prompts exactly as given."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    if all(isinstance(p, int | np.integer) for p in prompts):
        prompts = [list(prompts)]
    out = []
    for i, p in enumerate(prompts):
        ids = model.encode(p) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        _check_token_range(np.asarray(ids), model.config.V)
        out.append(ids)
    return out


class ContextWarning(UserWarning):
    """A context beyond the model's training context (`fit_context`)."""


#: The context warnings this process has given (each is given once).
_WARNED: set[str] = set()


def context_size(model: Any, n_ctx: int | None) -> int:
    """The context of a run, in cells per row: `n_ctx`, or for None / 0 the model's training
    context (llama.cpp's `-c 0`). Raises ValueError below 2."""
    size = int(model.config.max_position) if not n_ctx else int(n_ctx)
    if size < 2:
        raise ValueError(f"context size must be >= 2, got {size}")
    return size


def check_prompt_fits(length: int, n_ctx: int, what: str = "prompt") -> None:
    """ValueError with the numbers unless a prompt of `length` tokens leaves a cell of a
    context of `n_ctx` for a generated token."""
    if length >= n_ctx:
        raise ValueError(
            f"{what} of {length} tokens does not fit a context of {n_ctx} "
            f"(needs at least {length + 1} cells)"
        )


def context_note(model: Any, n_ctx: int) -> str | None:
    """The warning for a context beyond the model's training context (None: within it)."""
    train = int(model.config.max_position)
    if n_ctx <= train:
        return None
    return (
        f"context of {n_ctx} cells is beyond the model's training context of {train}: "
        f"text past position {train} may degrade"
    )


def fit_context(
    model: Any,
    prompt_lengths: Sequence[int],
    n_ctx: int | None,
    *,
    need: int | None = None,
    warn: bool = True,
    stacklevel: int = 2,
) -> tuple[int, int]:
    """The one context rule of every path (`specjax.generate`, `Generator`, batch jobs, the
    CLI's generate and batch, hybrid targets): returns (context, capacity).

    * The context is `n_ctx` cells per row, or for None / 0 the model's training context
      (`context_size`, llama.cpp's `-c 0`).
    * Every prompt must leave a cell for a generated token: one that does not raises
      ValueError with its numbers, before anything is traced (`check_prompt_fits`).
    * A row stops at the context: its last token sits at position context - 1 and its
      finish reason is `context` (the engine's; the CLI says so on stderr).
    * A context beyond the training context runs, with one `ContextWarning` (`warn`; the
      process warns once per message, whatever the warnings filters; `stacklevel` as
      `warnings.warn`'s, counted from `fit_context`'s caller).

    `capacity` is the static cells per row: the context, or `need` cells (prompt, tokens to
    generate, draft width and 2) rounded up to a multiple-of-two bucket from 128 when that
    is less, so short runs compile and allocate for what they use.
    """
    size = context_size(model, n_ctx)
    if prompt_lengths:
        check_prompt_fits(max(prompt_lengths), size)
    note = context_note(model, size) if warn else None
    if note is not None and note not in _WARNED:
        _WARNED.add(note)
        warnings.warn(note, ContextWarning, stacklevel=stacklevel + 1)
    capacity = size if need is None else min(size, _bucket(need, 128))
    return size, capacity


def build_engine_inputs(
    model: Any,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    n_ctx: int | None,
    k_max: int,
    warn: bool = False,
) -> tuple[int, int, int]:
    """Static sizes (prompt bucket T, capacity S, output capacity O), validated by the
    context rule (`fit_context`; `n_ctx` None = the model's training context)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompt_ids)
    need = longest + max_new_tokens + k_max + 2
    _, capacity = fit_context(
        model, [len(p) for p in prompt_ids], n_ctx, need=need if n_ctx is None else None,
        warn=warn,
    )  # fmt: skip
    T = min(prompt_bucket(longest), capacity)
    out_cap = _bucket(max_new_tokens + k_max + 1, 32)
    return T, capacity, out_cap


#: Sampling values of an idle Generator slot (greedy, all samplers off).
_IDLE_SAMPLING = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


def _host_leaf(value: Any, dtype: Any) -> Array:
    """A NumPy leaf of an entry point's arguments (typed as the jax.Array it becomes there)."""
    return cast(Array, np.asarray(value, dtype))
