"""specjax.train.objectives against the verifier, plain-Python transcriptions and finite differences."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode.verify import first_argmax, verify_greedy, verify_rejection
from specjax.drafters.base import DraftOutput
from specjax.sampling import SamplingParams, make_key, target_probs
from specjax.train import objectives as obj

# The verifier's functions as oracles, and the objectives checked against them, compiled once
# each instead of op by op (every eager jnp op compiles a program of its own: suite time)
target_probs = jax.jit(target_probs)
first_argmax = jax.jit(first_argmax)
verify_greedy = jax.jit(verify_greedy)
greedy_acceptance_length = jax.jit(obj.greedy_acceptance_length)
greedy_acceptance_rate = jax.jit(obj.greedy_acceptance_rate)
argmax_agreement = jax.jit(obj.argmax_agreement)

V = 16


def _logits(seed: int, shape: tuple[int, ...] = (V,), scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


TRUNCATIONS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's defaults
    dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
]


def test_truncated_probs_equal_the_verifiers_distribution() -> None:
    # rows 0-3 random, row 4 with tied logits (stable ranking must agree on who is kept)
    logits = np.stack([_logits(s) for s in range(4)] + [np.round(_logits(9), 0)])
    for kw in TRUNCATIONS:
        params = obj.sampling_params(**kw)
        mine = np.asarray(jax.jit(obj.truncated_probs)(jnp.asarray(logits), params))
        for row, lg in zip(mine, logits):
            ref = np.asarray(target_probs(jnp.asarray(lg), params))
            np.testing.assert_allclose(row, ref, atol=2e-7, err_msg=str(kw))
            assert np.array_equal(row > 0, ref > 0), kw


def test_top_p_boundary_is_the_verifiers() -> None:
    """top_p exactly equal to an exclusive cumulative mass: that token is cut, as upstream."""
    lg = _logits(11)
    p1 = jax.nn.softmax(jnp.asarray(lg))
    sorted_p = p1[jnp.argsort(-jnp.asarray(lg), stable=True)]
    boundary = float((jnp.cumsum(sorted_p) - sorted_p)[3])  # mass before the 4th token
    params = obj.sampling_params(temperature=0.9, top_p=boundary)
    mine = np.asarray(obj.truncated_probs(jnp.asarray(lg), params))
    ref = np.asarray(target_probs(jnp.asarray(lg), params))
    assert int((ref > 0).sum()) == 3
    np.testing.assert_array_equal(mine > 0, ref > 0)
    np.testing.assert_allclose(mine, ref, atol=2e-7)


def test_draft_q_is_draft_simples_top10_tempered_softmax() -> None:
    lg = _logits(3)
    q = np.asarray(obj.truncated_probs(jnp.asarray(lg), obj.draft_params(0.7)))
    top = np.argsort(-lg, kind="stable")[:10]
    ref = np.zeros(V)
    e = np.exp((lg[top] - lg[top].max()) / 0.7)
    ref[top] = e / e.sum()
    np.testing.assert_allclose(q, ref, atol=1e-6)


def test_acceptance_rate_is_the_rejection_verifiers_acceptance_probability() -> None:
    """alpha = P(verify_rejection accepts a token drawn from q), estimated over 4000 seeds."""
    tl, dl = _logits(1, scale=1.0), _logits(2, scale=1.0)
    tparams = obj.sampling_params(temperature=0.9, top_k=8)
    q = obj.truncated_probs(jnp.asarray(dl), obj.draft_params(0.9))
    alpha = float(obj.acceptance_rate(jnp.asarray(tl), jnp.asarray(dl), tparams))
    p = np.asarray(target_probs(jnp.asarray(tl), tparams), np.float64)
    qn = np.asarray(q, np.float64)
    assert alpha == pytest.approx(float(np.minimum(p, qn).sum()), abs=1e-6)

    n = 4000
    logits_TV = jnp.stack([jnp.asarray(tl), jnp.asarray(tl)])

    @jax.jit
    def accepted(seed: jax.Array) -> jax.Array:
        tok = jax.random.categorical(make_key(seed, 7, 9), jnp.log(q)).astype(jnp.int32)
        params = SamplingParams.create(temperature=0.9, top_k=8, top_p=1.0, min_p=0.0, seed=seed)
        out = verify_rejection(
            logits_TV, tok[None], jnp.ones((1,), bool), q[None], params, jnp.int32(5)
        )
        return out.n_accepted

    seeds = jnp.arange(n, dtype=jnp.uint32)
    rate = float(jnp.mean(jax.vmap(accepted)(seeds)))
    assert abs(rate - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / n), (rate, alpha)


def _chain_length(alpha: list[float]) -> float:
    total, prod = 1.0, 1.0
    for a in alpha:
        prod *= a
        total += prod
    return total


def test_expected_acceptance_length_and_positions() -> None:
    alpha = np.array([[0.9, 0.5, 0.8, 0.1], [1.0, 1.0, 0.0, 1.0]], np.float32)
    got = np.asarray(jax.jit(obj.expected_acceptance_length)(jnp.asarray(alpha)))
    np.testing.assert_allclose(got, [_chain_length(list(r)) for r in alpha.tolist()], rtol=1e-6)
    valid = jnp.asarray([[True, True, False, False]] * 2)
    got_v = np.asarray(obj.expected_acceptance_length(jnp.asarray(alpha), valid))
    np.testing.assert_allclose(got_v, [_chain_length(list(r[:2])) for r in alpha.tolist()])
    np.testing.assert_allclose(
        np.asarray(obj.position_acceptance_rates(jnp.asarray(alpha)))[0],
        [0.9, 0.45, 0.36, 0.036],
        rtol=1e-6,
    )
    assert float(obj.block_acceptance_length(jnp.asarray(alpha[0]))) == pytest.approx(got[0])


def test_greedy_length_is_the_greedy_verifiers_count() -> None:
    K = 4
    for seed in range(6):
        rng = np.random.default_rng(seed)
        tl = rng.integers(0, 3, size=(K + 1, V)).astype(np.float32)  # many ties
        dl = tl[:K] + rng.normal(size=(K, V)).astype(np.float32) * (seed % 3)
        draft = jnp.argmax(jnp.asarray(dl), -1).astype(jnp.int32)
        out = verify_greedy(
            first_argmax(jnp.asarray(tl))[None],
            DraftOutput(tokens=draft[None], valid=jnp.ones((1, K), bool)),
        )
        length = float(greedy_acceptance_length(jnp.asarray(tl[:K]), jnp.asarray(dl)))
        assert length == int(out.n_accepted[0]) + 1
        # at temperature 0 the greedy acceptance rate is argmax agreement
        g0 = greedy_acceptance_rate(jnp.asarray(tl[:K]), jnp.asarray(dl), obj.sampling_params(0))
        np.testing.assert_array_equal(
            np.asarray(g0), np.asarray(argmax_agreement(jnp.asarray(tl[:K]), jnp.asarray(dl)))
        )
    # above 0 it is p(argmax q)
    tl, dl = _logits(4), _logits(5)
    params = obj.sampling_params(temperature=0.7, top_p=0.9)
    p = np.asarray(target_probs(jnp.asarray(tl), params))
    g = float(greedy_acceptance_rate(jnp.asarray(tl), jnp.asarray(dl), params))
    assert g == pytest.approx(float(p[np.argmax(dl)]), abs=1e-7)


def _path_length_bruteforce(alphas: list[list[float]], k: int) -> float:
    """Enumerate every accept/reject outcome of every token (plain Python)."""
    acc_sum, rounds_sum = 0.0, 0.0
    for a in alphas:
        n = len(a)
        for bits in itertools.product([0, 1], repeat=n):
            prob = 1.0
            for j in range(n):
                prob *= a[j] if bits[j] else 1.0 - a[j]
            e, acc, rounds = 1, 0, 0
            while e < n:
                budget = min(k, n - e - 1)
                got = 0
                while got < budget and bits[e + got]:
                    got += 1
                if budget > 0:
                    rounds += 1
                    acc += got
                e += got + 1
            acc_sum += prob * acc
            rounds_sum += prob * rounds
    return 1.0 + acc_sum / rounds_sum


def test_path_acceptance_length_equals_enumeration() -> None:
    rng = np.random.default_rng(0)
    alphas = [list(rng.uniform(size=9)), list(rng.uniform(size=6)), [1.0] * 7]
    for k in (1, 3, 4):
        got = obj.path_acceptance_length([np.asarray(a) for a in alphas], k)
        assert got == pytest.approx(_path_length_bruteforce(alphas, k), rel=1e-9)
    # deterministic 0/1 rates: the exact greedy count (2 rounds accept 3 and 1 of 3, 1 of 1)
    path = [np.array([0, 1, 1, 1, 1, 0, 1, 1, 1], float)]
    assert obj.path_acceptance_length(path, 3) == pytest.approx(
        _path_length_bruteforce([list(path[0])], 3)
    )


# ------------------------------------------------------------------------------------------
# losses: values, gradients (finite differences), ties, jit / vmap


def _tiny_draft(w: jax.Array, x: jax.Array) -> jax.Array:
    """A linear 'draft model': logits = x @ w."""
    return x @ w


def _fd_check(f, w: np.ndarray, n_dirs: int = 3, eps: float = 1e-2, tol: float = 2e-3) -> None:
    g = np.asarray(jax.grad(f)(jnp.asarray(w)))
    assert np.all(np.isfinite(g))
    rng = np.random.default_rng(0)
    for _ in range(n_dirs):
        d = rng.normal(size=w.shape).astype(np.float32)
        d /= np.linalg.norm(d)
        fd = (float(f(jnp.asarray(w + eps * d))) - float(f(jnp.asarray(w - eps * d)))) / (2 * eps)
        assert fd == pytest.approx(float(np.sum(g * d)), abs=tol, rel=tol), (fd, np.sum(g * d))


def _spread_logits(seed: int, rows: int) -> np.ndarray:
    """Logits whose ranks are >= 0.3 apart: an eps = 1e-2 step never changes a top-k set."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(V) * 0.3 for _ in range(rows)]).astype(np.float32)


@pytest.mark.parametrize("name", obj.OBJECTIVES)
def test_loss_gradients_wrt_draft_params_match_finite_differences(name: str) -> None:
    rows, D = 3, 6
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(rows, D)).astype(np.float32))
    target = jnp.asarray(_spread_logits(2, rows))
    tokens = jnp.asarray(rng.integers(0, V, size=rows))
    # w such that the draft logits are spread too (top-10 set stable under the FD step)
    base = _spread_logits(3, rows) * 1.37  # no p(x) == q(x) kinks near w0
    w0 = np.linalg.lstsq(np.asarray(x), base, rcond=None)[0].astype(np.float32)
    tparams = obj.sampling_params(temperature=0.7, top_p=0.95)

    def f(w: jax.Array) -> jax.Array:
        terms = obj.objective_terms(name, target, _tiny_draft(w, x), tokens, tparams)
        return jnp.mean(terms.loss)

    _fd_check(jax.jit(f), w0)


@pytest.mark.parametrize("kind", ["alpha", "tv", "nla", "kl", "reverse_kl"])
def test_gradient_wrt_draft_temperature_matches_finite_differences(kind: str) -> None:
    target = jnp.asarray(_spread_logits(4, 4))
    draft = jnp.asarray(_spread_logits(5, 4) * 1.5)
    tparams = obj.sampling_params(temperature=0.8, top_k=12)

    def f(log_temp: jax.Array) -> jax.Array:
        temp = jnp.exp(log_temp)
        q = obj.truncated_probs(draft, obj.draft_params(temp))
        p = obj.truncated_probs(target, tparams)
        logq = jax.nn.log_softmax(draft / temp)
        logp = jax.nn.log_softmax(target / 0.8)
        values = {
            "alpha": obj.acceptance_rate_probs(p, q),
            "tv": obj.total_variation(p, q),
            "nla": obj.neg_log_acceptance(p, q),
            "kl": obj.kl_divergence(logp, logq),
            "reverse_kl": obj.kl_divergence(logq, logp),
        }
        return jnp.mean(values[kind])

    t0 = np.float32(np.log(0.9))
    g = float(jax.jit(jax.grad(f))(jnp.asarray(t0)))
    eps = 1e-3
    f = jax.jit(f)  # one compiled program for both points (op by op, each op compiles its own)
    fd = (float(f(jnp.asarray(t0 + eps))) - float(f(jnp.asarray(t0 - eps)))) / (2 * eps)
    assert abs(g) > 1e-3  # the check is not vacuous
    assert fd == pytest.approx(g, rel=5e-3, abs=1e-4)


def test_losses_against_float64_numpy() -> None:
    tl, dl = _logits(6), _logits(7)
    p = np.exp(tl - tl.max()).astype(np.float64)
    p /= p.sum()
    q = np.exp(dl - dl.max()).astype(np.float64)
    q /= q.sum()
    t = obj.objective_terms(
        "kl",
        jnp.asarray(tl),
        jnp.asarray(dl),
        jnp.int32(3),
        obj.sampling_params(1.0),
        obj.sampling_params(1.0),
    )
    assert float(t.kl) == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-4)
    assert float(t.reverse_kl) == pytest.approx(float(np.sum(q * np.log(q / p))), rel=1e-4)
    assert float(t.alpha) == pytest.approx(float(np.minimum(p, q).sum()), rel=1e-5)
    for name, ref in {
        "tv": 0.5 * np.abs(p - q).sum(),
        "nla": -np.log(np.minimum(p, q).sum()),
        "ce": -np.log(q[3]),
        "lk": -np.log(np.minimum(p, q).sum())
        + (1 - np.minimum(p, q).sum()) * np.sum(p * np.log(p / q)),
    }.items():
        got = obj.objective_terms(
            name,
            jnp.asarray(tl),
            jnp.asarray(dl),
            jnp.int32(3),
            obj.sampling_params(1.0),
            obj.sampling_params(1.0),
        )
        assert float(got.loss) == pytest.approx(float(ref), rel=1e-4), name
    lp, lq = jnp.log(jnp.asarray(p, jnp.float32)), jnp.log(jnp.asarray(q, jnp.float32))
    assert float(obj.cross_entropy(lp, lq)) == pytest.approx(
        float(-np.sum(p * np.log(q))), rel=1e-5
    )


def test_ties_disjoint_supports_and_greedy_have_documented_gradients() -> None:
    lg = jnp.asarray(_logits(8))
    params = obj.sampling_params(temperature=1.0)
    # p == q everywhere: alpha = 1, gradient wrt the draft is 0 (one-sided), never NaN
    g = jax.grad(lambda d: obj.acceptance_rate(lg, d, params, params))(lg)
    np.testing.assert_array_equal(np.asarray(g), 0.0)
    g_tv = jax.grad(
        lambda d: jnp.sum(
            obj.total_variation(obj.truncated_probs(lg, params), obj.truncated_probs(d, params))
        )
    )(lg)
    np.testing.assert_array_equal(np.asarray(g_tv), 0.0)
    # disjoint supports (top-1 on different tokens): alpha 0, -log alpha finite, zero gradient
    one = obj.sampling_params(temperature=1.0, top_k=1)
    d = lg.at[jnp.argmax(lg)].set(-10.0)
    f = lambda x: obj.neg_log_acceptance(  # noqa: E731
        obj.truncated_probs(lg, one), obj.truncated_probs(x, one)
    )
    assert np.isfinite(float(f(d)))
    np.testing.assert_array_equal(np.asarray(jax.grad(f)(d)), 0.0)
    # greedy target and greedy drafts: constant in the draft logits
    g0 = jax.grad(lambda x: obj.greedy_acceptance_rate(lg, x, obj.sampling_params(0.7)))(d)
    np.testing.assert_array_equal(np.asarray(g0), 0.0)
    gt = jax.grad(
        lambda x: obj.acceptance_rate(x, d, obj.sampling_params(0.0), obj.sampling_params(1.0))
    )(lg)
    np.testing.assert_array_equal(np.asarray(gt), 0.0)


def test_vmap_and_jit_agree_with_rows() -> None:
    tl = jnp.asarray(np.stack([_logits(s) for s in range(5)]))
    dl = jnp.asarray(np.stack([_logits(s + 10) for s in range(5)]))
    params = obj.sampling_params(temperature=0.7, top_k=8)
    batched = jax.jit(obj.acceptance_rate)(tl, dl, params)
    mapped = jax.vmap(obj.acceptance_rate, in_axes=(0, 0, None))(tl, dl, params)
    rows = [float(obj.acceptance_rate(a, b, params)) for a, b in zip(tl, dl)]
    np.testing.assert_allclose(np.asarray(batched), rows, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mapped), rows, rtol=1e-6)
    # traced temperature: one trace for several values
    traces = []

    @jax.jit
    def at(temp: jax.Array) -> jax.Array:
        traces.append(1)
        return obj.acceptance_rate(tl, dl, obj.sampling_params(temperature=temp))

    for t in (0.5, 0.7, 1.0):
        at(jnp.float32(t))
    assert len(traces) == 1


def test_unknown_objective_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown objective 'mse'"):
        obj.objective_terms("mse", jnp.zeros(V), jnp.zeros(V), jnp.int32(0), obj.sampling_params())
