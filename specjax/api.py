"""Public API: load/init a model, run a forward, generate (plain or speculative).

Everything here is host-side glue: `generate` checks the request before anything is traced
(`specjax.decode.inputs`: ValueErrors that name the numbers, static sizes from a few buckets so
repeated calls reuse compiled code), builds the drafter chain and the governor's prices
(`specjax.decode.prices`), puts the weights in the form the decode steps read (`specjax.decode.weights`),
and runs the jitted entry points of `specjax.decode.engine` through the process's executables
(`specjax.decode.executables`). The public names of those modules are re-exported here (`__all__`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any, Required, TypedDict, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.config import SpecConfig, fit_draft_limits
from specjax.decode import engine as eng
from specjax.decode.executables import (
    _SPARES,
    _SPARES_MAX,
    _compiled,
    _lru_put,
    clear_compiled,
    compile_count,
)
from specjax.decode.inputs import (
    _IDLE_SAMPLING,
    ContextWarning,
    _apply_stop,
    _check_token_range,
    _host_leaf,
    _n_predict,
    _per_row,
    _sampling_args,
    _tokenize_prompts,
    build_engine_inputs,
    fit_context,
    prompt_bucket,
)
from specjax.decode.prices import (
    ASK_OVERHEAD,
    ASK_REFERENCE_PARAMS,
    CALIBRATION_K,
    CPU_VERIFY_TOKEN,
    chain_call_price,
    chain_cost,
    chain_k_max,
    cost_model,
    leave_out_unpaying,
    unpaying_drafters,
)
from specjax.decode.stats import (
    format_impl_lines,
    format_rollback_line,
    format_server_lines,
    rollback_dict,
)
from specjax.decode.verify import resolve_synthetic_rates
from specjax.decode.weights import decode_params, drafter_decode_params
from specjax.drafters import lookup_index
from specjax.drafters.registry import build_drafters, reads_target_hidden
from specjax.jobs import continuous as cont
from specjax.jobs import slots as slots_mod
from specjax.memory import hybrid as hybrid_memory
from specjax.memory.hybrid import SeqRmType
from specjax.memory.kv import KVCache, cache_dtype, check_overflow
from specjax.models.config import ModelConfig
from specjax.models.llama import forward_fn, init_params, new_cache
from specjax.models.qwen35 import Qwen35Config
from specjax.types import Params

__all__ = [
    "ASK_OVERHEAD",
    "ASK_REFERENCE_PARAMS",
    "CALIBRATION_K",
    "CPU_VERIFY_TOKEN",
    "STREAM_INTERVAL_S",
    "STREAM_MAX_ROUNDS",
    "ContextWarning",
    "GenerationResult",
    "Generator",
    "Model",
    "SpecReport",
    "build_engine_inputs",
    "chain_call_price",
    "chain_cost",
    "chain_k_max",
    "clear_compiled",
    "compile_count",
    "cost_model",
    "decode_params",
    "default_compute_dtype",
    "drafter_decode_params",
    "forward",
    "generate",
    "init_model",
    "leave_out_unpaying",
    "load",
    "prompt_bucket",
    "unpaying_drafters",
]


@dataclasses.dataclass(frozen=True)
class Model:
    """A model: static config, parameter pytree and (optionally) its tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: Any = None
    path: str | None = None
    #: End-of-generation ids; None = the tokenizer's (EOS/EOT/...).
    eog: tuple[int, ...] | None = None

    def new_cache(
        self,
        batch: int,
        capacity: int,
        cache_type_k: str | None = None,
        cache_type_v: str | None = None,
    ) -> KVCache:
        """An empty KV cache; K/V types `f32`/`f16`/`bf16` (default: the model's dtype)."""
        _refuse_hybrid(self, "Model.new_cache")
        k = cache_dtype(cache_type_k) if cache_type_k else None
        v = cache_dtype(cache_type_v) if cache_type_v else None
        return new_cache(self.config, batch, capacity, k, v)

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text` as llama.cpp's `common_tokenize(ctx, text, add_special,
        parse_special)`, which its completion tool and server use for text prompts.

        With `add_special` the model's metadata decides: BOS first when it says add_bos
        (`tokenizer.ggml.add_bos_token`), EOS last when it says add_eos. As upstream, a text
        that already starts with the BOS token's text (parsed as special) then starts with two
        BOS tokens, and a warning says so. `parse_special` matches control-token texts.
        """
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        ids = list(tok.encode(text, parse_special=parse_special))
        if not add_special:
            return ids
        bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
        if getattr(tok, "add_bos", False):
            if bos is None:
                raise ValueError("the model's metadata says add_bos but it has no BOS token")
            ids = [int(bos), *ids]
            if len(ids) >= 2 and ids[1] == bos:
                warnings.warn(
                    "Added a BOS token to the prompt as specified by the model but the prompt "
                    "also starts with a BOS token. So now the final prompt starts with 2 BOS "
                    "tokens (as llama.cpp does).",
                    stacklevel=2,
                )
        if getattr(tok, "add_eos", False):
            if eos is None:
                raise ValueError("the model's metadata says add_eos but it has no EOS token")
            ids = [*ids, int(eos)]
            if len(ids) >= 2 and ids[-2] == eos:
                warnings.warn(
                    "Added an EOS token to the prompt as specified by the model but the prompt "
                    "also ends with an EOS token. So now the final prompt ends with 2 EOS "
                    "tokens (as llama.cpp does).",
                    stacklevel=2,
                )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return str(self.tokenizer.decode(list(ids)))

    @property
    def eog_ids(self) -> tuple[int, ...]:
        if self.eog is not None:
            return tuple(sorted(int(i) for i in self.eog))
        if self.tokenizer is None:
            return ()
        ids = getattr(self.tokenizer, "eog_ids", None)
        if ids is None:
            eos = getattr(self.tokenizer, "eos_id", None)
            ids = () if eos is None else (eos,)
        return tuple(sorted(int(i) for i in ids))


def default_compute_dtype(file_dtype: str) -> str:
    """The parameter dtype `load` picks: float32 on CPU, the file's dtype elsewhere.

    XLA's CPU backend has no half-precision matmul: it converts F16/BF16 weights to float32
    inside every step (a copy of all weights per token), so on CPU they are converted once,
    at load time. GPUs and TPUs compute in the file's dtype.
    """
    if jax.default_backend() == "cpu" and file_dtype in ("float16", "bfloat16"):
        return "float32"
    return file_dtype


def load(path: str, dtype: str | None = None) -> Model:
    """Load a GGUF file or a Hugging Face directory (config.json + safetensors + tokenizer.json).

    `dtype` ("float32" / "float16" / "bfloat16") is the parameter and compute dtype; default:
    `default_compute_dtype` of the file's dtype (float32 on CPU).
    """
    # (the file readers, and the tokenizers package they import, load when a file is read)
    from specjax.io import load_model_files

    hybrid = _load_hybrid(path, dtype)
    if hybrid is not None:
        return hybrid
    if dtype is None:
        config, params, tokenizer = load_model_files(path)
        wanted = default_compute_dtype(config.dtype)
        if wanted != config.dtype:
            config = dataclasses.replace(config, dtype=wanted)
            params = jax.tree.map(
                lambda x: (
                    np.asarray(x).astype(wanted) if jnp.issubdtype(x.dtype, jnp.floating) else x
                ),
                params,
            )
    else:
        config, params, tokenizer = load_model_files(path, dtype=dtype)
    return Model(config=config, params=jax.device_put(params), tokenizer=tokenizer, path=str(path))


def _refuse_hybrid(model: Model, what: str) -> None:
    if getattr(model.config, "arch", None) == "qwen35":
        raise ValueError(
            f"{what} is for attention-only models; a qwen35 (hybrid recurrent) model runs with "
            "specjax.models.qwen35.new_state / forward, or specjax.generate"
        )


def _load_hybrid(path: str, dtype: str | None) -> Model | None:
    """A qwen35 (hybrid recurrent) GGUF or Qwen3.5 folder as a Model, or None for any other."""
    import os

    from specjax.io.gguf_io import read_architecture

    if os.path.isdir(path):
        from specjax.io.hf_qwen35 import is_qwen35_folder, load_qwen35_hf

        if not is_qwen35_folder(path):
            return None
        return _hybrid_model(path, dtype, *load_qwen35_hf(path, dtype=dtype))
    if not (os.path.isfile(path) and str(path).lower().endswith(".gguf")):
        return None
    try:
        arch = read_architecture(path)  # the header only: the file is parsed once, below
    except Exception:  # unreadable: the regular loader reports it
        return None
    if arch != "qwen35":
        return None
    from specjax.io.gguf_qwen35 import load_qwen35_gguf

    return _hybrid_model(path, dtype, *load_qwen35_gguf(path, dtype=dtype))


def _hybrid_model(path: str, dtype: str | None, config: Any, params: Any, tokenizer: Any) -> Model:
    """A loaded qwen35 model; without a `dtype` asked for, in its default compute dtype."""
    if dtype is None and default_compute_dtype(config.dtype) != config.dtype:
        config = dataclasses.replace(config, dtype=default_compute_dtype(config.dtype))
        params = jax.tree.map(lambda x: jnp.asarray(x, config.dtype), params)
    return Model(config=config, params=params, tokenizer=tokenizer, path=str(path))  # type: ignore[arg-type]


def init_model(config: ModelConfig, seed: int = 0, tokenizer: Any = None) -> Model:
    """A randomly initialised model (tests, training from scratch)."""
    return Model(
        config=config, params=init_params(config, jax.random.PRNGKey(seed)), tokenizer=tokenizer
    )


_forward_jit = jax.jit(forward_fn, static_argnames=("config", "hidden_layers"))


def forward(model: Model, tokens: Any, positions: Any, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits [B, T, V] for `tokens` [B, T] at `positions` [B, T] (-1 = padding, not written)."""
    _refuse_hybrid(model, "specjax.forward")
    tokens = np.asarray(tokens)
    positions = np.asarray(positions)
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(
            f"tokens and positions must both be [B, T]; got {tokens.shape} and {positions.shape}"
        )
    if not np.issubdtype(tokens.dtype, np.integer) or not np.issubdtype(
        positions.dtype, np.integer
    ):
        raise ValueError(f"tokens/positions must be integers, got {tokens.dtype}/{positions.dtype}")
    if tokens.shape[0] != cache.batch:
        raise ValueError(
            f"batch of {tokens.shape[0]} rows does not match the cache's {cache.batch}"
        )
    _check_token_range(tokens[positions >= 0], model.config.V)
    logits, new, _ = _forward_jit(
        model.config,
        model.params,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        cache,
    )
    check_overflow(new)
    return logits, new


@dataclasses.dataclass(frozen=True)
class SpecReport:
    """Host-side speculative statistics of one run (llama.cpp's counters)."""

    stats: Any  # specjax.decode.stats.SpecStats with numpy leaves
    names: tuple[str, ...]
    #: The draft governor's counters (specjax.decode.governor): rounds with a draft budget, rounds
    #: it drafted shorter than the budget, rounds it did not draft; whether it was on; and
    #: `dropped`, the drafters left out of the run with why (`unpaying_drafters`).
    governor: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The target memory's rollback level (`seq_rm_type`: PART, FULL or RS) and `n_rs_seq`.
    target_memory: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Rounds of the loop (target forwards after the prefill, all rows at once).
    n_rounds: int = 0
    #: A recurrent draft context's row-rounds per rollback path, else None.
    draft_context: dict[str, int] | None = None

    def lines(self) -> list[str]:
        """The target memory's line (hybrid targets), llama.cpp's per-implementation lines,
        the server's acceptance lines, then the governor's line (specjax only)."""
        lines = []
        memory = self.target_memory
        if memory and memory["seq_rm_type"] != "PART":
            lines.append(
                f"target memory: {memory['seq_rm_type']} (n_rs_seq = {memory['n_rs_seq']})"
            )
        lines += format_impl_lines(self.stats, self.names) + format_server_lines(self.stats)
        if self.stats.n_rollback is not None:
            lines.append(format_rollback_line(rollback_dict(self.stats.n_rollback)))
        g = self.governor
        if g:
            state = "on" if g["enabled"] else "off"
            lines.append(
                f"draft governor: {state}, drafting shortened in {g['throttled']} and off "
                f"in {g['off']} of {g['rounds']} rounds"
            )
            lines += [f"draft governor: {name} off for this run: {why}"
                      for name, why in g.get("dropped", {}).items()]  # fmt: skip
        if self.draft_context is not None:
            c = self.draft_context
            lines.append(
                f"draft context: {c['rs_plane']} rounds rolled back by RS plane, "
                f"{c['checkpoint']} by checkpoint"
            )
        return lines

    def to_dict(self) -> dict[str, Any]:
        """vLLM-style names (num_drafts, num_draft_tokens, num_accepted_tokens, ...), plus
        `governor` (rounds / throttled / off / enabled)."""
        out = dict(self.stats.to_dict(self.names))
        out.update(self.target_memory)
        out["target_forwards"] = self.n_rounds
        if self.governor:
            out["governor"] = dict(self.governor)
        if self.draft_context is not None:
            out["draft_context"] = dict(self.draft_context)
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclasses.dataclass
class GenerationResult:
    """Generated ids per prompt, their text, timings and (speculative runs) statistics."""

    tokens: list[list[int]]
    text: list[str]
    timings: dict[str, float]
    finish_reasons: list[str]
    stats: Any = None
    prompt_tokens: list[list[int]] = dataclasses.field(default_factory=list)
    #: Final drafter states (device arrays), by drafter name; e.g. ngram-cache's context caches.
    #: Empty unless asked for (`generate(..., return_drafter_states=True)`): they are device
    #: memory a kept result would pin (ngram-mod's pool alone is 32 MB). A `Generator`'s
    #: result holds the Generator's own states: its next call consumes them (donated buffers,
    #: updated in place), so copy them (`jax.tree.map(jnp.copy, ...)`) to keep them past it.
    drafter_states: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Slots:
    """A `Generator`'s fixed rows: batch B, its built drafters and their carried states.

    `lookup_seen`: the lookup table the last call ended with, as `((n, gap, shape), table)`,
    or None for fresh states (their memory holds nothing); a table of another chain's
    lookups leaves the n-grams held unknown. `carry` receives this call's (`generate` writes
    it after the run)."""

    batch: int
    drafters: tuple[Any, ...]
    drafter_params: tuple[Any, ...]
    states: tuple[Any, ...]
    lookup_seen: Any = None
    carry: dict[str, Any] = dataclasses.field(default_factory=dict)


def _fit_draft_limits(
    spec: SpecConfig, context: int, prompt_lengths: list[int]
) -> SpecConfig | None:
    """`spec` with its draft limits clamped to what the context leaves after the shortest
    prompt (`config.fit_draft_limits`), with a warning saying what changed: a limit beyond
    the context only widens the compiled draft. Unlike the CLI's one-shot runs, `max_new_tokens`
    does not clamp here: the rounds' budgets already stop drafts at it, and a limit cut to it
    would change the static draft width (a compile) from call to call."""
    room = context - min(prompt_lengths) - 1
    why = f"n_ctx {context}, prompt of {min(prompt_lengths)} tokens"
    fitted, notes = fit_draft_limits(spec, room, why)
    if notes:
        warnings.warn("; ".join(notes), stacklevel=3)
    return fitted


def generate(
    model: Model,
    prompts: Any,
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repeat_penalty: float = 1.0,
    seed: int | Sequence[int] = 0,
    n_ctx: int | None = None,
    spec: SpecConfig | None = None,
    draft: Model | None = None,
    stop: Sequence[str] = (),
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    n_ubatch: int = 0,
    _slots: _Slots | None = None,
    stream: Any = None,
    stream_rounds: int = 8,
    interrupt: Any = None,
    slot_save_path: str | None = None,
    slot_save: str | Sequence[str | None] | None = None,
    slot_restore: str | Sequence[str | None] | None = None,
    slot_overwrite: bool = False,
    return_drafter_states: bool = False,
    n_rs_seq: int | None = None,
    swa_full: bool = False,
) -> GenerationResult:
    """Generate continuations for `prompts` (strings or token-id lists), all rows at once.

    With `spec` (and `draft` for draft-simple) the run is speculative; at temperature 0 its
    output equals plain greedy decoding token for token. With the draft governor on
    (`spec.adaptive`), a drafter it would never ask at this batch size is left out of the run
    (`unpaying_drafters`; `result.stats.governor["dropped"]` says which and why).
    `max_new_tokens` and `seed` may be given per prompt; `max_new_tokens=-1` generates until
    EOG or a full context (n_ctx, by default the model's training context), as llama.cpp's
    n_predict -1. Sampling parameters
    follow llama.cpp (see `_sampling_args`: "off" values clamped, refused values raise
    ValueError). `stop` strings end a row's text at their first occurrence (applied on
    the host after the device loop, which itself stops at end-of-generation tokens and
    max_new_tokens); the row's tokens are cut after the token completing the stop string.
    `n_ubatch` (llama.cpp's `-ub`) prefills the prompt in chunks of that many tokens, each
    chunk processed by the drafters (0 = one forward over the whole prompt).
    `cache_type_k` / `cache_type_v` (`f32`, `f16`, `bf16`; llama.cpp's `-ctk` / `-ctv`) set
    the target's KV cache types, F16 by default as in llama.cpp. Compilation is cached per static shape; `timings["compile_seconds"]`
    reports it apart from prefill/decode time. Drafter state lives for one call; a
    `Generator` keeps it across calls. `return_drafter_states=True` puts the drafters' final
    states in `result.drafter_states` (by default the result holds none: device memory a
    kept result would pin, 32 MB for ngram-mod's pool).

    Slots (`specjax.jobs.slots`, llama.cpp's `--slot-save-path`): `slot_save="NAME"` (or one name
    or None per prompt) saves each prompt's processed state as `slot_save_path/NAME` before
    decoding (never over an existing slot unless `slot_overwrite`); `slot_restore="NAME"`
    starts every prompt (or per prompt) from a saved slot, so only the tokens after the
    slot's prompt are prefilled; the prompt must start with the slot's prompt.
    `timings["slots"]` reports what was saved / restored.

    `stream(row, text)`: called with each prompt's new text as it is produced (the host
    reads the state after `stream_rounds` rounds, then about every STREAM_INTERVAL_S seconds
    when rounds are fast, never less than `stream_rounds` rounds apart; the tokens are the
    same as without it; `stop` strings apply to the returned result only).

    `interrupt()`: asked between segments of the loop (as streaming reads it: the same
    tokens, about every INTERRUPT_INTERVAL_S seconds); when it returns True the loop stops
    there and the result holds what was generated, rows still running with finish reason
    `interrupted` (the CLI's Ctrl-C).

    The context (`specjax.decode.inputs.fit_context`, the rule of every path): `n_ctx` cells
    per row, None meaning the model's training context (llama.cpp's `-c 0`). A prompt that
    does not fit raises ValueError with its numbers before anything runs; a row that
    reaches the context stops with finish reason `context`; a context beyond the training
    context runs with a `ContextWarning`.

    A qwen35 (hybrid recurrent) model runs through the same engine over its hybrid memory:
    rejected drafts leave the recurrent state by `n_rs_seq` snapshot planes (RS) or by
    restoring the round's checkpoint and replaying the accepted tokens (FULL, n_rs_seq 0);
    `n_rs_seq=None` takes upstream's `need_n_rs_seq`. A target the rollback probe calls NO
    decodes without drafts, with a warning. Its KV cache keeps the model's dtype, the draft
    governor is off (its prices are measured for attention targets only) and repeat
    penalties are refused.

    A gemma3 model's sliding-window layers keep a ring of window + K cells per row (llama.cpp's
    iSWA cache, `specjax.memory.swa`; `timings["kv_cache_bytes"]` shows the saving);
    `swa_full=True` keeps every cell of them (llama.cpp's `--swa-full`): the same tokens.
    """
    if isinstance(n_ubatch, bool) or not isinstance(n_ubatch, int | np.integer) or n_ubatch < 0:
        raise ValueError(f"n_ubatch must be an integer >= 0 (0 = whole prompt), got {n_ubatch!r}")
    hybrid = isinstance(model.config, Qwen35Config)
    if hybrid and repeat_penalty != 1.0:
        raise ValueError(
            f"repeat_penalty {repeat_penalty} is not supported on {model.config.arch} yet"
        )
    spec = spec if spec is not None and spec.enabled else None
    if draft is not None and spec is None and hybrid:
        raise ValueError("a draft model was given without a speculative type (spec)")
    rs_planes, seq_rm_type = _target_rollback(model, spec, n_rs_seq)
    if seq_rm_type == SeqRmType.NO and spec is not None:
        warnings.warn(
            f"the target ({model.config.arch}) failed the rollback probe (seq_rm type NO): "
            "speculative decoding is disabled, decoding without drafts",
            stacklevel=2,
        )
        spec, draft = None, None
    prompt_ids = _tokenize_prompts(model, prompts)
    slot_states, slot_report = None, None
    if slot_save_path is not None or slot_save is not None or slot_restore is not None:
        if n_ubatch:
            raise ValueError("slot save / restore prefill the prompt in one batch: n_ubatch 0")
        slot_states, slot_report = slots_mod.prepare(
            model, prompt_ids, directory=slot_save_path, save=slot_save, restore=slot_restore,
            overwrite=slot_overwrite, cache_type_k=None if hybrid else cache_type_k,
            cache_type_v=None if hybrid else cache_type_v,
        )  # fmt: skip
    n_prompts = len(prompt_ids)
    B = n_prompts if _slots is None else _slots.batch
    if n_prompts > B:
        raise ValueError(f"{n_prompts} prompts for a Generator of batch {B}")
    max_new = _n_predict(max_new_tokens, n_prompts)
    # the context rule (`fit_context`): None = the model's training context; a prompt that
    # does not fit is refused here; a context beyond the training one warns (a Generator's
    # warned when it was made)
    context, _ = fit_context(
        model, [len(p) for p in prompt_ids], n_ctx, warn=_slots is None, stacklevel=2
    )
    if (max_new < 0).any():  # until the context is full: the context stop comes first
        max_new = np.where(max_new < 0, context + 1, max_new)
    if _slots is None and spec is not None:  # a Generator's chain is fixed when it is made
        spec = _fit_draft_limits(spec, context, [len(p) for p in prompt_ids])
    seeds = _per_row(seed, n_prompts, "seed")
    sampling_args = _sampling_args(n_prompts, temperature, top_k, top_p, min_p, repeat_penalty)
    if _slots is None:
        drafters, drafter_params = build_drafters(spec, model, draft)
    else:
        drafters, drafter_params = _slots.drafters, _slots.drafter_params
    # the draft model's K one-token steps per round are matrix-vector products too
    drafter_params = tuple(
        drafter_decode_params(d, p) for d, p in zip(drafters, drafter_params, strict=True)
    )
    if hybrid:
        for d in drafters:
            if d.hidden_layers:
                raise ValueError(
                    f"{d.name} reads target hidden states, which the {model.config.arch} target "
                    "does not export yet; use n-gram drafters or draft-simple"
                )
    n_idle = B - n_prompts
    if n_idle:  # idle Generator slots: a 1-token prompt, done after prefill, never drafting
        prompt_ids = prompt_ids + [[0]] * n_idle
        max_new = np.concatenate([max_new, np.ones(n_idle, max_new.dtype)])
        seeds = np.concatenate([seeds, np.zeros(n_idle, seeds.dtype)])
        sampling_args = {
            k: np.concatenate([v, np.full(n_idle, _IDLE_SAMPLING[k], v.dtype)])
            for k, v in sampling_args.items()
        }
    k_max = chain_k_max(spec, drafters) if spec else 0
    T, S, out_cap = build_engine_inputs(
        model, prompt_ids, max_new_tokens=int(max_new.max()), n_ctx=n_ctx, k_max=k_max
    )
    synth = None
    if spec is not None and spec.synthetic:
        # upstream sizes the rates by its n_max; the static K may be wider (never drafted)
        n_rates = min(max(1, spec.n_max()), k_max)
        synth = resolve_synthetic_rates(
            n_rates,
            length=spec.synth_len if spec.synth_len >= 0 else None,
            rates=list(spec.synth_rates) or None,
        )
        if synth is not None:
            synth = np.concatenate([synth, np.zeros(k_max - n_rates)])
    engine = eng.Engine(
        target=model.config,
        drafters=drafters,
        k_max=k_max,
        capacity=S,
        out_capacity=out_cap,
        eog_ids=model.eog_ids,
        synthetic=synth is not None,
        cache_type_k=None if hybrid else cache_dtype(cache_type_k),
        cache_type_v=None if hybrid else cache_dtype(cache_type_v),
        n_ubatch=int(n_ubatch),
        n_rs_seq=rs_planes,
        swa_full=bool(swa_full),
    )
    cost = cost_model(
        None if hybrid else spec,
        model,
        draft,
        synthetic=synth is not None,
        batch=B,
        k_max=k_max,
        capacity=S,
        drafters=drafters,
    )
    carried = None if _slots is None else _slots.states
    built = [d.name for d in drafters]  # (the order of a Generator's carried states)
    dropped: dict[str, str] = {}
    if spec is not None:  # the governor would never ask them: left out
        keep, engine, cost, dropped = leave_out_unpaying(spec, model, engine, cost, B)
        drafters, k_max = engine.drafters, engine.k_max
        drafter_params = tuple(drafter_params[i] for i in keep)
        carried = None if carried is None else tuple(carried[i] for i in keep)
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompt_ids], np.int32)
    # NumPy leaves: the executables take them in with their other arguments, where each
    # jnp.asarray would dispatch an op of its own (~25 a call, ~1 ms of host time)
    run = eng.RunParams(
        sampling=sampling.SamplingParams.host(B, seed=seeds, **sampling_args),
        max_new=_host_leaf(max_new, np.int32),
        n_max=_host_leaf(spec.draft_n_max if spec else 0, np.int32),
        chain_n_max=_host_leaf(spec.n_max() if spec else 0, np.int32),
        n_min=_host_leaf(spec.draft_n_min if spec else 0, np.int32),
        p_min=_host_leaf(spec.draft_p_min if spec else 0.0, np.float32),
        synth_rates=_host_leaf(synth if synth is not None else np.zeros(max(k_max, 1)), np.float32),
        cost=cost,
    )
    start = None
    if slot_states is not None and any(st is not None for st in slot_states):
        for d in drafters:
            if d.hidden_layers or d.reads_nextn:
                raise ValueError(f"{d.name} reads the target's hidden states of the prompt, "
                                 "which a restored slot does not hold")  # fmt: skip
        if hybrid:
            start = slots_mod.hybrid_start(model, slot_states + [None] * n_idle, S, rs_planes)
        else:
            start = slots_mod.attention_start(
                model, slot_states + [None] * n_idle, S,
                engine.cache_type_k or model.config.dtype,
                engine.cache_type_v or engine.cache_type_k or model.config.dtype,
            )  # fmt: skip
    tc = time.perf_counter()
    params = decode_params(model.params)
    # one-shot calls of a chain that can renew its state take the last such call's states
    # (`_SPARES`) instead of allocating them again (ngram-mod's 32 MB pool)
    recycle = (
        _slots is None and not return_drafter_states and any(d.can_renew for d in engine.drafters)
    )
    spare_key = (engine.drafters, B, S)
    spare = _SPARES.pop(spare_key, None) if recycle else None
    init_exe = None
    if recycle and spare is None:
        init_exe = _compiled(eng.init_states_jit, engine, lengths)
    spare_shape = init_exe.out_info if init_exe is not None else spare
    # a Generator's chain with a shared lookup table: the table its last call ended with
    table_key, seen = None, None
    if _slots is not None and engine.lookup_n is not None and engine.lookup_shared:
        table_key = (engine.lookup_n, engine.lookup_gap, lookup_index.table_shape(B, S, True))
        held = _slots.lookup_seen
        if held is None:  # fresh states: nothing held yet
            seen = jnp.zeros(table_key[2], bool)
        elif held[0] == table_key:
            seen = held[1]  # (another chain's table: unknown, the table starts full)
    prefill_exe = _compiled(
        eng.prefill_jit, engine, params, drafter_params, tokens, lengths, run, carried, start,
        spare_shape, seen,
    )  # fmt: skip
    state_shape = prefill_exe.out_info  # the loop's input shapes, without re-tracing prefill
    if stream is None and interrupt is None:
        one_call = _compiled(
            eng.generate_loop_jit, engine, params, drafter_params, state_shape, run
        )

        def loop_exe(*args: Any) -> tuple[Any, bool]:
            return one_call(*args), False
    else:
        loop_exe = _segmented_loop(
            model, engine, drafter_params, state_shape, run, n_prompts, stream=stream,
            rounds=stream_rounds if stream is not None else INTERRUPT_FIRST_ROUNDS,
            interrupt=interrupt,
        )  # fmt: skip
    t0 = time.perf_counter()
    if init_exe is not None:
        spare = init_exe(lengths)
    state = prefill_exe(params, drafter_params, tokens, lengths, run, carried, start, spare, seen)
    del spare, seen  # (donated)
    jax.block_until_ready(state.last_token)
    t1 = time.perf_counter()
    state, interrupted = loop_exe(params, drafter_params, state, run)
    jax.block_until_ready(state.out_len)
    t2 = time.perf_counter()
    if recycle:
        _lru_put(_SPARES, spare_key, state.drafter_states, lambda d: len(d) > _SPARES_MAX)
    if table_key is not None and _slots is not None:
        _slots.carry["lookup_seen"] = (table_key, state.lookup_seen)
    check_overflow(engine.memory.kv(state.cache))
    if n_idle:  # idle slots did not begin a request
        st = state.stats
        state = dataclasses.replace(
            state, stats=dataclasses.replace(st, n_call_begin=st.n_call_begin - n_idle)
        )
    host = jax.device_get((state.out_tokens, state.out_len, state.finish, state.n_rounds))
    out_tokens, out_len, finish, n_rounds = host
    eog = set(model.eog_ids)
    results, texts, reasons = [], [], []
    for b in range(n_prompts):
        ids = [int(t) for t in out_tokens[b, : out_len[b]]]
        if ids and ids[-1] in eog and int(finish[b]) == eng.FINISH_EOG:
            ids = ids[:-1]
        text = model.decode(ids) if model.tokenizer is not None else ""
        reason = eng.FINISH_NAMES[int(finish[b])]
        if interrupted and int(finish[b]) == eng.FINISH_NONE:  # a row still running
            reason = "interrupted"
        if stop and text:
            ids, text, hit = _apply_stop(model, ids, text, stop)
            reason = "stop" if hit else reason
        results.append(ids)
        texts.append(text)
        reasons.append(reason)
    generated = int(np.sum(out_len[:n_prompts]))
    timings: dict[str, Any] = {
        "prompt_tokens": int(lengths[:n_prompts].sum()),
        "generated_tokens": generated,
        "prefill_seconds": t1 - t0,
        "decode_seconds": t2 - t1,
        "tokens_per_second": generated / max(t2 - t1, 1e-9),
        "n_rounds": int(n_rounds),
        "compile_seconds": t0 - tc,
        "kv_cache_bytes": engine.memory.kv(state.cache).nbytes,
    }
    if slot_report:
        timings["slots"] = slot_report
    stats = None
    if spec is not None:
        gov = jax.device_get(state.governor)
        stats = SpecReport(
            stats=state.stats.to_host(),
            names=tuple(d.name for d in drafters),
            target_memory={"seq_rm_type": engine.memory.seq_rm_type, "n_rs_seq": rs_planes},
            n_rounds=int(n_rounds),
            draft_context=_draft_context_counts(state.drafter_states),
            governor={
                "enabled": bool(run.cost.enabled),
                "rounds": int(gov.n_rounds),
                "throttled": int(gov.n_throttled),
                "off": int(gov.n_off),
                # drafters left out of the run: the governor would never ask them
                "dropped": dropped,
            },
        )
    return GenerationResult(
        tokens=results,
        text=texts,
        timings=timings,
        finish_reasons=reasons,
        stats=stats,
        prompt_tokens=prompt_ids[:n_prompts],
        drafter_states={
            # a drafter left out of the run keeps the state it came with (a Generator's)
            **({} if _slots is None else dict(zip(built, _slots.states, strict=True))),
            **{d.name: st for d, st in zip(drafters, state.drafter_states)},
        }
        if return_drafter_states or _slots is not None
        else {},
    )


def _target_rollback(
    model: Model, spec: SpecConfig | None, n_rs_seq: int | None
) -> tuple[int, SeqRmType]:
    """(n_rs_seq, rollback level) of the target's memory for a run of `spec`. An attention
    target is PART (no planes); a qwen35 target takes `n_rs_seq`, None meaning upstream's
    `need_n_rs_seq` (the draft n_max when a drafter runs on the target's hidden states, else
    0), and asks the probe (`can_seq_rm`: RS, FULL, or NO when it fails to decode)."""
    if not isinstance(model.config, Qwen35Config):
        return 0, SeqRmType.PART
    if spec is None:
        return 0, SeqRmType.FULL
    if n_rs_seq is None:
        n_rs_seq = int(spec.draft_n_max) if reads_target_hidden(spec.types) else 0
    if n_rs_seq < 0:
        raise ValueError(f"n_rs_seq must be >= 0, got {n_rs_seq}")
    kind = hybrid_memory.can_seq_rm(model, n_rs_seq)
    return (n_rs_seq if kind != SeqRmType.NO else 0), kind


def _draft_context_counts(states: tuple[Any, ...]) -> dict[str, int] | None:
    """Row-rounds per rollback path of the recurrent draft contexts (None: there is none)."""
    # (a drafter's module loads only when its type is used: `registry.drafter_class`)
    from specjax.drafters.draft_simple import DRAFT_ROLLBACK_PATHS, RecurrentDraftState

    counts = [
        np.asarray(s.rollbacks).sum(axis=0) for s in states if isinstance(s, RecurrentDraftState)
    ]
    if not counts:
        return None
    total = np.sum(counts, axis=0)
    return {name: int(x) for name, x in zip(DRAFT_ROLLBACK_PATHS, total)}


#: Streaming reads the state about this often (seconds) once rounds are fast: each read costs
#: a launch and a sync (~1 ms on a 2-core CPU), which at a fixed 8 rounds and a fast decode
#: step was ~20% of the decode time.
STREAM_INTERVAL_S = 0.05
#: Upper bound on the rounds between two reads.
STREAM_MAX_ROUNDS = 1024
#: An interruptible run (`generate(interrupt=...)`, without `stream`) asks `interrupt()`
#: about this often (seconds): the loop stops within two such segments of the request.
INTERRUPT_INTERVAL_S = 0.2
#: Rounds of an interruptible run's first segment (then sized by INTERRUPT_INTERVAL_S).
INTERRUPT_FIRST_ROUNDS = 4


def _segmented_loop(
    model: Model,
    engine: eng.Engine,
    drafter_params: Any,
    state_shape: Any,
    run: eng.RunParams,
    n_prompts: int,
    *,
    stream: Any,
    rounds: int,
    interrupt: Any,
) -> Any:
    """The generation loop in calls of a few rounds (`continuous.run_rounds`, compiled once:
    the same state as one `generate_loop` call), reading the state between calls: handing
    each prompt's new text to `stream(row, text)`, and asking `interrupt()` whether to stop
    there. The loop returns (state, interrupted).

    Segments start at `rounds` rounds (at least 1) and grow while they take less than
    STREAM_INTERVAL_S (streaming) or INTERRUPT_INTERVAL_S, up to STREAM_MAX_ROUNDS."""
    if rounds < 1:
        raise ValueError(f"stream_rounds must be >= 1, got {rounds}")
    exe = _compiled(
        cont.run_rounds_jit,
        engine,
        decode_params(model.params),
        drafter_params,
        state_shape,
        run,
        jnp.asarray(rounds, jnp.int32),
    )
    eog = set(model.eog_ids)
    interval = STREAM_INTERVAL_S if stream is not None else INTERRUPT_INTERVAL_S

    def show(out_tokens: Any, out_len: Any, done: Any, finish: Any, shown: list[str]) -> None:
        for b in range(n_prompts):
            ids = [int(t) for t in out_tokens[b, : out_len[b]]]
            if ids and ids[-1] in eog and int(finish[b]) == eng.FINISH_EOG:
                ids = ids[:-1]
            text = model.decode(ids) if model.tokenizer is not None else ""
            if not done[b]:  # an unfinished multi-byte character waits for its bytes
                text = text.rstrip("\ufffd")
            if text.startswith(shown[b]) and len(text) > len(shown[b]):
                stream(b, text[len(shown[b]) :])
                shown[b] = text

    def loop(params: Any, dparams: Any, state: Any, run: eng.RunParams) -> tuple[Any, bool]:
        shown = [""] * n_prompts
        if interrupt is not None and interrupt():  # (asked once before the first segment)
            return state, True
        span = rounds  # rounds per segment: grows while segments take < interval
        state = exe(params, dparams, state, run, jnp.asarray(span, jnp.int32))
        last_time, last_rounds = time.perf_counter(), 0
        while True:
            fields = [state.done, state.n_rounds]
            if stream is not None:
                # Pipelined: copy out what the host reads, queue the next segment (it donates
                # the state), then detokenize while it runs. A segment queued after the last
                # one is a no-op (run_rounds stops at once when every row is done).
                fields += [state.out_tokens, state.out_len, state.finish]
                snapshot = [jnp.array(f, copy=True) for f in fields]
                state = exe(params, dparams, state, run, jnp.asarray(span, jnp.int32))
                done, n_rounds, *rest = jax.device_get(snapshot)
            else:  # (no trailing no-op segment: a short run costs what one call costs)
                done, n_rounds = jax.device_get(fields)
            now, done_rounds = time.perf_counter(), int(n_rounds)
            if done_rounds > last_rounds and now > last_time:
                per_round = (now - last_time) / (done_rounds - last_rounds)
                span = int(min(STREAM_MAX_ROUNDS, max(rounds, interval / per_round)))
            last_time, last_rounds = now, done_rounds
            if stream is not None:
                show(rest[0], rest[1], done, rest[2], shown)
            if done.all() or done_rounds >= engine.max_rounds:
                return state, False
            if interrupt is not None and interrupt():
                return state, True
            if stream is None:
                state = exe(params, dparams, state, run, jnp.asarray(span, jnp.int32))

    return loop


class Request(TypedDict, total=False):
    """What `Generator.generate` takes per request: `generate`'s keywords of that name, with
    its defaults (the model, drafters, context and cache types are the Generator's)."""

    max_new_tokens: Required[int | Sequence[int]]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    seed: int | Sequence[int]
    stop: Sequence[str]


class Generator:
    """A model, its drafters and their state that outlives a call: llama.cpp's server slots.

    `Generator(model, spec=..., draft=..., n_ctx=..., batch=...)` builds the drafter chain once
    (draft model, lookup tables) and fixes the static sizes its state depends on: `batch` rows
    (slots) and a context of `n_ctx` cells per row (default: the model's training context).
    `generate(prompts, ...)` takes up to `batch` prompts (prompt i runs in slot i; unused
    slots idle) with `specjax.generate`'s sampling arguments, and hands every drafter the state
    the previous call left (ngram-mod's pool, learned n-grams), as the server keeps a slot's
    drafter across requests. Each request still starts as upstream's does: memory cells are
    dropped, then the drafters' `process` (the prompt) and `begin` run (ngram-cache's context
    cache and ngram-map's maps are per-request, ngram-mod's pool is not). Carried state never
    recompiles; prompt-length and max_new_tokens buckets compile as in `specjax.generate`.
    Each request's prefill takes the states as donated buffers (ngram-mod's 32 MB pool is
    updated in place, not copied per request), so a result's `drafter_states`, which are the
    Generator's, are valid until its next call.
    """

    def __init__(
        self,
        model: Model,
        *,
        spec: SpecConfig | None = None,
        draft: Model | None = None,
        n_ctx: int | None = None,
        batch: int = 1,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        n_ubatch: int = 0,
    ) -> None:
        if isinstance(n_ubatch, bool) or not isinstance(n_ubatch, int | np.integer) or n_ubatch < 0:
            raise ValueError(
                f"n_ubatch must be an integer >= 0 (0 = whole prompt), got {n_ubatch!r}"
            )
        if isinstance(batch, bool) or not isinstance(batch, int | np.integer) or batch < 1:
            raise ValueError(f"Generator batch must be an integer >= 1, got {batch!r}")
        # the context rule (`fit_context`): None = the model's training context, warned
        # here (once) when beyond it
        n_ctx, _ = fit_context(model, [], n_ctx, stacklevel=2)
        self.model, self.draft, self.batch, self.n_ctx = model, draft, int(batch), n_ctx
        self.spec = spec if spec is not None and spec.enabled else None
        self.cache_type_k, self.cache_type_v = cache_type_k, cache_type_v
        self.n_ubatch = int(n_ubatch)  # llama.cpp's -ub: prefill chunk, as `specjax.generate`
        self.drafters, self.drafter_params = build_drafters(self.spec, model, draft)
        self.reset()

    def reset(self) -> None:
        """Forget what the drafters learned (fresh states, as a new server)."""
        self.states: tuple[Any, ...] = tuple(d.init(self.batch, self.n_ctx) for d in self.drafters)
        # the n-grams their shared memory may hold: none (`specjax.drafters.lookup_index`)
        self.lookup_seen: Any = None

    def generate(self, prompts: Any, **request: Unpack[Request]) -> GenerationResult:
        """`specjax.generate` on this Generator's slots, drafter state carried over: its
        per-request keywords (`Request`: max_new_tokens, the sampling parameters, seed,
        stop) with its defaults; the rest is the Generator's."""
        unknown = sorted(set(request) - set(Request.__annotations__))
        if unknown:
            raise TypeError(
                f"Generator.generate got keywords {unknown} that are not per request; "
                f"it takes {sorted(Request.__annotations__)}"
            )
        slots = _Slots(
            batch=self.batch,
            drafters=self.drafters,
            drafter_params=self.drafter_params,
            states=self.states,
            lookup_seen=self.lookup_seen,
        )
        out = self._generate_carried(
            model=self.model,
            prompts=prompts,
            n_ctx=self.n_ctx,
            spec=self.spec,
            draft=self.draft,
            cache_type_k=self.cache_type_k,
            cache_type_v=self.cache_type_v,
            n_ubatch=self.n_ubatch,
            _slots=slots,
            **request,
        )
        self.states = tuple(out.drafter_states[d.name] for d in self.drafters)
        self.lookup_seen = slots.carry.get("lookup_seen", self.lookup_seen)
        return out

    def _generate_carried(self, **kwargs: Any) -> GenerationResult:
        """`generate` with this Generator's states, which the prefill consumes (donated: no
        copy of ngram-mod's pool per request). A call that fails after that leaves fresh
        states, as `reset` does: what the drafters had learned is gone with the request."""
        try:
            return generate(**kwargs)
        except BaseException:
            if any(x.is_deleted() for x in jax.tree.leaves(self.states)):
                self.reset()
            raise
