"""Where a batch job's arrays live on a device mesh with axes `data` and `model`.

    slots (the batch rows B of every per-row array: KV cache, history, outputs, per-row
    drafter leaves, counters)                                      -> `data`
    KV cache heads G of the target and of a draft model (when
    `model` divides G)                                             -> `model`
    fused q/k/v projection rows and fused gate/up rows of the
    target's and a draft model's layers: attention heads and the
    MLP (when divisible)                                           -> `model`
    input columns of those layers' output projections wo, w_down
    (the heads and hidden units above; when divisible)             -> `model`
    everything else (embeddings, output head, norms, shared
    drafter leaves such as ngram-mod's pool, a drafter head's
    other weights, statistics)                                     -> replicated

The jitted entry points of `specjax.jobs.continuous` are compiled with these shardings as their
input and output shardings, so layouts never drift between calls; XLA (GSPMD) inserts the
collectives. The mesh is built from this process's devices: under `jax.distributed` every
process runs its own share of the requests on its own devices (no cross-host traffic; see
docs/batch.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.decode import engine as eng
from specjax.drafters.base import per_row_leaves
from specjax.jobs import continuous as cont


def make_mesh(axes: dict[str, int], n_parallel: int, config: Any) -> Mesh:
    """A ("data", "model") mesh over this process's devices; ValueError naming the numbers
    when it does not fit."""
    data, model = int(axes.get("data", 1)), int(axes.get("model", 1))
    devices = jax.local_devices()
    if data * model != len(devices):
        raise ValueError(
            f"--mesh data={data},model={model} needs {data * model} devices; this process "
            f"has {len(devices)}"
        )
    if n_parallel % data:
        raise ValueError(f"-np {n_parallel} slots do not split over data={data} devices")
    return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))


def _model_dim(mesh: Mesh, size: int) -> str | None:
    m = mesh.shape["model"]
    return "model" if m > 1 and size % m == 0 else None


def param_shardings(mesh: Mesh, params: Any) -> Any:
    """A Llama-family pytree's parameters (the target's, a draft model's): fused qkv and
    gate/up rows, and the input columns of the output projections (`wo`, `w_down`), over
    `model`; the rest replicated (a pytree without such leaves is all replicated).

    The output projections read the attention heads and the MLP's hidden units the rows
    above split over `model`; XLA computes them per slice of their columns and sums over
    `model` whatever their layout, so a replicated `wo` / `w_down` was only stored 8 times
    over and sliced into temporaries every step (a Llama-3.1-8B on a v5e-8: 3 GiB of
    arguments and 0.6 GiB of temporaries per chip, `benchmarks/accelerators.py --scale`)."""

    def place(path: tuple[Any, ...], x: Any) -> NamedSharding:
        name = str(getattr(path[-1], "key", ""))
        if name in ("wqkv", "w_gate_up") and x.ndim == 2:
            return NamedSharding(mesh, P(_model_dim(mesh, x.shape[0]), None))
        if name in ("wo", "w_down") and x.ndim == 2:
            return NamedSharding(mesh, P(None, _model_dim(mesh, x.shape[1])))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(place, params)


def drafter_param_shardings(mesh: Mesh, drafter_params: tuple[Any, ...]) -> Any:
    """Each drafter's parameters by `param_shardings`: a draft model's (draft-simple) split
    as the target's, a head's leaves of other names replicated."""
    return tuple(param_shardings(mesh, p) for p in drafter_params)


def state_shardings(
    mesh: Mesh, engine: eng.Engine, state: eng.GenState, slot_stats: cont.SlotStats
) -> tuple[Any, Any]:
    """Shardings of the slots' state (see the module docstring)."""
    rep = NamedSharding(mesh, P())

    def rows(x: Any) -> NamedSharding:
        return NamedSharding(mesh, P("data", *([None] * (x.ndim - 1))))

    B = state.length.shape[0]
    cache = engine.memory.kv(state.cache)  # (a gemma3 ring's K/V sit a level deeper)
    heads = _model_dim(mesh, cache.k[0].shape[1]) if cache.k else None
    kv = NamedSharding(mesh, P("data", heads, None, None))

    def place(path: tuple[Any, ...], x: Any) -> NamedSharding:
        names = [str(getattr(k, "name", "")) for k in path]
        if names[0] in ("stats", "n_rounds"):
            return rep
        if names[0] == "cache" and {"k", "v"} & set(names[1:3]):
            return kv
        if names[0] in ("governor", "lookup_seen") and not (x.ndim and x.shape[0] == B):
            return rep
        return rows(x)

    def drafter_leaf(path: tuple[Any, ...], x: Any, per_row: bool) -> NamedSharding:
        if not per_row:
            return rep
        names = {str(getattr(k, "name", "")) for k in path}
        if x.ndim == 4 and names & {"k", "v"}:  # a draft model's KV cache [B, G, S, E]
            return NamedSharding(mesh, P("data", _model_dim(mesh, x.shape[1]), None, None))
        return rows(x)

    without = dataclasses.replace(state, drafter_states=())
    shard = jax.tree_util.tree_map_with_path(place, without)
    dstates = []
    for d, s in zip(engine.drafters, state.drafter_states):
        flags = per_row_leaves(d, engine.capacity)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(s)
        dstates.append(
            jax.tree.unflatten(
                treedef, [drafter_leaf(p, x, f) for (p, x), f in zip(leaves, flags, strict=True)]
            )
        )
    shard = dataclasses.replace(shard, drafter_states=tuple(dstates))
    return shard, jax.tree.map(rows, slot_stats)


def replicated(mesh: Mesh, tree: Any) -> Any:
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)
