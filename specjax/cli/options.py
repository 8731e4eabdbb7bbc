"""The `specjax` commands' shared options: `generate`'s flags and defaults (which `batch`
extends), --config files, the speculative settings they make, and draft limits clamped to what a
run leaves (with a note). Below both commands (`command`, `batch`): imports no cli module;
Ctrl-C handling is `specjax.cli.interrupt`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specjax.config import fit_draft_limits

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


#: The SpecConfig fields set as they are from the option of the same name after `spec_`
#: (`--spec-draft-n-max`, `--spec-ngram-mod-n-match`, ...).
_SPEC_FIELDS = (
    "draft_n_max",
    "draft_n_min",
    "draft_p_min",
    "draft_sampling",
    "ngram_simple_size_n",
    "ngram_simple_size_m",
    "ngram_map_k_size_n",
    "ngram_map_k_size_m",
    "ngram_map_k_min_hits",
    "ngram_map_k4v_size_n",
    "ngram_map_k4v_size_m",
    "ngram_map_k4v_min_hits",
    "ngram_mod_n_match",
    "ngram_mod_n_min",
    "ngram_mod_n_max",
)


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
        **{field: opts[f"spec_{field}"] for field in _SPEC_FIELDS},
        adaptive=opts["spec_governor"] != "off",
        lookup_cache_static=opts.get("lookup_cache_static"),
        lookup_cache_dynamic=opts.get("lookup_cache_dynamic"),
        synth_len=-1.0 if synth_len is None else float(synth_len),
        synth_rates=tuple(rates or ()),
    )
    kwargs.update(base)
    return SpecConfig(**kwargs)


def sampling_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The sampler's keyword arguments (`specjax.generate`, `specjax.jobs.batch.batch`) from
    the command's options (`--temp`, `--top-k`, `--top-p`, `--min-p`, `--repeat-penalty`,
    `--seed`)."""
    return dict(
        temperature=float(opts["temp"]),
        top_k=int(opts["top_k"]),
        top_p=float(opts["top_p"]),
        min_p=float(opts["min_p"]),
        repeat_penalty=float(opts["repeat_penalty"]),
        seed=int(opts["seed"]),
    )


def print_stats(stats: Any, log: Any) -> None:
    """A run's statistics lines (`SpecStats.lines`) on `log`, when it has statistics."""
    if stats is not None:
        for line in stats.lines():
            print(line, file=log)


def fit_drafts(spec: Any, room: int, why: str, log: Any) -> Any:
    """`specjax.config.fit_draft_limits` with its note printed on `log` (`specjax: ...`)."""
    spec, notes = fit_draft_limits(spec, room, why)
    if notes:
        print(f"specjax: {'; '.join(notes)}", file=log)
    return spec
