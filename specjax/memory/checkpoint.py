"""PARTIAL_ONLY checkpoints of one row of a hybrid memory (llama.cpp's `common_prompt_checkpoint`,
spec 3.2) in memory and on disk (orbax).

`PromptCheckpoint` is a pytree: `n_tokens`, `pos_min`, `pos_max` (bookkeeping, int32 0-d) and
three data pytrees: `data_tgt` (the target's PARTIAL_ONLY state: for a hybrid target the
recurrent state only, `{"conv": (...), "ssm": (...)}` of the row's current plane; the attention
KV is rolled back with `seq_rm` instead), `data_dft` and `data_spec` (draft context and drafter
state; `{}` when there is none). Inside the jitted loop a checkpoint is simply the pre-round
pytree (specjax.decode.engine); `take` / `restore` are the per-row versions.

On disk (`save` / `load`) a checkpoint is an orbax `CheckpointManager` directory: every save is a
new step, written to a temporary directory and renamed when complete (orbax's atomic
finalisation), and the older steps are deleted only after that (`max_to_keep=1`). A process
killed during a save therefore leaves the previous checkpoint readable: `load` reads the newest
complete step. Each field is its own orbax item (`bookkeeping`, `data_tgt`, `data_dft`,
`data_spec`) next to a JSON `meta` item that records the model's identity, every leaf's shape,
dtype and CRC-32. `load` raises `CheckpointError` naming the directory and the field (the item
and, for a leaf, its path) when an item cannot be read, a leaf's bytes do not match their
checksum, or the checkpoint does not fit the memory it is restored into (other model, other
shapes).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError
from specjax.memory.hybrid import HybridMemory, SavedState
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array

_ITEMS = ("data_tgt", "data_dft", "data_spec")
FORMAT = "specjax-prompt-checkpoint-1"


class CheckpointError(SpecjaxError):
    """A saved checkpoint is missing, corrupted or does not match the memory it is loaded into."""


@pytree_dataclass
class PromptCheckpoint:
    n_tokens: Array  # [] int32, tokens of the slot's prompt when taken
    pos_min: Array  # [] int32
    pos_max: Array  # [] int32
    data_tgt: Any  # PARTIAL_ONLY target state (hybrid: recurrent state of one row)
    data_dft: Any  # draft context state, {} if none
    data_spec: Any  # drafter state (get_state), {} if none


def take(
    mem: HybridMemory,
    row: int,
    n_tokens: Any,
    data_dft: Any = None,
    data_spec: Any = None,
) -> PromptCheckpoint:
    """`update_pos` + `update_tgt(PARTIAL_ONLY)` for `row`: its current recurrent state (the
    plane a pending rollback points at, as upstream's state writer) and its positions.
    Jitted; `row` and `n_tokens` are traced."""
    ckpt = _take(mem, jnp.asarray(row, jnp.int32), jnp.asarray(n_tokens, jnp.int32))
    return replace(
        ckpt,
        data_dft={} if data_dft is None else data_dft,
        data_spec={} if data_spec is None else data_spec,
    )


@jax.jit
def _take(mem: HybridMemory, row: Array, n_tokens: Array) -> PromptCheckpoint:
    conv, ssm = mem.rec.current()
    return PromptCheckpoint(
        n_tokens=jnp.asarray(n_tokens, jnp.int32),
        pos_min=mem.seq_pos_min(row).astype(jnp.int32),
        pos_max=mem.seq_pos_max(row).astype(jnp.int32),
        data_tgt={"conv": tuple(c[row] for c in conv), "ssm": tuple(s[row] for s in ssm)},
        data_dft={},
        data_spec={},
    )


def restore(mem: HybridMemory, row: int, ckpt: PromptCheckpoint) -> HybridMemory:
    """`load_tgt(PARTIAL_ONLY)` then `seq_rm(row, pos_max + 1, -1)` (the server's restore): the
    row's recurrent state becomes the checkpoint's (`RecurrentMemory.load`: no pending
    rollback, as a state load resets rs_idx upstream) and its KV cells after pos_max are
    dropped."""
    _check_fits(mem, ckpt.data_tgt, "<memory>")
    return _restore(mem, jnp.asarray(row, jnp.int32), ckpt)


@jax.jit
def _restore(mem: HybridMemory, row: Array, ckpt: PromptCheckpoint) -> HybridMemory:
    rec = mem.rec
    on = jnp.arange(rec.batch) == row
    B = rec.batch
    saved = SavedState(
        conv=tuple(jnp.broadcast_to(c[None], (B, *c.shape)) for c in ckpt.data_tgt["conv"]),
        ssm=tuple(jnp.broadcast_to(s[None], (B, *s.shape)) for s in ckpt.data_tgt["ssm"]),
        pos=jnp.broadcast_to(ckpt.pos_max, (B,)).astype(jnp.int32),
    )
    out, _ = replace(mem, rec=rec.load(on, saved)).seq_rm(row, ckpt.pos_max + 1, -1)
    return out


def nbytes(tree: Any) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def _check_fits(mem: HybridMemory, data_tgt: Any, where: str) -> None:
    for name, want in zip(("conv", "ssm"), mem.rec.row_state_shapes()):
        got = data_tgt.get(name, ()) if isinstance(data_tgt, dict) else ()
        if len(got) != len(want):
            raise CheckpointError(
                f"{where}: field data_tgt.{name} has {len(got)} layers, the memory {len(want)}"
            )
        for j, (g, w) in enumerate(zip(got, want)):
            if tuple(g.shape) != w:
                raise CheckpointError(
                    f"{where}: field data_tgt.{name}.{j} has shape {tuple(g.shape)}, the memory "
                    f"needs {w}"
                )


# ----------------------------------------------------------------------------- on disk
def _leaf_table(tree: Any) -> dict[str, dict[str, Any]]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.ascontiguousarray(np.asarray(leaf))
        out[jax.tree_util.keystr(path)] = {
            "shape": list(arr.shape),
            "dtype": str(arr.dtype),
            "crc32": zlib.crc32(arr.tobytes()),
        }
    return out


def _manager(directory: Path, read_only: bool = False) -> Any:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=1, create=not read_only, read_only=read_only, enable_async_checkpointing=False
    )
    return ocp.CheckpointManager(directory.absolute(), options=options)


def save(
    directory: str | Path,
    ckpt: PromptCheckpoint,
    model_id: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `ckpt` under `directory` as a new complete step (atomic); returns the step dir.

    `model_id`: JSON-able facts the checkpoint must match when loaded (arch, config);
    `extra`: JSON-able facts stored beside them (`read_meta(...)["extra"]`)."""
    import orbax.checkpoint as ocp

    directory = Path(directory)
    host = jax.device_get(ckpt)
    book = {"n_tokens": host.n_tokens, "pos_min": host.pos_min, "pos_max": host.pos_max}
    items: dict[str, Any] = {"bookkeeping": book}
    items.update({name: getattr(host, name) for name in _ITEMS})
    meta = {
        "format": FORMAT,
        "model": model_id,
        "extra": {} if extra is None else extra,
        "items": {name: _leaf_table(tree) for name, tree in items.items()},
        "treedefs": {name: str(jax.tree.structure(tree)) for name, tree in items.items()},
    }
    args = {"meta": ocp.args.JsonSave(meta)}
    for name, tree in items.items():
        if jax.tree.leaves(tree):
            args[name] = ocp.args.StandardSave(tree)
    mngr = _manager(directory)
    step = (mngr.latest_step() or 0) + 1
    mngr.save(step, args=ocp.args.Composite(**args), force=True)
    mngr.wait_until_finished()
    mngr.close()
    return directory / str(step)


def _open(directory: Path) -> tuple[Any, int, Path, dict[str, Any]]:
    """(manager, newest complete step, its directory, its meta) or CheckpointError."""
    import orbax.checkpoint as ocp

    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no checkpoint directory")
    mngr = _manager(directory, read_only=True)
    step = mngr.latest_step()
    if step is None:
        raise CheckpointError(f"{directory}: no complete checkpoint")
    where = directory / str(step)
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:
        raise CheckpointError(f"{where}: field meta cannot be read ({err})") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}: field meta.format is not {FORMAT!r}")
    return mngr, step, where, meta


def read_meta(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """(step directory, meta) of the newest complete checkpoint under `directory`: the model
    identity, `extra` and every leaf's shape / dtype / CRC-32, before any array is read."""
    mngr, _, where, meta = _open(Path(directory))
    mngr.close()
    return where, meta


def load(
    directory: str | Path, like: PromptCheckpoint, model_id: dict[str, Any]
) -> PromptCheckpoint:
    """The newest complete checkpoint under `directory`, read into the structure of `like`.

    Raises CheckpointError naming the directory and the field on any mismatch or corruption."""
    import orbax.checkpoint as ocp

    mngr, step, where, meta = _open(Path(directory))
    for key, want in model_id.items():
        have = meta.get("model", {}).get(key)
        if have != want:
            raise CheckpointError(f"{where}: field meta.model.{key} is {have!r}, expected {want!r}")
    like_host = jax.device_get(like)
    like_items: dict[str, Any] = {
        "bookkeeping": {
            "n_tokens": like_host.n_tokens,
            "pos_min": like_host.pos_min,
            "pos_max": like_host.pos_max,
        }
    }
    like_items.update({name: getattr(like_host, name) for name in _ITEMS})
    out: dict[str, Any] = {}
    for name, tree in like_items.items():
        table = meta["items"].get(name)
        if table is None:
            raise CheckpointError(f"{where}: field {name} is missing")
        want = _leaf_table(tree)
        if sorted(table) != sorted(want):
            raise CheckpointError(
                f"{where}: field {name} holds leaves {sorted(table)}, expected {sorted(want)}"
            )
        for leaf, info in want.items():
            saved = table[leaf]
            if saved["shape"] != info["shape"] or saved["dtype"] != info["dtype"]:
                raise CheckpointError(
                    f"{where}: field {name}{leaf} is {saved['dtype']}{saved['shape']}, expected "
                    f"{info['dtype']}{info['shape']}"
                )
        if not jax.tree.leaves(tree):
            out[name] = tree
            continue
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        try:
            got = mngr.restore(
                step, args=ocp.args.Composite(**{name: ocp.args.StandardRestore(abstract)})
            )[name]
        except Exception as err:
            raise CheckpointError(f"{where}: field {name} cannot be read ({err})") from err
        got = jax.tree.unflatten(jax.tree.structure(tree), jax.tree.leaves(got))
        for leaf, info in _leaf_table(got).items():
            if info["crc32"] != table[leaf]["crc32"]:
                raise CheckpointError(f"{where}: field {name}{leaf} is corrupted (checksum)")
        out[name] = got
    mngr.close()
    book = out.pop("bookkeeping")
    return PromptCheckpoint(
        n_tokens=jnp.asarray(book["n_tokens"]),
        pos_min=jnp.asarray(book["pos_min"]),
        pos_max=jnp.asarray(book["pos_max"]),
        **{name: jax.tree.map(jnp.asarray, out[name]) for name in _ITEMS},
    )


def model_id(config: Any) -> dict[str, Any]:
    """The identity a checkpoint records: architecture and its config as JSON."""
    return {
        "arch": getattr(config, "arch", "?"),
        "config": json.loads(json.dumps(config.to_dict())),
    }
