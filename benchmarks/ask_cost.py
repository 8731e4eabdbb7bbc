"""What asking a model-free drafter for a draft costs, in plain rounds of the target.

    python benchmarks/ask_cost.py [--gaps 1,8,64] [--loops 9] [--out FILE] [--overwrite]

The draft governor (`specjax.decode.governor`) charges each round in which it asks the chain the
price `call`, in target 1-token forwards. This measures that price per drafter on this
machine: the shipped target, the `main` prompt followed by 1,024 tokens of its own greedy
continuation (as benchmarks/peers.py builds it), each drafter built with its defaults and
begun on the prompt. A jitted loop asks the drafter (benchmarks/drafters.py's `ask`, which
that script times with the rest of a round at width 8, in microseconds) ASKS times for a
draft of the chain's own width, the stream advancing `gap` tokens between asks (gap 1:
asked every round; a larger gap: asked again after rounds off, with that many tokens to
catch up on; one dispatch per loop, so host overhead is not counted). The step is a round of plain greedy decoding of the same prompt
(decode seconds / rounds of a 256-token `generate`), the unit the governor's prices are in.
All are timed interleaved, the fastest of `--loops` each. `ask_steps` = seconds per ask /
seconds per step.

The per-drafter prices the drafters declare (`ask_steps`, used when `SpecConfig.cost_call` is
None) are these numbers at gap 8 on a quiet host (a plain round of ~155 us:
benchmarks/results/ask-cost.json; ngram-cache's from ask-cost-native.json, after its prompt
moved to `begin` and its counting to a native kernel), rounded up to 0.01; on a loaded host
the round slows more than the asks and the ratios fall. `ngram-cache/counting`: an ngram-cache
that drafts nothing (`n_draft` 0), its counting of the new positions alone (the rest of its
ask is drafting; `ask-cost-counting.json`, and `ask-cost-before.json`: this script run on the
library of 618569f, before the kernel, when the first ask of each loop also counted the prompt,
the two runs back to back on a loaded host, a ~265 us round). ask-cost-xla.json: the same with
`SPECJAX_CPU_KERNELS=0` (every kernel off, the target's round ~6x slower). The loop
donates the drafter state, as the engine does: without that every loop began with a copy of
ngram-mod's 32 MB pool, which read as 0.64 of a round an ask.

`--heads`: the feature drafters with the shipped heads (draft-eagle3, draft-dflash; n_max 4
as benchmarks/peers.py runs them). Between asks such a drafter `record`s the verify batch of
each round it was not asked in (`specjax.drafters.base`, `idle_record`: the target's
features of that round's token) and its ask applies those rows first, so the loop records
`gap` rows (features from a target forward over the stream) and then asks; the same loop
without the asks is timed beside it, and the ask is the difference (the records belong to
the off rounds, whose cost `benchmarks/idle_rounds.py --heads` measures). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax
import jax.numpy as jnp
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, emit, machine, refuse_overwrite
from drafters import ask
from peers import DEFAULT_DFLASH, DEFAULT_EAGLE3, PROMPT_FILES, Specjax

import specjax
from specjax import api
from specjax.drafters.base import TargetBatch, TokenHistory, hidden_by_layer
from specjax.drafters.registry import build_drafters

DRAFTERS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: Rows timed beside the drafters: a configuration and the drafter type it builds. An
#: ngram-cache that drafts nothing (`n_draft` 0) times its counting of new positions alone.
PARTS = {"ngram-cache/counting": ("ngram-cache", {"ngram_cache_n_draft": 0})}
#: Asks per timed loop.
ASKS = 16
CAPACITY = 2048
#: Greedy tokens after the prompt: the stream the asks advance over.
STREAM_TOKENS = 1024


def ask_timer(spec: specjax.SpecConfig, stream: list[int], start: int, gap: int) -> Any:
    """A thunk timing one ask of the drafter `spec` names: seconds per ask of a jitted loop
    of ASKS asks at stream lengths start, start + gap, ... (the drafter begun on
    `stream[:start]`)."""
    (drafter,), (params,) = build_drafters(spec, None, None)
    k = spec.resolved_k_max()
    tokens = jnp.zeros((1, CAPACITY), jnp.int32).at[0, : len(stream)].set(jnp.asarray(stream))
    state = drafter.begin(
        drafter.init(1, CAPACITY), TokenHistory(tokens=tokens, length=jnp.asarray([start]))
    )

    # the state donated, as the engine donates it: otherwise each loop starts with a copy of
    # it (ngram-mod's 32 MB pool: more than its asks cost)
    @functools.partial(jax.jit, donate_argnums=0)
    def loop(state: Any) -> Any:
        def body(i: Any, carry: Any) -> Any:
            state, n = carry
            length = jnp.int32(start) + i * gap
            state, out = ask(
                drafter, params, state, tokens, length[None], tokens[0, length][None], k
            )
            return state, n + jnp.sum(out.valid)

        return jax.lax.fori_loop(0, ASKS, body, (state, jnp.zeros((), jnp.int32)))

    return per_ask(loop, state)


def per_ask(loop: Any, state: Any) -> Any:
    """A thunk timing the jitted `loop` of ASKS asks (it donates its state: each run starts
    from a fresh copy of `state`, made outside the timing), in seconds per ask; compiled
    here."""

    def fresh() -> Any:
        return jax.block_until_ready(jax.tree.map(jnp.copy, state))

    jax.block_until_ready(loop(fresh()))

    def seconds() -> float:
        begun = fresh()
        t = time.perf_counter()
        jax.block_until_ready(loop(begun))
        return (time.perf_counter() - t) / ASKS

    return seconds


#: The feature drafters `--heads` times, with their shipped heads.
HEADS = {"draft-eagle3": DEFAULT_EAGLE3, "draft-dflash": DEFAULT_DFLASH}


def head_ask_timer(
    model: specjax.Model, kind: str, stream: list[int], start: int, gap: int
) -> tuple[Any, Any]:
    """Two thunks for the feature drafter `kind`: seconds per ask of a jitted loop of ASKS
    rounds of (record `gap` rows, then ask), and the same loop without the asks (the
    drafter processed `stream[:start]` first, as after a prefill)."""
    from specjax.models.llama import forward_compute, new_cache

    spec = specjax.SpecConfig(types=(kind,), draft_n_max=4)
    (drafter,), (params,) = build_drafters(spec, model, specjax.load(str(HEADS[kind])))
    params = api.drafter_decode_params(kind, params)
    k = drafter.max_draft_len
    n = len(stream)
    tokens = jnp.zeros((1, CAPACITY), jnp.int32).at[0, :n].set(jnp.asarray(stream))
    layers = drafter.hidden_layers
    out = jax.jit(forward_compute, static_argnums=(0, 5), static_argnames="cache_empty")(
        model.config,
        api.decode_params(model.params),
        tokens[:, :n],
        jnp.arange(n)[None, :],
        new_cache(model.config, 1, CAPACITY, jnp.float16, jnp.float16),
        layers,
        cache_empty=True,
    )
    hidden = hidden_by_layer(layers, out.hidden)  # {layer: [1, n, D]}

    def batch(lo: Any, width: int) -> TargetBatch:
        """The stream's tokens lo..lo+width-1 with their features."""
        pos = lo + jnp.arange(width)[None, :]
        return TargetBatch(
            tokens=jax.lax.dynamic_slice_in_dim(tokens, lo, width, 1),
            positions=pos.astype(jnp.int32),
            hidden={i: jax.lax.dynamic_slice_in_dim(h, lo, width, 1) for i, h in hidden.items()},
        )

    state = jax.jit(drafter.process)(params, drafter.init(1, CAPACITY), batch(0, start))

    def make(asks: bool) -> Any:
        @functools.partial(jax.jit, donate_argnums=0)
        def loop(state: Any) -> Any:
            def body(i: Any, carry: Any) -> Any:
                state, n = carry
                length = jnp.int32(start) + i * gap
                for j in range(gap):  # the off rounds before the ask: one row each
                    state = drafter.record(params, state, batch(length - gap + j, 1))
                if asks:
                    state, out = ask(
                        drafter, params, state, tokens, length[None], tokens[0, length][None], k
                    )
                    n = n + jnp.sum(out.valid)
                    state = drafter.rollback(state, length[None])
                return state, n

            return jax.lax.fori_loop(0, ASKS, body, (state, jnp.zeros((), jnp.int32)))

        return per_ask(loop, state)

    return make(True), make(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps", default="1,8,64")
    ap.add_argument("--loops", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    ap.add_argument("--heads", action="store_true", help="also the shipped feature heads")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)
    gaps = [int(g) for g in args.gaps.split(",")]

    peer = Specjax(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), 256)
    model = peer.model
    prompt = peer.ids(PROMPT_FILES["main"].read_text())
    plain = specjax.generate(model, [prompt], max_new_tokens=STREAM_TOKENS, n_ctx=CAPACITY)
    stream = prompt + plain.tokens[0]
    start = len(prompt)
    if start + (ASKS - 1) * max(gaps) >= len(stream):
        raise SystemExit(f"ask_cost.py: a gap of {max(gaps)} runs past the stream")

    def plain_round() -> float:  # what the governor's unit costs: a plain round
        r = specjax.generate(model, [prompt], max_new_tokens=256, n_ctx=CAPACITY)
        return r.timings["decode_seconds"] / max(int(r.timings["n_rounds"]), 1)

    timers: dict[str, Any] = {"step": plain_round}
    configs = {name: (name, {}) for name in DRAFTERS} | PARTS
    for name, (kind, options) in configs.items():
        spec = specjax.SpecConfig(types=(kind,), **options)
        for gap in gaps:
            timers[f"{name}/{gap}"] = ask_timer(spec, stream, start, gap)
    heads = tuple(HEADS) if args.heads else ()
    for kind in heads:
        for gap in gaps:
            with_asks, records = head_ask_timer(model, kind, stream, start + gap, gap)
            timers[f"{kind}/{gap}"], timers[f"{kind}/{gap}/records"] = with_asks, records
    best = {key: float("inf") for key in timers}
    for _ in range(args.loops):  # interleaved: a drift of the machine's speed hits them all
        for key, timer in timers.items():
            best[key] = min(best[key], timer())
    step = best["step"]
    drafters: dict[str, Any] = {}
    for kind in heads:  # the ask: the loop less its records
        for gap in gaps:
            best[f"{kind}/{gap}"] -= best.pop(f"{kind}/{gap}/records")
    for name in (*configs, *heads):
        drafters[name] = {
            f"gap_{gap}": {
                "ask_us": best[f"{name}/{gap}"] * 1e6,
                "ask_steps": best[f"{name}/{gap}"] / step,
            }
            for gap in gaps
        }
    emit(
        {
            "benchmark": "ask_cost",
            "model": str(DEFAULT_TARGET.relative_to(DEFAULT_TARGET.parents[2])),
            "prompt": "main",
            "prompt_tokens": start,
            "asks_per_loop": ASKS,
            "loops": args.loops,
            "machine": machine(),
            "step_us": step * 1e6,
            "drafters": drafters,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
