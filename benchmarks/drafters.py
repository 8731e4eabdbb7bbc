"""Per-round cost of the n-gram drafters, as the engine calls them. Prints one JSON object.

    python benchmarks/drafters.py [--drafters ngram-mod,ngram-cache] [--batch 1,8]
        [--capacity 2048,8192] [--scenario text,random] [--rounds 40] [--hlo DIR]

One round is exactly the drafter's share of `engine.spec_step`: `draft()` (as `_relay` calls it,
every row drafting), then `process()` on the verify batch, `accept()` and `rollback()`, jitted
with the drafter state donated (`donate_argnums`) so that in-place updates are measured.
Histories: `text` = the shipped tokenizer's tokens of Python's `argparse.py` (n-grams recur, some
rounds draft), `random` = random ids (nothing matches: the cost of a drafter that proposes
nothing). Each timed round appends one token (id_last, n_accepted = 0) to a ~600-token history.
Rounds run inside one jitted `fori_loop` (as in the engine's loop, so no dispatch cost):
one warm-up call (the first rounds after `begin` scan the prompt), then 3 timed calls of
`--rounds` rounds. Reports microseconds per round (median and min of the 3 calls: the machine
may be shared), plus, from the optimised HLO, the number of `copy` ops and of ops whose result
has at least `capacity` elements (signs of O(S) work per round).
Not a test: never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine

from specjax.config import SpecConfig
from specjax.drafters.base import DraftInput, TargetBatch, TokenHistory
from specjax.drafters.registry import build_drafters

K = 8  # the engine's static K_max (draft width)
HISTORY = 600  # tokens in memory when the timed rounds start
Array = Any
NAMES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def corpus_tokens(n: int) -> np.ndarray:
    """n tokens of real-looking text: Python's own `argparse.py` (fixed for a given Python, so
    runs before and after a change see the same text), shipped tokenizer."""
    import argparse as text_source

    from specjax.io.tokenizer import Tokenizer

    tok = Tokenizer.from_file(ROOT / "models" / "tokenizer")
    text = Path(str(text_source.__file__)).read_text()
    ids = tok.encode(text[: 40 * n])
    if len(ids) < n:
        raise SystemExit(f"corpus too short: {len(ids)} tokens < {n}")
    return np.asarray(ids[:n], np.int32)


def stream(scenario: str, batch: int, n: int) -> np.ndarray:
    """[B, n] token streams (rows offset from each other so that they differ)."""
    if scenario == "random":
        return np.random.default_rng(0).integers(3, 2048, (batch, n)).astype(np.int32)
    base = corpus_tokens(n + 64 * batch)
    return np.stack([base[64 * r : 64 * r + n] for r in range(batch)])


def ask(drafter: Any, params: Any, state: Any, tokens_BS: Array, length_B: Array, last_B, k=K):
    """`draft()` as `_relay` calls it, every row drafting, at width `k`: (state, draft)."""
    B = length_B.shape[0]
    inp = DraftInput(
        history=TokenHistory(tokens=tokens_BS, length=length_B),
        last_token=last_B,
        n_max=jnp.full((B,), k, jnp.int32),
        drafting=jnp.ones((B,), bool),
        n_min=jnp.int32(0),
        p_min=jnp.float32(0.0),
        temperature=jnp.zeros((B,), jnp.float32),
        seed=jnp.zeros((B,), jnp.int32),
        draft_n_max=jnp.int32(k),
    )
    return drafter.draft(params, state, inp, k)


def one_round(drafter: Any, params: Any, state: Any, tokens_BS: Array, length_B: Array, last_B):
    """draft -> process -> accept -> rollback, as `spec_step` does (n_accepted = 0)."""
    B = length_B.shape[0]
    state, out = ask(drafter, params, state, tokens_BS, length_B, last_B)
    v_tokens = jnp.concatenate([last_B[:, None], out.tokens], axis=1)
    v_valid = jnp.concatenate([jnp.ones((B, 1), bool), out.valid], axis=1)
    v_pos = jnp.where(v_valid, length_B[:, None] + jnp.arange(K + 1)[None, :], -1)
    state = drafter.process(params, state, TargetBatch(tokens=v_tokens, positions=v_pos))
    n_acc = jnp.zeros((B,), jnp.int32)
    had = out.valid[:, 0]
    state = drafter.accept(state, n_acc, jnp.zeros((B,), bool), had)
    state = drafter.rollback(state, length_B + 1)
    return state, out


def hlo_signs(text: str, capacity: int) -> dict[str, int]:
    """Counts in optimised HLO text: `copy` ops, and ops whose result has >= capacity elems."""
    copies = big = 0
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?\S+ = (\w+)\[([\d,]*)\]\{?[^ ]* (\w[\w-]*)\(", line)
        if not m:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        size = int(np.prod(dims)) if dims else 1
        op = m.group(3)
        if op == "copy":
            copies += 1
        if size >= capacity and op not in ("parameter", "get-tuple-element", "tuple", "bitcast"):
            big += 1
    return {"copy_ops": copies, "ops_ge_capacity": big}


def bench(name: str, batch: int, capacity: int, scenario: str, rounds: int, hlo_dir: str | None):
    spec = SpecConfig(types=(name,))
    (drafter,), (params,) = build_drafters(spec, None, None)
    calls = 4  # 1 warm-up call (the first rounds after begin scan the prompt) + 3 timed
    toks = stream(scenario, batch, HISTORY + calls * rounds + 8)
    hist = np.zeros((batch, capacity), np.int32)
    hist[:, : toks.shape[1]] = toks
    tokens_BS = jnp.asarray(hist)
    state = drafter.init(batch, capacity)
    length = jnp.full((batch,), HISTORY, jnp.int32)
    state = jax.jit(drafter.begin)(state, TokenHistory(tokens=tokens_BS, length=length))

    def run(params: Any, state: Any, tokens_BS: Array, start: Array) -> tuple[Any, Array, Array]:
        """`rounds` rounds inside one jitted loop (as in the engine's loop: no dispatch)."""

        def body(i: Array, c: tuple[Any, Array, Array]) -> tuple[Any, Array, Array]:
            st, drafted, check = c
            n = start + i
            length = jnp.full((batch,), n, jnp.int32)
            st, out = one_round(drafter, params, st, tokens_BS, length, tokens_BS[:, n])
            drafted = drafted + jnp.sum(out.valid[:, 0].astype(jnp.int32))
            return st, drafted, check + jnp.sum(jnp.where(out.valid, out.tokens, 0))

        zero = jnp.int32(0)
        return jax.lax.fori_loop(0, rounds, body, (state, zero, zero))

    fn = jax.jit(run, donate_argnums=(1,))
    t0 = time.perf_counter()
    compiled = fn.lower(params, state, tokens_BS, jnp.int32(HISTORY)).compile()
    compile_s = time.perf_counter() - t0
    signs = hlo_signs(compiled.as_text(), capacity)
    if hlo_dir:
        out = Path(hlo_dir) / f"{name}-B{batch}-S{capacity}.hlo.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(compiled.as_text())
    times, drafted = [], 0
    for c in range(calls):
        start = jnp.int32(HISTORY + c * rounds)
        jax.block_until_ready(start)
        t = time.perf_counter()
        state, had, check = compiled(params, state, tokens_BS, start)
        jax.block_until_ready((state, had, check))
        dt = (time.perf_counter() - t) / rounds
        if c > 0:
            times.append(dt)
            drafted += int(had)
    return {
        "drafter": name,
        "batch": batch,
        "capacity": capacity,
        "scenario": scenario,
        "us_per_round": round(1e6 * statistics.median(times), 1),
        "us_min": round(1e6 * min(times), 1),
        "rows_drafted_fraction": round(drafted / ((calls - 1) * rounds * batch), 3),
        "compile_seconds": round(compile_s, 2),
        **signs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafters", default=",".join(NAMES))
    p.add_argument("--batch", default="1,8")
    p.add_argument("--capacity", default="2048,8192")
    p.add_argument("--scenario", default="random,text")
    p.add_argument("--rounds", type=int, default=32, help="rounds per timed call")
    p.add_argument("--hlo", default=None, help="folder to write the optimised HLO into")
    args = p.parse_args(argv)
    results = []
    for name in args.drafters.split(","):
        for b in (int(x) for x in args.batch.split(",")):
            for s in (int(x) for x in args.capacity.split(",")):
                for sc in args.scenario.split(","):
                    r = bench(name, b, s, sc, args.rounds, args.hlo)
                    print(json.dumps(r), file=sys.stderr)
                    results.append(r)
    print(json.dumps({"machine": machine(), "k_max": K, "history": HISTORY, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
