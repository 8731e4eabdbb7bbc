"""`specjax batch`: an offline job over a JSONL request file (see `specjax.jobs.batch`).

    specjax batch -m MODEL --in requests.jsonl --out results.jsonl [-np N] [generate flags]
                  [--errors FILE] [--mesh data=D,model=M] [--no-progress]

Takes every `specjax generate` flag (sampling values are the requests' defaults; speculative
flags as there), except the prompt flags `-p` / `-f`. Running the same command again after
an interruption skips the requests already in `--out`. Under `jax.distributed` (several
processes), process i runs every n-th request and writes `OUT` with `.shard-i-of-n` before
its suffix (see docs/batch.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from specjax.cli.interrupt import EXIT_INTERRUPTED, current_interrupt
from specjax.cli.options import (
    _GENERATE_DEFAULTS,
    _generate_parser,
    _spec_from_options,
    fit_drafts,
    load_options,
    print_stats,
    sampling_options,
)
from specjax.io.paths import check_writable


def _batch_parser() -> argparse.ArgumentParser:

    p = _generate_parser()
    p.prog = "specjax batch"
    p.description = "Run a JSONL file of requests with continuous batching (resumable)."
    b = p.add_argument_group("batch job")
    b.add_argument("--in", dest="in_path", help="request file (JSONL, one request per line)")
    b.add_argument(
        "-np", "--parallel", dest="n_parallel", type=int, help="slots decoded together (8)"
    )
    b.add_argument(
        "--errors",
        dest="errors_path",
        help="write bad request lines here, skip them (checked before anything runs)",
    )
    b.add_argument(
        "--repair",
        action="store_true",
        default=None,
        help="resume from a damaged --out: drop (and list) the records it cannot trust "
        "(incomplete, edited, of ids not in --in, or a second one of an id) and run their "
        "requests again; the file as it was is kept in OUT.bak. Without it such a file is "
        "refused unchanged",
    )
    b.add_argument("--mesh", help="device mesh, e.g. data=4,model=2 (default: one device)")
    b.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill call (64)")
    b.add_argument("--fsync-interval", type=float, help="seconds between fsyncs of --out (1)")
    b.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    b.add_argument(
        "--distributed",
        action="store_true",
        default=None,
        help="join a jax.distributed job (coordinator and process ids from the environment "
        "or the flags below; on a TPU slice detected automatically)",
    )
    b.add_argument("--coordinator", help="jax.distributed coordinator HOST:PORT")
    b.add_argument("--num-processes", type=int, help="jax.distributed process count")
    b.add_argument("--process-id", type=int, help="this process's index")
    return p


_BATCH_DEFAULTS: dict[str, Any] = {
    "in_path": None,
    "n_parallel": 8,
    "errors_path": None,
    "mesh": None,
    "prefill_chunk": 64,
    "fsync_interval": 1.0,
    "progress": True,
    "distributed": False,
    "coordinator": None,
    "num_processes": None,
    "process_id": None,
    "repair": False,
}


def _load_options(argv: list[str]) -> dict[str, Any]:
    """`specjax batch`'s options: generate's defaults and the batch job's, a --config file's
    keys, then the flags."""
    return load_options(_batch_parser(), {**_GENERATE_DEFAULTS, **_BATCH_DEFAULTS}, argv)


def parse_mesh(text: str | None) -> dict[str, int] | None:
    """`data=4,model=2` -> {"data": 4, "model": 2}; None for no mesh."""
    if not text:
        return None
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in ("data", "model") or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--mesh takes data=D,model=M with integers >= 1, got {text!r}")
        if name in axes:
            raise ValueError(f"--mesh names {name!r} twice: {text!r}")
        axes[name] = int(value)
    return {"data": axes.get("data", 1), "model": axes.get("model", 1)}


def batch_main(argv: list[str]) -> int:
    opts = _load_options(argv)
    if opts.get("distributed") or opts.get("coordinator") or opts.get("num_processes"):
        import jax

        jax.distributed.initialize(
            coordinator_address=opts.get("coordinator"),
            num_processes=opts.get("num_processes"),
            process_id=opts.get("process_id"),
        )

    if not opts.get("model"):
        raise SystemExit("error: no model given (-m/--model or `model:` in --config)")
    if not opts.get("in_path") or not opts.get("out"):
        raise SystemExit("error: specjax batch needs --in REQUESTS.jsonl and --out RESULTS.jsonl")
    if opts.get("prompt") or opts.get("file"):
        raise SystemExit("error: specjax batch reads its prompts from --in, not -p/-f")

    if not Path(opts["in_path"]).is_file():
        raise SystemExit(f"error: request file {opts['in_path']} not found")
    # where results go is checked before anything loads or runs (a shard's own path, under
    # jax.distributed, again by `batch`)
    check_writable(str(opts["out"]), "--out")
    if opts.get("errors_path"):
        check_writable(str(opts["errors_path"]), "--errors")
    from specjax.api import load
    from specjax.decode.compile_cache import set_compile_cache

    cache_opt = opts.get("compile_cache")
    if cache_opt is False:
        set_compile_cache(None)
    elif isinstance(cache_opt, str) and cache_opt:
        set_compile_cache(cache_opt)
    spec = _spec_from_options(opts)
    mesh = parse_mesh(opts.get("mesh"))
    log = sys.stderr
    model = load(opts["model"])
    draft = load(opts["spec_draft_model"]) if opts.get("spec_draft_model") else None
    if spec is not None and "draft-simple" in spec.types and draft is None:
        raise SystemExit("error: --spec-type draft-simple needs -md/--spec-draft-model")
    if spec is not None:  # a request has at least one token; -n is a default requests change
        from specjax.decode.inputs import context_size

        ctx = context_size(model, opts["ctx_size"])
        spec = fit_drafts(spec, ctx - 2, f"context {ctx}", log)
    interrupt = current_interrupt()
    with interrupt.installed():
        summary = _run(model, opts, spec, draft, mesh, log, interrupt)
    print(
        f"specjax batch: {summary.n_done} request(s) done in {summary.seconds:.2f} s, "
        f"{summary.generated_tokens} tokens ({summary.tokens_per_second:.1f} t/s); "
        f"{summary.n_skipped} skipped (already done), {summary.n_errors} bad line(s) skipped",
        file=log,
    )
    if summary.n_context:
        print(
            f"specjax batch: {summary.n_context} request(s) stopped at the context of "
            f"{summary.context} tokens (finish_reason context): -c/--ctx-size sets it",
            file=log,
        )
    print_stats(summary.stats, log)
    if summary.interrupted:
        print(
            "specjax batch: interrupted (Ctrl-C); every record in --out is whole, the requests "
            "that were running run when the same command is given again (resume)",
            file=log,
        )
        return EXIT_INTERRUPTED
    return 0


def _run(
    model: Any, opts: dict[str, Any], spec: Any, draft: Any, mesh: Any, log: Any, interrupt: Any
) -> Any:
    """`specjax.jobs.batch.batch` with the command's options."""
    from specjax.jobs.batch import batch

    return batch(
        model,
        opts["in_path"],
        opts["out"],
        n_parallel=int(opts["n_parallel"]),
        spec=spec,
        draft=draft,
        n_ctx=int(opts["ctx_size"]) or None,
        n_predict=int(opts["n_predict"]),
        **sampling_options(opts),
        errors_path=opts.get("errors_path"),
        prefill_chunk=int(opts["prefill_chunk"]),
        fsync_interval=float(opts["fsync_interval"]),
        progress=bool(opts["progress"]),
        mesh=mesh,
        log=log,
        repair=bool(opts.get("repair")),
        interrupt=interrupt,
        swa_full=bool(opts.get("swa_full")),
    )
