"""The draft governor's prices, measured on the device that decodes.

`specjax.adaptive` weighs expected tokens against a cost model in units of a 1-token target
forward: `fwd(n) = 1 + (n - 1) * verify_token` for a forward of n tokens (all rows of the
batch), `draft_step * fwd(B)` for one draft-model step at B rows. On CPU the defaults are
medians measured on the shipped models (`api.CPU_VERIFY_TOKEN`); on an accelerator the
guesses (0.01 per extra token, the draft's share of the target's layers or parameters) were
far off: on an H200 a step of benchmarks/gpu.py's 2-layer draft cost 0.4 of its 16-layer
target's step, three times its layer share (benchmarks/results/gpu-h200.json), and with the
shipped pair speculation ran at 0.69-0.90x of plain continuous batching while the governor
drafted in nearly every round (benchmarks/results/batch-gpu-h200.json).

`measure` times, on this device and at the run's batch size, three jitted loops of forwards
over a cache filled with `fill` cells (interleaved, the fastest of LOOPS each): the target at
1 token per row, the target at the verify width W per row, and the draft model
(draft-simple) at 1 token per row. `fit` turns the seconds into prices. With R = t(B x W) / t(B x 1), fitting the line through both points:

    verify_token = (R - 1) / ((B W - 1) - R (B - 1))    clipped to [0, 1]
    draft_step   = t_draft(B x 1) / t(B x 1)

(at B = 1: (R - 1) / (W - 1)). A forward that grows faster than linearly in tokens has no
such line (the denominator <= 0): each extra token is then priced as a whole forward (1).
Measurements are kept per set of weights, batch, width and capacity (`_MEASURED`), so a
second run of the same shapes does not time again.

Only Llama-family pytrees (the fused Q/K/V weight) are timed; other models keep the
defaults.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

from specjax.executables import _lru_put
from specjax.models.llama import LINEAR_WEIGHTS, forward_fn
from specjax.weights import decode_params

#: Highest price of an extra token (a forward that grows faster than linearly in tokens).
MAX_VERIFY_TOKEN = 1.0
#: Forwards per timed loop, and timed loops per measurement (the fastest is kept).
FORWARDS_PER_LOOP = 16
LOOPS = 7

_MEASURED: dict[tuple[Any, ...], tuple[list[Any], dict[str, float]]] = {}
_MEASURED_MAX = 8


def fit(
    t_step: float, t_verify: float, t_draft: float | None, batch: int, width: int
) -> dict[str, float]:
    """Prices from measured seconds (see the module docstring); `t_draft` None: no draft
    model (`draft_step` absent)."""
    if min(t_step, t_verify) <= 0 or batch < 1 or width < 2:
        raise ValueError(
            f"cannot fit prices from t_step={t_step}, t_verify={t_verify}, "
            f"batch={batch}, width={width}"
        )
    ratio = t_verify / t_step
    denominator = (batch * width - 1) - ratio * (batch - 1)
    if denominator <= 0:
        verify_token = MAX_VERIFY_TOKEN
    else:
        verify_token = min(max((ratio - 1.0) / denominator, 0.0), MAX_VERIFY_TOKEN)
    out = {"verify_token": verify_token}
    if t_draft is not None:
        out["draft_step"] = max(t_draft, 0.0) / t_step
    return out


def timeable(params: Any) -> bool:
    """Whether `params` is a Llama-family pytree `measure` can time."""
    layers: Any = params.get("layers", ()) if isinstance(params, dict) else ()
    return bool(layers) and LINEAR_WEIGHTS[0] in layers[0]


def forward_timer(config: Any, params: Any, cache: Any, width: int, fill_BT: Any) -> Any:
    """A thunk timing one `width`-token forward per row of the empty `cache` after the
    tokens `fill_BT` are written: a jitted loop of FORWARDS_PER_LOOP forwards (one dispatch,
    so host overhead is not counted), each fed the previous one's argmax; seconds per
    forward. Compiled and run once here."""
    batch, fill = cache.batch, fill_BT.shape[1]
    fill_positions = jnp.broadcast_to(jnp.arange(fill, dtype=jnp.int32), (batch, fill))
    cache = _forward_jit(config, params, fill_BT, fill_positions, cache).cache
    positions = jnp.broadcast_to(fill + jnp.arange(width, dtype=jnp.int32), (batch, width))
    token = jnp.zeros((batch,), jnp.int32)
    jax.block_until_ready(_loop_jit(config, params, cache, token, positions))

    def seconds() -> float:
        t = time.perf_counter()
        jax.block_until_ready(_loop_jit(config, params, cache, token, positions))
        return (time.perf_counter() - t) / FORWARDS_PER_LOOP

    return seconds


def _loop(config: Any, params: Any, cache: Any, token_B: Any, positions_BT: Any) -> Any:
    width = positions_BT.shape[1]

    def body(_: Any, tok_B: Any) -> Any:
        tokens = jnp.broadcast_to(tok_B[:, None], (tok_B.shape[0], width))
        logits = forward_fn(config, params, tokens, positions_BT, cache).logits
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, FORWARDS_PER_LOOP, body, token_B)


_loop_jit = jax.jit(_loop, static_argnames=("config",))
_forward_jit = jax.jit(forward_fn, static_argnames=("config", "hidden_layers"))


def measure(
    model: Any, draft: Any | None, batch: int, width: int, capacity: int
) -> dict[str, float] | None:
    """Measured `verify_token` (and `draft_step` when `draft` is given) at `batch` rows and
    verify width `width`, on the weights the engine decodes with; None when the models are
    not Llama-family pytrees. Kept per set of weights and shapes (`_MEASURED`)."""
    if not timeable(model.params) or (draft is not None and not timeable(draft.params)):
        return None
    params = decode_params(model.params)
    draft_params = None if draft is None else decode_params(draft.params)
    leaves = jax.tree.leaves((params, draft_params))
    key = (id(params), id(draft_params), batch, width, capacity)
    hit = _MEASURED.pop(key, None)
    if hit is None or len(hit[0]) != len(leaves) or any(a is not b for a, b in zip(hit[0], leaves)):
        fill = max(1, min(capacity // 2, 256, capacity - width))
        fill_BT = jnp.broadcast_to(jnp.arange(fill, dtype=jnp.int32), (batch, fill))
        # the engine's default cache type (F16), as it decodes
        cache = model.new_cache(batch, capacity, "f16", "f16")
        timers = [
            forward_timer(model.config, params, cache, 1, fill_BT % model.config.V),
            forward_timer(model.config, params, cache, width, fill_BT % model.config.V),
        ]
        if draft is not None:
            draft_cache = draft.new_cache(batch, capacity, "f16", "f16")
            draft_fill = fill_BT % draft.config.V
            timers.append(forward_timer(draft.config, draft_params, draft_cache, 1, draft_fill))
        # interleaved, the fastest of each: a drift of the machine's speed hits all three
        best = [min(times) for times in zip(*([t() for t in timers] for _ in range(LOOPS)))]
        t_draft = best[2] if draft is not None else None
        hit = (leaves, fit(best[0], best[1], t_draft, batch, width))
    _lru_put(_MEASURED, key, hit, lambda d: len(d) > _MEASURED_MAX)
    return dict(hit[1])
