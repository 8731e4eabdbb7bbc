"""The native CPU linear kernel (`specjax.kernels.cpu`) as behaviour.

Independent sources: float64 NumPy products; the kernel's own single-row results (a row's
value must not depend on the rows beside it or on the thread split); the engine's greedy
tokens on XLA's dot (`cpu_kernels.disabled()`).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.decode import executables
from specjax.kernels import cpu as cpu_kernels
from specjax.models import llama
from specjax.testing import noisy_copy, tiny_model

ROOT = Path(__file__).resolve().parents[1]

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason=f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}",
)


def test_the_kernel_builds_wherever_a_compiler_is_found():
    """CI and development machines have g++: there the kernel must be in use, not silently
    replaced by XLA's dot."""
    if jax.default_backend() != "cpu" or not (os.environ.get("CXX") or shutil.which("g++")):
        pytest.skip("no CPU backend or no compiler")
    if os.environ.get(cpu_kernels.ENV_VAR, "").lower() in {"0", "off", "false", "no", "none"}:
        pytest.skip("turned off by the environment")
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


def test_the_kernel_builds_for_the_other_x86_vector_width(tmp_path):
    """The kernels have an AVX-512 and an AVX2 form (16-lane vectors do not fit AVX2's
    registers); the host builds one of them with -march=native, so this builds the other, as
    a user's machine would (the AVX2 form once failed to build, "impossible constraint in
    asm", leaving such machines on XLA's slower dot)."""
    compiler = os.environ.get("CXX") or shutil.which("g++")
    if not compiler or platform.machine().lower() not in {"x86_64", "amd64"}:
        pytest.skip("no g++ or not x86-64")
    host_has_avx512 = "avx512f" in cpu_kernels._cpu_features().split()
    other = "x86-64-v3" if host_has_avx512 else "x86-64-v4"  # AVX2 / AVX-512
    flags = tuple("-march=" + other if f == "-march=native" else f for f in cpu_kernels._FLAGS)
    cpu_kernels.compile_kernels(compiler, flags, tmp_path / "kernels.so")
    assert (tmp_path / "kernels.so").stat().st_size > 0


def _weights(rng, out, inp, dtype):
    w = (rng.standard_normal((out, inp)) * 0.1).astype(np.float32)
    return w.astype(np.float16) if dtype == "float16" else w


@needs_kernel
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("rows", "inp", "out"),
    [(1, 256, 1536), (3, 40, 5), (4, 16, 130), (5, 768, 256), (9, 33, 1), (64, 256, 2048)],
)
def test_linear_rows_matches_float64(rows, inp, out, dtype):
    """Output counts off the 16-output panel (5, 130, 1) exercise the zero-padded last panel;
    3, 4, 5, 9 and 64 rows every row tile (6 rows at a time, then 1-5); 1536 x 256 and 64
    rows the thread split."""
    rng = np.random.default_rng(rows * 1000 + inp + out)
    x = rng.standard_normal((rows, inp)).astype(np.float32)
    w = _weights(rng, out, inp, dtype)
    got = np.asarray(jax.jit(cpu_kernels.linear_rows)(jnp.asarray(x), jnp.asarray(w)))
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (rows, out)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.sqrt(inp))


@needs_kernel
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_row_gets_the_same_bits_alone_in_a_batch_and_in_any_order(dtype):
    """The kernel's stated invariant: decode (1 row), a batch and a verify block give each row
    identical bits. 3000 outputs make several chunks, so both threads share the work."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((37, 256)).astype(np.float32))
    w = jnp.asarray(_weights(rng, 3000, 256, dtype))
    f = jax.jit(cpu_kernels.linear_rows)
    batch = np.asarray(f(x, w))
    order = rng.permutation(37)
    shuffled = np.asarray(f(x[order], w))
    np.testing.assert_array_equal(shuffled, batch[order])
    for r in (0, 17, 36):
        np.testing.assert_array_equal(np.asarray(f(x[r : r + 1], w))[0], batch[r])
    three_d = np.asarray(f(x[:36].reshape(4, 9, 256), w))  # leading dims are rows
    np.testing.assert_array_equal(three_d.reshape(36, 3000), batch[:36])


@needs_kernel
def test_vmap_over_rows_and_over_weights():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 2, 48)).astype(np.float32))
    w = jnp.asarray(_weights(rng, 20, 48, "float16"))
    over_x = jax.vmap(cpu_kernels.linear_rows, in_axes=(0, None))(x, w)
    np.testing.assert_array_equal(
        np.asarray(over_x),
        np.asarray(cpu_kernels.linear_rows(x.reshape(6, 48), w)).reshape(3, 2, 20),
    )
    ws = jnp.stack([w, -w, 2 * w])
    over_w = jax.vmap(cpu_kernels.linear_rows)(x, ws)
    expected = np.einsum("bri,boi->bro", np.asarray(x, np.float64), np.asarray(ws, np.float64))
    np.testing.assert_allclose(np.asarray(over_w), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_weights_use_float16_only_where_it_is_exact_and_linear_dispatches_by_rows():
    model = tiny_model(4)
    params = dict(model.params)
    exact = jnp.asarray(np.asarray(params["lm_head"]).astype(np.float16).astype(np.float32))
    params["lm_head"] = exact
    form = llama.kernel_weights(params)
    head = form["lm_head"]
    assert isinstance(head, llama.KernelWeight) and head.panels.dtype == jnp.float16
    assert head.stored is exact
    np.testing.assert_array_equal(  # panels[p, i, j] = w[16 p + j, i]
        np.asarray(head.panels[1, :, 3], np.float32), np.asarray(exact)[16 + 3]
    )
    gate_up = form["layers"][0]["w_gate_up"]  # random f32 init: not exact in f16
    assert gate_up.panels.dtype == jnp.float32
    assert llama.kernel_weights(form)["lm_head"] is head  # idempotent

    rng = np.random.default_rng(3)
    w = np.asarray(gate_up.stored, np.float64)
    for rows in (1, cpu_kernels.MAX_ROWS, cpu_kernels.MAX_ROWS + 1):
        x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
        f = jax.jit(lambda x: llama.linear(x, gate_up))
        uses_kernel = cpu_kernels.TARGET in str(jax.make_jaxpr(f)(x))
        assert uses_kernel == (rows <= cpu_kernels.MAX_ROWS)
        np.testing.assert_allclose(np.asarray(f(x)), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_generation_on_the_kernel_matches_xla_dot_and_the_loop_calls_it():
    """Greedy tokens, plain and speculative (verify blocks run on the kernel too), equal plain
    greedy on XLA's dot; the compiled loops hold the custom call; without the kernel the
    decode form is `InputMajor` and the loop has no custom call."""
    target = tiny_model(4)
    draft = noisy_copy(target, 0.6)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=3)
    executables._COMPILED.clear()
    kernel_plain = generate(target, prompts, max_new_tokens=12, n_ctx=64)
    kernel_spec = generate(target, prompts, max_new_tokens=12, n_ctx=64, spec=spec, draft=draft)
    loops = [
        exe for key, exe in executables._COMPILED.items() if key[0] is api.eng.generate_loop_jit
    ]
    assert len(loops) == 2
    for exe in loops:
        assert cpu_kernels.TARGET in exe.as_text() and cpu_kernels.ATTEND_TARGET in exe.as_text()
    assert isinstance(api.decode_params(target.params)["layers"][0]["wqkv"], llama.KernelWeight)
    stats = kernel_spec.stats.to_dict()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    with cpu_kernels.disabled():
        executables._COMPILED.clear()
        xla_plain = generate(target, prompts, max_new_tokens=12, n_ctx=64)
        loops = [
            exe for key, exe in executables._COMPILED.items() if key[0] is api.eng.generate_loop_jit
        ]
        assert len(loops) == 1 and "specjax_" not in loops[0].as_text()
        assert isinstance(api.decode_params(target.params)["layers"][0]["wqkv"], llama.InputMajor)
    assert kernel_plain.tokens == xla_plain.tokens == kernel_spec.tokens


def _np_attend_state(q, k, v, k_pos, q_pos, n_used, window):
    """float64 max, normaliser and weighted sum of each query row over cells below n_used."""
    B, G, Q, E = q.shape
    T = q_pos.shape[1]
    m = np.full((B, G, Q), -np.inf)
    total = np.zeros((B, G, Q))
    acc = np.zeros((B, G, Q, E))
    for b in range(B):
        for g in range(G):
            for r in range(Q):
                qp = q_pos[b, r % T]
                kp = k_pos[b, :n_used]
                visible = (kp >= 0) & (qp >= 0) & (kp <= qp)
                if window:
                    visible &= qp - kp < window
                if not visible.any():
                    continue
                s = k[b, g, :n_used].astype(np.float64) @ q[b, g, r].astype(np.float64)
                s = s[visible] / np.sqrt(E)
                m[b, g, r] = s.max()
                p = np.exp(s - s.max())
                total[b, g, r] = p.sum()
                acc[b, g, r] = p @ v[b, g, :n_used][visible].astype(np.float64)
    return m, total, acc


@needs_kernel
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("heads, n_cells, n_used, dim", [(3, 96, 70, 28), (1, 203, 203, 36)])
def test_attend_cache_matches_float64(dtype, window, heads, n_cells, n_used, dim):
    """A verify block (T = 3 tokens, `heads` per group: 9 rows, two quads and a row paired
    with itself; 3 rows, a pair and a single), F16 and F32 caches, a hole, a row holding
    fewer cells, a padding token (q_pos = -1: sees nothing), a sliding window, E off the
    vector width of AVX2 and AVX-512 (28: two vectors of 8 and one, then 4 scalars; 36),
    cells at and above n_used that must not be read, and (second shape) two softmax chunks,
    the second ending in a block the cache cannot fill (S = 203)."""
    rng = np.random.default_rng(5)
    B, G, R, T, E, S = 2, 2, heads, 3, dim, n_cells
    k = rng.standard_normal((B, G, S, E)).astype(dtype)
    v = rng.standard_normal((B, G, S, E)).astype(dtype)
    k_pos = np.full((B, S), -1, np.int32)
    k_pos[0, :n_used] = np.arange(n_used)
    k_pos[0, 11] = -1
    k_pos[1, :50] = np.arange(50)
    k_pos[:, n_used:] = 5  # visible if read: the kernel must stop at n_used
    q_pos = np.array([[n_used, n_used + 1, n_used + 2], [50, 51, -1]], np.int32)
    q = rng.standard_normal((B, G, R * T, E)).astype(np.float32)
    m, total, acc = jax.jit(cpu_kernels.attend_cache, static_argnums=6)(
        q, k, v, k_pos, q_pos, jnp.int32(n_used), window
    )
    want_m, want_total, want_acc = _np_attend_state(q, k, v, k_pos, q_pos, n_used, window)
    np.testing.assert_allclose(np.asarray(m), want_m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(total), want_total, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(acc), want_acc, rtol=1e-4, atol=1e-4)
    assert np.isneginf(np.asarray(m)[1, :, T - 1 :: T]).all()  # the padding token's rows
    # A query row's bits do not depend on the other rows of the call (rows are processed in
    # quads and pairs): each row alone, as a 1-token call, gives the same state.
    for r in range(R * T):
        alone = cpu_kernels.attend_cache(
            q[:, :, r : r + 1], k, v, k_pos, q_pos[:, r % T : r % T + 1], n_used, window
        )
        for got, one in zip((m, total, acc), alone, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[:, :, r], np.asarray(one)[:, :, 0])


@needs_kernel
@pytest.mark.parametrize("k", [1, 3, 10, 40])
def test_top_k_is_the_stable_sort_prefix_and_small_top_k_takes_it(k):
    """The kernel against NumPy's stable argsort (ties by lower index): few distinct values so
    ties are everywhere, -inf entries (grammar-masked tokens), a row with fewer finite values
    than k, the largest value last (it must displace the list), leading dims, k = V, vmap; and
    `sampling.small_top_k` runs on it (its compiled program calls the kernel) with the same
    result as its XLA form (`top_k_rounds`, used off CPU)."""
    from specjax.sampling import small_top_k, top_k_rounds

    rng = np.random.default_rng(k)
    x = rng.integers(0, 6, size=(2, 3, 40)).astype(np.float32)
    x[0, 1, rng.choice(40, 25, replace=False)] = -np.inf
    x[1, 0, :] = -np.inf
    x[1, 0, [7, 3]] = 1.0
    x[1, 2, -1] = 9.0
    want = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    values, indices = jax.jit(cpu_kernels.top_k, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(indices), want)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, want, -1))
    _, vmapped = jax.vmap(lambda r: cpu_kernels.top_k(r, k))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(vmapped), want)

    fn = jax.jit(small_top_k, static_argnums=1)
    assert "specjax_top_k" in fn.lower(jnp.asarray(x), k).as_text()
    xla_values, xla_indices = jax.jit(top_k_rounds, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x), k)[1]), np.asarray(xla_indices))
    np.testing.assert_array_equal(np.asarray(xla_values), np.asarray(values))
    with pytest.raises(ValueError, match="k must be in"):
        cpu_kernels.top_k(jnp.asarray(x), 41)


def _np_attention(q, segments, q_pos, window):
    """float64 softmax attention of query rows (R heads x T tokens, token fastest) over the
    visible cells of every segment (k, v [B, G, X, E], pos [B, X]) together."""
    B, G, Q, E = q.shape
    T = q_pos.shape[1]
    k = np.concatenate([s[0] for s in segments], 2).astype(np.float64)
    v = np.concatenate([s[1] for s in segments], 2).astype(np.float64)
    k_pos = np.concatenate([s[2] for s in segments], 1)
    out = np.zeros((B, G, Q, E))
    for b in range(B):
        for g in range(G):
            for r in range(Q):
                qp = q_pos[b, r % T]
                visible = (k_pos[b] >= 0) & (qp >= 0) & (k_pos[b] <= qp)
                if window:
                    visible &= qp - k_pos[b] < window
                if visible.any():
                    s = (k[b, g] @ q[b, g, r].astype(np.float64))[visible] / np.sqrt(E)
                    p = np.exp(s - s.max())
                    out[b, g, r] = p @ v[b, g][visible] / p.sum()
    return out


@needs_kernel
@pytest.mark.parametrize("window", [0, 5])
def test_attention_all_on_the_kernel_matches_float64(window):
    """A decode/verify step's attention with every segment on the kernel (the new tokens, a
    drafter's scratch, the cache below its high-water mark), merged state by state, against
    float64: a verify block of 3 tokens whose last is padding (it sees nothing: output 0, no
    NaN), a scratch with empty slots, a cache with cells above the mark that must not be read,
    a row whose scratch is all empty; and the same values from XLA's path (`_attend`)."""
    rng = np.random.default_rng(11)
    B, G, R, T, E, X, S, used = 2, 2, 2, 3, 16, 4, 32, 20
    f16 = np.float16
    q = rng.standard_normal((B, G, R, T, E)).astype(np.float32)
    q_pos = np.array([[24, 25, -1], [21, 22, 23]], np.int32)
    own = (
        rng.standard_normal((B, G, T, E)).astype(f16),
        rng.standard_normal((B, G, T, E)).astype(f16),
        q_pos,
    )
    scratch_pos = np.array([[20, 21, 22, -1], [-1, -1, -1, -1]], np.int32)
    scratch = (
        rng.standard_normal((B, G, X, E)).astype(f16),
        rng.standard_normal((B, G, X, E)).astype(f16),
        scratch_pos,
    )
    cache_pos = np.full((B, S), -1, np.int32)
    cache_pos[:, :used] = np.arange(used)
    cache_pos[:, used:] = 3  # visible if read
    cache = (
        rng.standard_normal((B, G, S, E)).astype(f16),
        rng.standard_normal((B, G, S, E)).astype(f16),
        cache_pos,
    )
    own_j = [tuple(map(jnp.asarray, own)), tuple(map(jnp.asarray, scratch))]
    cache_j = tuple(map(jnp.asarray, cache))
    native = jax.jit(llama._attend_native, static_argnums=3)(
        jnp.asarray(q), own_j, jnp.asarray(q_pos), window, cache_j, jnp.int32(used)
    )
    cut = (cache[0][:, :, :used], cache[1][:, :, :used], cache[2][:, :used])
    want = _np_attention(q.reshape(B, G, R * T, E), [own, scratch, cut], q_pos, window)
    got = np.asarray(native).reshape(B, G, R * T, E)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # XLA's path reads whole chunks: there, cells above the mark are empty, as in a real cache
    empty_above = (*cache_j[:2], jnp.where(jnp.arange(S) < used, cache_j[2], -1))
    xla = jax.jit(llama._attend, static_argnums=3)(
        jnp.asarray(q), own_j, jnp.asarray(q_pos), window, empty_above, jnp.int32(1)
    )
    valid = (q_pos >= 0)[:, None, None, :, None]
    np.testing.assert_allclose(
        np.where(valid, np.asarray(xla), 0), np.asarray(native), rtol=2e-4, atol=2e-4
    )


def test_rope_angles_are_computed_once_per_forward():
    """XLA fuses elementwise producers into their consumers: the RoPE sines and cosines were
    evaluated inside every layer's q and k rotation (per head), ~15% of a verify forward.
    `_materialised` keeps them one computation: the optimised verify forward holds one sine
    and one cosine, not 2 per layer."""
    model = tiny_model(4)
    params = api.decode_params(model.params)
    cache = model.new_cache(1, 64, "f16", "f16")
    tokens, positions = jnp.ones((1, 5), jnp.int32), 10 + jnp.arange(5)[None]
    fn = jax.jit(llama.forward_compute, static_argnums=0)
    text = fn.lower(model.config, params, tokens, positions, cache).compile().as_text()
    assert model.config.L >= 2  # fused into the layers, there would be 2L of each
    # one in each branch of the conditional that keeps them apart
    assert text.count(" sine(") == 2 and text.count(" cosine(") == 2


@needs_kernel
def test_products_up_to_max_rows_take_the_kernel_and_longer_prompts_xla_dot():
    """`forward_compute` runs every product of up to `cpu_kernels.MAX_ROWS` rows on the kernel
    (a verify batch, a prompt or prompt chunk, a 65-row verify of ngram-mod's 64-token drafts,
    wider than the 64-row limit the kernel once had); a longer prompt's products go to XLA's
    dot, all but its one-row LM head (`logit_index`)."""
    model = tiny_model(4)
    params = api.decode_params(model.params)
    cache = model.new_cache(1, 128, "f16", "f16")

    def kernel_calls(T: int) -> int:
        tokens, positions = jnp.ones((1, T), jnp.int32), jnp.arange(T)[None]
        fn = jax.jit(
            lambda p, c: llama.forward_compute(
                model.config, p, tokens, positions, c, logit_index=jnp.array([T - 1])
            )
        )
        return fn.lower(params, cache).as_text().count(cpu_kernels.TARGET)

    assert kernel_calls(cpu_kernels.MAX_ROWS + 1) == 1
    for T in (5, 65, cpu_kernels.MAX_ROWS):
        assert kernel_calls(T) == 1 + 4 * model.config.L


def test_a_failed_build_warns_once_and_generation_uses_xla_dot(tmp_path):
    """A compiler that fails leaves `available()` False with the reason, and generation runs
    (in a fresh process, with an empty kernel cache)."""
    code = (
        "import warnings\n"
        "from specjax import cpu_kernels, api\n"
        "from specjax.models import llama\n"
        "from specjax.testing import tiny_model\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert not cpu_kernels.available() and not cpu_kernels.available()\n"
        "assert sum('CPU kernel unavailable' in str(x.message) for x in w) == 1, w\n"
        "assert 'failed' in cpu_kernels.unavailable_reason()\n"
        "m = tiny_model(4)\n"
        "assert isinstance(api.decode_params(m.params)['lm_head'], llama.InputMajor)\n"
        "print(api.generate(m, [[1, 2, 3]], max_new_tokens=3, n_ctx=32).tokens)\n"
    )
    env = {
        **os.environ,
        "CXX": "false",
        "XDG_CACHE_HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "SPECJAX_COMPILE_CACHE": "0",
    }
    env.pop(cpu_kernels.ENV_VAR, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("[[")
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind
