"""`specjax` command line: generate (plain or speculative), train, lookup cache tools.

Flag names follow llama.cpp where it has them. Generated text goes to stdout; logs, timings
and statistics go to stderr; `--out FILE.jsonl` writes one JSON record per prompt.
`--no-compile-cache` / `--compile-cache DIR` choose JAX's persistent compilation cache
(`specjax.decode.compile_cache`; on by default, so a second identical run skips XLA compilation).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specjax.cli import batch as batch_command
from specjax.cli.interrupt import EXIT_INTERRUPTED, Interrupt, current_interrupt
from specjax.cli.options import (
    _load_options,
    _spec_from_options,
    fit_drafts,
    print_stats,
    sampling_options,
)
from specjax.io.paths import check_writable


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
            **sampling_options(opts),
            n_ctx=int(opts["ctx_size"] or 0) or None,  # (None: sized by the run, <= context)
            spec=spec,
            draft=draft,
            n_ubatch=int(opts["ubatch_size"] or 0),
            swa_full=bool(opts["swa_full"]),
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
    print_stats(result.stats, log)
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
        "batch": batch_command.batch_main,
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
