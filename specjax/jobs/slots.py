"""Slot save / restore for users: a prompt's processed state on disk (llama.cpp's
`--slot-save-path` and the server's `/slots/{id}?action=save|restore`).

A *slot file* (a full slot) is what a later generation needs to skip the prefill of a prompt
prefix: the target's memory of one row after the prompt's first n - 1 tokens,

* attention-only targets (llama, qwen2, qwen3): the KV cells of positions 0..n-2 of every
  layer (`data_tgt = {"k": (...), "v": (...)}`, each `[G, n - 1, E]` in the cache's dtype);
* hybrid targets (qwen35): the attention layers' KV cells as above AND the recurrent state
  (`"conv"`, `"ssm"` per delta-net layer) after token n - 2.

It differs from the in-loop PARTIAL_ONLY checkpoint of `specjax.memory.target` (the pre-round
recurrent state only, the attention KV being rolled back with `seq_rm`): a slot file starts a
new memory, so it must hold the attention KV too. The state stops one token short of the
prompt, as upstream re-evaluates at least one prompt token after a restore to get its logits:
a restored row evaluates `prompt[n - 1:]` (the last saved token and whatever the new prompt
adds) and then decodes as if the whole prompt had been prefilled, token for token at
temperature 0. Drafter state is not saved (upstream saves only the target context): drafters
process the whole prompt as in a normal prefill, so drafters that read the target's hidden
states (draft-eagle3, draft-dflash, draft-dspark) cannot start from a slot.

On disk a slot is `DIR/NAME/`, a `specjax.memory.checkpoint` directory (orbax, atomic: a save
is complete or absent, a process killed mid-save leaves the previous save readable), with the
prompt's n tokens, the model's identity (architecture, config, a fingerprint of its weights)
and the KV cache types in its meta. Rules:

* `NAME` is a file name (llama.cpp's `fs_validate_filename`: no path separators, not `.` or
  `..`, no control characters, at most 255 bytes); `DIR` must exist.
* Saving never replaces an existing `DIR/NAME` unless `overwrite=True` (`--slot-overwrite`):
  a `SlotExistsError` names it.
* Restoring raises `CheckpointError` naming the step directory and the field when the slot is
  corrupted (checksums), was saved by another model (`meta.model.arch`, `meta.model.config`,
  `meta.model.weights`), with other KV cache types (`meta.extra.cache_type_k`), or when the
  prompt does not start with the slot's tokens (`meta.extra.tokens`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.inputs import _tokenize_prompts
from specjax.errors import SpecjaxError
from specjax.memory import checkpoint as sc
from specjax.memory.hybrid import HybridMemory, SavedState
from specjax.memory.kv import cache_dtype
from specjax.memory.target import uses_swa_cache
from specjax.models import qwen35
from specjax.models.llama import commit_kv, forward_compute, new_cache
from specjax.pytree import replace
from specjax.types import Array

#: Bytes of each weight leaf hashed into the model fingerprint (first elements of each leaf).
_FINGERPRINT_ELEMS = 256


class SlotExistsError(SpecjaxError):
    """`save_slot` would replace an existing slot (pass overwrite=True to replace it)."""


@dataclasses.dataclass(frozen=True)
class SlotState:
    """One row's saved prompt state, on the host (numpy arrays)."""

    tokens: tuple[int, ...]  # the prompt the slot was saved from (n tokens)
    data: dict[str, tuple[np.ndarray, ...]]  # k, v [G, n-1, E] (+ conv, ssm for qwen35)
    path: Path | None = None  # the step directory it was read from / written to

    @property
    def n_cached(self) -> int:
        """Prompt tokens whose state the slot holds (n - 1)."""
        return len(self.tokens) - 1

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for leaves in self.data.values() for a in leaves))


def validate_name(name: str) -> str:
    """llama.cpp's `fs_validate_filename` (the parts that matter on POSIX): ValueError if bad."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"slot name must be a non-empty file name, got {name!r}")
    if len(name.encode("utf-8")) > 255:
        raise ValueError(f"slot name {name[:32]!r}... is longer than 255 bytes")
    if name in (".", "..") or any(c in name for c in "/\\:") or name != name.strip():
        raise ValueError(f"slot name {name!r} is not a plain file name")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"slot name {name!r} holds control characters")
    return name


def _slot_dir(directory: str | Path, name: str) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"slot save path {directory} is not a directory")
    return directory / validate_name(name)


def _is_hybrid(model: Any) -> bool:
    return getattr(model.config, "arch", None) == "qwen35"


def model_identity(model: Any) -> dict[str, Any]:
    """`slot_checkpoint.model_id` plus `weights`: CRC-32 over the first elements of every
    weight leaf (another model with the same config is told apart)."""
    ident = sc.model_id(model.config)
    crc = 0
    for leaf in jax.tree.leaves(model.params):
        head = np.asarray(jax.device_get(jnp.ravel(leaf)[:_FINGERPRINT_ELEMS]))
        crc = zlib.crc32(head.astype(np.float32).tobytes(), crc)
    ident["weights"] = crc
    return ident


def _cache_types(model: Any, cache_type_k: str | None, cache_type_v: str | None) -> tuple[str, str]:
    k = cache_dtype(cache_type_k) if cache_type_k else str(model.config.dtype)
    v = cache_dtype(cache_type_v) if cache_type_v else k
    return k, v


# ----------------------------------------------------------------------------- compute
@functools.partial(jax.jit, static_argnames=("config", "capacity", "k_dtype", "v_dtype"))
def _prefill(
    config: Any, params: Any, tokens_BT: Array, n_B: Array, capacity: int, k_dtype: str,
    v_dtype: str,
) -> Any:  # fmt: skip
    """A fresh prefill of each row's first n_B tokens: the `KVCache` of an attention-only
    target, the `qwen35.State` of a hybrid one (its `kv` the attention layers' cache)."""
    B, T = tokens_BT.shape
    pos = jnp.where(jnp.arange(T)[None] < n_B[:, None], jnp.arange(T)[None], -1)
    if getattr(config, "arch", None) == "qwen35":
        state = qwen35.new_state(config, B, capacity, k_dtype, v_dtype)
        return qwen35.forward(config, params, tokens_BT, pos, state, cache_empty=True).state
    cache = new_cache(config, B, capacity, k_dtype, v_dtype)
    out = forward_compute(config, params, tokens_BT, pos, cache, cache_empty=True, logits=False)
    return commit_kv(cache, pos, out.k, out.v)


def prompt_states(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
) -> list[SlotState]:
    """The slot state of each prompt (token ids, >= 2 tokens): one jitted prefill over the
    prompts' first n - 1 tokens, then each row's cells copied to the host."""
    lens = [len(p) for p in prompts]
    for i, n in enumerate(lens):
        if n < 2:
            raise ValueError(f"prompt {i} has {n} token(s); a slot needs a prompt of >= 2 tokens")
    k_dtype, v_dtype = _cache_types(model, cache_type_k, cache_type_v)
    T = max(16, 1 << (max(lens) - 2).bit_length())
    toks = np.zeros((len(prompts), T), np.int32)
    for b, p in enumerate(prompts):
        toks[b, : len(p) - 1] = p[:-1]
    n_B = jnp.asarray([n - 1 for n in lens], jnp.int32)
    out = jax.device_get(
        _prefill(model.config, model.params, jnp.asarray(toks), n_B, T, k_dtype, v_dtype)
    )
    kv = out.kv if _is_hybrid(model) else out
    states = []
    for b, p in enumerate(prompts):
        n = lens[b] - 1
        if not np.array_equal(np.asarray(kv.pos[b, :n]), np.arange(n)):
            raise AssertionError("a fresh prefill must fill cells 0..n-1 in order")
        data = {
            "k": tuple(np.asarray(k[b, :, :n]) for k in kv.k),
            "v": tuple(np.asarray(v[b, :, :n]) for v in kv.v),
        }
        if _is_hybrid(model):
            data["conv"] = tuple(np.asarray(c[b]) for c in out.conv)
            data["ssm"] = tuple(np.asarray(s[b]) for s in out.ssm)
        states.append(SlotState(tokens=tuple(int(t) for t in p), data=data))
    return states


# ----------------------------------------------------------------------------- disk
def _ckpt(state: SlotState) -> sc.PromptCheckpoint:
    n = state.n_cached
    return sc.PromptCheckpoint(
        n_tokens=jnp.asarray(len(state.tokens), jnp.int32),
        pos_min=jnp.asarray(0, jnp.int32),
        pos_max=jnp.asarray(n - 1, jnp.int32),
        data_tgt={k: tuple(jnp.asarray(a) for a in v) for k, v in state.data.items()},
        data_dft={},
        data_spec={},
    )


def write_slot(
    model: Any,
    state: SlotState,
    directory: str | Path,
    name: str,
    *,
    overwrite: bool = False,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
) -> SlotState:
    """Write `state` as `directory/name` (atomic); returns it with `path` set."""
    path = _slot_dir(directory, name)
    if path.exists() and not overwrite:
        raise SlotExistsError(
            f"{path}: a slot named {name!r} exists; pass overwrite=True (--slot-overwrite) to "
            "replace it"
        )
    k_dtype, v_dtype = _cache_types(model, cache_type_k, cache_type_v)
    extra = {
        "tokens": list(state.tokens),
        "tokens_crc32": zlib.crc32(np.asarray(state.tokens, np.int32).tobytes()),
        "cache_type_k": k_dtype,
        "cache_type_v": v_dtype,
    }
    step = sc.save(path, _ckpt(state), model_identity(model), extra=extra)
    return dataclasses.replace(state, path=step)


def save_slot(
    model: Any,
    prompt: str | Sequence[int],
    directory: str | Path,
    name: str,
    *,
    overwrite: bool = False,
    cache_type_k: str | None = "f16",
    cache_type_v: str | None = "f16",
) -> SlotState:
    """Prefill `prompt` (text or token ids) and save its state as slot `directory/name`.

    The KV cache types must be those of the generations that restore it (`generate`'s
    default f16 for attention targets; pass None for the model's dtype, as a qwen35 target
    decodes). Returns the saved state (`path` = the checkpoint step directory)."""
    if _is_hybrid(model) and cache_type_k == "f16" and cache_type_v == "f16":
        cache_type_k = cache_type_v = None  # a qwen35 target keeps KV in its own dtype
    (ids,) = _tokenize_prompts(model, [prompt])
    (state,) = prompt_states(model, [ids], cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    return write_slot(
        model, state, directory, name, overwrite=overwrite, cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
    )  # fmt: skip


def load_slot(
    model: Any,
    directory: str | Path,
    name: str,
    *,
    cache_type_k: str | None = "f16",
    cache_type_v: str | None = "f16",
) -> SlotState:
    """Read slot `directory/name` for `model`; CheckpointError naming the file and field if
    it is corrupted or does not belong to this model / these cache types."""
    if _is_hybrid(model) and cache_type_k == "f16" and cache_type_v == "f16":
        cache_type_k = cache_type_v = None
    path = _slot_dir(directory, name)
    if not path.exists():
        raise sc.CheckpointError(f"{path}: no slot named {name!r}")
    where, meta = sc.read_meta(path)
    ident = model_identity(model)
    for key, want in ident.items():
        have = meta.get("model", {}).get(key)
        if have != want:
            raise sc.CheckpointError(
                f"{where}: field meta.model.{key} is {have!r}, this model's is {want!r}"
            )
    extra = meta.get("extra") or {}
    k_dtype, v_dtype = _cache_types(model, cache_type_k, cache_type_v)
    for key, want in (("cache_type_k", k_dtype), ("cache_type_v", v_dtype)):
        if extra.get(key) != want:
            raise sc.CheckpointError(
                f"{where}: field meta.extra.{key} is {extra.get(key)!r}, this run uses {want!r}"
            )
    tokens = extra.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) < 2
        or not all(isinstance(t, int) and 0 <= t < model.config.V for t in tokens)
        or zlib.crc32(np.asarray(tokens, np.int32).tobytes()) != extra.get("tokens_crc32")
    ):
        raise sc.CheckpointError(f"{where}: field meta.extra.tokens is corrupted")
    like = _like(model, len(tokens) - 1, k_dtype, v_dtype)
    ckpt = sc.load(path, _ckpt(like), ident)
    data = {k: tuple(np.asarray(a) for a in v) for k, v in ckpt.data_tgt.items()}
    return SlotState(tokens=tuple(tokens), data=data, path=where)


def _like(model: Any, n: int, k_dtype: str, v_dtype: str) -> SlotState:
    """A zero SlotState of the shapes `model` needs for n cached tokens (what load expects)."""
    cfg = model.config
    if _is_hybrid(model):
        n_attn, n_rec = len(cfg.attention_layers), len(cfg.recurrent_layers)
        data = {
            "k": tuple(np.zeros((cfg.G, n, cfg.E), k_dtype) for _ in range(n_attn)),
            "v": tuple(np.zeros((cfg.G, n, cfg.E), v_dtype) for _ in range(n_attn)),
            "conv": tuple(
                np.zeros((cfg.ssm_conv_kernel - 1, cfg.conv_dim), np.float32) for _ in range(n_rec)
            ),
            "ssm": tuple(np.zeros((cfg.Hv, cfg.S, cfg.S), np.float32) for _ in range(n_rec)),
        }
    else:
        data = {
            "k": tuple(np.zeros((cfg.G, n, cfg.E), k_dtype) for _ in range(cfg.L)),
            "v": tuple(np.zeros((cfg.G, n, cfg.E), v_dtype) for _ in range(cfg.L)),
        }
    return SlotState(tokens=(0,) * (n + 1), data=data)


def check_prefix(state: SlotState, prompt: Sequence[int], index: int = 0) -> None:
    """CheckpointError (naming the slot and the field) unless `prompt` starts with the slot's
    tokens."""
    where = state.path or "<slot>"
    saved = state.tokens
    if len(prompt) < len(saved):
        raise sc.CheckpointError(
            f"{where}: field meta.extra.tokens holds {len(saved)} tokens, prompt {index} only "
            f"{len(prompt)}: it must start with the slot's prompt"
        )
    for i, (a, b) in enumerate(zip(saved, prompt)):
        if a != b:
            raise sc.CheckpointError(
                f"{where}: field meta.extra.tokens differs from prompt {index} at token {i} "
                f"({a} vs {b}): the prompt must start with the slot's prompt"
            )


# ----------------------------------------------------------------------------- engines
def attention_start(
    model: Any, states: Sequence[SlotState | None], capacity: int, k_dtype: str, v_dtype: str
) -> tuple[Any, Array]:
    """(KVCache [B rows, capacity], n_cached [B]) holding each row's slot cells (rows
    without a slot: empty) for `specjax.decode.engine.prefill(start=...)`."""
    cache = new_cache(model.config, len(states), capacity, k_dtype, v_dtype)
    return _fill_kv(cache, states), jnp.asarray(
        [0 if s is None else s.n_cached for s in states], jnp.int32
    )


def _fill_kv(cache: Any, states: Sequence[SlotState | None]) -> Any:
    B, _, S, _ = cache.k[0].shape
    pos = np.full((B, S), -1, np.int32)
    ks = [np.array(jax.device_get(k)) for k in cache.k]
    vs = [np.array(jax.device_get(v)) for v in cache.v]
    for b, s in enumerate(states):
        if s is None:
            continue
        n = s.n_cached
        if n >= S:
            raise ValueError(f"a slot of {n + 1} tokens does not fit a context of {S} cells")
        pos[b, :n] = np.arange(n)
        for j, (k, v) in enumerate(zip(s.data["k"], s.data["v"])):
            ks[j][b, :, :n] = k
            vs[j][b, :, :n] = v
    return replace(
        cache,
        k=tuple(jnp.asarray(k) for k in ks),
        v=tuple(jnp.asarray(v) for v in vs),
        pos=jnp.asarray(pos),
    )


def hybrid_start(
    model: Any, states: Sequence[SlotState | None], capacity: int, n_rs_seq: int
) -> tuple[Any, Array]:
    """(HybridMemory, n_cached [B]) for `specjax.decode.engine.prefill(start=...)`: each row's
    KV cells and recurrent state (`RecurrentMemory.load`: no pending rollback)."""
    mem = HybridMemory.init(model.config, len(states), capacity, n_rs_seq)
    kv = _fill_kv(mem.kv, states)
    conv_shapes, ssm_shapes = mem.rec.row_state_shapes()

    def rows(name: str, j: int, shape: tuple[int, ...]) -> Array:
        host = np.zeros((len(states), *shape), np.float32)
        for b, s in enumerate(states):
            if s is not None:
                host[b] = s.data[name][j]
        return jnp.asarray(host)

    saved = SavedState(
        conv=tuple(rows("conv", j, shape) for j, shape in enumerate(conv_shapes)),
        ssm=tuple(rows("ssm", j, shape) for j, shape in enumerate(ssm_shapes)),
        pos=jnp.asarray([-1 if s is None else s.n_cached - 1 for s in states], jnp.int32),
    )
    loaded = jnp.asarray([s is not None for s in states])
    n = jnp.asarray([0 if s is None else s.n_cached for s in states], jnp.int32)
    return replace(mem, kv=kv, rec=mem.rec.load(loaded, saved)), n


# ----------------------------------------------------------------------------- generate
def _names(value: Any, n_prompts: int, what: str) -> list[str | None]:
    if value is None:
        return [None] * n_prompts
    if isinstance(value, str):
        if what == "slot_save" and n_prompts != 1:
            raise ValueError(f"slot_save={value!r} names one slot for {n_prompts} prompts: give "
                             "a list with one name (or None) per prompt")  # fmt: skip
        return [value] * n_prompts
    names = list(value)
    if len(names) != n_prompts:
        raise ValueError(f"{what} has {len(names)} names for {n_prompts} prompts")
    return names


def prepare(
    model: Any,
    prompt_ids: list[list[int]],
    *,
    directory: str | Path | None,
    save: Any,
    restore: Any,
    overwrite: bool,
    cache_type_k: str | None,
    cache_type_v: str | None,
) -> tuple[list[SlotState | None], dict[str, Any]]:
    """Host side of `generate(slot_save_path=..., slot_save=..., slot_restore=...)`: each
    prompt's slot state to start from (None = a normal prefill) and a report for timings.

    Restored slots are read and checked against the prompt first; slots to save are computed
    (one prefill of the prompts' first n - 1 tokens) and written, and the generation then
    starts from them, so saving costs no extra prefill."""
    B = len(prompt_ids)
    save_names = _names(save, B, "slot_save")
    restore_names = _names(restore, B, "slot_restore")
    if directory is None:
        if any(n is not None for n in save_names + restore_names):
            raise ValueError("slot_save / slot_restore need slot_save_path (a directory)")
        return [None] * B, {}
    if uses_swa_cache(model.config):
        raise ValueError(
            f"slot save / restore is not supported for a {model.config.arch} target yet (its "
            "sliding-window layers keep a ring of cells, not the whole prompt)"
        )
    for b, (s, r) in enumerate(zip(save_names, restore_names)):
        if s is not None and r is not None:
            raise ValueError(f"prompt {b} both restores slot {r!r} and saves slot {s!r}")
        for n in (s, r):
            if n is not None:
                validate_name(n)
    t0 = time.perf_counter()
    states: list[SlotState | None] = [None] * B
    loaded: dict[str, SlotState] = {}
    for b, name in enumerate(restore_names):
        if name is None:
            continue
        if name not in loaded:
            loaded[name] = load_slot(
                model, directory, name, cache_type_k=cache_type_k, cache_type_v=cache_type_v
            )
        check_prefix(loaded[name], prompt_ids[b], b)
        states[b] = loaded[name]
    t1 = time.perf_counter()
    to_save = [b for b, n in enumerate(save_names) if n is not None]
    for b in to_save:  # refuse before computing anything
        path = _slot_dir(directory, save_names[b])  # type: ignore[arg-type]
        if path.exists() and not overwrite:
            raise SlotExistsError(
                f"{path}: a slot named {save_names[b]!r} exists; pass overwrite=True "
                "(--slot-overwrite) to replace it"
            )
    saved = []
    if to_save:
        computed = prompt_states(
            model, [prompt_ids[b] for b in to_save], cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
        )  # fmt: skip
        for b, st in zip(to_save, computed):
            st = write_slot(
                model, st, directory, save_names[b], overwrite=overwrite,  # type: ignore[arg-type]
                cache_type_k=cache_type_k, cache_type_v=cache_type_v,
            )  # fmt: skip
            states[b] = st
            saved.append({"name": save_names[b], "path": str(st.path), "n_tokens": len(st.tokens),
                          "bytes": st.nbytes})  # fmt: skip
    t2 = time.perf_counter()
    report = {
        "restored": [
            {
                "row": b,
                "name": restore_names[b],
                "path": str(s.path),
                "n_tokens": len(s.tokens),
                "bytes": s.nbytes,
            }
            for b, s in enumerate(states)
            if s is not None and restore_names[b] is not None
        ],
        "saved": saved,
        "restore_seconds": t1 - t0,
        "save_seconds": t2 - t1,
        "prefill_tokens_skipped": sum(
            s.n_cached for b, s in enumerate(states) if s is not None and restore_names[b]
        ),
    }
    return states, report
