"""Dimension key and array aliases used across specjax.

Shapes are written with these letters in docstrings, einsum strings and local-variable
suffixes (`logits_BTV`):

    B  batch rows (parallel sequences; llama.cpp's seq_id == row index)
    T  new tokens in one forward (prompt chunk, or 1 + K_max for a verify batch)
    S  cache slots (static capacity of a KV cache row)
    K  draft length (static K_max; validity masks mark the real length)
    V  vocabulary size
    D  model width
    H  query heads
    G  key/value heads (GQA groups)
    E  head dimension (Dh)
    F  feed-forward width
    L  layers
    W  window (recent-token window for penalties / n-gram history)

A config or state names its sizes with these keys through `alias` / `axis_size` (`V =
alias("vocab_size")`, `batch = alias("kv.batch")`, `capacity = axis_size("pos", 1)`):
read-only class attributes, not dataclass fields, so pytree flattening, equality and hashing
(jit static arguments) see only the fields.
"""

from __future__ import annotations

import operator
from typing import Any, Generic, NoReturn, Self, TypeAlias, TypeVar, overload

import jax

Array: TypeAlias = jax.Array
PRNGKey: TypeAlias = jax.Array
Params: TypeAlias = dict[str, Any]

#: Position value of an empty cache cell and of a padding token in a batch.
EMPTY_POS = -1


T = TypeVar("T")


class ReadOnly(Generic[T]):
    """A read-only attribute that reads another: the attribute at `path` (a field, or a
    dotted path into a part: "kv.batch"; None: the private one of its own name, `_name`), or,
    with `axis`, the length of that axis of the array there (`alias`, `axis_size`)."""

    def __init__(self, path: str | None = None, axis: int | None = None) -> None:
        self.path, self.axis, self.name = path, axis, path or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.path = self.path or "_" + name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Self | T:
        if obj is None:
            return self
        assert self.path is not None  # set by __set_name__ at the latest
        value: Any = operator.attrgetter(self.path)(obj)
        return value if self.axis is None else int(value.shape[self.axis])  # type: ignore[return-value]

    def __set__(self, obj: object, value: NoReturn) -> NoReturn:
        raise AttributeError(f"{self.name} is read-only: it reads {self.path}")


def alias(path: str) -> ReadOnly[int]:
    """The attribute at `path` (a field, or a dotted path into a part: "kv.batch") under
    another name."""
    return ReadOnly(path)


def axis_size(array: str, axis: int) -> ReadOnly[int]:
    """The length of axis `axis` of the array attribute `array` (static under jit)."""
    return ReadOnly(array, axis)
