"""Weight layouts: the form of the parameters each decode step reads fastest.

`decode_params` turns a Llama-family target's (or draft model's) linear weights into the
native CPU kernels' `KernelWeight`s, or `InputMajor` copies where the kernel is missing;
`drafter_decode_params` does the same for a drafter by its `Drafter.params_form`. Each form is
made once per set of weights and kept (`_DECODE_PARAMS`). Elsewhere than on CPU the
parameters are used as they are. Both are public (re-exported by `specjax.api`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from specjax.decode.executables import _lru_put
from specjax.drafters.base import Drafter
from specjax.drafters.registry import drafter_class
from specjax.kernels import cpu as cpu_kernels
from specjax.models.llama import LINEAR_WEIGHTS, input_major, kernel_weight, kernel_weights
from specjax.types import Params

#: Decode forms of recently used parameter pytrees, by form, structure and the identities of
#: the leaves (not of the dict holding them: a head drafter's parameters are a new dict around
#: the same arrays each call, `registry.build_drafters`); each entry keeps the original's
#: leaves, so their ids stay theirs while it is cached (arrays are immutable: the same leaves
#: mean the copy is still right).
_DECODE_PARAMS: dict[tuple[Any, ...], tuple[list[Any], Params]] = {}
_DECODE_PARAMS_MAX = 4


def decode_params(params: Params) -> Params:
    """The parameters the engine decodes with. On CPU, a Llama-family pytree's linear weights
    become `llama.KernelWeight`s (few-row products on `specjax.kernels.cpu`, reading F16 weights
    as F16) when the native kernel is available, else `llama.InputMajor` copies (XLA's CPU
    matrix-vector products read `[in, out]` ~1.7x faster); made once per set of weights and
    kept for the next calls. Elsewhere, and for other pytrees (a qwen35 model's, say),
    `params` itself."""
    layers = params.get("layers", ()) if isinstance(params, dict) else ()
    # the fused Q/K/V matrix the decode forms convert marks a Llama-family pytree
    if jax.default_backend() != "cpu" or not (layers and LINEAR_WEIGHTS[0] in layers[0]):
        return params
    if cpu_kernels.available():
        return _cached_form(params, "kernel", kernel_weights)
    return _cached_form(params, "input_major", jax.jit(input_major))


def _cached_form(params: Any, form: str, make: Any) -> Any:
    """`make(params)`, made once per set of weights (`_DECODE_PARAMS`)."""
    leaves, treedef = jax.tree.flatten(params)
    key = (form, treedef, *map(id, leaves))
    hit = _DECODE_PARAMS.pop(key, None)
    if hit is None or any(a is not b for a, b in zip(hit[0], leaves, strict=True)):
        hit = (leaves, make(params))
    _lru_put(_DECODE_PARAMS, key, hit, lambda d: len(d) > _DECODE_PARAMS_MAX)
    return hit[1]


def drafter_decode_params(drafter: Drafter | type[Drafter] | str, params: Any) -> Any:
    """A drafter's parameters in the form its draft steps run fastest (`Drafter.params_form`):
    a draft model's (draft-simple) as `decode_params`; on CPU with the native kernel, a
    head's (draft-eagle3, and the block heads draft-dflash / draft-dspark) as its
    `head_kernel_params` and the target's LM head it shares as a `KernelWeight` (EAGLE-3's
    products and attention then run on the kernels instead of XLA's dots and YNNPACK
    fusions, ~13 us each per step; a block head's products, ~1 ms of a round on XLA's path).
    Made once per set of weights; other drafters' parameters unchanged. `drafter`: the
    drafter (or its class, or its type name)."""
    kind = drafter_class(drafter) if isinstance(drafter, str) else drafter
    if kind.params_form == "model":
        return decode_params(params)
    if kind.params_form != "head" or jax.default_backend() != "cpu":
        return params
    if not cpu_kernels.available():
        return params
    head_form = functools.partial(_head_kernel_form, kind.head_kernel_params)
    return _cached_form(params, kind.name, head_form)


def _head_kernel_form(head_form: Callable[[Params], Params], params: Any) -> Any:
    """A head drafter's parameters with its head in `head_form` and the target's LM head it
    shares as a `KernelWeight`."""
    shared = dict(params["shared"])
    if isinstance(shared.get("lm_head"), jax.Array):
        shared["lm_head"] = kernel_weight(shared["lm_head"])
    return {**params, "head": head_form(params["head"]), "shared": shared}
