"""Attention over KV segments in one Pallas kernel for GPUs (Triton-lowered), selected by
`specjax.control.attention_kernel`.

Two entry points, one kernel:
* `attend(q, q_pos, segments, window)`: `models.llama._attend` in one launch, for rotated
  queries `q [B, G, Q, E]` at `q_pos [B, Q]` (row j of KV head g: a query at `q_pos[b, j]`)
  over `segments`, each K/V `[B, G, N, E]` at positions `[B, N]`, optionally bounded per row.
* `attend_qkv(qkv, cos, sin, q_pos, ...)`: the same straight from a layer's fused projection
  `qkv [B, T, H + 2G, E]`: RoPE of the queries and of the new tokens' keys runs in the
  kernel, the new tokens are its first segment, and the output is `[B, T, H, E]`, which the
  output projection reads as it is. No XLA kernel runs between the QKV product and `wo`
  (`models.llama.forward_compute` takes this one where it can: 9 kernels per layer on an
  H100, against 15 with attention on XLA's ops; tests/test_accelerators.py).

Each query row attends to every segment (the new tokens' own K/V, a drafter's scratch, the
cached cells) by position, in one online softmax (flash attention's running max, normaliser
and weighted sum, updated block by block of `BLOCK_CELLS` cells). One program per (row, KV
head) holds that head's R * T query rows (the R query heads sharing it, at each of the T new
tokens); a segment with a per-row bound `n_B` (the cache: each row's high-water mark) is read
only below it, in a loop inside the kernel: the cost follows the used context, not the
capacity, and no loop runs from the host. (No split over cells: at B = 1 a layer runs G
programs. Splitting would need a merge of the splits' states after the kernel, another XLA
kernel per layer.)

Why not JAX's own `jax.experimental.pallas.ops.gpu.decode_attention` (`mqa` / `gqa`, whose
kernel this one is shaped after): it masks cells by index only (`start_idx <= i <
kv_seq_len`), and here visibility is by position (`kv.KVCache`: cell i holds position i of a
row only while no `seq_add`, `seq_div`, `seq_cp` or mid-range `seq_rm` has run, and a
verify batch's tokens each see a different prefix); it attends one segment, so the new
tokens' K/V (the cache is read-only during the forward) would need a second softmax and a
merge; its split-K final round runs as further XLA kernels around an optimisation barrier;
and its queries come rotated, so RoPE is another kernel. This one relies on no cell order.

Semantics, as `_attend`: scores in float32 (keys cast to the queries' dtype first), the
probabilities cast to the compute dtype before the product with the values, accumulated in
float32; a cell is visible iff its position is >= 0, <= the query's, and (window > 0) less
than `window` behind it; an invisible cell scores -1e30, so a query that sees nothing
(padding) gets a finite average, never NaN (its output is never read). E must be a power of
two >= 16 (`supported`: Triton's tiles). `interpret=True` runs the kernel in Pallas's
interpreter (any backend: the tests' check on CPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from specjax.types import Array

#: Cells per block of the scan (a [BLOCK_CELLS, E] tile of K and of V at a time).
BLOCK_CELLS = 64
#: Smallest tile side Triton's dot takes.
_MIN_TILE = 16
_MASKED = -1e30  # as models.llama's: finite, so a query that sees nothing gets no NaN


def _rows(ref: Any, row: Any, first: int, size: int, ok: Any) -> Any:
    """`ref[row[i], first : first + size]` for the rows where `ok` (else 0), as a [len(row),
    size] tile: integer-array indices on both axes (Pallas's interpreter takes no mix of
    arrays and slices)."""
    from jax.experimental.pallas import triton as plgpu

    col = first + jnp.arange(size)
    mask = jnp.broadcast_to(ok[:, None], (row.shape[0], size))
    return plgpu.load(ref.at[row[:, None], col[None, :]], mask=mask, other=0)


def _tile(n: int) -> int:
    return max(_MIN_TILE, 1 << max(0, n - 1).bit_length())


def supported(q_BGQE: Array, segments: Sequence[tuple[Array, Array, Array, Array | None]]) -> bool:
    """Whether the kernel takes these shapes: a head dim that is a power of two >= 16."""
    E = q_BGQE.shape[-1]
    return E >= _MIN_TILE and E & (E - 1) == 0 and all(s[0].shape[-1] == E for s in segments)


def attend(
    q_BGQE: Array,
    q_pos_BQ: Array,
    segments: Sequence[tuple[Array, Array, Array, Array | None]],
    window: int,
    *,
    interpret: bool = False,
) -> Array:
    """Softmax attention of the query rows over `segments`, each `(k [B, G, N, E], v [B, G,
    N, E], pos [B, N], n_B)`: `n_B [B]` int32 bounds the cells read per row (None: all N),
    by position visibility (module docstring). Returns `[B, G, Q, E]` in q's dtype."""
    from jax.experimental import pallas as pl

    B, G, Q, E = q_BGQE.shape
    rows = _tile(Q)
    specs: list[Any] = [
        pl.BlockSpec((None, None, rows, E), lambda b, g: (b, g, 0, 0)),
        pl.BlockSpec((None, rows), lambda b, g: (b, 0)),
    ]
    operands: list[Array] = [q_BGQE, q_pos_BQ.astype(jnp.int32)]

    def queries(refs: Any, g: Any) -> tuple[Any, Any, Any, Any]:
        from jax.experimental.pallas import triton as plgpu

        q_ref, q_pos_ref = refs
        ok = jnp.arange(rows) < Q
        q1 = plgpu.load(q_ref.at[pl.ds(0, rows), pl.ds(0, E // 2)], mask=ok[:, None], other=0)
        q2 = plgpu.load(q_ref.at[pl.ds(0, rows), pl.ds(E // 2, E // 2)], mask=ok[:, None], other=0)
        q_pos = plgpu.load(q_pos_ref.at[pl.ds(0, rows)], mask=ok, other=-1)
        return q1, q2, q_pos, ()

    def store(o_ref: Any, g: Any, out: Any) -> None:
        from jax.experimental.pallas import triton as plgpu

        ok = jnp.arange(rows) < Q
        plgpu.store(o_ref.at[pl.ds(0, rows), :], out.astype(o_ref.dtype), mask=ok[:, None])

    return _call(
        specs, operands, 2, queries, store, segments, window,
        out_spec=pl.BlockSpec((None, None, rows, E), lambda b, g: (b, g, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q_BGQE.shape, q_BGQE.dtype),
        grid=(B, G), E=E, dtype=q_BGQE.dtype, interpret=interpret,
    )  # fmt: skip


def attend_qkv(
    qkv_BTCE: Array,
    cos_BTe: Array,
    sin_BTe: Array,
    q_pos_BT: Array,
    n_heads: int,
    own_dtypes: tuple[Any, Any],
    segments: Sequence[tuple[Array, Array, Array, Array | None]],
    window: int,
    *,
    interpret: bool = False,
) -> Array:
    """`attend` straight from a layer's fused projection `qkv [B, T, H + 2G, E]` (heads:
    H query, G key, G value; compute dtype), RoPE included: the queries and the new tokens'
    keys are rotated in the kernel (rotate-half, `cos, sin [B, T, E/2]`, in float32, rounded
    to the compute dtype, keys then to `own_dtypes[0]` and values to `own_dtypes[1]`, as
    `models.llama.forward_compute` rounds them before the cache holds them), and the new
    tokens are attended as a first segment at positions `q_pos [B, T]`, before `segments`
    (stored, rotated: a drafter's scratch, the cache). Query row j of KV head g is head
    g * R + j % R at token j // R (R = H / G). Returns `[B, T, H, E]`: a layout the output
    projection reads as it is."""
    from jax.experimental import pallas as pl

    B, T, C, E = qkv_BTCE.shape
    H = n_heads
    G = (C - H) // 2
    R = H // G
    Q = R * T
    rows, own_rows = _tile(Q), _tile(T)
    half = E // 2
    specs: list[Any] = [
        pl.BlockSpec((None, T * C, E), lambda b, g: (b, 0, 0)),
        pl.BlockSpec((None, T, half), lambda b, g: (b, 0, 0)),
        pl.BlockSpec((None, T, half), lambda b, g: (b, 0, 0)),
        pl.BlockSpec((None, T), lambda b, g: (b, 0)),
    ]
    operands: list[Array] = [
        qkv_BTCE.reshape(B, T * C, E),
        cos_BTe.astype(jnp.float32),
        sin_BTe.astype(jnp.float32),
        q_pos_BT.astype(jnp.int32),
    ]
    dtype = qkv_BTCE.dtype

    def rotate(x1: Any, x2: Any, c: Any, s: Any) -> tuple[Any, Any]:
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return (x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)

    def queries(refs: Any, g: Any) -> tuple[Any, Any, Any, Any]:
        from jax.experimental.pallas import triton as plgpu

        qkv_ref, cos_ref, sin_ref, q_pos_ref = refs
        # rows past Q repeat the first ones (so their stores write the same values)
        j = jnp.arange(rows) % Q
        ok = j >= 0
        t = j // R
        row = t * C + g * R + j % R
        x1, x2 = _rows(qkv_ref, row, 0, half, ok), _rows(qkv_ref, row, half, half, ok)
        c, s = _rows(cos_ref, t, 0, half, ok), _rows(sin_ref, t, 0, half, ok)
        q1, q2 = rotate(x1, x2, c, s)
        q_pos = plgpu.load(q_pos_ref.at[t], mask=ok, other=-1)
        # the new tokens' own keys and values (head g at each token), rounded as cached
        tk = jnp.arange(own_rows)
        own_ok = tk < T
        tk = jnp.where(own_ok, tk, 0)
        k_row, v_row = tk * C + H + g, tk * C + H + G + g
        k1, k2 = _rows(qkv_ref, k_row, 0, half, own_ok), _rows(qkv_ref, k_row, half, half, own_ok)
        ck, sk = _rows(cos_ref, tk, 0, half, own_ok), _rows(sin_ref, tk, 0, half, own_ok)
        k1, k2 = rotate(k1, k2, ck, sk)
        k1, k2 = k1.astype(own_dtypes[0]), k2.astype(own_dtypes[0])
        v = _rows(qkv_ref, v_row, 0, E, own_ok).astype(own_dtypes[1])
        k_pos = plgpu.load(q_pos_ref.at[tk], mask=own_ok, other=-1)
        return q1, q2, q_pos, ((k1, k2, v, k_pos, own_ok),)

    def store(o_ref: Any, g: Any, out: Any) -> None:
        from jax.experimental.pallas import triton as plgpu

        j = jnp.arange(rows) % Q
        row = (j // R) * H + g * R + j % R
        col = jnp.arange(E)
        plgpu.store(o_ref.at[row[:, None], col[None, :]], out.astype(o_ref.dtype))

    out = _call(
        specs, operands, 4, queries, store, segments, window,
        out_spec=pl.BlockSpec((None, T * H, E), lambda b, g: (b, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T * H, E), dtype),
        grid=(B, G), E=E, dtype=dtype, interpret=interpret,
    )  # fmt: skip
    return out.reshape(B, T, H, E)


def _call(
    specs: list[Any],
    operands: list[Array],
    n_query_refs: int,
    queries: Any,
    store: Any,
    segments: Sequence[tuple[Array, Array, Array, Array | None]],
    window: int,
    *,
    out_spec: Any,
    out_shape: Any,
    grid: tuple[int, int],
    E: int,
    dtype: Any,
    interpret: bool,
) -> Array:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B = grid[0]
    specs, operands = list(specs), list(operands)
    meta: list[tuple[int, bool]] = []  # per stored segment: cells N, whether bounded by n_B
    for k, v, pos, n_B in segments:
        N = k.shape[2]
        specs += [
            pl.BlockSpec((None, None, N, E), lambda b, g: (b, g, 0, 0)),
            pl.BlockSpec((None, None, N, E), lambda b, g: (b, g, 0, 0)),
            pl.BlockSpec((None, N), lambda b, g: (b, 0)),
        ]
        operands += [k, v, pos.astype(jnp.int32)]
        if n_B is not None:
            specs.append(pl.BlockSpec((None,), lambda b, g: (b,)))
            operands.append(jnp.broadcast_to(n_B, (B,)).astype(jnp.int32))
        meta.append((N, n_B is not None))
    kernel = functools.partial(
        _kernel, meta=tuple(meta), window=window, n_query_refs=n_query_refs,
        queries=queries, store=store, scale=1.0 / math.sqrt(E), dtype=dtype,
    )  # fmt: skip
    return pl.pallas_call(  # type: ignore[no-any-return]
        kernel,
        grid=grid,
        in_specs=specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="specjax_attend",
    )(*operands)


def _kernel(
    *refs: Any,
    meta: tuple[tuple[int, bool], ...],
    window: int,
    n_query_refs: int,
    queries: Any,
    store: Any,
    scale: float,
    dtype: Any,
) -> None:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    g = pl.program_id(1)
    query_refs, seg_refs, o_ref = refs[:n_query_refs], refs[n_query_refs:-1], refs[-1]
    q1, q2, q_pos, own = queries(query_refs, g)
    rows, half = q1.shape
    E = 2 * half

    def update(k1: Any, k2: Any, v: Any, k_pos: Any, inside: Any, carry: Any) -> Any:
        """The running (max, normaliser, weighted sum) with one block of cells added."""
        m, total, acc = carry
        s = pl.dot(q1, k1.astype(dtype), trans_b=True) + pl.dot(q2, k2.astype(dtype), trans_b=True)
        s = s * scale  # [rows, cells] float32
        visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
        visible = visible & (q_pos[:, None] >= 0) & inside[None, :]
        if window > 0:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        rescale = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        total = total * rescale + jnp.sum(p, axis=1)
        acc = acc * rescale[:, None] + pl.dot(p.astype(dtype), v.astype(dtype))
        return m_new, total, acc

    def stored(k_ref: Any, v_ref: Any, pos_ref: Any, first: Any, size: int, n: Any, carry: Any):
        idx = first + jnp.arange(size)
        inside = idx < n
        cells = pl.ds(first, size)
        k1 = plgpu.load(k_ref.at[cells, pl.ds(0, half)], mask=inside[:, None], other=0)
        k2 = plgpu.load(k_ref.at[cells, pl.ds(half, half)], mask=inside[:, None], other=0)
        v = plgpu.load(v_ref.at[cells, :], mask=inside[:, None], other=0)
        k_pos = plgpu.load(pos_ref.at[cells], mask=inside, other=-1)
        return update(k1, k2, v, k_pos, inside, carry)

    carry = (
        jnp.full((rows,), _MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, E), jnp.float32),
    )
    for k1, k2, v, k_pos, inside in own:
        carry = update(k1, k2, v, k_pos, inside, carry)
    at = 0
    for N, bounded in meta:
        k_ref, v_ref, pos_ref = seg_refs[at : at + 3]
        at += 3
        if bounded:
            n = jnp.minimum(seg_refs[at][()], N)
            at += 1

            def body(i: Any, c: Any, k_ref: Any = k_ref, v_ref: Any = v_ref, pos_ref: Any = pos_ref,
                     n: Any = n) -> Any:  # fmt: skip
                return stored(k_ref, v_ref, pos_ref, i * BLOCK_CELLS, BLOCK_CELLS, n, c)

            carry = jax.lax.fori_loop(0, pl.cdiv(n, BLOCK_CELLS), body, carry)
        else:
            size = min(BLOCK_CELLS, _tile(N))
            for first in range(0, N, size):
                carry = stored(k_ref, v_ref, pos_ref, first, size, N, carry)
    _, total, acc = carry
    store(o_ref, g, acc / total[:, None])
