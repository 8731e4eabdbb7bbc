"""Llama-family decoder (llama / qwen2 / qwen3 / qwen3moe) as a pure function of (params, tokens, positions, cache).

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
* A qwen3moe layer (`config.is_moe_layer`) runs `models.moe.moe_ffn` in place of the dense
  FFN; everything else is qwen3's.
* RoPE angles are computed once per forward (`_materialised`), not per layer.
* Compute runs in the parameter dtype; norms, softmax and logits accumulate in float32. Cached
  K/V are stored in the cache's dtypes (F16 by default in `generate`) and read in the compute
  dtype.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.control import cpu_control_flow
from specjax.kernels import cpu as cpu_kernels
from specjax.memory.kv import KVCache, used_cells, write_layer, write_positions
from specjax.models.config import ModelConfig, rope_frequencies
from specjax.models.moe import init_moe_layer, moe_ffn
from specjax.pytree import pytree_dataclass
from specjax.types import Array, Params

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
    trip count, which a GPU would drive from the host, and a loop body's kernels once.
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


def _layer_attention(
    config: ModelConfig,
    layer_index: int,
    q_BTHE: Array,
    k_BTGE: Array,
    v_BTGE: Array,
    positions_BT: Array,
    cache: KVCache,
    n_chunks: Array | None,
    extra: ExtraKV | None,
    native: bool = False,
    used: Array | None = None,
) -> Array:
    """Attention of the new tokens over the used cached cells (the first `used`), `extra`
    cells and each other; `native`: on `cpu_kernels.attend_cache` where it takes the dtypes."""
    B, T, H, E = q_BTHE.shape
    G = config.G
    q = q_BTHE.reshape(B, T, G, H // G, E).transpose(0, 2, 3, 1, 4)  # [B, G, R, T, E]
    window = config.layer_window(layer_index)
    own = [(k_BTGE.transpose(0, 2, 1, 3), v_BTGE.transpose(0, 2, 1, 3), positions_BT)]
    if extra is not None:
        own.append((extra.k[layer_index], extra.v[layer_index], extra.pos))
    cached = None
    if n_chunks is not None:
        cached = (cache.k[layer_index], cache.v[layer_index], cache.pos)
    if cached is None and extra is None and not _takes_native(native, q, own, cached):
        out = _attend_prompt(q, *own[0], window)  # a prompt into an empty cache
    else:
        out = attend_segments(q, own, positions_BT, window, cached, n_chunks, used, native)
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
    cached: tuple[Array, Array, Array] | None,
    n_chunks: Array | None,
    used: Array | None,
    native: bool,
) -> Array:
    """Attention over `own` segments and the cached cells: on the native kernel
    (`_attend_native`, every cell below `used`) when `native` (the weights are in the kernel
    form) and the kernel takes the segments' dtypes, else on XLA (`_attend`, `n_chunks`
    chunks). The target's layers and the block heads' (`models.dflash`) share it."""
    if _takes_native(native, q_BGRTE, own, cached):
        return _attend_native(q_BGRTE, own, q_pos_BT, window, cached, used)
    return _attend(q_BGRTE, own, q_pos_BT, window, cached, n_chunks)


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
    cache: KVCache,
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
    inv_freq = jnp.asarray(rope_frequencies(config), jnp.float32)
    cos, sin = _materialised(rope_angles, positions_BT, inv_freq)
    n_chunks = used = None
    # Decode weights in the native kernel's form mean the native kernels are in use.
    native = bool(params["layers"]) and isinstance(params["layers"][0].get("wqkv"), KernelWeight)
    if not cache_empty:
        chunk = min(CACHE_CHUNK, cache.capacity)
        used = used_cells(cache.pos) if high_water_B is None else jnp.max(high_water_B)
        n_chunks = (used + chunk - 1) // chunk

    x = params["embed"][tokens_BT]
    B, T, _ = x.shape
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
        q = apply_rope(q, cos, sin)
        # Rounded to the cache dtypes first, so a token reads its batch-mates exactly as it
        # would read them from the cache: a verify batch equals one-token-at-a-time decoding.
        k = apply_rope(k, cos, sin).astype(cache.k[i].dtype)
        v = v.astype(cache.v[i].dtype)
        new_k.append(k)
        new_v.append(v)
        attn = _layer_attention(
            config, i, q, k, v, positions_BT, cache, n_chunks, extra, native, used
        )
        x = x + linear(attn, layer["wo"])
        h = rms_norm(x, layer["ffn_norm"], config.norm_eps)
        if config.is_moe_layer(i):
            x = x + moe_ffn(config, layer, h)
        else:
            gate_up = linear(h, layer["w_gate_up"])
            gate, up = gate_up[..., : config.F], gate_up[..., config.F :]
            x = x + linear(jax.nn.silu(gate) * up, layer["w_down"])
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
    return ForwardCompute(
        out_logits, tuple(new_k), tuple(new_v), tuple(hidden[i] for i in hidden_layers)
    )


def commit_kv(
    cache: KVCache,
    positions_BT: Array,
    k: tuple[Array, ...],
    v: tuple[Array, ...],
    after: Array | None = None,
    high_water_B: Array | None = None,
) -> KVCache:
    """Write new tokens' K/V into the lowest free cells (padding, position -1, is skipped).
    `high_water_B`: as `forward_compute`'s.

    `after`: an array computed from every read of `cache` (the logits, or the last hidden).
    XLA's CPU runtime runs independent ops concurrently, so an in-place write that does not
    depend on the reads makes it copy every layer's K and V first. The write positions are
    made to depend on one element of `after` (a NaN there drops the write; it cannot be
    constant-folded), which orders the write after the reads and keeps the update in place.
    """
    if after is not None:
        probe = after.reshape(-1)[0]
        positions_BT = jnp.where(probe != probe, -1, positions_BT)
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
        layers.append(layer)
    params: Params = {
        "embed": normal(next(keys), (V, D), std),
        "layers": tuple(layers),
        "final_norm": jnp.ones((D,), dtype),
    }
    if not config.tie_embeddings:
        params["lm_head"] = normal(next(keys), (V, D), std)
    return params
