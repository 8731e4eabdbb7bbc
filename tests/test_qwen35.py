"""The qwen35 hybrid forward (specjax.models.qwen35) against a float64 NumPy transcription of
llama.cpp's graph run token by token (tests/oracles/qwen35_reference.py), and against itself:
chunked scan == one-token recurrence, prefill in uneven chunks == whole, per-position states ==
the states after each prefix, padding leaves the recurrent state untouched."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.qwen35_reference import Reference

from specjax.models import llama
from specjax.models import qwen35 as q
from specjax.testing import tiny_qwen35_config

CFG = tiny_qwen35_config()
T = 13


@functools.lru_cache(maxsize=1)
def _params() -> dict:
    # std 0.2: logits and states far from zero, so a wrong term shows
    return q.init_params(CFG, jax.random.PRNGKey(0), std=0.2)


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, CFG.V, size=n)


@functools.partial(jax.jit, static_argnames=("mode", "per_position"))
def _fwd(params, tokens, positions, state, mode="auto", per_position=False):
    return q.forward(CFG, params, tokens, positions, state, mode=mode, per_position=per_position)


def _reference_run(tokens: np.ndarray) -> tuple[np.ndarray, list[dict[int, np.ndarray]], Reference]:
    ref = Reference(CFG, _params())
    logits, states = [], []
    for p, t in enumerate(tokens):
        logits.append(ref.step(int(t), p))
        states.append({i: s.copy() for i, s in ref.state.items()})
    return np.stack(logits), states, ref


def _two_rows() -> tuple[list[np.ndarray], jax.Array, jax.Array]:
    """Rows of 13 and 9 tokens, padded as a suffix: (rows, tokens [2, T], positions [2, T])."""
    rows = [_tokens(1, T), _tokens(2, 9)]
    toks = np.zeros((2, T), np.int32)
    pos = np.full((2, T), -1, np.int32)
    for b, r in enumerate(rows):
        toks[b, : len(r)] = r
        pos[b, : len(r)] = np.arange(len(r))
    return rows, jnp.asarray(toks), jnp.asarray(pos)


@pytest.mark.parametrize("mode", [pytest.param("recurrent", marks=pytest.mark.slow), "chunked"])
def test_forward_matches_float64_reference(mode: str) -> None:
    """Two rows of different lengths (padding as a suffix), logits and final states."""
    rows, toks, pos = _two_rows()
    out = _fwd(_params(), toks, pos, q.new_state(CFG, 2, 32), mode=mode)
    for b, r in enumerate(rows):
        want, _, ref = _reference_run(r)
        got = np.asarray(out.logits[b, : len(r)])
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
        for j, layer in enumerate(CFG.recurrent_layers):
            np.testing.assert_allclose(np.asarray(out.state.ssm[j][b]), ref.state[layer], atol=1e-4)
            np.testing.assert_allclose(
                np.asarray(out.state.conv[j][b]), ref.conv[layer], atol=1e-5, rtol=1e-5
            )


def test_prompt_into_an_empty_state_in_query_blocks_matches_float64(monkeypatch) -> None:
    """`cache_empty` attends the prompt in query blocks up to each block's end (4 tokens here:
    blocks of 4, 4, 4 and 1 of 13; row 1 padded after 9)."""
    monkeypatch.setattr(llama, "PROMPT_BLOCK", 4)
    rows, toks, pos = _two_rows()
    prefill = jax.jit(lambda p, t, ps, s: q.forward(CFG, p, t, ps, s, cache_empty=True))
    out = prefill(_params(), toks, pos, q.new_state(CFG, 2, 32))
    for b, r in enumerate(rows):
        want, _, _ = _reference_run(r)
        got = np.asarray(out.logits[b, : len(r)])
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_chunked_scan_equals_recurrence_across_chunk_boundaries() -> None:
    """T = 10 with chunks of 4 (2 full + 1 padded), H_v heads, a non-zero initial state."""
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    B, T_, H, S = 2, 10, 3, 4
    M0 = jax.random.normal(ks[0], (B, H, S, S))
    k = q.l2_norm(jax.random.normal(ks[1], (B, T_, H, S)), 1e-6)
    qq = jax.random.normal(ks[2], (B, T_, H, S))
    v = jax.random.normal(ks[3], (B, T_, H, S))
    g = -2.0 * jax.random.uniform(ks[4], (B, T_, H))
    beta = jax.random.uniform(ks[5], (B, T_, H))
    rec = jax.jit(functools.partial(q.delta_recurrent, keep_steps=True))
    M1, o1, steps = rec(M0, qq, k, v, g, beta)
    M2, o2 = jax.jit(functools.partial(q.delta_chunked, chunk=4))(M0, qq, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(M2), np.asarray(M1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), atol=1e-5)
    assert steps is not None
    np.testing.assert_allclose(np.asarray(steps[:, -1]), np.asarray(M1), atol=0)


def test_uneven_prefill_chunks_and_decode_equal_whole() -> None:
    """Prefill 5 + 1 + 7 tokens (the 1 via the one-token recurrence) == all 13 at once."""
    toks = _tokens(4, T)
    whole = _fwd(_params(), jnp.asarray(toks[None]), jnp.arange(T)[None], q.new_state(CFG, 1, 32))
    state = q.new_state(CFG, 1, 32)
    logits = []
    start = 0
    for n in (5, 1, 7):
        tk = jnp.asarray(toks[None, start : start + n])
        ps = jnp.arange(start, start + n)[None]
        out = _fwd(_params(), tk, ps, state)
        logits.append(np.asarray(out.logits[0]))
        state = out.state
        start += n
    np.testing.assert_allclose(np.concatenate(logits), np.asarray(whole.logits[0]), atol=2e-4)
    for a, b in zip(state.ssm, whole.state.ssm):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for a, b in zip(state.conv, whole.state.conv):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("unrolled", [False, True])
def test_per_position_states_are_each_prefix_state(monkeypatch, unrolled: bool) -> None:
    """The verify forward's per-token states against the float64 reference, with the scan
    looped (CPU, TPU) and unrolled (GPU: `control.unroll_stacking_scans`)."""
    monkeypatch.setattr(q, "unroll_stacking_scans", lambda: unrolled)
    toks = _tokens(5, 9)
    out = _fwd(
        _params(),
        jnp.asarray(toks[None]),
        jnp.arange(9)[None],
        q.new_state(CFG, 1, 32),
        per_position=True,
    )
    want, states, _ = _reference_run(toks)
    np.testing.assert_allclose(np.asarray(out.logits[0]), want, atol=1e-4 * np.abs(want).max())
    ref = Reference(CFG, _params())
    for t in range(9):
        ref.step(int(toks[t]), t)
        for j, layer in enumerate(CFG.recurrent_layers):
            np.testing.assert_allclose(
                np.asarray(out.ssm_steps[j][0, t]), states[t][layer], atol=1e-4
            )
            # the reference's conv window after token t ends with token t's conv input
            np.testing.assert_allclose(
                np.asarray(out.conv_inputs[j][0, t]), ref.conv[layer][-1], atol=1e-5, rtol=1e-5
            )


def test_rope_sections_follow_imrope() -> None:
    """Qwen3.5's 64 rotated dims (11, 11, 10, 0) all rotate; a 4th section rotates by 0."""
    cfg = q.Qwen35Config(
        vocab_size=8, dim=8, n_layers=4, n_heads=1, n_kv_heads=1, head_dim=256, ffn_dim=8,
        rope_dim=64,
    )  # fmt: skip
    assert cfg.sections == (11, 11, 10, 0)
    assert all(f > 0 for f in q.rope_pair_frequencies(cfg))
    cfg2 = q.Qwen35Config.from_dict({**cfg.to_dict(), "rope_sections": (2, 2, 2, 2)})
    freqs = q.rope_pair_frequencies(cfg2)
    # pairs 0..31, sector = p % 8: sectors 0..5 are t/h/w (< 3 * 2), 6 and 7 are "e"
    assert [f == 0 for f in freqs[:8]] == [False] * 6 + [True] * 2


def test_bad_config_names_the_numbers() -> None:
    with pytest.raises(
        ValueError, match=r"ssm_v_heads \(3\) must be a multiple of ssm_k_heads \(2\)"
    ):
        q.Qwen35Config.from_dict({**CFG.to_dict(), "ssm_v_heads": 3})
    with pytest.raises(ValueError, match=r"parameter layers\.0\.conv has shape"):
        params = dict(_params())
        layers = list(params["layers"])
        layers[0] = {**layers[0], "conv": jnp.zeros((3, 3))}
        q.check_params(CFG, {**params, "layers": tuple(layers)})
