"""Shared helpers for benchmark scripts (model resolution, timing, memory)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

import specjax
from specjax.models.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = ROOT / "models" / "code-target" / "code-target-f16.gguf"
DEFAULT_DRAFT = ROOT / "models" / "code-draft" / "code-draft-f16.gguf"
#: Stand-in with the shipped target's shape, used when models/ has no GGUF yet.
FALLBACK_CONFIG = ModelConfig(
    vocab_size=2048, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=768
)


def load_or_random(
    path: str | os.PathLike[str] | None, fallback: ModelConfig = FALLBACK_CONFIG, seed: int = 0
) -> tuple[specjax.Model, str]:
    if path and Path(path).exists():
        return specjax.load(str(path)), str(path)
    return specjax.init_model(fallback, seed), f"random-init {fallback.num_params() / 1e6:.2f}M"


def best_of(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, Any]:
    """Minimum wall time of `repeats` calls (after the caller warmed up / compiled)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t)
    return best, out


def peak_memory() -> dict[str, Any]:
    """Host peak RSS, plus device peak bytes where the backend reports it."""
    out: dict[str, Any] = {
        "host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    }
    try:
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            out["device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
    except Exception:
        pass
    return out


def forward_timer(
    model: specjax.Model, prompt: list[int], width: int, n_ctx: int
) -> Callable[[], float]:
    """A thunk timing one `width`-token forward after `prompt`, on the weights and F16 cache
    the engine decodes with (`specjax.decode.prices.forward_timer`: a jitted loop of forwards, each
    fed the previous one's argmax, one dispatch); seconds per forward. Compiled here."""
    import jax.numpy as jnp

    from specjax import api
    from specjax.decode import prices

    cache = model.new_cache(1, n_ctx, "f16", "f16")
    params = api.decode_params(model.params)
    return prices.forward_timer(model.config, params, cache, width, jnp.asarray([prompt]))


def profiled(run: Callable[[], Any]) -> tuple[Any, list[dict[str, Any]]]:
    """`run()` under `jax.profiler`: its result and the trace's events (perfetto JSON)."""
    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            result = run()
        (path,) = glob.glob(f"{out}/**/*perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    return result, trace["traceEvents"] if isinstance(trace, dict) else trace


def llamacpp_prompt_ids(model: specjax.Model, prompt_text: str) -> list[int]:
    """What llama.cpp evaluates for `-f FILE`: BOS + the text without its last newline."""
    tok = model.tokenizer
    text = prompt_text[:-1] if prompt_text.endswith("\n") else prompt_text
    bos = getattr(tok, "bos_id", None)
    return ([int(bos)] if bos is not None else []) + list(tok.encode(text))


def refuse_overwrite(out: str | os.PathLike[str] | None, overwrite: bool) -> None:
    """Stop before a run whose `--out` file exists (a recorded result, perhaps) unless
    `--overwrite` was given: nothing a user saved is replaced without being asked for."""
    if out is not None and Path(out).exists() and not overwrite:
        raise SystemExit(
            f"{Path(sys.argv[0]).name}: {out} exists; pass --overwrite to replace it "
            "or choose another --out"
        )


def emit(
    result: dict[str, Any], out: str | os.PathLike[str] | None, *, partial: bool = False
) -> None:
    """Print `result` as JSON and write it to `out` (its folder created if needed; None: print
    only).

    `partial=True` writes without printing, marked `"partial": true`: a long run (an
    accelerator lease with a hard time limit) keeps what it measured so far if it is killed."""
    text = json.dumps({**result, "partial": True} if partial else result, indent=2)
    if not partial:
        print(text)
    if out is None:
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text + "\n")


def machine() -> dict[str, Any]:
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
    }


def run_mode(
    modes: dict[str, Callable[[list[str]], None]],
    doc: str,
    argv: list[str] | None = None,
    default: str | None = None,
) -> None:
    """The command line of a benchmark script with modes: `SCRIPT MODE [options]` runs
    `modes[MODE]` on the remaining arguments (each mode parses its own, `SCRIPT MODE --help`
    lists them); with a `default` mode, `SCRIPT [options]` runs it. `SCRIPT --help` prints
    `doc` (the script's docstring, which describes every mode)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in modes:
        modes[args[0]](args[1:])
        return
    if default is not None and not (args and args[0] in ("-h", "--help")):
        modes[default](args)
        return
    print(doc.strip() + "\n\nmodes: " + ", ".join(modes), file=sys.stderr)
    raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)


def mode_parser(mode: str, doc: str) -> Any:
    """The argument parser of one mode of a benchmark script (prog `SCRIPT MODE`)."""
    import argparse

    return argparse.ArgumentParser(prog=f"{Path(sys.argv[0]).name} {mode}", description=doc)
