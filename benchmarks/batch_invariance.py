"""Whether a request's greedy tokens depend on the batch beside it or on speculation.

    python benchmarks/batch_invariance.py [--requests 24] [--batch 8] [--tokens 128]
                                          [--no-kernels] [--out FILE]

`--requests` requests of benchmarks/batch.py's mix, greedy, decoded three ways: in batches of
`--batch` (plain), in the same batches with ngram-mod + draft-simple, and one at a time
(plain). Counts the requests whose tokens differ from the batched plain run. With the native
CPU kernels each row's bits are independent of the rows beside it and of the verify width,
so both counts are 0 (the tests assert it); `--no-kernels` (SPECJAX_CPU_KERNELS=0) runs
XLA's path, where a product of another shape may round a near-tie the other way, as on an
accelerator (`--dtype float16` computes in the GGUF's F16, as an accelerator does). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-kernels", action="store_true", help="XLA's path (no native kernels)")
    ap.add_argument("--dtype", default=None, help="compute dtype (float16: an accelerator's)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    if args.no_kernels:
        os.environ["SPECJAX_CPU_KERNELS"] = "0"  # read when specjax first builds a kernel
    from _common import DEFAULT_DRAFT, DEFAULT_TARGET, emit, machine, refuse_overwrite
    from batch import make_requests

    import specjax
    from specjax.kernels import cpu as cpu_kernels

    refuse_overwrite(args.out, args.overwrite)
    model = specjax.load(str(DEFAULT_TARGET), dtype=args.dtype)
    draft = specjax.load(str(DEFAULT_DRAFT), dtype=args.dtype)
    prompts = [r["tokens"] for r in make_requests(model, args.requests)]
    spec = specjax.SpecConfig(types=("ngram-mod", "draft-simple"), draft_n_max=4)
    kw = dict(max_new_tokens=args.tokens, n_ctx=512)
    batched, speculative, alone = [], [], []
    for i in range(0, len(prompts), args.batch):
        group = prompts[i : i + args.batch]
        batched += specjax.generate(model, group, **kw).tokens
        speculative += specjax.generate(model, group, spec=spec, draft=draft, **kw).tokens
        alone += [specjax.generate(model, [p], **kw).tokens[0] for p in group]
    emit(
        {
            "benchmark": "batch_invariance",
            "native_kernels": cpu_kernels.available(),
            "dtype": model.config.dtype,
            "requests": len(prompts),
            "batch": args.batch,
            "tokens": args.tokens,
            "machine": machine(),
            "speculative_differs": sum(a != b for a, b in zip(batched, speculative)),
            "alone_differs": sum(a != b for a, b in zip(batched, alone)),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
