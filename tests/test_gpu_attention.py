"""The GPU attention kernel (`specjax.kernels.gpu`, Pallas) run in Pallas's interpreter on
CPU: against a float64 NumPy transcription of attention by position, and, inside the model's
forward (`control.attention_kernel` answering the interpreter), against XLA's path.

What the deviceless H100 compile of the same kernel gives (kernels per layer) is asserted in
tests/test_accelerators.py."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import control
from specjax.kernels import gpu
from specjax.models import llama
from specjax.models.llama import ExtraKV, forward_compute, forward_fn, new_cache
from specjax.testing import tiny_config

B, G, R, T, E, S = 2, 2, 2, 3, 64, 100


def _reference(q_BQGRE, k_BGNE, v_BGNE, pos_BN, q_pos_BQ, window):
    """float64 softmax attention by position: cell n is visible to a query at p iff
    0 <= pos[n] <= p (and p - pos[n] < window), and the query itself is not padding."""
    s = np.einsum("bqgre,bgne->bqgrn", q_BQGRE, k_BGNE) / np.sqrt(E)
    qp, kp = q_pos_BQ[:, :, None, None, None], pos_BN[:, None, None, None, :]
    visible = (kp >= 0) & (kp <= qp) & (qp >= 0)
    if window:
        visible &= qp - kp < window
    s = np.where(visible, s, -np.inf)
    with np.errstate(invalid="ignore"):  # a padding query sees nothing: NaN, never compared
        p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bqgrn,bgne->bqgre", p / p.sum(-1, keepdims=True), v_BGNE)


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q_pos = np.array([[40, 41, 42], [7, 8, -1]], np.int32)  # row 1: a padding token
    k_cache = rng.standard_normal((B, G, S, E)).astype(np.float16)
    v_cache = rng.standard_normal((B, G, S, E)).astype(np.float16)
    pos = np.full((B, S), -1, np.int32)
    pos[0, :40] = np.arange(40)
    pos[1, :7] = np.arange(7)[::-1]  # cell order carries no meaning
    pos[1, 3] = -1  # a hole below the high-water mark
    used = np.array([40, 7], np.int32)
    return rng, q_pos, k_cache, v_cache, pos, used


@pytest.mark.parametrize("window", [0, 5])
def test_attend_by_position_matches_float64(window: int) -> None:
    """Rotated queries over the new tokens' K/V and the cache (cells out of order, a hole,
    rows bounded by their own high-water marks), by position, vs float64."""
    rng, q_pos, kc, vc, pc, used = _inputs()
    q = rng.standard_normal((B, G, R * T, E)).astype(np.float32)  # row r * T + t
    kn = rng.standard_normal((B, G, T, E)).astype(np.float16)
    vn = rng.standard_normal((B, G, T, E)).astype(np.float16)
    segments = [(kn, vn, q_pos, None), (kc, vc, pc, jnp.asarray(used))]
    out = np.asarray(gpu.attend(q, np.tile(q_pos, (1, R)), segments, window, interpret=True))
    assert np.isfinite(out).all()
    q_BTGRE = q.reshape(B, G, R, T, E).transpose(0, 3, 1, 2, 4).astype(np.float64)
    K = np.concatenate([kn, kc], 2).astype(np.float64)
    V = np.concatenate([vn, vc], 2).astype(np.float64)
    ref = _reference(q_BTGRE, K, V, np.concatenate([q_pos, pc], 1), q_pos, window)
    got = out.reshape(B, G, R, T, E).transpose(0, 3, 1, 2, 4)
    valid = q_pos >= 0
    np.testing.assert_allclose(got[valid], ref[valid], atol=2e-6)


@pytest.mark.parametrize("window", [0, 5])
def test_attend_qkv_rotates_and_matches_float64(window: int) -> None:
    """From a layer's projection `qkv`: RoPE of the queries and the new keys in the kernel,
    the new K/V rounded to the cache dtype, output in [B, T, H, E], vs float64."""
    rng, q_pos, kc, vc, pc, used = _inputs(1)
    H = G * R
    qkv = rng.standard_normal((B, T, H + 2 * G, E)).astype(np.float32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, E, 2) / E))
    angle = q_pos[..., None].astype(np.float64) * inv_freq
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)

    def rope(x):  # [B, T, N, E] float64
        x1, x2 = x[..., : E // 2], x[..., E // 2 :]
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    segments = [(kc, vc, pc, jnp.asarray(used))]
    dtypes = (jnp.float16, jnp.float16)
    out = gpu.attend_qkv(qkv, cos, sin, q_pos, H, dtypes, segments, window, interpret=True)
    out = np.asarray(out)
    assert out.shape == (B, T, H, E) and np.isfinite(out).all()
    q = rope(qkv[:, :, :H].astype(np.float64)).reshape(B, T, G, R, E)
    k_new = rope(qkv[:, :, H : H + G].astype(np.float64)).astype(np.float16)
    v_new = qkv[:, :, H + G :].astype(np.float16)
    K = np.concatenate([k_new.transpose(0, 2, 1, 3), kc], 2).astype(np.float64)
    V = np.concatenate([v_new.transpose(0, 2, 1, 3), vc], 2).astype(np.float64)
    ref = _reference(q, K, V, np.concatenate([q_pos, pc], 1), q_pos, window)
    valid = q_pos >= 0
    np.testing.assert_allclose(out[valid], ref.reshape(B, T, H, E)[valid], atol=2e-6)


def test_supported_shapes() -> None:
    seg = [(np.zeros((1, 1, 4, 64)), None, None, None)]
    assert gpu.supported(np.zeros((1, 1, 2, 64)), seg)  # type: ignore[arg-type]
    seg8 = [(np.zeros((1, 1, 4, 8)), None, None, None)]
    assert not gpu.supported(np.zeros((1, 1, 2, 8)), seg8)  # type: ignore[arg-type]
    seg48 = [(np.zeros((1, 1, 4, 48)), None, None, None)]
    assert not gpu.supported(np.zeros((1, 1, 2, 48)), seg48)  # type: ignore[arg-type]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_forward_on_the_kernel_matches_xla(monkeypatch: pytest.MonkeyPatch, qk_norm: bool) -> None:
    """The forward with `control.attention_kernel` naming the kernel (interpreted): a prompt,
    then a decode step and a 3-token verify with a drafter's scratch segment (`extra`), give
    the logits of XLA's path (the CPU one), rows at different lengths; layer 0 attends a
    sliding window of 3, layer 1 everything. Without a norm between the projection and RoPE
    the layers run `attend_qkv` (RoPE in the kernel), with one (`qk_norm`) `attend`."""
    config = tiny_config(
        n_heads=4, n_kv_heads=2, dim=64, sliding_window=3, swa_layers=(True, False),
        qk_norm=qk_norm,
    )  # fmt: skip
    params = llama.init_params(config, jax.random.PRNGKey(0))
    cache = new_cache(config, 2, 32, dtype="float16")
    prompt = jnp.asarray([[5, 9, 2, 7, 1, 3], [4, 4, 8, 6, 0, 0]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1]], jnp.int32)
    cache = forward_fn(config, params, prompt, pos, cache).cache
    H, G, E = config.H, config.G, config.E
    rng = np.random.default_rng(0)
    extra = ExtraKV(
        k=tuple(jnp.asarray(rng.standard_normal((2, G, 2, E)), jnp.float16) for _ in range(2)),
        v=tuple(jnp.asarray(rng.standard_normal((2, G, 2, E)), jnp.float16) for _ in range(2)),
        pos=jnp.asarray([[6, 7], [4, -1]], jnp.int32),
    )
    steps = [
        (jnp.asarray([[11], [12]]), jnp.asarray([[6], [4]]), None),
        (jnp.asarray([[1, 2, 3], [4, 5, 6]]), jnp.asarray([[6, 7, 8], [4, 5, -1]]), extra),
    ]

    def jitted() -> Any:  # a function of its own: jit caches traces per function
        def forward(tokens: Any, positions: Any, cache: Any, extra: Any) -> Any:
            return forward_compute(config, params, tokens, positions, cache, extra=extra).logits

        return jax.jit(forward)

    xla, on_kernel = jitted(), jitted()
    calls: list[str] = []
    attend, attend_qkv = gpu.attend, gpu.attend_qkv
    for tokens, positions, ext in steps:
        want = xla(tokens, positions, cache, ext)
        with monkeypatch.context() as m:
            m.setattr(control, "attention_kernel", lambda: control.PALLAS_INTERPRET)
            m.setattr(gpu, "attend", lambda *a, **k: calls.append("q") or attend(*a, **k))
            m.setattr(gpu, "attend_qkv", lambda *a, **k: calls.append("qkv") or attend_qkv(*a, **k))
            got = on_kernel(tokens, positions, cache, ext)
        assert want is not None and got is not None
        valid = np.asarray(positions) >= 0
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5)
    # every layer of both steps ran on the kernel
    assert calls == ["q" if qk_norm else "qkv"] * 2 * config.n_layers
    assert H // G * 3 <= llama.KERNEL_MAX_ROWS
