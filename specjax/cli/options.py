"""The `specjax` commands' shared options: `generate`'s flags and defaults (which `batch`
extends), --config files, the speculative settings they make, draft limits clamped to what a
run leaves, and Ctrl-C handling. Below both commands (`command`, `batch`): imports no cli
module."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
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
    "swa_full": False,
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
    p.add_argument(
        "--swa-full",
        action="store_true",
        default=None,
        help="keep every cell of a gemma3 model's sliding-window layers (llama.cpp's "
        "--swa-full; default: a ring of window + draft length cells)",
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
    """`specjax generate`'s options: its defaults, a --config file's keys, then the flags."""
    return load_options(_generate_parser(), _GENERATE_DEFAULTS, argv)


def load_options(
    parser: argparse.ArgumentParser, defaults: dict[str, Any], argv: list[str]
) -> dict[str, Any]:
    """A command's options: `defaults`, then the keys of its --config file (each one of the
    defaults' names), then the flags given."""
    args = parser.parse_args(argv)
    opts = dict(defaults)
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"error: config file {path} not found")
        loaded = _read_config(path)
        unknown = sorted(set(loaded) - set(defaults))
        if unknown:
            raise SystemExit(f"error: unknown keys in {path}: {', '.join(unknown)}")
        opts.update(loaded)
    for key, value in vars(args).items():
        if key != "config" and value is not None:
            opts[key] = value
    return opts


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
