"""The draft governor's prices: its cost model for a run, and the prices measured on the device.

`specjax.decode.governor` weighs expected tokens against a cost model in units of a 1-token target
forward: `fwd(n) = 1 + (n - 1) * verify_token` for a forward of n tokens (all rows of the
batch), `draft_step * fwd(B)` for one draft-model step at B rows, `call` for asking the chain
(`chain_call_price`: the engine's part, `ASK_OVERHEAD`, plus each drafter's `ask_steps`).
`cost_model` builds it for a run; `unpaying_drafters` / `leave_out_unpaying` find the drafters
the governor would never ask at the run's batch size, which `generate` and batch jobs leave
out of the run. These names are public (re-exported by `specjax.api`).

On CPU the default prices are medians measured on the shipped models (`CPU_VERIFY_TOKEN`);
on an accelerator the guesses (0.01 per extra token, the draft's share of the target's layers
or parameters) were far off: on an H200 a step of benchmarks/gpu.py's 2-layer draft cost 0.4 of its 16-layer
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
defaults. A mixture-of-experts target (qwen3moe) is timed on CPU too by default: CPU_VERIFY_TOKEN
was measured on dense targets, whose weights a verify reads once for all its tokens, while each
token of a MoE verify brings its own experts (on CPU's pair-by-pair dispatch, its own reads
of them). On a D 512, 16-expert top-2 target against a dense one of the same active FFN width
(tests/test_prices.py's pair, a 2-core shared host) the measured `verify_token` was 0.78-0.93
for the MoE target and 0.01-0.11 for the dense one at widths 2, 5 and 9.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import SpecConfig
from specjax.decode import engine as eng
from specjax.decode import governor as adaptive
from specjax.decode.executables import _lru_put
from specjax.decode.governor import CostModel
from specjax.decode.inputs import _host_leaf
from specjax.decode.weights import decode_params
from specjax.drafters.base import Drafter, chain_width
from specjax.drafters.registry import price_terms
from specjax.models.llama import LINEAR_WEIGHTS, forward_fn

#: The governor's CPU price of each token past the first of a forward, in 1-token forwards:
#: ~1 + 0.4 (n - 1) for the shipped target on the native kernels (benchmarks/peers.py's
#: `draft_simple_round.verify_token`: median 0.41, 0.16-0.58, over the eleven runs in
#: benchmarks/results/peers-avx2*.json, peers-empty-off*.json and peers-prices.json; 0.12
#: predated the kernels).
CPU_VERIFY_TOKEN = 0.4
#: Longest draft whose verify `cost_model` times when it measures the prices.
CALIBRATION_K = 8
#: The engine's own part of a round in which the chain is asked (plan, relay, statistics), in
#: 1-token target steps: what `SpecConfig.cost_call` charged every chain before the drafters
#: had prices of their own.
ASK_OVERHEAD = 0.08
#: Parameters of the target the drafters' `ask_steps` were measured against (the shipped
#: code-target, `models/code-target`).
ASK_REFERENCE_PARAMS = 7_344_384


def chain_call_price(
    drafters: Sequence[Drafter], on_cpu: bool = True, target_params: int | None = None
) -> float:
    """The governor's price `call` of asking the chain `drafters` for drafts (when
    `SpecConfig.cost_call` is None): `ASK_OVERHEAD` plus, on CPU, every drafter's
    `ask_steps` (the relay may ask each of them). Those were measured on CPU against the
    shipped target's plain round (benchmarks/governor.py ask: an ngram-mod ask cost 0.12 of a
    round, an ngram-cache ask 0.07 on its native kernel, an ngram-simple ask 0.07; with
    `--heads`, a draft-eagle3 ask 2.6 rounds and a draft-dflash block 1.25); on
    accelerators asks have not been timed, so the engine's part stands alone there.

    `target_params`: the target's parameter count. An ask's time is about fixed (lookups, a
    head's small kernels), while a plain round of the shipped target already costs about its
    products on CPU (~150 us for 7.3M parameters), so for a larger target the measured asks
    are scaled down by ASK_REFERENCE_PARAMS / target_params (never up: a smaller target's
    round is launch-bound, as the reference's is). None = the reference target."""
    if not on_cpu:
        return ASK_OVERHEAD
    asks = sum(float(d.ask_steps) for d in drafters)
    if target_params is not None:
        asks *= min(1.0, ASK_REFERENCE_PARAMS / max(int(target_params), 1))
    return ASK_OVERHEAD + asks


def cost_model(
    spec: SpecConfig | None,
    model: Any,
    draft: Any | None,
    *,
    synthetic: bool = False,
    batch: int = 1,
    k_max: int = 0,
    capacity: int = 0,
    drafters: Sequence[Any] = (),
) -> CostModel:
    """The draft governor's cost model for a run (see specjax.decode.governor): traced values, built
    as NumPy leaves (an entry point takes them in with its other arguments).

    `drafters`: the chain as built (`registry.build_drafters`), priced by `chain_call_price`
    unless `spec.cost_call` is given.

    With `spec.cost_calibrate` (None: on accelerators, and on CPU for a mixture-of-experts
    target) and the run's shapes (`batch` rows,
    static draft width `k_max`, cache `capacity`), the verify and draft-simple prices are
    measured on this device (`specjax.decode.prices`) instead of the defaults, at the verify width
    of the longest draft the chain's n_max lets through, at most CALIBRATION_K + 1."""
    on_cpu = jax.default_backend() == "cpu"
    verify = CPU_VERIFY_TOKEN if on_cpu else 0.01
    draft_step, call, enabled, simple = 0.0, 0.0, False, False
    if spec is not None:
        enabled = spec.adaptive and not synthetic
        call = _call_price(spec, model, drafters)
        terms = price_terms(spec.types)  # (`Drafter.prices` of the chain's types)
        simple = draft is not None and "catch_up" in terms
        if draft is not None and "draft_step" in terms:
            t, d = model.config, draft.config
            draft_step = max(d.L / t.L, d.num_params() / t.num_params())
        calibrate = spec.cost_calibrate
        if calibrate is None:  # CPU_VERIFY_TOKEN is a dense target's: a MoE target's is timed
            calibrate = not on_cpu or getattr(model.config, "n_experts", 0) > 0
        # the line through 1- and W-token forwards prices the widths drafts usually take
        width = min(k_max, spec.n_max() if spec.n_max() > 0 else k_max, CALIBRATION_K) + 1
        if enabled and calibrate and width >= 2 and capacity > width:
            measured = measure(model, draft if simple else None, batch, width, capacity)
            if measured is not None:
                verify = measured["verify_token"]
                draft_step = measured.get("draft_step", draft_step)
        if spec.cost_verify_token is not None:
            verify = spec.cost_verify_token
        if spec.cost_draft_step is not None:
            draft_step = spec.cost_draft_step
    # a "catch_up" drafter's model (draft-simple's) skips the rounds it is not asked in and
    # catches up before it drafts (None for other chains: no catch-up term in their programs)
    return _priced(enabled, verify, draft_step, call, draft_step if simple else None)


def _priced(
    enabled: bool, verify_token: float, draft_step: float, call: float, catch_up: float | None
) -> CostModel:
    """A `CostModel` of these prices (NumPy leaves, as `generate`'s other run parameters)."""
    f32 = np.float32
    return CostModel(
        enabled=_host_leaf(enabled, np.bool_),
        verify_token=_host_leaf(verify_token, f32),
        draft_step=_host_leaf(draft_step, f32),
        call=_host_leaf(call, f32),
        catch_up=None if catch_up is None else _host_leaf(catch_up, f32),
    )


def _call_price(spec: SpecConfig, model: Any, drafters: Sequence[Drafter]) -> float:
    """The governor's price of asking `drafters`: `spec.cost_call`, else `chain_call_price`
    on this backend against `model`."""
    if spec.cost_call is not None:
        return float(spec.cost_call)
    on_cpu = jax.default_backend() == "cpu"
    return chain_call_price(drafters, on_cpu, target_params=model.config.num_params())


def chain_cost(
    cost: CostModel, spec: SpecConfig, model: Any, drafters: Sequence[Drafter]
) -> CostModel:
    """`cost` (the whole chain's, from `cost_model`) as it prices the part `drafters` of the
    chain: their own asks (`chain_call_price`, unless `spec.cost_call` is given), a draft
    step only with a draft-model drafter in it (or `spec.cost_draft_step` given), a catch-up
    only with draft-simple. The measured verify price is kept (no new calibration)."""
    terms = frozenset().union(*(d.prices for d in drafters))  # (`Drafter.prices`)
    call = _call_price(spec, model, drafters)
    stepped = "draft_step" in terms or spec.cost_draft_step is not None
    return dataclasses.replace(
        cost,
        call=_host_leaf(call, np.float32),
        draft_step=cost.draft_step if stepped else _host_leaf(0.0, np.float32),
        catch_up=cost.catch_up if "catch_up" in terms else None,
    )


def chain_k_max(spec: SpecConfig, drafters: Sequence[Drafter]) -> int:
    """The static draft width K of the chain `drafters`: `spec.k_max` when given, else the
    maximum over the chain's drafters (`drafters.base.chain_width`)."""
    k_max = spec.resolved_k_max()
    return k_max if spec.k_max is not None else chain_width(drafters, k_max)


def unpaying_drafters(
    spec: SpecConfig, model: Any, engine: eng.Engine, cost: CostModel, batch: int
) -> dict[str, str]:
    """The drafters of `engine`'s chain that the draft governor would never ask in a run of
    `batch` rows (`adaptive.never_asks`), each with the reason, in words: `generate` and batch
    jobs leave them out of the run, so they cost nothing, not even their per-round
    bookkeeping.

    Each drafter is weighed alone, at its own price (`chain_cost`) and its own caps, so a
    drafter that never pays does not keep the rest of the chain from being asked (the chain's
    price is the sum of its asks); then the drafters left, as the chain they form. Empty with
    the governor off (`spec.adaptive` False, synthetic runs): llama.cpp drafts whatever it
    costs."""
    if not bool(cost.enabled) or not engine.drafters:
        return {}

    def never(drafters: Sequence[Any]) -> tuple[bool, CostModel, eng.Engine]:
        part = dataclasses.replace(
            engine, drafters=tuple(drafters), k_max=chain_k_max(spec, drafters)
        )
        priced = chain_cost(cost, spec, model, drafters)
        prices = (priced.verify_token, priced.draft_step, priced.call, priced.catch_up)
        off = _never_asks(
            *(None if x is None else float(x) for x in prices),
            batch,
            part.k_max,
            part.verify_widths(),
            part.draft_caps(),
        )
        return off, priced, part

    def why(priced: CostModel, part: eng.Engine) -> str:
        longest = min(part.k_max, part.draft_caps()[0], spec.n_max() or part.k_max)
        return (
            f"an ask is priced at {float(priced.call):.2f} target steps (+ "
            f"{float(priced.draft_step):.2f} a drafted token), and no draft of up to {longest} "
            f"tokens pays for it at B <= {batch}, even accepted as the governor's prior expects "
            "(`--spec-governor off` drafts anyway)"
        )

    dropped: dict[str, str] = {}
    for d in engine.drafters:
        off, priced, part = never([d])
        if off:
            dropped[d.name] = why(priced, part)
    kept = [d for d in engine.drafters if d.name not in dropped]
    if len(kept) > 1:
        off, priced, part = never(kept)
        if off:
            dropped.update(
                {d.name: "with the rest of the chain: " + why(priced, part) for d in kept}
            )
    return dropped


def leave_out_unpaying(
    spec: SpecConfig,
    model: Any,
    engine: eng.Engine,
    cost: CostModel,
    batch: int,
    k_max: int | None = None,
) -> tuple[list[int], eng.Engine, CostModel, dict[str, str]]:
    """The run without the drafters `unpaying_drafters` finds: (indices of the drafters kept,
    for the callers' per-drafter parameters and states; the engine and the cost model of the
    chain they form; the drafters left out, with why). `k_max`: the kept chain's static
    width (None: its own, `chain_k_max`; 0 when nothing is kept)."""
    dropped = unpaying_drafters(spec, model, engine, cost, batch)
    keep = [i for i, d in enumerate(engine.drafters) if d.name not in dropped]
    if not dropped:
        return keep, engine, cost, dropped
    kept = tuple(engine.drafters[i] for i in keep)
    width = 0 if not kept else chain_k_max(spec, kept) if k_max is None else k_max
    engine = dataclasses.replace(engine, drafters=kept, k_max=width)
    return keep, engine, chain_cost(cost, spec, model, kept), dropped


@functools.lru_cache(maxsize=256)
def _never_asks(
    verify_token: float,
    draft_step: float,
    call: float,
    catch_up: float | None,
    batch: int,
    k_max: int,
    widths: tuple[int, ...],
    caps: tuple[int, ...],
) -> bool:
    """`adaptive.never_asks` of an enabled cost model, by value: it runs ~10 ms of small
    eager ops, about half of a short `generate` call's own time, so each price is weighed
    once per process."""
    cost = _priced(True, verify_token, draft_step, call, catch_up)
    return adaptive.never_asks(cost, batch, k_max, widths, caps)


# --------------------------------------------------------------------------------------------
# Prices measured on this device

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
