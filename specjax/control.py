"""Control flow shared by the engine and the drafters.

Invariant: `run_once` never copies what its body updates in place (a while loop's carry is
aliased; `lax.cond` branches may copy their operands, the KV caches among them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from specjax.types import Array


def run_once(pred: Array, body: Callable[[Any], Any], carry: Any) -> Any:
    """`body(carry)` if `pred`, else `carry`: a while-loop run 0 or 1 times. Not `lax.cond` or
    `lax.switch`: their branches would copy the KV cache, and every branch must return the
    same shapes, so a narrow branch pads its logits and K/V to the widest one's."""
    return jax.lax.while_loop(
        lambda c: c[0], lambda c: (jnp.zeros((), bool), body(c[1])), (pred, carry)
    )[1]
