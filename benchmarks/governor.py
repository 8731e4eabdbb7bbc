"""The draft governor's benchmarks (`specjax.decode.governor`). Modes:

    python benchmarks/governor.py ask [--gaps 1,8,64] [--loops 9] [--heads] [--out FILE]
    python benchmarks/governor.py rounds [--tokens 256] [--cost-call C] [--out FILE]
    python benchmarks/governor.py model [--drafters ngram-cache,ngram-mod] [--files 12]
                                        [--cost-call 0.08,chain] [--out FILE]

Each prints one JSON object (and writes it to --out; an existing file only with --overwrite).

## `ask`: what asking a drafter for a draft costs, in plain rounds of the target

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
benchmarks/results/ask-cost.json, since replaced; ngram-cache's from ask-cost-native.json, after its prompt
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
the off rounds, whose cost ``benchmarks/rounds.py idle --heads`` measures).

## `rounds`: what the governor asks of drafters, rounds per run and rounds it asked

Deterministic counts (no timing), for comparing governor settings at two commits
(`PYTHONPATH=<worktree>`): the shipped target, greedy, `--tokens` new tokens, governor on.

* `cases`: each of ngram-simple / ngram-map-k / ngram-mod / ngram-cache over the `main`,
  `repetitive` and `norepeat` prompts (as benchmarks/peers.py builds them): rounds taken
  (fewer = more tokens per target forward) and rounds in which the drafter was asked;
  `total_rounds` sums them. For a lookup drafter, `repeats`: of the generated tokens, those
  that end an n-gram of its `lookup_size` that also ends at least `lookup_gap` + 1
  positions earlier in the stream (prompt and output), by a plain-Python scan: where a
  lookup could draft at all (asks beyond these come from the lookup index's collisions). `draft_model`: draft-simple with the shipped draft over the same
  prompts, apart (its asks cost a draft model's steps and catch-up, not a lookup).
* `finds_nothing`: ngram-map-k with an n-gram size no text can match, asked rounds after
  64, 256 and 1,024 tokens: the probing a drafter that never drafts costs (the backoff in
  `specjax.decode.governor`; 0 since the lookup index, `specjax.drafters.lookup_index`, rules every round
  out).
* `generator`: one `specjax.Generator` with ngram-mod (B = 1, `-c 2048`) serving 16
  requests in turn, each the first 400 tokens of one of the installed `yaml` package's
  modules (sorted by name) and `--generator-tokens` new tokens: asks and drafts per request.
  Its pool and its lookup table outlive the requests, so the table fills request after
  request (`lookup_index`: a shared table is never cleared) and its collisions grow.

`--cost-call` sets `SpecConfig.cost_call` (the governor's price of asking the chain, in
target forwards) for every run: the trade-off between the two lists above. Without it each
chain has its own price (`prices.chain_call_price`, in `chain_call_price`).

## `model`: what the governor's choices cost under the measured prices, over many prompts

Timing a governor setting on this shared 2-core host moves by 5-20% between runs (and by more
while other jobs run: a plain 256-token run took 38 ms in one hour and 110 ms in the next),
while the choices it makes are deterministic. So this prices them: each configuration runs
greedily (shipped target, 256 new tokens, capacity 2048) over the `main`, `repetitive` and
`norepeat` prompts (as benchmarks/peers.py builds them) and the first 256 tokens of `--files`
validation files (`benchmarks/heads.py`'s `validation_prompts`), and every round is charged
what it costs on this CPU, in plain rounds of the shipped target:

    1                                   the round (a plain round's 1-token step)
    + VERIFY_TOKEN * (w - 1)            a verify of width w (the narrowest compiled verify
                                        width holding the round's draft; CPU_VERIFY_TOKEN)
    + ASK_OVERHEAD + ask_steps          a round the chain was asked in (the engine's part and
                                        the drafter's, `ask`)

`modeled_speed` = tokens after the first / total cost: a plain run scores 1. It leaves out
what is not per round (a run's fixed ~1 ms) and the noise. `aggregate` pools the prompts; `below_0.97` counts prompts the
issue's goal 4 would fail. `--cost-call`: the governor's price of an ask for each run, a
number or `chain` (None: `prices.chain_call_price`, the measured prices).

The round's draft length comes from a host callback in the verify (`jax.debug.callback`),
which the persistent compilation cache cannot store: this script turns that cache off for
its own process (its programs compile, ~10 s each).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax
import jax.numpy as jnp
from _common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    emit,
    machine,
    mode_parser,
    refuse_overwrite,
    run_mode,
)
from drafters import ask as drafter_ask
from heads import validation_prompts
from peers import DEFAULT_DFLASH, DEFAULT_EAGLE3, NO_MATCH_N, PROMPT_FILES, Specjax

import specjax
from specjax import api
from specjax.decode import compile_cache
from specjax.decode import engine as eng
from specjax.drafters.base import TargetBatch, TokenHistory, hidden_by_layer
from specjax.drafters.registry import build_drafters

#: The prompts (as benchmarks/peers.py builds them) `rounds` and `model` run over.
PROMPTS = ("main", "repetitive", "norepeat")
CAPACITY = 2048


def asked(result: Any) -> int:
    """Rounds of a `generate` result in which the governor asked the chain."""
    governor = result.stats.to_dict()["governor"]
    return governor["rounds"] - governor["off"]


# ------------------------------------------------------------------------------- ask
#: The drafters `ask` times.
ASK_DRAFTERS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: Rows timed beside the drafters: a configuration and the drafter type it builds. An
#: ngram-cache that drafts nothing (`n_draft` 0) times its counting of new positions alone.
PARTS = {"ngram-cache/counting": ("ngram-cache", {"ngram_cache_n_draft": 0})}
#: Asks per timed loop.
ASKS = 16
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
            state, out = drafter_ask(
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
                    state, out = drafter_ask(
                        drafter, params, state, tokens, length[None], tokens[0, length][None], k
                    )
                    n = n + jnp.sum(out.valid)
                    state = drafter.rollback(state, length[None])
                return state, n

            return jax.lax.fori_loop(0, ASKS, body, (state, jnp.zeros((), jnp.int32)))

        return per_ask(loop, state)

    return make(True), make(False)


def ask(argv: list[str]) -> None:
    ap = mode_parser("ask", "what asking a drafter for a draft costs, in plain rounds")
    ap.add_argument("--gaps", default="1,8,64")
    ap.add_argument("--loops", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    ap.add_argument("--heads", action="store_true", help="also the shipped feature heads")
    args = ap.parse_args(argv)
    refuse_overwrite(args.out, args.overwrite)
    gaps = [int(g) for g in args.gaps.split(",")]

    peer = Specjax(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), 256)
    model = peer.model
    prompt = peer.ids(PROMPT_FILES["main"].read_text())
    plain = specjax.generate(model, [prompt], max_new_tokens=STREAM_TOKENS, n_ctx=CAPACITY)
    stream = prompt + plain.tokens[0]
    start = len(prompt)
    if start + (ASKS - 1) * max(gaps) >= len(stream):
        raise SystemExit(f"governor.py ask: a gap of {max(gaps)} runs past the stream")

    def plain_round() -> float:  # what the governor's unit costs: a plain round
        r = specjax.generate(model, [prompt], max_new_tokens=256, n_ctx=CAPACITY)
        return r.timings["decode_seconds"] / max(int(r.timings["n_rounds"]), 1)

    timers: dict[str, Any] = {"step": plain_round}
    configs = {name: (name, {}) for name in ASK_DRAFTERS} | PARTS
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


# ------------------------------------------------------------------------------- rounds
#: The drafters `rounds` runs.
ROUNDS_DRAFTERS = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def repeats(stream: Sequence[int], first: int, n: int, gap: int) -> int:
    """Positions p >= first of `stream` whose n-gram (ending at p) also ends at a position
    <= p - 1 - gap (the earliest occurrence of each n-gram is all that matters)."""
    earliest: dict[tuple[int, ...], int] = {}
    count = 0
    for p in range(n - 1, len(stream)):
        gram = tuple(stream[p - n + 1 : p + 1])
        seen = earliest.setdefault(gram, p)
        count += p >= first and seen <= p - 1 - gap
    return count


def generator_requests(model: Any, tokens: int, priced: dict[str, Any]) -> dict[str, Any]:
    """The `generator` section (module docstring)."""
    files = sorted(Path(yaml.__file__).parent.glob("*.py"))[:16]
    spec = specjax.SpecConfig(types=("ngram-mod",), draft_n_max=4, **priced)
    gen = specjax.Generator(model, spec=spec, n_ctx=2048)
    per_request = []
    for path in files:
        ids = model.tokenizer.encode(path.read_text())[:400]
        r = gen.generate([ids], max_new_tokens=tokens, temperature=0.0)
        stats = r.stats.to_dict()["drafters"]["ngram-mod"]
        per_request.append(
            {"file": path.name, "asked": stats["n_call_draft"], "drafts": stats["n_gen_drafts"]}
        )
    return {
        "requests": per_request,
        "asked": sum(r["asked"] for r in per_request),
        "drafts": sum(r["drafts"] for r in per_request),
    }


def rounds(argv: list[str]) -> None:
    ap = mode_parser("rounds", "what the governor asks of drafters")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--cost-call", type=float, default=None, help="default: SpecConfig's")
    ap.add_argument("--generator-tokens", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    refuse_overwrite(args.out, args.overwrite)
    peer = Specjax(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), args.tokens)
    model = peer.model
    ids = {p: peer.ids(PROMPT_FILES[p].read_text()) for p in PROMPTS}
    priced = {} if args.cost_call is None else {"cost_call": args.cost_call}
    cases: dict[str, dict[str, int]] = {}
    for drafter in ROUNDS_DRAFTERS:
        spec = specjax.SpecConfig(types=(drafter,), draft_n_max=4, **priced)
        (built,), _ = build_drafters(spec, None, None)
        for prompt in PROMPTS:
            r = specjax.generate(
                model, [ids[prompt]], max_new_tokens=args.tokens, n_ctx=2048, spec=spec
            )
            case = cases[f"{drafter}/{prompt}"] = {
                "rounds": r.timings["n_rounds"],
                "asked": asked(r),
            }
            n = built.lookup_size()
            if n is not None:
                stream = ids[prompt] + r.tokens[0]
                case["repeats"] = repeats(stream, len(ids[prompt]), n, built.lookup_gap())
    draft_model = {}
    spec = specjax.SpecConfig(types=("draft-simple",), draft_n_max=4, **priced)
    for prompt in PROMPTS:
        r = specjax.generate(
            model,
            [ids[prompt]],
            max_new_tokens=args.tokens,
            n_ctx=2048,
            spec=spec,
            draft=peer.draft,
        )
        draft_model[f"draft-simple/{prompt}"] = {"rounds": r.timings["n_rounds"], "asked": asked(r)}
    never = specjax.SpecConfig(
        types=("ngram-map-k",), draft_n_max=4, ngram_map_k_size_n=NO_MATCH_N, **priced
    )
    finds_nothing = {}
    for n in (64, 256, 1024):
        r = specjax.generate(model, [ids["norepeat"]], max_new_tokens=n, n_ctx=4096, spec=never)
        finds_nothing[str(n)] = asked(r)
    emit(
        {
            "benchmark": "governor_rounds",
            "tokens": args.tokens,
            # None: each chain's own price (`prices.chain_call_price`), listed per drafter
            "cost_call": args.cost_call,
            "chain_call_price": {
                d: api.chain_call_price(
                    build_drafters(specjax.SpecConfig(types=(d,)), None, None)[0]
                )
                for d in ROUNDS_DRAFTERS
            },
            "machine": machine(),
            "cases": cases,
            "total_rounds": sum(c["rounds"] for c in cases.values()),
            "finds_nothing_asked": finds_nothing,
            "draft_model": draft_model,
            "generator_tokens": args.generator_tokens,
            "generator": generator_requests(model, args.generator_tokens, priced),
        },
        args.out,
    )


# ------------------------------------------------------------------------------- model
TOKENS = 256


def _record_draft_lengths(rounds: list[int]) -> None:
    """Make every verify report the round's longest draft to `rounds` (a host callback)."""
    verify = eng._verify_round

    def recorded(engine: Any, target_params: Any, cache: Any, v_tokens: Any, v_pos: Any,
                 draft: Any, draft_len_B: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        jax.debug.callback(lambda n: rounds.append(int(n)), jnp.max(draft_len_B))
        return verify(engine, target_params, cache, v_tokens, v_pos, draft, draft_len_B,
                      *args, **kwargs)  # fmt: skip

    eng._verify_round = recorded


def modeled_run(
    model: Any, ids: list[int], spec: specjax.SpecConfig, drafted: list[int], ask: float
) -> dict[str, Any]:
    """One greedy run and its cost under the module's prices."""
    drafted.clear()
    r = specjax.generate(model, [ids], spec=spec, max_new_tokens=TOKENS, n_ctx=CAPACITY)
    n_asked = asked(r)
    widths = eng.Engine(
        target=model.config, k_max=spec.resolved_k_max(), capacity=CAPACITY, out_capacity=1
    ).verify_widths()
    verify = sum(
        api.CPU_VERIFY_TOKEN * (min(w for w in widths if w >= n + 1) - 1) for n in drafted if n
    )
    rounds = int(r.timings["n_rounds"])
    cost = rounds + verify + n_asked * ask
    steps = int(r.timings["generated_tokens"]) - 1
    return {"rounds": rounds, "asked": n_asked, "drafts": sum(1 for n in drafted if n),
            "tokens": steps, "cost": cost}  # fmt: skip


def model(argv: list[str]) -> None:
    ap = mode_parser("model", "what the governor's choices cost under the measured prices")
    ap.add_argument("--drafters", default="ngram-simple,ngram-map-k,ngram-mod,ngram-cache")
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--cost-call", default="0.08,chain")
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    refuse_overwrite(args.out, args.overwrite)
    compile_cache.set_compile_cache(None)  # (the callback cannot be stored)
    drafted: list[int] = []
    _record_draft_lengths(drafted)

    peer = Specjax(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), TOKENS)
    target = peer.model
    prompts = [(p, peer.ids(PROMPT_FILES[p].read_text())) for p in PROMPTS]
    prompts += validation_prompts(target, args.files, 256, 256 + TOKENS + 4)
    out: dict[str, Any] = {}
    for name in args.drafters.split(","):
        built, _ = build_drafters(specjax.SpecConfig(types=(name,)), target, None)
        ask = api.chain_call_price(built)  # what an ask costs on this CPU
        for price in args.cost_call.split(","):
            call = None if price == "chain" else float(price)
            spec = specjax.SpecConfig(types=(name,), draft_n_max=4, cost_call=call)
            runs = {p: modeled_run(target, ids, spec, drafted, ask) for p, ids in prompts}
            speeds = {p: r["tokens"] / r["cost"] for p, r in runs.items()}
            out[f"{name}/{price}"] = {
                "governor_call_price": ask if call is None else call,
                "aggregate": sum(r["tokens"] for r in runs.values())
                / sum(r["cost"] for r in runs.values()),
                "min": min(speeds.values()),
                "below_0.97": sum(s < 0.97 for s in speeds.values()),
                "modeled_speed": speeds,
                "runs": runs,
            }
            print(f"governor_model: {name}/{price} {out[f'{name}/{price}']['aggregate']:.3f}",
                  file=sys.stderr)  # fmt: skip
    emit(
        {
            "benchmark": "governor_model",
            "model": str(DEFAULT_TARGET.relative_to(DEFAULT_TARGET.parents[2])),
            "tokens": TOKENS,
            "prompts": [p for p, _ in prompts],
            "verify_token": api.CPU_VERIFY_TOKEN,
            "machine": machine(),
            "configs": out,
        },
        args.out,
    )


if __name__ == "__main__":
    run_mode({"ask": ask, "rounds": rounds, "model": model}, __doc__)
