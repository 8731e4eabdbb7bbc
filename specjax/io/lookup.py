"""llama.cpp lookup caches on the host: llama.cpp's host algorithms, lookup-create/-merge/-stats.

File format (`common_ngram_cache_save/load`): no header, native byte order, a sequence of
records `[4 x int32 n-gram][int32 n] n x ([int32 token][int32 count])` with `n > 0` and every
count > 0. An empty file is an empty cache.

Invariants:
* The dict form is `dict[(t0, t1, t2, t3), dict[token, count]]` (unused n-gram slots -1) and
  its order is the file's record order. `load_cache` returns the records in file order and
  `save_cache` writes them in dict order, so load + save reproduces a file byte for byte.
  Loading a file gives the same in-memory order llama.cpp gets (its insertion order is the file
  order), so drafting from a loaded cache breaks ties exactly as upstream.
* Results of computations (`create_static_cache`, `merge_caches`) are returned in the order
  llama.cpp's `common_ngram_cache_save` would write them (libstdc++ iteration order,
  `stl_iteration_order`), so their files are llama.cpp's files.
* Malformed files raise `specjax.errors.ModelFileError` naming the file and the byte offset.
  Upstream keeps the first of duplicated n-grams/tokens (emplace) and silently ignores a trailing
  partial n-gram; here duplicates are kept-first too, but any trailing bytes are an error.
* `save_cache` is atomic: it writes a temporary file next to the target and renames it; a failed
  save leaves an existing file untouched.
* `lookup_stats` replays llama.cpp's `lookup-stats` exactly (chunks of `n_ctx` tokens with
  `i_start + n_ctx < n_input`, the context cache merged into the dynamic cache after each
  chunk) and reports the same numbers.
* This module is the host side of the ngram-cache drafter: it holds llama.cpp's host
  algorithms (`ngram_cache_update/draft/merge`) and the lookup tools. The files are read and
  written, and the drafter's device tables built, by `specjax.io.lookup_file` (`load_cache`,
  `save_cache`, `make_tables`, `load_tables`, ... re-exported here), which the drafter's
  `from_spec` imports too. This module imports `specjax.drafters.ngram_cache`, never the other
  way round, and no test oracle.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from specjax.drafters.ngram_cache import (
    MIN_PERCENT_LAX,
    MIN_PERCENT_STRICT,
    MIN_SAMPLE_LAX,
    MIN_SAMPLE_STRICT,
    NGRAM_MAX,
    NGRAM_MIN,
    NGRAM_STATIC,
    context_cache,
)
from specjax.errors import ModelFileError
from specjax.io.lookup_file import (
    Cache,
    CacheDict,
    Ngram,
    NgramCacheTables,
    Part,
    build_lookup_table,
    cache_keys,
    decode_cache,
    encode_cache,
    hash_words_np,
    i32,
    load_cache,
    load_tables,
    make_tables,
    part_items,
    save_cache,
    stl_iteration_order,
    to_file_order,
)

# ---------------------------------------------------------------------------------------------
# llama.cpp's host algorithms (common/ngram-cache.cpp) and libstdc++ iteration order
# ---------------------------------------------------------------------------------------------

TOKEN_NULL = -1


def make_ngram(tokens: Sequence[int]) -> Ngram:
    """A 4-slot n-gram from up to 4 tokens (the rest `TOKEN_NULL`)."""
    t = list(tokens) + [TOKEN_NULL] * (NGRAM_MAX - len(tokens))
    return (int(t[0]), int(t[1]), int(t[2]), int(t[3]))


# ---------------------------------------------------------------------------------------------
# common/ngram-cache.cpp
# ---------------------------------------------------------------------------------------------


def ngram_cache_update(
    cache: Cache, ngram_min: int, ngram_max: int, inp: Sequence[int], nnew: int
) -> None:
    """`common_ngram_cache_update`: count `inp[i]` after `inp[i-s:i]` for the last `nnew` i."""
    n = len(inp)
    for size in range(ngram_min, ngram_max + 1):
        for i in range(max(n - nnew, size), n):
            ng = make_ngram(inp[i - size : i])
            tok = int(inp[i])
            part = cache.get(ng)
            if part is None:
                cache[ng] = {tok: 1}
            else:
                part[tok] = part.get(tok, 0) + 1


def _try_draft_static(nc_static: Cache, ngram_static: Ngram) -> int:
    part = nc_static.get(ngram_static)
    if part is None:
        return TOKEN_NULL
    max_count = 0
    total = 0
    best = TOKEN_NULL
    for tok, count in part_items(part):
        if count > max_count:
            best, max_count = tok, count
        total = i32(total + count)
    if total < MIN_SAMPLE_LAX[NGRAM_STATIC - 1]:
        return TOKEN_NULL
    if i32(100 * max_count) < i32(MIN_PERCENT_LAX[NGRAM_STATIC - 1] * total):
        return TOKEN_NULL
    return best


def _try_draft_primary(
    nc_primary: Cache,
    ngrams: Sequence[Ngram | None],
    part_static: Part,
    min_sample: Sequence[int],
    min_percent: Sequence[int],
) -> int:
    for i in range(len(ngrams) - 1, -1, -1):
        ng = ngrams[i]
        if ng is None:
            continue
        part = nc_primary.get(ng)
        if part is None:
            continue
        max_p = max_s = total = 0
        best = TOKEN_NULL
        items = list(part.items())
        # only ties need the libstdc++ order; find the best product first
        prods = []
        for tok, count in items:
            sc = part_static.get(tok)
            cs = i32(100 * sc) if sc is not None else 1
            prods.append((i32(count * cs), count, cs, tok))
            total = i32(total + count)
        top = max(p[0] for p in prods)
        if sum(1 for p in prods if p[0] == top) > 1:
            ordered = [items.index(it) for it in part_items(part)]
            prods = [prods[j] for j in ordered]
        for prod, count, cs, tok in prods:
            if prod > i32(max_p * max_s):
                best, max_p, max_s = tok, count, cs
        if total < min_sample[i]:
            continue
        if i32(100 * max_p) < i32(min_percent[i] * total):
            continue
        return best
    return TOKEN_NULL


def ngram_cache_draft(
    inp: Sequence[int],
    draft: list[int],
    n_draft: int,
    ngram_min: int,
    ngram_max: int,
    nc_context: Cache,
    nc_dynamic: Cache,
    nc_static: Cache,
) -> None:
    """`common_ngram_cache_draft`: extend `draft` (which starts as `[id_last]`) in place."""
    assert len(draft) == 1
    inp_size = len(inp)
    if inp_size < NGRAM_STATIC:
        return

    def tok_at(j: int) -> int:
        return int(inp[j]) if j < inp_size else draft[1 + j - inp_size]

    while len(draft) - 1 < n_draft:
        end = inp_size + len(draft) - 1
        ngram_static = make_ngram([tok_at(j) for j in range(end - NGRAM_STATIC, end)])
        part_static = nc_static.get(ngram_static, {})
        ngrams: list[Ngram | None] = []
        for size in range(ngram_min, ngram_max + 1):
            start = end - size
            ok = start >= 0
            ngrams.append(make_ngram([tok_at(j) for j in range(start, end)]) if ok else None)
        tok = _try_draft_primary(nc_context, ngrams, part_static, MIN_SAMPLE_LAX, MIN_PERCENT_LAX)
        if tok == TOKEN_NULL:
            tok = _try_draft_primary(
                nc_dynamic, ngrams, part_static, MIN_SAMPLE_STRICT, MIN_PERCENT_STRICT
            )
        if tok == TOKEN_NULL:
            tok = _try_draft_static(nc_static, ngram_static)
        if tok == TOKEN_NULL:
            break
        draft.append(tok)


def ngram_cache_merge(target: Cache, add: Cache) -> None:
    """`common_ngram_cache_merge`: add the counts of `add` into `target` (in place)."""
    for ng in cache_keys(add):
        part = add[ng]
        tpart = target.get(ng)
        if tpart is None:
            target[ng] = dict(part)  # a copy keeps the source's order
            continue
        for tok, count in part_items(part):
            tpart[tok] = tpart.get(tok, 0) + count


def copy_cache(cache: Cache) -> Cache:
    return {ng: dict(part) for ng, part in cache.items()}


# ---------------------------------------------------------------------------------------------
# common/speculative.cpp: common_speculative_impl_ngram_cache
# ---------------------------------------------------------------------------------------------


def build_cache(
    tokens: Iterable[int], ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX
) -> Cache:
    """A cache holding every n-gram of `tokens` (one `ngram_cache_update` over all of them)."""
    toks = [int(t) for t in tokens]
    cache: Cache = {}
    ngram_cache_update(cache, ngram_min, ngram_max, toks, len(toks))
    return cache


# ---------------------------------------------------------------------------------------------
# create / merge
# ---------------------------------------------------------------------------------------------


def create_static_cache(tokens: Iterable[int], ngram_size: int = NGRAM_STATIC) -> CacheDict:
    """`lookup-create`: every n-gram of size `ngram_size` of `tokens` and its followers."""
    if not 1 <= ngram_size <= NGRAM_MAX:
        raise ValueError(f"ngram_size must be in 1..{NGRAM_MAX}, got {ngram_size}")
    return to_file_order(build_cache(tokens, ngram_size, ngram_size))


def merge_caches(target: CacheDict, *others: CacheDict) -> CacheDict:
    """`common_ngram_cache_merge` of `others` into (a copy of) `target`, in file order."""
    merged = copy_cache(target)
    for other in others:
        ngram_cache_merge(merged, other)
    return to_file_order(merged)


def update_dynamic_cache(path: str | os.PathLike[str], *contexts: CacheDict) -> CacheDict:
    """End of a lookup run: merge context caches into the dynamic cache file (created if
    missing) and save it, as llama.cpp's lookup example does. Returns the saved cache."""
    path = os.fspath(path)
    dynamic = load_cache(path) if os.path.exists(path) else {}
    merged = merge_caches(dynamic, *contexts)
    save_cache(path, merged)
    return merged


def tables_from_cache(
    static: CacheDict | None = None,
    dynamic: CacheDict | None = None,
    min_shape: tuple[int, int, int, int] | None = None,
) -> NgramCacheTables | None:
    """Device tables (the ngram-cache drafter's params) from cache dicts; None if both are
    empty. `min_shape` pads them (see `build_lookup_table`)."""
    return make_tables(static, dynamic, min_shape)


def cache_from_state(state: Any, row: int) -> CacheDict:
    """A row's device context cache as a cache dict (in-memory insertion order)."""
    return context_cache(state, row)


def cache_stats(cache: CacheDict) -> dict[str, int]:
    """Sizes of a cache: n-grams, (n-gram, token) pairs, total count."""
    return {
        "ngrams": len(cache),
        "pairs": sum(len(p) for p in cache.values()),
        "count": sum(sum(p.values()) for p in cache.values()),
    }


# ---------------------------------------------------------------------------------------------
# lookup-stats
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LookupStats:
    """The numbers `llama-lookup-stats` prints."""

    n_draft: int
    n_predict: int
    n_drafted: int
    n_accept: int
    t_draft_flat_us: int = 0
    t_draft_us: int = 0

    @property
    def accept_percent(self) -> float:
        """`100.0f * n_accept / n_drafted` in float32, like upstream (nan when nothing drafted)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.float32(100.0) * np.float32(self.n_accept) / np.float32(self.n_drafted))

    def lines(self) -> list[str]:
        """The printed block, line by line (`%.2f`/`%.3f` as upstream)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            per_tok = float(np.float32(self.t_draft_us) / np.float32(self.n_drafted))
        tps = (
            self.n_drafted / (1e-6 * self.t_draft_us)
            if self.t_draft_us
            else (float("inf") if self.n_drafted else float("nan"))
        )
        return [
            f"n_draft      = {self.n_draft}",
            f"n_predict    = {self.n_predict}",
            f"n_drafted    = {self.n_drafted}",
            f"t_draft_flat = {_cfmt(self.t_draft_flat_us * 1e-3, 2)} ms",
            f"t_draft      = {_cfmt(self.t_draft_us * 1e-3, 2)} ms, {_cfmt(per_tok, 2)} us per "
            f"token, {_cfmt(tps, 2)} tokens per second",
            f"n_accept     = {self.n_accept}",
            "accept       = "
            + (f"{_cfmt(self.accept_percent, 3)}%" if self.n_drafted else "n/a (nothing drafted)"),
        ]


def _cfmt(x: float, digits: int) -> str:
    """printf `%.Nf` as glibc prints it, except a ratio without a denominator (0/0, where
    llama.cpp prints "-nan"): `n/a`."""
    if np.isnan(x):
        return "n/a"
    if np.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}f}"


def lookup_stats(
    tokens: Sequence[int],
    static: CacheDict | None = None,
    dynamic: CacheDict | None = None,
    n_draft: int = 3,
    n_ctx: int = 4096,
) -> LookupStats:
    """`lookup-stats` over `tokens`: chunks of `n_ctx` replayed as if generated, drafting with
    the three caches; the context cache is merged into (a copy of) `dynamic` after each chunk.
    `n_ctx` is used as given (the CLI rounds it up to a multiple of 256 like llama.cpp)."""
    if n_ctx <= 0:
        raise ValueError(f"n_ctx must be > 0, got {n_ctx}")
    inp = [int(t) for t in tokens]
    nc_static = static if static is not None else {}
    nc_dynamic = copy_cache(dynamic or {})
    nc_context: Cache = {}
    n_input = len(inp)
    n_drafted = n_accept = 0
    t_draft = 0.0
    lo, hi = NGRAM_MIN, NGRAM_MAX
    i_start = 0
    while i_start + n_ctx < n_input:
        inp_slice = inp[i_start : i_start + n_ctx]
        out = [inp_slice[0]]
        while len(out) < n_ctx:
            draft = [out[-1]]
            t0 = time.perf_counter()
            ngram_cache_draft(out, draft, n_draft, lo, hi, nc_context, nc_dynamic, nc_static)
            t_draft += time.perf_counter() - t0
            n_drafted += len(draft) - 1
            for j in range(1, len(draft)):
                if len(out) >= n_ctx or inp_slice[len(out)] != draft[j]:
                    break
                n_accept += 1
                out.append(draft[j])
                t0 = time.perf_counter()
                ngram_cache_update(nc_context, lo, hi, out, 1)
                t_draft += time.perf_counter() - t0
            if len(out) < n_ctx:
                out.append(inp_slice[len(out)])
                t0 = time.perf_counter()
                ngram_cache_update(nc_context, lo, hi, out, 1)
                t_draft += time.perf_counter() - t0
        ngram_cache_merge(nc_dynamic, nc_context)
        nc_context = {}
        i_start += n_ctx
    return LookupStats(
        n_draft=n_draft,
        n_predict=n_input - n_input % n_ctx,
        n_drafted=n_drafted,
        n_accept=n_accept,
        t_draft_us=int(t_draft * 1e6),
    )


# ---------------------------------------------------------------------------------------------
# command line (`specjax lookup-create | lookup-merge | lookup-stats`)
# ---------------------------------------------------------------------------------------------


def _add_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="model (GGUF file or HF folder) whose tokenizer to use")
    p.add_argument("--tokenizer", help="tokenizer.json (or its folder) instead of a model")
    p.add_argument(
        "--byte-tokens",
        action="store_true",
        help="tokenize as raw UTF-8 bytes (ids 0..255), no model needed",
    )
    p.add_argument("-f", "--file", help="text file to read")
    p.add_argument("-p", "--prompt", help="text given on the command line")


def _read_text(args: argparse.Namespace) -> str:
    if args.file:
        try:
            with open(args.file, encoding="utf-8", errors="surrogateescape") as f:
                return f.read()
        except OSError as e:
            raise SystemExit(f"error: cannot read {args.file}: {e.strerror}") from e
    if args.prompt is not None:
        return str(args.prompt)
    raise SystemExit("error: give the text with -f/--file or -p/--prompt")


def _tokenize(args: argparse.Namespace, text: str) -> tuple[list[int], int | None]:
    """Token ids as llama.cpp's `common_tokenize(ctx, text, add_special=true,
    parse_special=true)`, and the model's training context (None if unknown)."""
    if args.byte_tokens:
        return list(text.encode("utf-8", errors="surrogateescape")), None
    n_ctx_train = None
    if args.tokenizer:
        from specjax.io.tokenizer import Tokenizer

        tok = Tokenizer.from_file(args.tokenizer)
    elif args.model:
        from specjax.io import load_model_files

        config, _, tok = load_model_files(args.model)
        n_ctx_train = getattr(config, "max_position", None)
    else:
        raise SystemExit("error: give -m/--model, --tokenizer or --byte-tokens")
    add_bos = bool(getattr(tok, "add_bos", False)) and tok.bos_id is not None
    ids = tok.encode(text, add_bos=add_bos, parse_special=True)
    if getattr(tok, "add_eos", False) and tok.eos_id is not None:
        ids = [*ids, tok.eos_id]
    return ids, n_ctx_train


def _exit_status(command: Callable[[], None]) -> int:
    """0 once `command()` has run; 1, with `error: ...` on stderr, when it stopped on bad input
    or a file it could not read or write (ValueError, ModelFileError among them, or OSError)."""
    try:
        command()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def lookup_create_main(argv: Sequence[str] | None = None) -> int:
    """`lookup-create`: build a static cache (2-grams) from a text."""
    p = argparse.ArgumentParser(
        prog="specjax lookup-create", description="Create a static lookup cache from a text."
    )
    _add_input_args(p)
    p.add_argument("-lcs", "--lookup-cache-static", required=True, help="output cache file")
    p.add_argument("--ngram-size", type=int, default=NGRAM_STATIC, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    def create() -> None:
        ids, _ = _tokenize(args, _read_text(args))
        print("lookup-create: tokenization done", file=sys.stderr)
        cache = create_static_cache(ids, args.ngram_size)
        print(
            f"lookup-create: hashing done, writing file to {args.lookup_cache_static}",
            file=sys.stderr,
        )
        save_cache(args.lookup_cache_static, cache)

    return _exit_status(create)


def lookup_merge_main(argv: Sequence[str] | None = None) -> int:
    """`lookup-merge part_1.bin part_2.bin ... merged.bin`."""
    p = argparse.ArgumentParser(
        prog="specjax lookup-merge",
        description="Merges multiple lookup cache files into a single one (the last path).",
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    args = p.parse_args(argv)
    if len(args.files) < 2:
        p.error("need at least one input and the output path")
    *inputs, output = args.files

    def merge() -> None:
        print(f"lookup-merge: loading file {inputs[0]}", file=sys.stderr)
        merged = load_cache(inputs[0])
        others = []
        for path in inputs[1:]:
            print(f"lookup-merge: loading file {path}", file=sys.stderr)
            others.append(load_cache(path))
        merged = merge_caches(merged, *others)
        print(f"lookup-merge: saving file {output}", file=sys.stderr)
        save_cache(output, merged)

    return _exit_status(merge)


def lookup_stats_main(argv: Sequence[str] | None = None) -> int:
    """`lookup-stats`: offline drafting statistics of a text in chunks of the context size."""
    p = argparse.ArgumentParser(
        prog="specjax lookup-stats", description="Replay a text through lookup decoding offline."
    )
    _add_input_args(p)
    p.add_argument("-lcs", "--lookup-cache-static", help="static lookup cache")
    p.add_argument("-lcd", "--lookup-cache-dynamic", help="dynamic lookup cache (not updated)")
    p.add_argument(
        "--spec-draft-n-max",
        type=int,
        default=3,
        dest="n_draft",
        help="tokens to draft per step (default: 3)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=0,
        dest="n_ctx",
        help="chunk size, rounded up to a multiple of 256 (0 = model's context, "
        "4096 without a model)",
    )
    args = p.parse_args(argv)
    if args.n_draft < 0:
        p.error("--spec-draft-n-max must be >= 0")
    if args.n_ctx < 0:
        p.error("-c/--ctx-size must be >= 0")
    try:
        ids, n_ctx_train = _tokenize(args, _read_text(args))
        t0 = time.perf_counter()
        static = load_cache(args.lookup_cache_static) if args.lookup_cache_static else None
        dynamic = None
        if args.lookup_cache_dynamic:
            try:
                dynamic = load_cache(args.lookup_cache_dynamic)
            except ModelFileError:
                if os.path.exists(args.lookup_cache_dynamic):
                    raise
                dynamic = None  # upstream: a missing dynamic cache is simply empty
        t_flat = int((time.perf_counter() - t0) * 1e6)
    except (ModelFileError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_ctx = args.n_ctx or n_ctx_train or 4096
    n_ctx = -(-n_ctx // 256) * 256  # llama_context pads n_ctx to a multiple of 256
    stats = lookup_stats(ids, static, dynamic, args.n_draft, n_ctx)
    stats.t_draft_flat_us = t_flat
    print("", file=sys.stderr)
    for line in stats.lines():
        print(line, file=sys.stderr)
    return 0


__all__ = [
    "Cache",
    "CacheDict",
    "LookupStats",
    "build_lookup_table",
    "cache_from_state",
    "cache_stats",
    "create_static_cache",
    "decode_cache",
    "encode_cache",
    "hash_words_np",
    "load_cache",
    "load_tables",
    "lookup_create_main",
    "lookup_merge_main",
    "lookup_stats",
    "lookup_stats_main",
    "make_tables",
    "merge_caches",
    "save_cache",
    "stl_iteration_order",
    "tables_from_cache",
    "to_file_order",
    "update_dynamic_cache",
]
