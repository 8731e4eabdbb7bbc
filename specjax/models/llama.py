"""Llama-family decoder (llama / qwen2 / qwen3 / qwen3moe / gemma3) as a pure function of (params, tokens, positions, cache).

gemma3's differences are static branches on `config.arch` (specjax.models.config's docstring
lists them); its cache may be a `SWACache` (specjax.memory.swa: the sliding-window layers'
cells in a ring), read and written per layer part by `forward_compute` / `commit_kv`.

Invariants:
* `positions[b, t] == -1` marks padding: its K/V are not written and its logits are garbage
  (finite, never NaN) and must be ignored by the caller.
* `forward_compute` reads the cache and never writes it: new tokens attend to the cached cells,
  to each other and to optional `extra` cells (a drafter's scratch), all by position (see
  specjax.memory.kv), in one softmax; `commit_kv` writes the new K/V afterwards. So a token
  attends to itself and to earlier tokens of the same call exactly as if written first.
* Attention reads the cache in chunks of CACHE_CHUNK cells up to its high-water mark (an
  online softmax in a loop), so cost follows the used context, not the capacity. With decode
  weights in the native form (`KernelWeight`, CPU), `cpu_kernels.attend_cache` computes the
  same online-softmax state for each part (the new tokens, `extra`, the cells below the
  high-water mark) and the states are merged (`_attend_native`). A prompt into an empty cache
  (`cache_empty`) runs there too; on XLA's path it is attended in blocks of query tokens that
  score only the cells up to the block's end (`_attend_prompt`: a prompt's positions
  increase along T).
* That chunk loop is XLA CPU's (`control.cpu_control_flow`). On accelerators a step over the
  cache attends every segment in one pass instead, chosen by `control.attention_kernel`: on a
  GPU one Pallas kernel per layer (`specjax.kernels.gpu`), straight from the QKV projection
  with RoPE inside (`_attend_qkv`; `_attend_kernel` where a norm sits between projection and
  RoPE, or for a block head's queries), reading each row's cells below its own high-water
  mark; elsewhere (TPU), and for what the kernel does not take (a head dim that is not a
  power of two, more than `KERNEL_MAX_ROWS` query rows per KV head: prompt chunks), one
  masked pass over every cell in XLA's ops. Both mask by position and assume no cell order.
* A qwen3moe layer (`config.is_moe_layer`) runs `models.moe.moe_ffn` in place of the dense
  FFN; everything else is qwen3's.
* RoPE angles are computed once per forward (`_materialised`), not per layer.
* Compute runs in the parameter dtype; norms, softmax and logits accumulate in float32. Cached
  K/V are stored in the cache's dtypes (F16 by default in `generate`) and read in the compute
  dtype.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax import control
from specjax.control import cpu_control_flow
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels import gpu as gpu_kernels
from specjax.memory.kv import KVCache, row_high_water, used_cells, write_layer, write_positions
from specjax.memory.swa import SWACache, write_ring
from specjax.models.config import ModelConfig, layer_rope_frequencies, rope_frequencies
from specjax.models.moe import init_moe_layer, moe_ffn
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array, Params

#: The caches `forward_compute` reads and `commit_kv` writes (its result is the kind it took).
CacheT = TypeVar("CacheT", KVCache, SWACache)

_MASKED = -1e30  # finite: a query that sees no key (padding) gets a uniform row, not NaN


class ForwardOutput(NamedTuple):
    logits: Array  # [B, T, V] float32
    cache: KVCache
    hidden: tuple[Array, ...]  # one [B, T, D] per requested layer (see `forward_fn`)


@pytree_dataclass
class ExtraKV:
    """Extra cells attended besides the cache (a drafter's scratch of its own drafted tokens)."""

    k: tuple[Array, ...]  # per layer [B, G, X, E]
    v: tuple[Array, ...]  # per layer [B, G, X, E]
    pos: Array  # [B, X] int32, -1 = empty


@pytree_dataclass
class InputMajor:
    """A linear weight held transposed, `[in, out]`, for products with a few activation rows.

    Parameters store linear weights `[out, in]` (as GGUF and PyTorch do). XLA's CPU dot reads
    a weight stored `[in, out]` about 1.7x faster when the activations are one row (decode).
    This is the decode form where the native kernel (`KernelWeight`) is not available.
    """

    t: Array  # [in, out]


@pytree_dataclass
class KernelWeight:
    """A linear weight for `specjax.kernels.cpu`: products with at most `cpu_kernels.MAX_ROWS`
    activation rows (decode, verify, prompts up to that length) run on the native kernel over
    `panels`, larger ones (longer prompts) on XLA's dot over `stored`.

    `panels` is the weight packed for the kernel (`cpu_kernels.pack_panels`: `[ceil(out /
    16), in, 16]`), in float16 when that holds the stored values exactly (GGUF F16 weights:
    half the bytes to stream, same products), else in float32: a copy, so weights that
    float16 cannot hold take twice their memory in this form (prefill reads `stored`).
    """

    panels: Array  # [P, in, 16] float16 or float32
    stored: Array  # [out, in], the parameters' own array


def linear(x: Array, w: Array | InputMajor | KernelWeight, **kwargs: Any) -> Array:
    """`x @ w.T` for a `[out, in]` weight, `x @ w.t` for an `InputMajor` one; a `KernelWeight`
    takes the native kernel for at most `cpu_kernels.MAX_ROWS` float32 rows (verify batches,
    prompts and prompt chunks up to that length; its result is float32), XLA's dot of
    `stored` beyond."""
    if isinstance(w, KernelWeight):
        rows = math.prod(x.shape[:-1])
        if x.dtype == jnp.float32 and 0 < rows <= cpu_kernels.MAX_ROWS:
            return cpu_kernels.linear_panels(x, w.panels, w.stored.shape[0])
        w = w.stored
    if isinstance(w, InputMajor):
        return jnp.einsum("...i,io->...o", x, w.t, **kwargs)
    return jnp.einsum("...i,oi->...o", x, w, **kwargs)


#: The per-layer linear weights the decode forms replace.
LINEAR_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


def _decode_form(params: Params, make: Any) -> Params:
    out = dict(params)
    out["layers"] = [
        {
            k: make(v) if k in LINEAR_WEIGHTS and isinstance(v, jax.Array) else v
            for k, v in layer.items()
        }
        for layer in params["layers"]
    ]
    # A tied model's head is its embedding: the decode form gives it its own `lm_head` entry
    # so the LM head runs on the same path as the other matrices (the embedding lookup keeps
    # reading `embed`).
    head = params["lm_head"] if "lm_head" in params else params.get("embed")
    if isinstance(head, jax.Array):
        out["lm_head"] = make(head)
    return out


def input_major(params: Params) -> Params:
    """`params` with every layer's linear weights and the LM head as `InputMajor`."""
    return _decode_form(params, lambda w: InputMajor(t=w.T))


def kernel_weight(w: Array) -> KernelWeight:
    """`w` as a `KernelWeight` (host-side: float16 panels when they hold `w` exactly)."""
    # on the host: eager device ops here cost a dispatch (and a compile or a compilation-cache
    # read) per distinct shape: 0.7 s of a CLI start (cProfile, on a loaded machine)
    host = np.asarray(w, np.float32)
    half = host.astype(np.float16)
    exact = w.dtype in (jnp.float32, jnp.float16) and np.array_equal(half.astype(np.float32), host)
    panels = np.ascontiguousarray(cpu_kernels.pack_panels(half if exact else host))
    return KernelWeight(panels=jax.device_put(panels, _panel_sharding(w, panels)), stored=w)


def _panel_sharding(w: Array, panels: np.ndarray) -> Any:
    """The sharding of `w [out, in]` carried over to its panels `[P, in, 16]` (the output
    axis's to P, where the mesh divides it; else replicated there)."""
    sharding = w.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    out_axis = spec[0]
    if out_axis is not None:
        names = out_axis if isinstance(out_axis, tuple) else (out_axis,)
        size = math.prod(sharding.mesh.shape[n] for n in names)
        if panels.shape[0] % size:
            out_axis = None
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(out_axis, spec[1], None)
    )


def kernel_weights(params: Params) -> Params:
    """`params` with every layer's linear weights and the LM head as `KernelWeight`
    (host-side: decides per matrix whether float16 holds it exactly)."""
    return _decode_form(params, kernel_weight)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + weight.shape)
    return (y * w).astype(x.dtype)


def rope_angles(positions_BT: Array, inv_freq: Array) -> tuple[Array, Array]:
    angle = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, E/2]
    return jnp.cos(angle), jnp.sin(angle)


def _materialised(fn: Any, *args: Array) -> Any:
    """`fn(*args)` computed once, as its own kernel. Left alone, XLA fuses the RoPE sines and
    cosines into every layer's q and k rotation and evaluates them there per head, 2L times
    (~200 us of a ~1.3 ms 5-token verify of the shipped target on CPU); an optimization
    barrier does not stop it (XLA CPU expands barriers before fusion), a conditional's
    boundary does. The predicate only has to be unknown to the compiler. CPU only: on a GPU
    a conditional can cost a device-to-host read of its predicate."""
    if not cpu_control_flow():
        return fn(*args)
    unknown = args[0].reshape(-1)[0] > jnp.iinfo(jnp.int32).min
    return jax.lax.cond(unknown, fn, fn, *args)


def apply_rope(x_BTNE: Array, cos_BTe: Array, sin_BTe: Array) -> Array:
    """Rotate-half RoPE on [B, T, heads, E]."""
    half = x_BTNE.shape[-1] // 2
    x32 = x_BTNE.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos_BTe[:, :, None, :], sin_BTe[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_BTNE.dtype)


def attention_mask(q_pos_BT: Array, k_pos_BS: Array, window: int) -> Array:
    """[B, T, S] visibility from positions only."""
    q = q_pos_BT[:, :, None]
    k = k_pos_BS[:, None, :]
    visible = (k >= 0) & (k <= q) & (q >= 0)
    if window > 0:
        visible = visible & (q - k < window)
    return visible


#: Cells per step of the loop over cached cells (llama.cpp pads its `n_kv` to 256 too).
CACHE_CHUNK = 256


def _scores(
    q_BGRTE: Array,
    k_BGSE: Array,
    q_pos_BT: Array,
    k_pos_BS: Array,
    window: int,
) -> Array:
    """Scaled, masked attention scores [B, G, R, T, S] in float32."""
    scale = 1.0 / math.sqrt(q_BGRTE.shape[-1])
    k = k_BGSE.astype(q_BGRTE.dtype)
    # Keys as the left operand ([S, E] @ [E, R*T]) and the small result transposed: XLA's
    # CPU dot emitter takes the cache chunk in its stored layout instead of transposing every
    # chunk of every layer each step (0.73 -> 0.45 ms per token at 768 cells, 8 layers).
    s = jnp.einsum("bgse,bgrte->bgsrt", k, q_BGRTE, preferred_element_type=jnp.float32)
    s = s.transpose(0, 1, 3, 4, 2)
    mask = attention_mask(q_pos_BT, k_pos_BS, window)[:, None, None]
    return jnp.where(mask, s * scale, _MASKED)


def _weighted_values(p_BGRTS: Array, v_BGSE: Array, dtype: jnp.dtype) -> Array:
    """p @ v in the compute dtype, accumulated in float32."""
    p, v = p_BGRTS.astype(dtype), v_BGSE.astype(dtype)
    return jnp.einsum("bgrts,bgse->bgrte", p, v, preferred_element_type=jnp.float32)


def _attend(
    q_BGRTE: Array,
    own: list[tuple[Array, Array, Array]],
    q_pos_BT: Array,
    window: int,
    cache: tuple[Array, Array, Array] | None = None,
    n_chunks: Array | None = None,
) -> Array:
    """Softmax attention over `own` segments (k, v [B, G, X, E], pos [B, X]) and, optionally,
    the first `n_chunks` chunks of CACHE_CHUNK cached cells (an online softmax: the running
    max, normaliser and weighted sum are rescaled chunk by chunk, as in flash attention).

    The loop reads only the chunks below the high-water mark, so cost follows the used
    context, and it slices in place: nothing of cache size is copied. (With the native CPU
    kernels, `_attend_native` runs every segment instead.) On accelerators the cached cells
    are read in one masked pass instead (`control.cpu_control_flow`): no loop with a traced
    trip count, which a GPU would drive from the host, and a loop body's kernels once (on a
    GPU `attend_segments` takes the Pallas kernel first, where it serves).
    """
    s_own = jnp.concatenate([_scores(q_BGRTE, k, q_pos_BT, pos, window) for k, _, pos in own], -1)
    m = jnp.max(s_own, axis=-1)
    p = jnp.exp(s_own - m[..., None])
    total = jnp.sum(p, axis=-1)
    acc, start = None, 0
    for _, v, pos in own:
        n = pos.shape[1]
        part = _weighted_values(p[..., start : start + n], v, q_BGRTE.dtype)
        acc = part if acc is None else acc + part
        start += n
    assert acc is not None
    if cache is not None:
        k_c, v_c, pos_c = cache

        def merge(k: Array, v: Array, pos: Array, carry: tuple[Array, Array, Array]) -> Any:
            """The running softmax state with the cells `k, v, pos` added."""
            m, total, acc = carry
            s = _scores(q_BGRTE, k, q_pos_BT, pos, window)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            rescale = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            total = total * rescale + jnp.sum(p, axis=-1)
            acc = acc * rescale[..., None] + _weighted_values(p, v, q_BGRTE.dtype)
            return m_new, total, acc

        if not cpu_control_flow():
            m, total, acc = merge(k_c, v_c, pos_c, (m, total, acc))
        else:
            assert n_chunks is not None
            S = pos_c.shape[1]
            C = min(CACHE_CHUNK, S)

            def chunk(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
                # The last chunk of a capacity that C does not divide starts early (slices
                # must fit); cells before i * C were read by the previous chunk: masked here.
                first = jnp.minimum(i * C, S - C)
                k = jax.lax.dynamic_slice_in_dim(k_c, first, C, axis=2)
                v = jax.lax.dynamic_slice_in_dim(v_c, first, C, axis=2)
                pos = jax.lax.dynamic_slice_in_dim(pos_c, first, C, axis=1)
                pos = jnp.where(first + jnp.arange(C)[None, :] >= i * C, pos, -1)
                return merge(k, v, pos, carry)  # type: ignore[no-any-return]

            m, total, acc = jax.lax.fori_loop(0, n_chunks, chunk, (m, total, acc))
    return (acc / total[..., None]).astype(q_BGRTE.dtype)


#: Query tokens per block of `_attend_prompt` (at least), and most blocks per layer.
PROMPT_BLOCK = 512
PROMPT_MAX_BLOCKS = 8


def _attend_prompt(
    q_BGRTE: Array, k_BGTE: Array, v_BGTE: Array, pos_BT: Array, window: int
) -> Array:
    """`_attend` of a prompt over itself (XLA's path), in blocks of query tokens that score
    only the cells up to the block's end: a prompt's positions increase along T (padding
    aside), so no later cell is visible to the block. A long prompt computes a little over
    half of the T x T scores and holds at most [B, G, R, U, T] of them at once (the whole
    [B, G, R, T, T] float32 scores of 8,192 tokens would be 1 GiB per layer and row)."""
    T = q_BGRTE.shape[3]
    U = max(PROMPT_BLOCK, -(-T // PROMPT_MAX_BLOCKS))
    outs = []
    for start in range(0, T, U):
        stop = min(start + U, T)
        own = [(k_BGTE[:, :, :stop], v_BGTE[:, :, :stop], pos_BT[:, :stop])]
        outs.append(_attend(q_BGRTE[:, :, :, start:stop], own, pos_BT[:, start:stop], window))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)


class CachedCells(NamedTuple):
    """A layer's cached cells as attention reads them: the segment k, v [B, G, S, E], pos
    [B, S], read up to the high-water mark `used` (one for all rows, or each row's [B] for the
    GPU kernel), which is `n_chunks` chunks of CACHE_CHUNK cells (XLA CPU's loop)."""

    segment: tuple[Array, Array, Array]
    n_chunks: Array
    used: Array


def _attention_over_cells(
    config: ModelConfig,
    layer_index: int,
    q_BTHE: Array,
    k_BTGE: Array,
    v_BTGE: Array,
    positions_BT: Array,
    cached: CachedCells | None,
    extra: ExtraKV | None,
    native: bool,
) -> Array:
    """Attention of the new tokens over the layer's cached cells (None: a prompt into an
    empty cache), whichever cache holds them (a `KVCache`, or a `SWACache`'s ring or full
    part), `extra` cells and each other; `native`: on `cpu_kernels.attend_cache` where it
    takes the dtypes."""
    B, T, H, E = q_BTHE.shape
    G = config.G
    q = q_BTHE.reshape(B, T, G, H // G, E).transpose(0, 2, 3, 1, 4)  # [B, G, R, T, E]
    window = config.layer_window(layer_index)
    own = [(k_BTGE.transpose(0, 2, 1, 3), v_BTGE.transpose(0, 2, 1, 3), positions_BT)]
    if extra is not None:
        own.append((extra.k[layer_index], extra.v[layer_index], extra.pos))
    if cached is None and extra is None and not _takes_native(native, q, own, None):
        out = _attend_prompt(q, *own[0], window)  # a prompt into an empty cache
    else:
        out = attend_segments(q, own, positions_BT, window, cached, native)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H * E)


def _takes_native(
    native: bool,
    q_BGRTE: Array,
    own: list[tuple[Array, Array, Array]],
    cached: tuple[Array, Array, Array] | None,
) -> bool:
    segments = own if cached is None else [*own, cached]
    return native and all(_native_attention(q_BGRTE, s) for s in segments)


def attend_segments(
    q_BGRTE: Array,
    own: list[tuple[Array, Array, Array]],
    q_pos_BT: Array,
    window: int,
    cached: CachedCells | None,
    native: bool,
) -> Array:
    """Attention over `own` segments and the cached cells: on the native kernel
    (`_attend_native`, every cell below `used`) when `native` (the weights are in the kernel
    form) and the kernel takes the segments' dtypes, else on XLA (`_attend`, `n_chunks`
    chunks). The target's layers and the block heads' (`models.dflash`) share it. Where
    `control.attention_kernel()` names one (GPUs), a step over cached cells runs on it
    instead (`_attend_kernel`; `used`: the cells to read, per row [B] or for all rows)."""
    segment, n_chunks, used = (None, None, None) if cached is None else cached
    if _takes_native(native, q_BGRTE, own, segment):
        return _attend_native(q_BGRTE, own, q_pos_BT, window, segment, used)
    kernel = control.attention_kernel()
    if kernel is not None and segment is not None and _takes_kernel(q_BGRTE, own, segment):
        assert used is not None
        interpret = kernel == control.PALLAS_INTERPRET
        return _attend_kernel(q_BGRTE, own, q_pos_BT, window, segment, used, interpret)
    return _attend(q_BGRTE, own, q_pos_BT, window, segment, n_chunks)


#: Most query rows per KV head (query heads sharing it x new tokens) `_attend_kernel` takes:
#: decode, verify and draft steps; a prompt chunk stays on XLA's path.
KERNEL_MAX_ROWS = 128


def _takes_kernel(
    q_BGRTE: Array, own: list[tuple[Array, Array, Array]], cached: tuple[Array, Array, Array]
) -> bool:
    R, T = q_BGRTE.shape[2:4]
    segments = [(k, v, pos, None) for k, v, pos in [*own, cached]]
    return R * T <= KERNEL_MAX_ROWS and gpu_kernels.supported(q_BGRTE, segments)


def _attend_kernel(
    q_BGRTE: Array,
    own: list[tuple[Array, Array, Array]],
    q_pos_BT: Array,
    window: int,
    cache: tuple[Array, Array, Array],
    used: Array,
    interpret: bool,
) -> Array:
    """`_attend` in one kernel launch (`specjax.kernels.gpu.attend`): the R query heads of a
    KV head at the T new tokens are its R * T query rows (row r * T + t), every segment
    (`own`, then the cells below `used`) is attended by position in one online softmax.
    No loop with a traced trip count in the program, nothing of cache size copied."""
    B, G, R, T, E = q_BGRTE.shape
    q = q_BGRTE.reshape(B, G, R * T, E)
    q_pos_BQ = jnp.tile(q_pos_BT, (1, R))
    segments: list[tuple[Array, Array, Array, Array | None]]
    segments = [(k, v, pos, None) for k, v, pos in own]
    segments.append((*cache, used))
    out = gpu_kernels.attend(q, q_pos_BQ, segments, window, interpret=interpret)
    return out.reshape(B, G, R, T, E)


def _attend_native(
    q_BGRTE: Array,
    own: list[tuple[Array, Array, Array]],
    q_pos_BT: Array,
    window: int,
    cache: tuple[Array, Array, Array] | None,
    used: Array | None,
) -> Array:
    """`_attend` with every segment on `cpu_kernels.attend_cache` (the new tokens, a drafter's
    scratch, the cached cells below the high-water mark `used`): each call's online-softmax
    state is merged into the running one. On XLA CPU the few own cells of a decode or verify
    step cost a dozen small kernels per layer (a 5-token verify's two products went to
    YNNPACK at ~14 us each: ~17% of the forward); a kernel call costs one.

    A padding token (position -1) sees nothing: its state stays (-inf, 0, 0) and its output
    is 0 (XLA's path gives it a finite average instead; neither is ever read)."""
    B, G, R, T, E = q_BGRTE.shape
    q = q_BGRTE.reshape(B, G, R * T, E)
    segments: list[tuple[Array, Array, Array, Array | int]]
    segments = [(k, v, pos, pos.shape[1]) for k, v, pos in own]
    if cache is not None:
        assert used is not None
        segments.append((*cache, used))
    m = total = acc = None
    for k, v, pos, n in segments:
        m_s, total_s, acc_s = cpu_kernels.attend_cache(q, k, v, pos, q_pos_BT, n, window)
        if m is None or total is None or acc is None:
            m, total, acc = m_s, total_s, acc_s
            continue
        m_new = jnp.maximum(m, m_s)
        # a row that has seen nothing yet on either side: -inf - -inf would be NaN
        m_ref = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        scale, scale_s = jnp.exp(m - m_ref), jnp.exp(m_s - m_ref)
        total = total * scale + total_s * scale_s
        acc = acc * scale[..., None] + acc_s * scale_s[..., None]
        m = m_new
    assert total is not None and acc is not None
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(B, G, R, T, E).astype(q_BGRTE.dtype)


def _native_attention(q_BGRTE: Array, segment: tuple[Array, Array, Array]) -> bool:
    """Whether the kernel takes these query rows over this segment's K/V: any number of rows.
    A whole prompt is one call: the kernel skips each chunk of cells a quad of rows cannot
    see, so a causal prompt costs its triangle (a 1,418-token prefill of the shipped target
    ran in ~210 ms, whole or in blocks of 128-1024 tokens, against 975 ms on XLA's path,
    which scores all T x T pairs); prompt chunks (`n_ubatch`) of 256 and 512 tokens ~195 ms
    against 340-430 ms on XLA's chunk loop."""
    if q_BGRTE.dtype != jnp.float32:
        return False
    return all(c.dtype in (jnp.float16, jnp.float32) for c in segment[:2])


def cached_dtype(cache: KVCache | SWACache, layer: int, kind: str) -> jnp.dtype:
    """The dtype of `layer`'s cached K (`kind` "k") or V ("v")."""
    part, j = cache.part(layer) if isinstance(cache, SWACache) else (cache, layer)
    return (part.k if kind == "k" else part.v)[j].dtype


def _cached_cells(
    config: ModelConfig,
    cache: KVCache | SWACache,
    cache_empty: bool,
    high_water_B: Array | None,
    per_row: bool = False,
) -> list[CachedCells | None]:
    """Per layer: its cached cells (None with `cache_empty`), read up to the high-water mark
    (`per_row`: each row's own [B], for the GPU attention kernel; else one for all rows). A `SWACache` (gemma3 without
    `swa_full`) reads its sliding-window layers from the ring, the others from the full part
    (`high_water_B` is the full part's)."""
    if cache_empty:
        return [None] * config.L

    def marks(part: KVCache, high_water: Array | None) -> tuple[Array, Array]:
        chunk = min(CACHE_CHUNK, part.capacity)
        if per_row:
            used = row_high_water(part.pos) if high_water is None else high_water
            top = jnp.max(used)
        else:
            used = top = used_cells(part.pos) if high_water is None else jnp.max(high_water)
        return (top + chunk - 1) // chunk, used

    if not isinstance(cache, SWACache):
        n_chunks, used = marks(cache, high_water_B)
        segments = [(cache.k[i], cache.v[i], cache.pos) for i in range(config.L)]
        return [CachedCells(segment, n_chunks, used) for segment in segments]
    full, ring = marks(cache.full, high_water_B), marks(cache.ring, None)
    out: list[CachedCells | None] = []
    for i in range(config.L):
        part, j = cache.part(i)
        n_chunks, used = ring if cache.swa[i] else full
        out.append(CachedCells((part.k[j], part.v[j], part.pos), n_chunks, used))
    return out


def _takes_fused_kernel(config: ModelConfig, T: int) -> bool:
    """Whether a layer's attention runs on `gpu_kernels.attend_qkv` (RoPE in the kernel):
    no norm between the projection and RoPE (`qk_norm`), a head dim the kernel takes, at
    most `KERNEL_MAX_ROWS` query rows per KV head."""
    E = config.E
    rows = config.H // config.G * T
    plain_q = not config.qk_norm and not config.attn_scale  # nothing between projection and RoPE
    return plain_q and E >= 16 and E & (E - 1) == 0 and rows <= KERNEL_MAX_ROWS


def _attend_qkv(
    config: ModelConfig,
    layer_index: int,
    qkv_BTF: Array,
    cos_BTe: Array,
    sin_BTe: Array,
    positions_BT: Array,
    cached: tuple[Array, Array, Array],
    extra: ExtraKV | None,
    used: Array,
    kernel: str,
) -> Array:
    """`_attention_over_cells` in one kernel launch from the layer's projection `qkv` (before
    RoPE and the split into heads): `gpu_kernels.attend_qkv`, which rotates the queries and
    the new keys itself and writes its output in the layout `wo` reads. No XLA kernel runs
    between the projection and the kernel, nor between the kernel and `wo`."""
    B, T, _ = qkv_BTF.shape
    H, G, E = config.H, config.G, config.E
    i = layer_index
    segments: list[tuple[Array, Array, Array, Array | None]] = []
    if extra is not None:
        segments.append((extra.k[i], extra.v[i], extra.pos, None))
    k_BGSE, v_BGSE, pos_BS = cached
    segments.append((k_BGSE, v_BGSE, pos_BS, used))
    out = gpu_kernels.attend_qkv(
        qkv_BTF.reshape(B, T, H + 2 * G, E), cos_BTe, sin_BTe, positions_BT, H,
        (k_BGSE.dtype, v_BGSE.dtype), segments, config.layer_window(i),
        interpret=kernel == control.PALLAS_INTERPRET,
    )  # fmt: skip
    return out.reshape(B, T, H * E)


class ForwardCompute(NamedTuple):
    logits: Array | None  # [B, T, V] float32 ([B, 1, V] with `logit_index`; None if not asked)
    k: tuple[Array, ...]  # per layer [B, T, G, E], rotated at the token positions
    v: tuple[Array, ...]  # per layer [B, T, G, E]
    hidden: tuple[Array, ...]


def forward_compute(
    config: ModelConfig,
    params: Params,
    tokens_BT: Array,
    positions_BT: Array,
    cache: KVCache | SWACache,
    hidden_layers: tuple[int, ...] = (),
    *,
    cache_empty: bool = False,
    extra: ExtraKV | None = None,
    logits: bool = True,
    logit_index: Array | None = None,
    high_water_B: Array | None = None,
) -> ForwardCompute:
    """The forward with the cache read-only: returns logits and the new tokens' K/V.

    New tokens attend to the cached cells (none with `cache_empty`, static: prefill of a
    fresh cache reads nothing; its positions must increase along T apart from padding, as a
    prompt's do), to `extra` cells and to each other (by position), exactly as if they had
    been written first; `commit_kv` writes them afterwards. Keeping the cache read-only lets
    callers branch (`lax.switch` over verify widths) without XLA copying the whole cache into
    and out of every branch. `logits=False` skips the LM head; `logit_index [B]` computes the
    logits of one token per row only (prefill needs just the last prompt token's).
    `high_water_B`: `cache.row_high_water(cache.pos)` when the caller has it (a caller that
    also commits passes the same to `commit_kv`: one pass over the cells instead of two).
    """
    E, H, G = config.E, config.H, config.G
    # one set of RoPE angles per distinct frequencies (gemma3: sliding-window and global)
    layer_freqs = [tuple(layer_rope_frequencies(config, i)) for i in range(config.L)]
    angles = {
        f: _materialised(rope_angles, positions_BT, jnp.asarray(f, jnp.float32))
        for f in dict.fromkeys(layer_freqs)
    }
    # Decode weights in the native kernel's form mean the native kernels are in use.
    native = bool(params["layers"]) and isinstance(params["layers"][0].get("wqkv"), KernelWeight)
    kernel = None if native or cache_empty else control.attention_kernel()
    cells = _cached_cells(config, cache, cache_empty, high_water_B, per_row=kernel is not None)
    gemma = config.arch == "gemma3"

    x = params["embed"][tokens_BT]
    if gemma:  # (HF rounds the scale to the weights' dtype: sqrt(3072) is 55.5 in bfloat16)
        x = x * jnp.asarray(math.sqrt(config.D), x.dtype)
    B, T, _ = x.shape
    fused = kernel is not None and _takes_fused_kernel(config, T)
    hidden: dict[int, Array] = {}
    new_k, new_v = [], []
    for i, layer in enumerate(params["layers"]):
        if i in hidden_layers:
            hidden[i] = x
        h = rms_norm(x, layer["attn_norm"], config.norm_eps)
        qkv = linear(h, layer["wqkv"])
        if config.qkv_bias:
            qkv = qkv + layer["bqkv"][None, None, :]
        q = qkv[..., : H * E].reshape(B, T, H, E)
        k = qkv[..., H * E : (H + G) * E].reshape(B, T, G, E)
        v = qkv[..., (H + G) * E :].reshape(B, T, G, E)
        if config.qk_norm:
            q = rms_norm(q, layer["q_norm"], config.norm_eps)
            k = rms_norm(k, layer["k_norm"], config.norm_eps)
        cos, sin = angles[layer_freqs[i]]
        q = apply_rope(q, cos, sin)
        if config.attn_scale:  # attention scales scores by 1/sqrt(E): the queries make up the rest
            q = (q.astype(jnp.float32) * (config.attn_scale * math.sqrt(E))).astype(q.dtype)
        cached = cells[i]
        # Rounded to the cache dtypes first, so a token reads its batch-mates exactly as it
        # would read them from the cache: a verify batch equals one-token-at-a-time decoding.
        k = apply_rope(k, cos, sin).astype(cached_dtype(cache, i, "k"))
        v = v.astype(cached_dtype(cache, i, "v"))
        new_k.append(k)
        new_v.append(v)
        if fused:  # the kernel reads q, k, v from `qkv` and rotates them itself
            assert cached is not None and kernel is not None
            segment, used = cached.segment, cached.used
            attn = _attend_qkv(config, i, qkv, cos, sin, positions_BT, segment, extra, used, kernel)
        else:
            attn = _attention_over_cells(config, i, q, k, v, positions_BT, cached, extra, native)
        out = linear(attn, layer["wo"])
        x = x + (rms_norm(out, layer["post_attn_norm"], config.norm_eps) if gemma else out)
        h = rms_norm(x, layer["ffn_norm"], config.norm_eps)
        if config.is_moe_layer(i):
            out = moe_ffn(config, layer, h)
        else:
            gate_up = linear(h, layer["w_gate_up"])
            gate, up = gate_up[..., : config.F], gate_up[..., config.F :]
            act = jax.nn.gelu(gate, approximate=True) if gemma else jax.nn.silu(gate)
            out = linear(act * up, layer["w_down"])
        x = x + (rms_norm(out, layer["post_ffn_norm"], config.norm_eps) if gemma else out)
    if config.L in hidden_layers:
        hidden[config.L] = x
    out_logits = None
    if logits:
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, None, None].astype(jnp.int32), axis=1)
        x = rms_norm(x, params["final_norm"], config.norm_eps)
        # a decode form (`kernel_weights`, `input_major`) has an `lm_head` even when tied
        tied = config.tie_embeddings and "lm_head" not in params
        head = params["embed"] if tied else params["lm_head"]
        out_logits = linear(x, head, preferred_element_type=jnp.float32)
        if config.final_logit_softcap:
            c = config.final_logit_softcap
            out_logits = c * jnp.tanh(out_logits / c)
    return ForwardCompute(
        out_logits, tuple(new_k), tuple(new_v), tuple(hidden[i] for i in hidden_layers)
    )


def commit_kv(
    cache: CacheT,
    positions_BT: Array,
    k: tuple[Array, ...],
    v: tuple[Array, ...],
    after: Array | None = None,
    high_water_B: Array | None = None,
) -> CacheT:
    """Write new tokens' K/V (per model layer [B, T, G, E]) into the lowest free cells
    (padding, position -1, is skipped); a `SWACache` takes its sliding-window layers' into
    its ring (`swa.write_ring`), the others' into its full part. `high_water_B`: as
    `forward_compute`'s (a `SWACache`'s full part's).

    `after`: an array computed from every read of `cache` (the logits, or the last hidden).
    XLA's CPU runtime runs independent ops concurrently, so an in-place write that does not
    depend on the reads makes it copy every layer's K and V first. The write positions are
    made to depend on one element of `after` (a NaN there drops the write; it cannot be
    constant-folded), which orders the write after the reads and keeps the update in place.
    """
    if after is not None:
        probe = after.reshape(-1)[0]
        positions_BT = jnp.where(probe != probe, -1, positions_BT)
    if isinstance(cache, SWACache):
        full_k = tuple(x for x, f in zip(k, cache.swa) if not f)
        full_v = tuple(x for x, f in zip(v, cache.swa) if not f)
        full = commit_kv(cache.full, positions_BT, full_k, full_v, high_water_B=high_water_B)
        ring = write_ring(
            cache.ring,
            positions_BT,
            tuple(x for x, f in zip(k, cache.swa) if f),
            tuple(x for x, f in zip(v, cache.swa) if f),
        )
        return replace(cache, full=full, ring=ring)
    cache, slot_BT = write_positions(cache, positions_BT, high_water_B)
    return KVCache(
        k=tuple(write_layer(c, slot_BT, x) for c, x in zip(cache.k, k)),
        v=tuple(write_layer(c, slot_BT, x) for c, x in zip(cache.v, v)),
        pos=cache.pos,
        overflow=cache.overflow,
        inv_freq=cache.inv_freq,
    )


def forward_fn(
    config: ModelConfig,
    params: Params,
    tokens_BT: Array,
    positions_BT: Array,
    cache: KVCache,
    hidden_layers: tuple[int, ...] = (),
) -> ForwardOutput:
    """One forward over new tokens; returns logits, the updated cache and requested hiddens.

    `hidden_layers` (static) lists layer indices i in [0, L]: entry i is the residual stream
    *entering* layer i (i == L: leaving the last layer, before the final norm). EAGLE-3 and
    MTP drafters read these.
    """
    out = forward_compute(config, params, tokens_BT, positions_BT, cache, hidden_layers)
    cache = commit_kv(cache, positions_BT, out.k, out.v, after=out.logits)
    assert out.logits is not None
    return ForwardOutput(out.logits, cache, out.hidden)


def new_cache(
    config: ModelConfig,
    batch: int,
    capacity: int,
    dtype: str | None = None,
    v_dtype: str | None = None,
) -> KVCache:
    """An empty cache (K in `dtype`, V in `v_dtype`; default: the model's dtype).

    The optimization barrier keeps XLA from constant-folding attention over an all-empty cache
    created inside a jitted function (prefill, training), which made compilation take minutes.
    """
    k_dtype = dtype or config.dtype
    cache = KVCache.init(
        batch=batch,
        capacity=capacity,
        n_layers=config.L,
        n_kv_heads=config.G,
        head_dim=config.E,
        inv_freq=tuple(rope_frequencies(config)),
        dtype=k_dtype,
        v_dtype=v_dtype or k_dtype,
    )
    return jax.lax.optimization_barrier(cache)


def init_params(config: ModelConfig, key: Array) -> Params:
    """Random initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L)."""
    dtype = jnp.dtype(config.dtype)
    E, D, F, H, G, V = config.E, config.D, config.F, config.H, config.G, config.V
    std = 0.02
    out_std = std / math.sqrt(2 * config.L)

    def normal(k: Array, shape: tuple[int, ...], s: float) -> Array:
        return (jax.random.normal(k, shape, jnp.float32) * s).astype(dtype)

    keys = iter(jax.random.split(key, 4 + 4 * config.L))
    layers = []
    for i in range(config.L):
        layer = {
            "attn_norm": jnp.ones((D,), dtype),
            "wqkv": normal(next(keys), ((H + 2 * G) * E, D), std),
            "wo": normal(next(keys), (D, H * E), out_std),
            "ffn_norm": jnp.ones((D,), dtype),
        }
        if config.is_moe_layer(i):
            layer.update(init_moe_layer(config, next(keys), std, out_std))
            next(keys)
        else:
            layer["w_gate_up"] = normal(next(keys), (2 * F, D), std)
            layer["w_down"] = normal(next(keys), (D, F), out_std)
        if config.qkv_bias:
            layer["bqkv"] = jnp.zeros(((H + 2 * G) * E,), dtype)
        if config.qk_norm:
            layer["q_norm"] = jnp.ones((E,), dtype)
            layer["k_norm"] = jnp.ones((E,), dtype)
        if config.arch == "gemma3":
            layer["post_attn_norm"] = jnp.ones((D,), dtype)
            layer["post_ffn_norm"] = jnp.ones((D,), dtype)
        layers.append(layer)
    params: Params = {
        "embed": normal(next(keys), (V, D), std),
        "layers": tuple(layers),
        "final_norm": jnp.ones((D,), dtype),
    }
    if not config.tie_embeddings:
        params["lm_head"] = normal(next(keys), (V, D), std)
    return params
