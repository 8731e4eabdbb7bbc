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
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax

Array: TypeAlias = jax.Array
PRNGKey: TypeAlias = jax.Array
Params: TypeAlias = dict[str, Any]

#: Position value of an empty cache cell and of a padding token in a batch.
EMPTY_POS = -1
