"""The one way specjax declares state: frozen, keyword-only dataclasses registered as pytrees.

Array fields are pytree leaves (traced under jit). Fields declared with `static_field()` are
pytree metadata: hashed into the jit cache key, so changing one recompiles. Sizes (capacity,
K_max, vocabulary) are static; everything a user changes per call (temperature, n_max, seeds)
must be an array field.

Configs (plain frozen dataclasses, not pytrees) read from JSON / YAML check their keys with
`check_known_keys`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar, dataclass_transform

import jax

T = TypeVar("T")

_STATIC = "specjax_static"


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is pytree metadata (static under jit), not a leaf."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_STATIC] = True
    return dataclasses.field(metadata=metadata, **kwargs)


@dataclass_transform(
    frozen_default=True, kw_only_default=True, field_specifiers=(dataclasses.field, static_field)
)
def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make `cls` a frozen keyword-only dataclass and register it as a pytree."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    data = [f.name for f in fields if not f.metadata.get(_STATIC, False)]
    meta = [f.name for f in fields if f.metadata.get(_STATIC, False)]
    jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
    return cls


def replace(obj: T, **changes: Any) -> T:
    """`dataclasses.replace`, re-exported so state updates read the same everywhere."""
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def check_known_keys(
    cls: Any, data: Mapping[str, Any], what: str, *, exclude: Iterable[str] = ()
) -> None:
    """A `from_dict`'s check: ValueError `{what}: a, b` naming, sorted, the keys of `data` that
    are not fields of the dataclass `cls` (fields in `exclude` count as unknown)."""
    known = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{what}: {', '.join(unknown)}")
