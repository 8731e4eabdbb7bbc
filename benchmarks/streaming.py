"""Cost of streaming in `specjax.generate`: decode tok/s streamed vs not, interleaved.

    python benchmarks/streaming.py [--tokens 256] [--repeats 5] [--stream-rounds 8]
                                   [--out benchmarks/results/streaming.json]

One prompt on the shipped target, plain and speculative (ngram-mod + draft-simple): each
repeat runs the non-streamed and the streamed call back to back (best decode time of each
over the repeats, after a warm-up that compiles). Goal: streamed >= 0.95x. Checks that both
give the same tokens. Prints JSON and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, load_or_random, machine, refuse_overwrite

import specjax
from specjax.config import SpecConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream-rounds", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "streaming.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)
    model, name = load_or_random(str(DEFAULT_TARGET))
    draft, _ = load_or_random(str(DEFAULT_DRAFT))
    prompt = (Path(__file__).parent / "prompts" / "humaneval_main.py").read_text()
    spec = SpecConfig(types=("ngram-mod", "draft-simple"), draft_n_max=4)
    results = {}
    for label, kw in [("plain", {}), ("speculative", {"spec": spec, "draft": draft})]:
        pieces: list[str] = []

        def call(streamed: bool, kw=kw, pieces=pieces):
            extra = {}
            if streamed:
                extra = {
                    "stream": lambda r, t: pieces.append(t),
                    "stream_rounds": args.stream_rounds,
                }
            return specjax.generate(
                model, [prompt], max_new_tokens=args.tokens, n_ctx=512, **kw, **extra
            )

        call(False), call(True)  # compile
        best = {False: float("inf"), True: float("inf")}
        tokens = {}
        for _ in range(args.repeats):
            for streamed in (False, True):
                r = call(streamed)
                best[streamed] = min(best[streamed], r.timings["decode_seconds"])
                tokens[streamed] = r.tokens
        n = len(tokens[False][0])
        results[label] = {
            "generated_tokens": n,
            "tokens_per_second": n / best[False],
            "streamed_tokens_per_second": n / best[True],
            "streamed_over_plain": best[False] / best[True],
            "same_tokens": tokens[False] == tokens[True],
        }
        print(label, results[label], file=sys.stderr)
    out = {
        "model": name,
        "stream_rounds": args.stream_rounds,
        "results": results,
        "machine": machine(),
    }
    text = json.dumps(out, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
