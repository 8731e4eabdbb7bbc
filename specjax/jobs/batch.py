"""Offline batch jobs: JSONL requests in, JSONL results out, resumable and bit-identical.

    specjax.batch(model, "requests.jsonl", "results.jsonl", n_parallel=16, spec=..., draft=...)
    specjax batch -m MODEL --in requests.jsonl --out results.jsonl -np 16 [generate flags]

A request line is a JSON object with `prompt` (text) or `tokens` (ids), and optionally `id`
(default: its 1-based line number), `n_predict`, `temperature`, `top_k`, `top_p`, `min_p`,
`repeat_penalty`, `seed` (defaults: the job's options). A result line holds `id`, `tokens`,
`text`, `finish_reason`, `timings` and `stats` (the request's verify rounds, drafted and
accepted draft tokens, acceptance rate and mean acceptance length).

Invariants:
* Every line is checked before anything runs (invalid JSON, unknown keys, neither or both of
  prompt/tokens, empty prompts, token ids out of range, prompts that do not fit the context,
  bad sampling values, duplicate ids): all bad lines are reported with their numbers in one
  ValueError, or, with `errors_path`, written there and skipped. Blank lines are not requests.
* Results are appended with one `write` on an O_APPEND descriptor per line (a line is
  written whole or not at all), fsynced at most `fsync_interval` seconds apart and at the
  end. A restart with the same arguments reads the results file, drops a torn last line if a
  crash left one, and skips the ids already there; it never writes an id twice.
* A request's tokens depend only on the request and the model (see `specjax.jobs.continuous`):
  not on its slot, the other requests, `n_parallel`, or interruptions. The static sizes (context
  S, output capacity, prefill chunk, draft width) come from the whole request file and the
  options, so a restart compiles the same programs. Rejection sampling of probabilistic
  drafts and synthetic acceptance would make tokens depend on drafts, so they are refused.
* Results are written in completion order; readers key them by `id`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import api, sampling
from specjax.config import SpecConfig
from specjax.decode import engine as eng
from specjax.decode import inputs, prices, weights
from specjax.drafters.registry import build_drafters
from specjax.errors import CacheOverflowError
from specjax.io.paths import check_writable
from specjax.jobs import continuous as cont
from specjax.jobs import sharding as bs
from specjax.memory.kv import cache_dtype

#: Keys a request line may hold.
REQUEST_KEYS = (
    "id",
    "prompt",
    "tokens",
    "n_predict",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "seed",
)


@dataclasses.dataclass(frozen=True)
class Request:
    """One validated request: prompt ids and its own sampling values."""

    id: Any  # str or int, unique in the job
    line: int  # 1-based line number in the request file
    tokens: tuple[int, ...]
    n_predict: int  # >= 1, or -1 = until the context is full
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    seed: int


@dataclasses.dataclass(frozen=True)
class LineError:
    line: int
    error: str
    text: str


class BatchInputError(ValueError):
    """Bad request lines, each with its line number (raised before anything runs)."""

    def __init__(self, errors: Sequence[LineError], source: str) -> None:
        self.errors = list(errors)
        shown = "\n".join(f"  line {e.line}: {e.error}" for e in self.errors[:50])
        more = f"\n  ... and {len(self.errors) - 50} more" if len(self.errors) > 50 else ""
        super().__init__(f"{len(self.errors)} bad request line(s) in {source}:\n{shown}{more}")


# ----------------------------------------------------------------------------------------
# requests


def _lines(source: str | os.PathLike[str] | Iterable[Any]) -> tuple[list[tuple[int, str]], str]:
    """(line number, text) of the request source: a path, or an iterable of dicts/strings."""
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"request file {path} not found")
        with open(path, "rb") as fh:
            raw = fh.read().split(b"\n")
        if raw and raw[-1] == b"":
            raw.pop()
        # a line that is not UTF-8 is a bad line like any other (reported with its number)
        return [(i + 1, line.decode("utf-8", errors="surrogateescape")) for i, line in
                enumerate(raw)], path  # fmt: skip
    out = []
    for i, item in enumerate(source):
        out.append((i + 1, item if isinstance(item, str) else json.dumps(item)))
    return out, "requests"


def parse_requests(
    model: api.Model,
    source: str | os.PathLike[str] | Iterable[Any],
    *,
    n_ctx: int,
    defaults: dict[str, Any],
) -> tuple[list[Request], list[LineError], str]:
    """Validate every request line; returns (requests, bad lines, source name)."""
    lines, name = _lines(source)
    requests: list[Request] = []
    errors: list[LineError] = []
    seen: dict[Any, int] = {}
    for number, text in lines:
        if not text.strip():
            continue
        try:
            req = _parse_line(model, number, text, n_ctx, defaults)
        except ValueError as err:
            errors.append(LineError(number, str(err), text.rstrip("\n")))
            continue
        key = (type(req.id).__name__, req.id)
        if key in seen:
            errors.append(
                LineError(
                    number, f"duplicate id {req.id!r} (first on line {seen[key]})", text.rstrip()
                )
            )
            continue
        seen[key] = number
        requests.append(req)
    return requests, errors, name


def _parse_line(
    model: api.Model, number: int, text: str, n_ctx: int, defaults: dict[str, Any]
) -> Request:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not UTF-8 (byte {err.start + 1} of the line)") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a request must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(REQUEST_KEYS)}"
        )
    rid = obj.get("id", number)
    if isinstance(rid, bool) or not isinstance(rid, int | str):
        raise ValueError(f"id must be a string or an integer, got {rid!r}")
    if ("prompt" in obj) == ("tokens" in obj):
        raise ValueError("a request needs exactly one of 'prompt' (text) or 'tokens' (ids)")
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        ids = model.encode(prompt)
    else:
        toks = obj["tokens"]
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            raise ValueError("tokens must be a list of integer token ids")
        ids = list(toks)
    if not ids:  # (an empty text is the BOS token alone where the model adds one)
        raise ValueError("empty prompt: no tokens (the model adds no BOS token to a text)")
    V = model.config.V
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {V}")
    inputs.check_prompt_fits(len(ids), n_ctx)  # (the context rule: `inputs.fit_context`)
    values = {k: obj.get(k, defaults[k]) for k in REQUEST_KEYS[3:]}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {value!r}")
    for key in ("n_predict", "top_k", "seed"):
        if float(values[key]) != int(values[key]):
            raise ValueError(f"{key} must be an integer, got {values[key]!r}")
    n_predict = int(inputs._n_predict(int(values["n_predict"]), 1)[0])
    s = inputs._sampling_args(
        1,
        values["temperature"],
        values["top_k"],
        values["top_p"],
        values["min_p"],
        values["repeat_penalty"],
    )
    return Request(
        id=rid,
        line=number,
        tokens=tuple(int(t) for t in ids),
        n_predict=n_predict,
        temperature=float(s["temperature"][0]),
        top_k=int(s["top_k"][0]),
        top_p=float(s["top_p"][0]),
        min_p=float(s["min_p"][0]),
        repeat_penalty=float(s["repeat_penalty"][0]),
        seed=int(values["seed"]),
    )


# ----------------------------------------------------------------------------------------
# results file


def read_results(path: str | os.PathLike[str], repair: bool = True) -> list[dict[str, Any]]:
    """Records of a results file, as a reader sees them (no check against requests; the job
    itself uses `load_results`). A torn last line (no newline: a crash mid-write) is cut off
    the file when `repair`, else ignored; any other unreadable line raises."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return []
    with open(path, "rb") as fh:
        data = fh.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if repair:
            _truncate(path, end)
            print(
                f"specjax batch: dropped a torn last line of {len(data) - end} bytes from {path}",
                file=sys.stderr,
            )
        data = data[:end]
    records = []
    for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path} line {i + 1} is not a result record") from None
        if not isinstance(rec, dict) or "id" not in rec:
            raise ValueError(f"{path} line {i + 1} is not a result record (no id)")
        records.append(rec)
    return records


def _truncate(path: str, end: int) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(end)
        fh.flush()
        os.fsync(fh.fileno())


#: What a result record holds, with the type of each value.
RECORD_KEYS: dict[str, Any] = {
    "id": (int, str),
    "tokens": list,
    "text": str,
    "finish_reason": str,
    "timings": dict,
    "stats": dict,
    "check": str,
}


def _id_key(rid: Any) -> tuple[str, Any]:
    return (type(rid).__name__, rid)


def request_fingerprint(req: Request) -> str:
    """What a request's record depends on besides the model: its prompt ids and sampling."""
    text = json.dumps(
        [
            list(req.tokens),
            req.n_predict,
            req.temperature,
            req.top_k,
            req.top_p,
            req.min_p,
            req.repeat_penalty,
            req.seed,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


def record_check(record: dict[str, Any], req: Request) -> str:
    """The `check` a record carries: a hash of its other fields (as parsed, so the file's
    spacing does not matter) and of its request. An edited record, or one left from a request
    that has since changed, no longer matches it."""
    body = {k: v for k, v in record.items() if k != "check"}
    text = json.dumps(body, sort_keys=True, ensure_ascii=True) + request_fingerprint(req)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _record_problem(rec: Any, requests: dict[tuple[str, Any], Request]) -> str | None:
    """Why a parsed line is not a trusted result record of `requests` (None: it is)."""
    if not isinstance(rec, dict):
        return f"not a JSON object ({type(rec).__name__})"
    missing = [k for k in RECORD_KEYS if k not in rec]
    if missing:
        return f"missing {', '.join(missing)}"
    extra = sorted(set(rec) - set(RECORD_KEYS))
    if extra:
        return f"unknown key(s) {', '.join(map(repr, extra))}"
    for key, kind in RECORD_KEYS.items():
        if isinstance(rec[key], bool) or not isinstance(rec[key], kind):
            return f"{key} has the wrong type ({type(rec[key]).__name__})"
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in rec["tokens"]):
        return "tokens must be integer ids"
    if rec["finish_reason"] not in eng.FINISH_NAMES.values():
        return f"unknown finish_reason {rec['finish_reason']!r}"
    req = requests.get(_id_key(rec["id"]))
    if req is None:
        return "its id is not a request of the input"
    if rec["check"] != record_check(rec, req):
        return "its check does not match (the record was edited, or its request changed)"
    return None


@dataclasses.dataclass(frozen=True)
class ResultProblem:
    line: int  # 1-based line of the results file
    id: Any  # the record's id when it has one, else None
    reason: str

    def __str__(self) -> str:
        rid = "" if self.id is None else f" (id {self.id!r})"
        return f"line {self.line}{rid}: {self.reason}"


class DamagedResultsError(ValueError):
    """A results file holding lines a resume cannot trust (raised before anything changes)."""

    def __init__(self, path: str, problems: Sequence[ResultProblem]) -> None:
        self.path, self.problems = path, list(problems)
        shown = "\n".join(f"  {p}" for p in self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        super().__init__(
            f"{path} holds {len(self.problems)} line(s) a resume cannot trust; the file was not "
            f"changed (run again with --repair to drop them, keeping a backup):\n{shown}{more}"
        )


def check_results(
    path: str, requests: Sequence[Request]
) -> tuple[list[dict[str, Any]], list[ResultProblem], int]:
    """Validate every line of the results file `path` against `requests`: (trusted records,
    problems, length of the whole lines in bytes). A record is trusted when it has every key
    with its type, a known finish reason, an id of the input, a `check` matching it and its
    request, and is the first trusted record of its id. A torn last line (no newline: a crash
    mid-write) is not a problem: it is past the whole lines and the resume cuts it off."""
    by_id = {_id_key(r.id): r for r in requests}
    with open(path, "rb") as fh:
        data = fh.read()
    end = data.rfind(b"\n") + 1
    records: list[dict[str, Any]] = []
    problems: list[ResultProblem] = []
    first: dict[tuple[str, Any], int] = {}
    for i, raw in enumerate(data[:end].split(b"\n")[:-1]):
        number = i + 1
        if not raw.strip():
            problems.append(ResultProblem(number, None, "blank line"))
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            why = "not UTF-8" if isinstance(err, UnicodeDecodeError) else "not JSON"
            problems.append(ResultProblem(number, None, why))
            continue
        rid = rec.get("id") if isinstance(rec, dict) else None
        rid = rid if isinstance(rid, int | str) and not isinstance(rid, bool) else None
        problem = _record_problem(rec, by_id)
        if problem is not None:
            problems.append(ResultProblem(number, rid, problem))
            continue
        key = _id_key(rec["id"])
        if key in first:
            problems.append(
                ResultProblem(
                    number, rid, f"a second record of its id (first on line {first[key]})"
                )
            )
            continue
        first[key] = number
        records.append(rec)
    return records, problems, end


def load_results(
    path: str, requests: Sequence[Request], *, repair: bool = False, log: Any = None
) -> list[dict[str, Any]]:
    """The trusted records of the results file `path` for a resume (see `check_results`).

    A torn last line is cut off (a crash mid-write: the request runs again). Any other
    problem raises `DamagedResultsError` naming each line and id, with the file unchanged;
    with `repair`, the file is first copied to `path + ".bak"` (the copy holds every byte, so
    nothing is lost), each dropped line is listed on `log`, and the file is rewritten with the
    trusted records only (atomically); their requests run again."""
    log = sys.stderr if log is None else log
    if not os.path.exists(path):
        return []
    records, problems, end = check_results(path, requests)
    if problems and not repair:
        raise DamagedResultsError(path, problems)
    size = os.path.getsize(path)
    if problems:
        backup = _backup_path(path)
        shutil.copy2(path, backup)
        for p in problems:
            print(f"specjax batch: --repair drops {path} {p}", file=log)
        tmp = f"{path}.repair.tmp"
        with open(tmp, "wb") as fh:
            for rec in records:
                fh.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        print(
            f"specjax batch: --repair kept {len(records)} record(s) of {path}, dropped "
            f"{len(problems)} line(s) (their requests run again); the file as it was is in "
            f"{backup}",
            file=log,
        )
    elif end < size:
        _truncate(path, end)
        print(
            f"specjax batch: dropped a torn last line of {size - end} bytes from {path}",
            file=log,
        )
    return records


def _backup_path(path: str) -> str:
    """`path.bak`, or `path.bak.N` for the first N free: an earlier backup is never replaced."""
    candidate, n = f"{path}.bak", 1
    while os.path.exists(candidate):
        candidate, n = f"{path}.bak.{n}", n + 1
    return candidate


class _Appender:
    """Whole-line appends (one write on an O_APPEND descriptor), fsync at a bounded interval."""

    def __init__(self, path: str, fsync_interval: float) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.interval = fsync_interval
        self.last_sync = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        if time.monotonic() - self.last_sync >= self.interval:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.fd)
        self.last_sync = time.monotonic()

    def close(self) -> None:
        self.sync()
        os.close(self.fd)


# ----------------------------------------------------------------------------------------
# the job


@dataclasses.dataclass
class BatchSummary:
    """What a job did: counts, tokens, wall time, and the job-wide speculative statistics."""

    n_requests: int
    n_skipped: int  # already in the results file (resume)
    n_done: int  # finished in this run
    n_errors: int  # bad lines written to the errors file
    generated_tokens: int
    seconds: float
    tokens_per_second: float
    stats: Any = None  # api.SpecReport of this run
    compile_seconds: float = 0.0
    #: requests of this run that stopped at the context (finish_reason `context`)
    n_context: int = 0
    #: the context of the job's slots (cells per slot)
    context: int = 0
    #: stopped by `interrupt` (the requests it left unfinished run on resume)
    interrupted: bool = False


def _sizes(
    model: api.Model, requests: Sequence[Request], n_ctx: int | None, k_max: int, chunk: int
) -> tuple[int, int]:
    """Static (context S, output capacity O) of a job, from all its requests: the context
    rule's capacity (`inputs.fit_context`: `n_ctx`, or with None what the requests need, at
    most the model's training context)."""
    need = None
    if n_ctx is None and requests and all(r.n_predict > 0 for r in requests):
        need = max(len(r.tokens) + r.n_predict for r in requests) + k_max + 2
    _, n_ctx = inputs.fit_context(model, [], n_ctx, need=need, warn=False)
    longest_out = max([r.n_predict if r.n_predict > 0 else n_ctx for r in requests] or [1])
    out_cap = inputs._bucket(min(longest_out, n_ctx) + k_max + 1, 32)
    return n_ctx, out_cap


def batch(
    model: api.Model,
    requests: str | os.PathLike[str] | Iterable[Any],
    out: str | os.PathLike[str],
    *,
    n_parallel: int = 8,
    spec: SpecConfig | None = None,
    draft: api.Model | None = None,
    n_ctx: int | None = None,
    n_predict: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repeat_penalty: float = 1.0,
    seed: int = 0,
    errors_path: str | os.PathLike[str] | None = None,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    prefill_chunk: int = 64,
    segment_rounds: int = 64,
    fsync_interval: float = 1.0,
    progress: bool = True,
    mesh: dict[str, int] | None = None,
    log: Any = None,
    repair: bool = False,
    interrupt: Any = None,
    swa_full: bool = False,
) -> BatchSummary:
    """Run every request of `requests` (a JSONL path, or an iterable of request dicts) with
    `n_parallel` slots of continuous batching and append one result line per request to
    `out`. Requests whose id is already in `out` are skipped (resume). Keyword values are
    the per-request defaults (`n_predict=-1`: until end of generation or a full context).
    `n_ctx`: context cells per slot (default: from the requests). Bad lines raise
    `BatchInputError` before anything runs, or go to `errors_path` and are skipped.
    An existing `out` is checked whole first (`load_results`): a line it cannot trust raises
    `DamagedResultsError` with the file unchanged, or with `repair` is dropped (the file as it
    was is kept in `out.bak`) and its request runs again.

    The context follows `specjax.decode.inputs.fit_context` (the rule of every path): a
    request whose prompt does not fit is a bad line; one that reaches the context stops
    with finish_reason `context` (`BatchSummary.n_context` counts them).
    `interrupt()`: asked after each segment of rounds; when it returns True the job stops
    there, with every finished request written whole and those in the slots left for the
    next run (resume), and `BatchSummary.interrupted` set (the CLI's Ctrl-C).
    `swa_full`: a gemma3 model keeps every cell of its sliding-window layers (llama.cpp's
    `--swa-full`) instead of a ring of window + K (`specjax.memory.swa`).
    """
    log = sys.stderr if log is None else log
    if isinstance(n_parallel, bool) or not isinstance(n_parallel, int) or n_parallel < 1:
        raise ValueError(f"n_parallel must be an integer >= 1, got {n_parallel!r}")
    if prefill_chunk < 1 or segment_rounds < 1:
        raise ValueError(
            f"prefill_chunk and segment_rounds must be >= 1, got {prefill_chunk}, {segment_rounds}"
        )
    spec = spec if spec is not None and spec.enabled else None
    if spec is not None and spec.synthetic:
        raise ValueError("synthetic acceptance changes the emitted tokens; not in a batch job")
    if spec is not None and spec.draft_sampling != "greedy":
        raise ValueError(
            "--spec-draft-sampling probabilistic verifies drafts by rejection sampling, so a "
            "request's tokens would depend on its drafts (its slot and batch-mates); batch "
            "jobs need greedy drafts, which give the same tokens as plain sampling"
        )
    k_max = spec.resolved_k_max() if spec else 0
    defaults = {
        "n_predict": n_predict,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repeat_penalty": repeat_penalty,
        "seed": seed,
    }
    # the context rule (`inputs.fit_context`): None = the model's training context; each
    # request's prompt is checked against it below; beyond the training context one warning
    check_ctx, _ = inputs.fit_context(model, [], n_ctx, stacklevel=2)
    reqs, errors, source = parse_requests(model, requests, n_ctx=check_ctx, defaults=defaults)
    if errors and errors_path is None:
        raise BatchInputError(errors, source)
    out = os.fspath(out)
    n_proc, proc = jax.process_count(), jax.process_index()
    if n_proc > 1:  # jax.distributed: process i runs requests i, i + n, ... into its own shard
        out = shard_path(out, proc, n_proc)
        reqs = reqs[proc::n_proc]
    check_writable(out, "--out")
    if errors_path is not None:
        check_writable(os.fspath(errors_path), "--errors")
    # before anything is written: a damaged results file stops the job here, unchanged
    finished = load_results(out, reqs, repair=repair, log=log)
    if errors_path is not None and jax.process_index() == 0:
        with open(errors_path, "w", encoding="utf-8") as fh:
            for e in errors:
                fh.write(json.dumps({"line": e.line, "error": e.error, "text": e.text}) + "\n")
        if errors:
            print(
                f"specjax batch: {len(errors)} bad line(s) written to {errors_path} and skipped",
                file=log,
            )
    S, out_cap = _sizes(model, reqs, n_ctx, k_max, prefill_chunk)
    done_ids = {_id_key(r["id"]) for r in finished}
    todo = [r for r in reqs if _id_key(r.id) not in done_ids]
    by_id = {_id_key(r.id): r for r in todo}
    n_skipped = len(reqs) - len(todo)
    print(
        f"specjax batch: {len(reqs)} request(s) in {source}; skipped {n_skipped} already in "
        f"{out}; {len(todo)} to run with {n_parallel} slot(s), context {S}",
        file=log,
    )
    if not todo:
        return BatchSummary(len(reqs), n_skipped, 0, len(errors), 0, 0.0, 0.0, context=S)

    runner = _Runner(
        model,
        spec=spec,
        draft=draft,
        n_parallel=n_parallel,
        capacity=S,
        out_capacity=out_cap,
        k_max=k_max,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        prefill_chunk=prefill_chunk,
        segment_rounds=segment_rounds,
        mesh=mesh,
        swa_full=swa_full,
    )
    writer = _Appender(out, fsync_interval)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), initial=n_skipped, unit="req", file=log, dynamic_ncols=True)
    t0 = time.perf_counter()
    generated = n_done = n_context = 0
    try:
        for record in runner.run(todo, interrupt):
            record["check"] = record_check(record, by_id[_id_key(record["id"])])
            writer.write(record)
            generated += len(record["tokens"])
            n_done += 1
            n_context += record["finish_reason"] == "context"
            if bar is not None:
                elapsed = max(time.perf_counter() - t0, 1e-9)
                post = {"tok/s": f"{generated / elapsed:.1f}"}
                acc = runner.acceptance()
                if acc is not None:
                    post["acc"] = f"{acc:.2f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    return BatchSummary(
        n_requests=len(reqs),
        n_skipped=n_skipped,
        n_done=n_done,
        n_errors=len(errors),
        generated_tokens=generated,
        seconds=seconds,
        tokens_per_second=generated / max(seconds, 1e-9),
        stats=runner.report(),
        compile_seconds=runner.compile_seconds,
        n_context=n_context,
        context=S,
        interrupted=runner.interrupted,
    )


def shard_path(path: str, index: int, count: int) -> str:
    """`out.jsonl` -> `out.shard-1-of-2.jsonl`: the results of process `index` of `count`."""
    root, ext = os.path.splitext(path)
    return f"{root}.shard-{index}-of-{count}{ext}"


class _Runner:
    """The slots of one job on device, fed and drained by the host."""

    def __init__(
        self,
        model: api.Model,
        *,
        spec: SpecConfig | None,
        draft: api.Model | None,
        n_parallel: int,
        capacity: int,
        out_capacity: int,
        k_max: int,
        cache_type_k: str,
        cache_type_v: str,
        prefill_chunk: int,
        segment_rounds: int,
        mesh: dict[str, int] | None = None,
        swa_full: bool = False,
    ) -> None:
        self.model, self.spec, self.B = model, spec, n_parallel
        self.drafters, self.drafter_params = build_drafters(spec, model, draft)
        self.engine = eng.Engine(
            target=model.config,
            drafters=self.drafters,
            k_max=k_max,
            capacity=capacity,
            out_capacity=out_capacity,
            eog_ids=model.eog_ids,
            cache_type_k=cache_dtype(cache_type_k),
            cache_type_v=cache_dtype(cache_type_v),
            swa_full=bool(swa_full),
        )
        self.chunk = int(prefill_chunk)
        self.segment_rounds = int(segment_rounds)
        B = n_parallel
        self.host = {
            "temperature": np.zeros(B, np.float32),
            "top_k": np.zeros(B, np.int32),
            "top_p": np.ones(B, np.float32),
            "min_p": np.zeros(B, np.float32),
            "repeat_penalty": np.ones(B, np.float32),
            "seed": np.zeros(B, np.uint32),
            "max_new": np.ones(B, np.int32),
        }
        self.cost = prices.cost_model(
            spec,
            model,
            draft,
            batch=n_parallel,
            k_max=k_max,
            capacity=capacity,
            drafters=self.drafters,
        )
        # drafters the governor would never ask at this batch size: left out of the job
        self.dropped: dict[str, str] = {}
        if spec is not None:
            keep, self.engine, self.cost, self.dropped = prices.leave_out_unpaying(
                spec, model, self.engine, self.cost, n_parallel, k_max=k_max
            )
            self.drafters = self.engine.drafters
            self.drafter_params = tuple(self.drafter_params[i] for i in keep)
        self.stats_host: Any = None
        self.compile_seconds = 0.0
        self.interrupted = False  # (the last `run` stopped by its `interrupt`)
        # the mesh path below keeps the stored form
        self.params = weights.decode_params(model.params)
        self.init_fn: Any = cont.init_slots_jit
        self.prefill_fn: Any = cont.prefill_chunk_jit
        self.segment_fn: Any = cont.run_segment_jit
        if mesh is not None:
            self._place(mesh)

    def _place(self, axes: dict[str, int]) -> None:
        """Shard params and slots over a ("data", "model") mesh (specjax.jobs.sharding)."""
        mesh = bs.make_mesh(axes, self.B, self.model.config)
        stored = self.model.params
        self.params = jax.device_put(stored, bs.param_shardings(mesh, stored))
        self.drafter_params = jax.device_put(
            self.drafter_params, bs.drafter_param_shardings(mesh, self.drafter_params)
        )
        shapes = jax.eval_shape(lambda: cont.init_slots(self.engine, self.B))
        st, ss = bs.state_shardings(mesh, self.engine, *shapes)
        rep = bs.replicated(mesh, 0)
        donate = ("state", "slot_stats")
        self.init_fn = jax.jit(
            cont.init_slots, static_argnames=("engine", "batch"), out_shardings=(st, ss)
        )
        self.prefill_fn = jax.jit(
            cont.prefill_chunk,
            static_argnames=("engine",),
            donate_argnames=donate,
            out_shardings=(st, ss),
        )
        self.segment_fn = jax.jit(
            cont.run_segment,
            static_argnames=("engine",),
            donate_argnames=donate,
            out_shardings=(st, ss, rep),
        )

    def _run_params(self) -> eng.RunParams:
        h, spec = self.host, self.spec
        return eng.RunParams(
            sampling=sampling.SamplingParams(
                temperature=jnp.asarray(h["temperature"]),
                top_k=jnp.asarray(h["top_k"]),
                top_p=jnp.asarray(h["top_p"]),
                min_p=jnp.asarray(h["min_p"]),
                repeat_penalty=jnp.asarray(h["repeat_penalty"]),
                seed=jnp.asarray(h["seed"]),
            ),
            max_new=jnp.asarray(h["max_new"]),
            n_max=jnp.asarray(spec.draft_n_max if spec else 0, jnp.int32),
            chain_n_max=jnp.asarray(spec.n_max() if spec else 0, jnp.int32),
            n_min=jnp.asarray(spec.draft_n_min if spec else 0, jnp.int32),
            p_min=jnp.asarray(spec.draft_p_min if spec else 0.0, jnp.float32),
            synth_rates=jnp.zeros((max(self.engine.k_max, 1),), jnp.float32),
            cost=self.cost,
        )

    def _assign(self, slot: int, req: Request) -> None:
        h = self.host
        h["temperature"][slot] = req.temperature
        h["top_k"][slot] = req.top_k
        h["top_p"][slot] = req.top_p
        h["min_p"][slot] = req.min_p
        h["repeat_penalty"][slot] = req.repeat_penalty
        h["seed"][slot] = req.seed % (1 << 32)
        S = self.engine.capacity
        h["max_new"][slot] = req.n_predict if req.n_predict > 0 else S + 1

    def _prefill(self, state: Any, ss: Any, slot: int, req: Request, run: eng.RunParams):
        C = self.chunk
        ids = np.asarray(req.tokens, np.int32)
        n_chunks = (len(ids) + C - 1) // C
        for i in range(n_chunks):
            part = ids[i * C : (i + 1) * C]
            tokens = np.zeros(C, np.int32)
            tokens[: len(part)] = part
            state, ss = self.prefill_fn(
                self.engine,
                self.params,
                self.drafter_params,
                state,
                ss,
                np.int32(slot),
                tokens,
                np.int32(i * C),
                np.int32(len(part)),
                np.bool_(i == n_chunks - 1),
                run,
            )
        return state, ss

    def run(self, todo: Sequence[Request], interrupt: Any = None) -> Iterable[dict[str, Any]]:
        """Yield one result record per request, in completion order. `interrupt()` is
        asked after each segment (once the first one ran: compiled); True stops the run
        there (`self.interrupted`), the requests in the slots unfinished."""
        B, engine = self.B, self.engine
        self.interrupted = False
        queue = collections.deque(todo)
        slots: list[tuple[Request, float] | None] = [None] * B
        tc = time.perf_counter()
        state, ss = self.init_fn(engine, B)
        jax.block_until_ready(state.done)
        self.compile_seconds = time.perf_counter() - tc
        eog = set(self.model.eog_ids)
        while queue or any(s is not None for s in slots):
            free = [b for b in range(B) if slots[b] is None]
            starting = []
            for b in free:
                if not queue:
                    break
                req = queue.popleft()
                self._assign(b, req)
                starting.append((b, req))
            run = self._run_params()
            for b, req in starting:
                slots[b] = (req, time.perf_counter())
                state, ss = self._prefill(state, ss, b, req, run)
            busy = np.asarray([s is not None for s in slots])
            state, ss, _ = self.segment_fn(
                engine,
                self.params,
                self.drafter_params,
                state,
                ss,
                run,
                jnp.asarray(busy),
                jnp.asarray(self.segment_rounds, jnp.int32),
            )
            done, out_len, finish, overflow, rounds, accepted, drafted = jax.device_get(
                (
                    state.done,
                    state.out_len,
                    state.finish,
                    state.cache.overflow,
                    ss.rounds,
                    ss.accepted,
                    ss.drafted,
                )
            )
            if overflow.any():
                rows = np.nonzero(overflow)[0].tolist()
                raise CacheOverflowError(
                    f"KV cache overflow in slots {rows} (capacity {engine.capacity} cells)"
                )
            ready = [b for b in range(B) if slots[b] is not None and done[b]]
            if not ready:
                if interrupt is not None and interrupt():
                    self.interrupted = True
                    return
                continue
            out_tokens = np.asarray(jax.device_get(state.out_tokens))
            if self.spec is not None:
                self.stats_host = jax.device_get((state.stats, state.governor))
            now = time.perf_counter()
            for b in ready:
                entry = slots[b]
                assert entry is not None
                req, t_start = entry
                slots[b] = None
                ids = [int(t) for t in out_tokens[b, : out_len[b]]]
                if ids and ids[-1] in eog and int(finish[b]) == eng.FINISH_EOG:
                    ids = ids[:-1]
                text = self.model.decode(ids) if self.model.tokenizer is not None else ""
                n_rounds, n_acc, n_drafted = int(rounds[b]), int(accepted[b]), int(drafted[b])
                yield {
                    "id": req.id,
                    "tokens": ids,
                    "text": text,
                    "finish_reason": eng.FINISH_NAMES[int(finish[b])],
                    "timings": {
                        "prompt_tokens": len(req.tokens),
                        "generated_tokens": int(out_len[b]),
                        "seconds": now - t_start,
                    },
                    "stats": {
                        "rounds": n_rounds,
                        "drafted_tokens": n_drafted,
                        "accepted_tokens": n_acc,
                        "acceptance_rate": n_acc / n_drafted if n_drafted else 0.0,
                        "mean_acceptance_length": (n_rounds + n_acc) / n_rounds
                        if n_rounds
                        else 1.0,
                    },
                }
            if interrupt is not None and interrupt():
                self.interrupted = True
                return

    def acceptance(self) -> float | None:
        """Job-wide accepted / drafted tokens so far (None without speculation or drafts)."""
        if self.stats_host is None:
            return None
        st = self.stats_host[0]
        drafted = int(st.n_draft_tokens)
        return int(st.n_draft_accepted) / drafted if drafted else None

    def report(self) -> api.SpecReport | None:
        if self.stats_host is None or self.spec is None:
            return None
        st, gov = self.stats_host
        return api.SpecReport(
            stats=jax.tree.map(lambda x: np.asarray(x, np.int64), st),
            names=tuple(d.name for d in self.drafters),
            governor={
                "enabled": bool(self.cost.enabled),
                "rounds": int(gov.n_rounds),
                "throttled": int(gov.n_throttled),
                "off": int(gov.n_off),
                "dropped": self.dropped,
            },
        )
