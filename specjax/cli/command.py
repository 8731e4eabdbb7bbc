"""`specjax` command line: generate (plain or speculative), train, lookup cache tools.

Flag names follow llama.cpp where it has them. Generated text goes to stdout; logs, timings
and statistics go to stderr; `--out FILE.jsonl` writes one JSON record per prompt.
`--no-compile-cache` / `--compile-cache DIR` choose JAX's persistent compilation cache
(`specjax.decode.compile_cache`; on by default, so a second identical run skips XLA compilation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# --config YAML keys are the argparse destinations below (e.g. n_predict, spec_type).
_GENERATE_DEFAULTS: dict[str, Any] = {
    "model": None,
    "prompt": None,
    "file": None,
    "n_predict": 64,
    "ctx_size": 0,
    "ubatch_size": 0,
    "temp": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repeat_penalty": 1.0,
    "seed": 0,
    "out": None,
    "spec_type": None,
    "spec_default": False,
    "spec_draft_model": None,
    "spec_draft_n_max": 3,
    "spec_draft_n_min": 0,
    "spec_draft_p_min": 0.0,
    "spec_governor": "on",
    "spec_draft_sampling": "greedy",
    "spec_ngram_simple_size_n": 12,
    "spec_ngram_simple_size_m": 48,
    "spec_ngram_map_k_size_n": 12,
    "spec_ngram_map_k_size_m": 48,
    "spec_ngram_map_k_min_hits": 1,
    "spec_ngram_map_k4v_size_n": 12,
    "spec_ngram_map_k4v_size_m": 48,
    "spec_ngram_map_k4v_min_hits": 1,
    "spec_ngram_mod_n_match": 24,
    "spec_ngram_mod_n_min": 48,
    "spec_ngram_mod_n_max": 64,
    "lookup_cache_static": None,
    "lookup_cache_dynamic": None,
    "spec_synthetic_acceptance_length": None,
    "spec_synthetic_acceptance_rates": None,
    "verbose": False,
    "stream": False,
    # None: the default (SPECJAX_COMPILE_CACHE or the user cache dir); False: off; str: dir
    "compile_cache": None,
    "slot_save_path": None,
    "slot_save": None,
    "slot_restore": None,
    "slot_overwrite": False,
}


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specjax generate", description="Generate text (llama.cpp flags)."
    )
    p.add_argument("--config", help="YAML preset (keys = option names with underscores)")
    p.add_argument("-m", "--model", help="target model: GGUF file or Hugging Face directory")
    p.add_argument(
        "-p",
        "--prompt",
        action="append",
        help="prompt (repeat for a batch). An empty prompt is the model's BOS token alone "
        "where the model adds one (as llama.cpp), else refused: the same rule in `specjax "
        "batch`",
    )
    p.add_argument(
        "-f",
        "--file",
        help="file with the prompt, read as is except that one trailing newline is dropped "
        "(as llama.cpp's -f); bytes that are not UTF-8 become their byte-level BPE tokens "
        "(an error for a vocabulary without them); a .jsonl file holds one prompt per line "
        "as {'prompt': ...}",
    )
    p.add_argument("-n", "--n-predict", type=int, help="tokens to generate per prompt")
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        help="context size in tokens, prompt included (0 = the model's training context, as "
        "llama.cpp); a prompt that does not fit is refused, a run that reaches it stops there "
        "(said on stderr, finish_reason `context`), beyond the training context a warning",
    )
    p.add_argument(
        "-ub",
        "--ubatch-size",
        type=int,
        help="prefill the prompt in chunks of this many tokens, each chunk processed by the "
        "drafters (llama.cpp's n_ubatch; 0 = the whole prompt at once)",
    )
    p.add_argument("--temp", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repeat-penalty", type=float)
    p.add_argument("-s", "--seed", type=int)
    p.add_argument(
        "--out",
        help="write one JSON record per prompt to this .jsonl file (checked before anything runs)",
    )
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--spec-type",
        action="append",
        help="comma list of drafter types; repeatable, the lists add up, and `none` empties "
        "only the list it is in (as llama.cpp)",
    )
    g.add_argument(
        "--spec-default",
        action="store_true",
        default=None,
        help="ngram-mod with n_match 24, n_min 48, n_max 64",
    )
    g.add_argument("-md", "--spec-draft-model", "--model-draft", dest="spec_draft_model")
    g.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        "--draft-n",
        "--draft",
        dest="spec_draft_n_max",
        type=int,
        help="longest draft of a draft model (3; llama.cpp's earlier names --draft-max, "
        "--draft-n, --draft are accepted); clamped to what the context and -n leave, with a "
        "note; 0 drafts nothing, so the draft-model types leave the chain",
    )
    g.add_argument(
        "--spec-draft-n-min",
        "--draft-min",
        "--draft-n-min",
        dest="spec_draft_n_min",
        type=int,
        help="shortest draft worth verifying (0; also --draft-min, --draft-n-min)",
    )
    g.add_argument("--spec-draft-p-min", "--draft-p-min", dest="spec_draft_p_min", type=float)
    g.add_argument(
        "--spec-governor",
        dest="spec_governor",
        choices=("on", "off"),
        help="shorten or skip drafts that do not pay under the cost model (default on; "
        "off = llama.cpp's behaviour, always draft the full budget)",
    )
    g.add_argument(
        "--spec-draft-sampling",
        choices=("greedy", "probabilistic"),
        help="draft-simple: greedy drafts verified by match (default; same tokens as plain "
        "sampling with the same seed) or sampled drafts verified by rejection sampling",
    )
    for name in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
        g.add_argument(f"--spec-{name}-size-n", type=int)
        g.add_argument(f"--spec-{name}-size-m", type=int)
        g.add_argument(f"--spec-{name}-min-hits", type=int)
    g.add_argument("--spec-ngram-mod-n-match", type=int)
    g.add_argument("--spec-ngram-mod-n-min", type=int)
    g.add_argument("--spec-ngram-mod-n-max", type=int)
    g.add_argument("-lcs", "--lookup-cache-static", dest="lookup_cache_static")
    g.add_argument("-lcd", "--lookup-cache-dynamic", dest="lookup_cache_dynamic")
    g.add_argument("--spec-synthetic-acceptance-length", type=float)
    g.add_argument("--spec-synthetic-acceptance-rates", help="comma list of K rates")
    p.add_argument(
        "--stream",
        action="store_true",
        default=None,
        help="print the text as it is produced (one prompt; the host reads the state every "
        "few rounds)",
    )
    p.add_argument("-v", "--verbose", action="store_true", default=None)
    sl = p.add_argument_group("slots (llama.cpp's --slot-save-path; specjax.jobs.slots)")
    sl.add_argument(
        "--slot-save-path",
        metavar="DIR",
        help="directory of saved slots (a prompt's processed state), must exist",
    )
    sl.add_argument(
        "--slot-save",
        metavar="NAME",
        help="save the prompt's processed state as DIR/NAME before generating (one prompt; "
        "an existing slot is an error unless --slot-overwrite)",
    )
    sl.add_argument(
        "--slot-restore",
        metavar="NAME",
        help="start from slot DIR/NAME: only the prompt after the slot's prompt is prefilled "
        "(every prompt must start with the slot's prompt)",
    )
    sl.add_argument(
        "--slot-overwrite",
        action="store_true",
        default=None,
        help="let --slot-save replace an existing slot (atomically)",
    )
    c = p.add_mutually_exclusive_group()
    c.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="persistent compilation cache directory (default: $SPECJAX_COMPILE_CACHE, "
        "else $XDG_CACHE_HOME/specjax/jax or ~/.cache/specjax/jax)",
    )
    c.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_const",
        const=False,
        help="do not read or write the persistent compilation cache",
    )
    return p


def _load_options(argv: list[str]) -> dict[str, Any]:
    args = _generate_parser().parse_args(argv)
    opts = dict(_GENERATE_DEFAULTS)
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"error: config file {path} not found")
        loaded = _read_config(path)
        unknown = sorted(set(loaded) - set(_GENERATE_DEFAULTS))
        if unknown:
            raise SystemExit(f"error: unknown keys in {path}: {', '.join(unknown)}")
        opts.update(loaded)
    for key, value in vars(args).items():
        if key != "config" and value is not None:
            opts[key] = value
    return opts


def check_writable(path: str, flag: str) -> None:
    """Raise ValueError (one line: the flag, the path, why) unless `path` can be opened for
    writing; checked before any work, so a run never ends with nowhere to put its result. A
    file this check creates is removed again."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory")
    existed = os.path.exists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write there ({err.strerror})") from None
    os.close(fd)
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _read_config(path: Path) -> dict[str, Any]:
    """A --config YAML file as a dict (a clear error for one that is not YAML or no mapping)."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as err:
        raise SystemExit(f"error: config file {path} cannot be read: {err}") from None
    if not isinstance(loaded, dict):
        raise SystemExit(f"error: config file {path} must hold a mapping of option names")
    return loaded


def _spec_from_options(opts: dict[str, Any]):
    from specjax.config import SpecConfig, types_from_values

    # each --spec-type value (or YAML list item) is one comma list; `none` empties only its own
    spec_type = opts.get("spec_type")
    if isinstance(spec_type, str):
        spec_type = [spec_type]
    types = list(types_from_values([str(item) for item in spec_type or []]))
    base = {}
    if opts.get("spec_default"):
        types.append("ngram-mod")
        base = {"ngram_mod_n_match": 24, "ngram_mod_n_min": 48, "ngram_mod_n_max": 64}
    if not types:
        return None
    rates = opts.get("spec_synthetic_acceptance_rates")
    if isinstance(rates, str):
        rates = [float(x) for x in rates.split(",") if x.strip()]
    synth_len = opts.get("spec_synthetic_acceptance_length")
    kwargs = dict(
        types=tuple(types),
        draft_n_max=opts["spec_draft_n_max"],
        draft_n_min=opts["spec_draft_n_min"],
        draft_p_min=opts["spec_draft_p_min"],
        adaptive=opts["spec_governor"] != "off",
        draft_sampling=opts["spec_draft_sampling"],
        ngram_simple_size_n=opts["spec_ngram_simple_size_n"],
        ngram_simple_size_m=opts["spec_ngram_simple_size_m"],
        ngram_map_k_size_n=opts["spec_ngram_map_k_size_n"],
        ngram_map_k_size_m=opts["spec_ngram_map_k_size_m"],
        ngram_map_k_min_hits=opts["spec_ngram_map_k_min_hits"],
        ngram_map_k4v_size_n=opts["spec_ngram_map_k4v_size_n"],
        ngram_map_k4v_size_m=opts["spec_ngram_map_k4v_size_m"],
        ngram_map_k4v_min_hits=opts["spec_ngram_map_k4v_min_hits"],
        ngram_mod_n_match=opts["spec_ngram_mod_n_match"],
        ngram_mod_n_min=opts["spec_ngram_mod_n_min"],
        ngram_mod_n_max=opts["spec_ngram_mod_n_max"],
        lookup_cache_static=opts.get("lookup_cache_static"),
        lookup_cache_dynamic=opts.get("lookup_cache_dynamic"),
        synth_len=-1.0 if synth_len is None else float(synth_len),
        synth_rates=tuple(rates or ()),
    )
    kwargs.update(base)
    return SpecConfig(**kwargs)


def _read_prompts(opts: dict[str, Any]) -> list[str | bytes]:
    """The prompts of -p and -f: text, or the bytes of a -f file that is not UTF-8 (its
    tokens are then made from the bytes, `_prompt_inputs`)."""
    prompts: list[str | bytes] = []
    prompt = opts.get("prompt")
    if isinstance(prompt, str):
        prompts.append(prompt)
    elif prompt:
        prompts.extend(prompt)
    if opts.get("file"):
        path = Path(opts["file"])
        if not path.is_file():
            raise SystemExit(f"error: prompt file {path} not found")
        # bytes as they are (no newline translation), as llama.cpp's read_file
        data = path.read_bytes()
        if path.suffix == ".jsonl":
            for number, line in enumerate(data.split(b"\n"), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    raise SystemExit(f"error: {path} line {number} is not UTF-8") from None
                except json.JSONDecodeError as err:
                    raise SystemExit(
                        f"error: {path} line {number}: invalid JSON ({err.msg})"
                    ) from None
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise SystemExit(f'error: {path} line {number}: needs {{"prompt": "..."}}')
                prompts.append(obj["prompt"])
        else:
            # llama.cpp's -f: `if (prompt.back() == '\n') prompt.pop_back();` (one, not "\r\n")
            data = data[:-1] if data.endswith(b"\n") else data
            try:
                prompts.append(data.decode("utf-8"))
            except UnicodeDecodeError:
                prompts.append(data)
    if not prompts:
        raise SystemExit("error: no prompt given (use -p/--prompt or -f/--file)")
    return prompts


def _prompt_inputs(model: Any, prompts: list[str | bytes]) -> list[str | list[int]]:
    """What `generate` gets for each prompt: the text, or for raw bytes their token ids
    (`Tokenizer.encode_bytes`, with BOS/EOS as `Model.encode` adds them to a text)."""
    out: list[str | list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(prompt)
            continue
        tok = model.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer to read a prompt file with")
        try:
            ids = tok.encode_bytes(prompt)
        except ValueError as err:
            raise ValueError(f"prompt file: {err}") from None
        if getattr(tok, "add_bos", False) and tok.bos_id is not None:
            ids = [int(tok.bos_id), *ids]
        if getattr(tok, "add_eos", False) and tok.eos_id is not None:
            ids = [*ids, int(tok.eos_id)]
        out.append(ids)
    return out


def _prompt_text(prompt: str | bytes) -> str:
    return prompt if isinstance(prompt, str) else prompt.decode("utf-8", errors="replace")


def _write_stdout(*parts: str | bytes) -> None:
    """Text to stdout; a prompt's raw bytes as they are."""
    for part in parts:
        if isinstance(part, bytes):
            sys.stdout.flush()
            sys.stdout.buffer.write(part)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(part)


#: (SpecConfig field, its flag, the type it limits) of the draft lengths `fit_drafts` clamps.
_DRAFT_LIMITS = (
    ("draft_n_max", "--spec-draft-n-max", "draft-"),
    ("ngram_simple_size_m", "--spec-ngram-simple-size-m", "ngram-simple"),
    ("ngram_map_k_size_m", "--spec-ngram-map-k-size-m", "ngram-map-k"),
    ("ngram_map_k4v_size_m", "--spec-ngram-map-k4v-size-m", "ngram-map-k4v"),
    ("ngram_mod_n_max", "--spec-ngram-mod-n-max", "ngram-mod"),
    ("ngram_cache_n_draft", "ngram-cache's n_draft", "ngram-cache"),
)


def fit_drafts(spec: Any, room: int, why: str, log: Any) -> Any:
    """`spec` with every draft-length limit of its types clamped to `room` (the tokens a
    draft can still be verified in: what the context and -n leave), with one note on `log`
    when one was; the draft-model types leave the chain when --spec-draft-n-max is 0 (they
    draft nothing). None when nothing is left to draft."""
    import dataclasses

    if spec is None:
        return None
    notes: list[str] = []
    if spec.draft_n_max <= 0 and any(t.startswith("draft-") for t in spec.types):
        gone = [t for t in spec.types if t.startswith("draft-")]
        rest = tuple(t for t in spec.types if not t.startswith("draft-"))
        notes.append(f"--spec-draft-n-max 0 drafts nothing: {', '.join(gone)} left out")
        spec = dataclasses.replace(spec, types=rest) if rest else None
        if spec is None:
            notes[-1] += ", speculation off"
    if spec is not None and room < 1:
        notes.append(f"no room for a draft ({why}): speculation off")
        spec = None
    if spec is not None:
        changes: dict[str, int] = {}
        clamped: list[str] = []
        for field, flag, kind in _DRAFT_LIMITS:
            value = int(getattr(spec, field))
            if value > room and any(t.startswith(kind) for t in spec.types):
                changes[field] = room
                clamped.append(f"{flag} {value} -> {room}")
        if "draft_n_max" in changes and spec.draft_n_min > room:
            changes["draft_n_min"] = room
        if "ngram_mod_n_max" in changes and spec.ngram_mod_n_min > room:
            changes["ngram_mod_n_min"] = room
        if changes:
            spec = dataclasses.replace(spec, **changes)
            notes.append(f"draft limits clamped to what is left ({why}): {', '.join(clamped)}")
    if notes:
        print(f"specjax: {'; '.join(notes)}", file=log)
    return spec


def _draft_room(model: Any, opts: dict[str, Any], prompt_lengths: list[int]) -> tuple[int, str]:
    """(longest draft a round can still verify, why): the context after the shortest prompt,
    and -n - 1 (llama.cpp's server drafts at most n_remaining - 1)."""
    from specjax.decode.inputs import context_size

    n_predict = int(opts["n_predict"])
    ctx = context_size(model, opts["ctx_size"])
    shortest = min(prompt_lengths) if prompt_lengths else 1
    rooms, why = [ctx - shortest - 1], [f"context {ctx}, prompt of {shortest} tokens"]
    if n_predict > 0:
        rooms.append(n_predict - 1)
        why.append(f"-n {n_predict}")
    return (min(rooms) if rooms else 1 << 30), ", ".join(why)


def _write_records(path: str, records: list[dict[str, Any]]) -> None:
    """All records to `path`, replacing it whole (a regular file: a temporary next to it,
    then a rename, so a failed write leaves the old file as it was)."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
    if os.path.exists(path) and not os.path.isfile(path):  # a device or a pipe: as it is
        with open(path, "wb") as fh:
            fh.write(data)
        return
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".specjax-out-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _save_elsewhere(records: list[dict[str, Any]]) -> str | None:
    """The records in a new file of the temporary directory (None if that fails too)."""
    try:
        fd, path = tempfile.mkstemp(prefix="specjax-out-", suffix=".jsonl")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in records))
        return path
    except OSError:
        return None


def check_context(model: Any, ctx_size: Any, lengths: list[int]) -> int:
    """The context rule (`specjax.decode.inputs.fit_context`) before anything runs: the
    context of -c (0 = the model's training context); a prompt that does not fit is a
    ValueError naming the numbers and -c. Returns the context."""
    from specjax.decode.inputs import fit_context

    try:
        context, _ = fit_context(model, lengths, int(ctx_size or 0) or None, warn=False)
    except ValueError as err:
        train = int(model.config.max_position)
        what = "default 0: " if not ctx_size else ""
        raise ValueError(
            f"{err}; -c/--ctx-size sets the context ({what}the model's training context, {train})"
        ) from None
    return context


def context_stop_lines(
    context: int, finish_reasons: list[str], prompt_lengths: list[int], generated: list[int]
) -> list[str]:
    """stderr lines for the rows that stopped at the context (none when none did)."""
    lines = []
    for i, reason in enumerate(finish_reasons):
        if reason != "context":
            continue
        which = f"prompt {i + 1}: " if len(finish_reasons) > 1 else ""
        lines.append(
            f"specjax: {which}stopped at the context of {context} tokens (prompt "
            f"{prompt_lengths[i]} + {generated[i]} generated; finish_reason context): "
            "-c/--ctx-size sets it"
        )
    return lines


@contextlib.contextmanager
def cli_warnings() -> Iterator[None]:
    """specjax's context warnings as one stderr line (`specjax: warning: ...`) while a
    command runs; other warnings as Python shows them."""
    from specjax.decode.inputs import ContextWarning

    shown = warnings.showwarning

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, ContextWarning):
            print(f"specjax: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


class Interrupt:
    """Ctrl-C (SIGINT) while a command runs. Once the decode loop asks (`generate(interrupt=
    ...)`, a batch job's runner): a flag the loop reads between its segments, so it stops
    there and what was generated is kept. Before the loop first asks (loading, compiling,
    prefill) and at a second Ctrl-C: KeyboardInterrupt (`main`: exit 130, no traceback),
    and the flag too, so that one raised where Python drops exceptions (a garbage-collector
    callback, a finalizer: dropped here without a word) still stops the loop when it asks."""

    def __init__(self) -> None:
        self.asked = False
        self.hit = False

    def __call__(self) -> bool:
        self.asked = True
        return self.hit

    def _handle(self, signum: int, frame: Any) -> None:
        first = not self.hit
        self.hit = True
        if not (self.asked and first):
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupt]:
        """The handler for SIGINT while in the block (the main thread's only: signals are)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        unraisable = sys.unraisablehook

        def hook(args: Any) -> None:
            if args.exc_type is None or not issubclass(args.exc_type, KeyboardInterrupt):
                unraisable(args)

        sys.unraisablehook = hook
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.pop()
            sys.unraisablehook = unraisable
            signal.signal(signal.SIGINT, previous)


#: The Interrupts installed (`main` installs one for the whole command).
_ACTIVE: list[Interrupt] = []


def current_interrupt() -> Interrupt:
    """The command's Interrupt (a new one outside `main`)."""
    return _ACTIVE[-1] if _ACTIVE else Interrupt()


#: The exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130


def generate_main(argv: list[str]) -> int:
    opts = _load_options(argv)
    if not opts.get("model"):
        raise SystemExit("error: no model given (-m/--model or `model:` in --config)")
    # where results go is checked before anything runs
    if opts.get("out"):
        check_writable(str(opts["out"]), "--out")
    if opts.get("lookup_cache_dynamic"):
        check_writable(str(opts["lookup_cache_dynamic"]), "--lookup-cache-dynamic")
    spec = _spec_from_options(opts)
    prompts = _read_prompts(opts)
    from specjax.api import generate, load
    from specjax.decode.compile_cache import set_compile_cache

    cache_opt = opts.get("compile_cache")  # None/True: default, False: off, str: directory
    if cache_opt is False:
        set_compile_cache(None)
    elif isinstance(cache_opt, str) and cache_opt:
        set_compile_cache(cache_opt)
    log = sys.stderr
    slot_kwargs = _slot_options(opts, len(prompts))
    model = load(opts["model"])
    draft = None
    if opts.get("spec_draft_model"):
        draft = load(opts["spec_draft_model"])
    for needs in ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark"):
        if spec is not None and needs in spec.types and draft is None:
            raise SystemExit(f"error: --spec-type {needs} needs -md/--spec-draft-model")
    inputs = _prompt_inputs(model, prompts)
    lengths = [len(p) if isinstance(p, list) else len(model.encode(p)) for p in inputs]
    context = check_context(model, opts["ctx_size"], lengths)  # (before anything runs)
    if spec is not None:
        spec = fit_drafts(spec, *_draft_room(model, opts, lengths), log)
    print(
        f"specjax: model {opts['model']} ({model.config.num_params() / 1e6:.2f}M params), "
        f"{len(prompts)} prompt(s), speculative: {','.join(spec.types) if spec else 'off'}",
        file=log,
    )
    stream = None
    if opts.get("stream"):
        if len(prompts) != 1:
            raise SystemExit(f"error: --stream takes one prompt, got {len(prompts)}")
        _write_stdout(prompts[0])
        sys.stdout.flush()

        def stream(row: int, text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

    # the run's context caches are merged into the dynamic cache file after it (below)
    saves_dynamic_cache = bool(
        spec is not None and "ngram-cache" in spec.types and opts.get("lookup_cache_dynamic")
    )
    interrupt = current_interrupt()
    with interrupt.installed():
        result = generate(
            model,
            inputs,
            stream=stream,
            interrupt=interrupt,
            max_new_tokens=int(opts["n_predict"]),
            temperature=float(opts["temp"]),
            top_k=int(opts["top_k"]),
            top_p=float(opts["top_p"]),
            min_p=float(opts["min_p"]),
            repeat_penalty=float(opts["repeat_penalty"]),
            seed=int(opts["seed"]),
            n_ctx=int(opts["ctx_size"] or 0) or None,  # (None: sized by the run, <= context)
            spec=spec,
            draft=draft,
            n_ubatch=int(opts["ubatch_size"] or 0),
            **slot_kwargs,
            return_drafter_states=saves_dynamic_cache,
        )
    for prompt, text in zip(prompts, result.text):
        if stream is not None:
            sys.stdout.write("\n")
            continue
        _write_stdout(prompt, text + "\n")
        if len(prompts) > 1:
            sys.stdout.write("\n")
    sys.stdout.flush()
    t = result.timings
    prompt_lengths = [len(p) for p in result.prompt_tokens]
    generated = [len(ids) for ids in result.tokens]
    for line in context_stop_lines(context, result.finish_reasons, prompt_lengths, generated):
        print(line, file=log)
    if interrupt.hit:
        print(
            f"specjax: interrupted (Ctrl-C) after {sum(generated)} generated token(s); "
            "the text so far is on stdout"
            + (
                ", the record(s) in --out with finish_reason interrupted" if opts.get("out") else ""
            ),
            file=log,
        )
    print(
        f"prefill: {t['prompt_tokens']} tokens in {t['prefill_seconds']:.3f} s; "
        f"decode: {t['generated_tokens']} tokens in {t['decode_seconds']:.3f} s "
        f"({t['tokens_per_second']:.1f} t/s, {t['n_rounds']} rounds)",
        file=log,
    )
    slot_report: dict[str, Any] = result.timings.get("slots") or {}  # type: ignore[assignment]
    for saved in slot_report.get("saved", []):
        print(
            f"slot: saved {saved['name']} ({saved['n_tokens']} tokens, {saved['bytes']} bytes) "
            f"to {saved['path']}",
            file=log,
        )
    for restored in slot_report.get("restored", []):
        print(
            f"slot: prompt {restored['row']} restored {restored['name']} "
            f"({restored['n_tokens']} tokens) from {restored['path']}",
            file=log,
        )
    if result.stats is not None:
        for line in result.stats.lines():
            print(line, file=log)
    status = 0
    if saves_dynamic_cache:
        # llama.cpp's lookup example: merge this run's context caches into the dynamic cache
        from specjax.drafters.ngram_cache import context_cache
        from specjax.io.lookup import update_dynamic_cache

        state = result.drafter_states["ngram-cache"]
        contexts = [context_cache(state, row) for row in range(len(prompts))]
        try:
            merged = update_dynamic_cache(opts["lookup_cache_dynamic"], *contexts)
            print(
                f"saved dynamic lookup cache {opts['lookup_cache_dynamic']} "
                f"({len(merged)} n-grams)",
                file=log,
            )
        except OSError as err:
            print(
                f"error: could not save the dynamic lookup cache {opts['lookup_cache_dynamic']} "
                f"({err.strerror or err}); the generated text is on stdout",
                file=log,
            )
            status = 1
    if opts.get("out"):
        records = []
        for i, prompt in enumerate(prompts):
            record = {
                "prompt": _prompt_text(prompt),
                "prompt_tokens": result.prompt_tokens[i],
                "tokens": result.tokens[i],
                "text": result.text[i],
                "finish_reason": result.finish_reasons[i],
                "timings": {**t, "generated_tokens": len(result.tokens[i])},
            }
            if result.stats is not None:
                record["stats"] = result.stats.to_dict()
            records.append(record)
        try:
            _write_records(str(opts["out"]), records)
        except OSError as err:
            elsewhere = _save_elsewhere(records)
            where = f"; the records are in {elsewhere} instead" if elsewhere else ""
            print(
                f"error: could not write the records to --out {opts['out']} "
                f"({err.strerror or err}); the generated text is on stdout{where}",
                file=log,
            )
            status = 1
    return EXIT_INTERRUPTED if interrupt.hit else status


def _slot_options(opts: dict[str, Any], n_prompts: int) -> dict[str, Any]:
    """`generate`'s slot arguments from --slot-save-path / --slot-save / --slot-restore."""
    path, save, restore = (
        opts.get("slot_save_path"),
        opts.get("slot_save"),
        opts.get("slot_restore"),
    )
    if path is None:
        if save or restore:
            raise SystemExit("error: --slot-save / --slot-restore need --slot-save-path DIR")
        return {}
    if not Path(path).is_dir():
        raise SystemExit(f"error: --slot-save-path: not a directory: {path}")
    if save and n_prompts != 1:
        raise SystemExit(f"error: --slot-save takes one prompt, got {n_prompts}")
    if save and restore:
        raise SystemExit("error: give --slot-save or --slot-restore, not both")
    return {
        "slot_save_path": str(path),
        "slot_save": save or None,
        "slot_restore": restore or None,
        "slot_overwrite": bool(opts.get("slot_overwrite")),
    }


#: Subcommands and their one-line descriptions (`specjax --help`).
_COMMAND_HELP = {
    "generate": "generate text, plain or speculative (llama.cpp's flags)",
    "batch": "run a JSONL file of requests with continuous batching (resumable)",
    "train": "train a model from a YAML config (how the shipped models were made)",
    "train-draft": "distil a draft model on an acceptance objective (ce, tv, nla, kl, lk)",
    "lookup-create": "build a static n-gram lookup cache from a text (llama-lookup-create)",
    "lookup-merge": "merge lookup cache files (llama-lookup-merge)",
    "lookup-stats": "measure lookup-cache drafting on a text (llama-lookup-stats)",
}


def _usage() -> str:
    width = max(len(name) for name in _COMMAND_HELP) + 2
    lines = [
        "usage: specjax COMMAND [options]",
        "",
        "commands:",
        *(f"  {name:<{width}}{text}" for name, text in _COMMAND_HELP.items()),
        "",
        "`specjax COMMAND --help` lists a command's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "generate": generate_main,
        "batch": lambda a: __import__("specjax.cli.batch", fromlist=["x"]).batch_main(a),
        "train": lambda a: __import__("specjax.train.target", fromlist=["train_main"]).train_main(
            a
        ),
        "train-draft": lambda a: __import__("specjax.train.draft", fromlist=["x"]).train_draft_main(
            a
        ),
        "lookup-create": lambda a: __import__(
            "specjax.io.lookup", fromlist=["x"]
        ).lookup_create_main(a),
        "lookup-merge": lambda a: __import__("specjax.io.lookup", fromlist=["x"]).lookup_merge_main(
            a
        ),
        "lookup-stats": lambda a: __import__("specjax.io.lookup", fromlist=["x"]).lookup_stats_main(
            a
        ),
    }
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if not argv or argv[0] not in commands:
        if argv:
            hint = " (options go after a command: `specjax generate -m ...`)"
            hint = hint if argv[0].startswith("-") else ""
            print(f"specjax: unknown command {argv[0]!r}{hint}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        with cli_warnings(), Interrupt().installed():
            return int(commands[argv[0]](argv[1:]) or 0)
    except KeyboardInterrupt:  # Ctrl-C before (or outside) a loop that keeps what it made
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        print("specjax: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as err:  # specjax errors are ValueErrors with a clear message
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a path the user gave: one line, no traceback
        where = f" {err.filename}" if getattr(err, "filename", None) else ""
        print(f"error:{where} {err.strerror or err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
