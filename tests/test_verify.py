"""Verification: distribution preservation, the sampled-stream property, branch selection, one trace."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode.verify import (
    BRANCH_MATCH,
    BRANCH_REJECTION,
    BRANCH_REPLAY,
    BRANCH_SYNTHETIC,
    PAD_TOKEN,
    resolve_synthetic_rates,
    synthetic_acceptance_rates,
    verify_match,
    verify_rejection,
    verify_replay,
    verify_rows,
    verify_synthetic,
)
from specjax.drafters.base import DraftOutput
from specjax.sampling import (
    ROLE_DRAFT,
    ROLE_SAMPLE,
    SamplingParams,
    apply_penalties,
    make_key,
    sample_token,
    target_probs,
)

#: chi-square quantiles at 1 - 1e-4 by degrees of freedom (scipy.stats.chi2.ppf).
CHI2_CRIT = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878}

PLAIN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def _chi2(samples: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic of `samples` against `probs`; inf if a zero-probability cell is hit."""
    counts = np.bincount(samples, minlength=len(probs))
    if counts[probs == 0].sum() > 0:
        return float("inf"), int((probs > 0).sum()) - 1
    nz = probs > 0
    expected = probs[nz] * len(samples)
    return float(((counts[nz] - expected) ** 2 / expected).sum()), int(nz.sum()) - 1


def _log(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(p, np.float32))


# --------------------------------------------------------------------------------------------
# rejection sampling preserves the target distribution

N_TRIALS = 20000


@jax.jit
def _rejection_trials(logits_V, q_V, allowed_V, params):
    """K = 1: draw x ~ q, verify it; per trial (x, first emitted token, n_accepted)."""

    def trial(i):
        x = jax.random.categorical(make_key(params.seed, 100 + i, ROLE_DRAFT), jnp.log(q_V))
        draft_K = x.astype(jnp.int32)[None]
        logits_TV = jnp.stack([logits_V, logits_V])
        allowed_TV = jnp.stack([allowed_V, allowed_V])
        out = verify_rejection(
            logits_TV,
            draft_K,
            jnp.ones((1,), bool),
            q_V[None],
            params,
            jnp.int32(100 + i) - 1,
            allowed_TV=allowed_TV,
        )
        return x.astype(jnp.int32), out.tokens[0], out.n_accepted

    return jax.vmap(trial)(jnp.arange(N_TRIALS, dtype=jnp.int32) * 7)


#: p over V = 8 with two dead tokens (zero target and draft mass), so every case shares one compile.
P8 = np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03, 0.0, 0.0])


@pytest.mark.parametrize(
    ("name", "logits", "q", "allowed", "temperature", "top_k"),
    [
        ("generic", _log(P8), [0.05, 0.10, 0.40, 0.05, 0.20, 0.20, 0, 0], None, 1.0, 0),
        ("q_zero_where_p_positive", _log(P8), [0, 0.5, 0, 0.5, 0, 0, 0, 0], None, 1.0, 0),
        # top_k = 3 and temperature 0.7 zero p on tokens the draft likes; q covers a dead token
        ("p_zero_where_q_positive", _log(P8), [0.1, 0.1, 0.1, 0.2, 0.2, 0.1, 0.2, 0], None, 0.7, 3),
        ("identical", _log(P8), P8, None, 1.0, 0),
        (
            "grammar_mask",
            _log(P8),
            [0.4, 0.1, 0.1, 0.1, 0.2, 0.1, 0, 0],
            [False, True, True, False, True, True, True, True],
            1.0,
            0,
        ),
        (
            "v8_sharp_q",
            _log([0.02, 0.3, 0.1, 0.05, 0.2, 0.03, 0.2, 0.1]),
            [0.0, 0.05, 0.9, 0.0, 0.0, 0.05, 0.0, 0.0],
            None,
            1.3,
            0,
        ),
    ],
)
def test_rejection_preserves_target_distribution(name, logits, q, allowed, temperature, top_k):
    vocab = len(logits)
    q = np.asarray(q, np.float32)
    q = q / q.sum()
    params = SamplingParams.create(
        temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0, seed=11
    )
    allowed_V = np.ones(vocab, bool) if allowed is None else np.asarray(allowed)
    drafts, tokens, n_acc = _rejection_trials(
        jnp.asarray(logits), jnp.asarray(q), jnp.asarray(allowed_V), params
    )
    drafts, tokens, n_acc = np.asarray(drafts), np.asarray(tokens), np.asarray(n_acc)

    p = np.asarray(jax.jit(target_probs)(jnp.asarray(logits), params), np.float64)  # compiled once
    p = np.where(allowed_V, p, 0.0)
    p = p / p.sum()
    stat, df = _chi2(tokens, p)
    assert stat < CHI2_CRIT[df], (name, stat, df)
    # acceptance probability is sum_x min(p, q), within 5 standard errors
    acc = np.minimum(p, q).sum()
    assert abs(n_acc.mean() - acc) < 5 * np.sqrt(acc * (1 - acc) / N_TRIALS + 1e-12), name
    if name != "identical":
        # power check: the drafts themselves (distributed as q) fail the same test
        assert _chi2(drafts, p)[0] > CHI2_CRIT[df], name
    else:
        assert np.all(n_acc == 1)


# K = 2: the joint distribution of the first two emitted tokens. A two-token "model" over V = 4:
# the target gives P1 at the first position and P2[x1] at the second (it depends on the first
# token, as a real model's does); the drafter drafts d0 ~ Q1, d1 ~ Q2[d0]. The verify batch's
# row 1 therefore holds P2[d0]. When d0 is rejected only one token is emitted, and the next
# round (id_last = x1, a fresh draft e0 ~ Q2[x1]) emits the second. Exact target joint:
# P(x1, x2) = P1[x1] * P2[x1, x2].
P1 = np.array([0.40, 0.30, 0.20, 0.10])
P2 = np.array(
    [[0.10, 0.20, 0.30, 0.40], [0.50, 0.20, 0.20, 0.10], [0.25] * 4, [0.70, 0.10, 0.10, 0.10]]
)
Q1 = np.array([0.10, 0.20, 0.30, 0.40])
Q2 = np.array(
    [[0.40, 0.30, 0.20, 0.10], [0.10, 0.10, 0.40, 0.40], [0.60, 0.20, 0.10, 0.10], [0.25] * 4]
)
#: chi-square quantile at 1 - 1e-4 for 15 degrees of freedom (scipy.stats.chi2.ppf).
CHI2_CRIT_15 = 44.263


def _two_token_joint(verifier, n_trials: int = N_TRIALS) -> np.ndarray:
    """Per trial the first two emitted tokens, flattened as x1 * 4 + x2 (a fresh jit per call,
    so a monkeypatched verifier is traced)."""
    lp1, lp2 = jnp.asarray(_log(P1)), jnp.asarray(_log(P2))
    q1, q2 = jnp.asarray(Q1, jnp.float32), jnp.asarray(Q2, jnp.float32)

    def trial(seed):
        params = SamplingParams.create(temperature=1.0, **PLAIN, seed=seed)
        d0 = jax.random.categorical(make_key(seed, 1, ROLE_DRAFT), jnp.log(q1)).astype(jnp.int32)
        d1 = jax.random.categorical(make_key(seed, 2, ROLE_DRAFT), jnp.log(q2[d0]))
        first = verifier(
            jnp.stack([lp1, lp2[d0], lp1]),  # row 2 (the bonus) is not looked at here
            jnp.stack([d0, d1.astype(jnp.int32)]),
            jnp.ones((2,), bool),
            jnp.stack([q1, q2[d0]]),
            params,
            jnp.int32(0),
        )
        x1 = first.tokens[0]
        e0 = jax.random.categorical(make_key(seed, 2, ROLE_DRAFT), jnp.log(q2[x1]))
        second = verifier(  # the next round, used when only x1 was emitted
            jnp.stack([lp2[x1], lp1, lp1]),
            jnp.stack([e0.astype(jnp.int32), jnp.int32(0)]),
            jnp.asarray([True, False]),
            jnp.stack([q2[x1], q2[x1]]),
            params,
            jnp.int32(1),
        )
        x2 = jnp.where(first.n_accepted >= 1, first.tokens[1], second.tokens[0])
        return x1 * 4 + x2

    seeds = jnp.arange(n_trials, dtype=jnp.uint32)
    return np.asarray(jax.jit(jax.vmap(trial))(seeds))


def test_rejection_k2_preserves_the_joint_of_two_emitted_tokens(monkeypatch):
    import specjax.decode.verify as verify_module

    joint = (P1[:, None] * P2).reshape(-1)
    samples = _two_token_joint(verify_rejection)
    stat, df = _chi2(samples, joint)
    assert df == 15 and stat < CHI2_CRIT_15, stat

    # power: verifiers broken only at K >= 2 fail the same test
    def wrong_row(logits_TV, draft_K, valid_K, q_KV, params, pos0):
        # tests d1 against the first position's p instead of P2[d0]
        logits_TV = logits_TV.at[1].set(logits_TV[0])
        return verify_rejection(logits_TV, draft_K, valid_K, q_KV, params, pos0)

    assert _chi2(_two_token_joint(wrong_row, 4000), joint)[0] > CHI2_CRIT_15
    # acceptance that is not a prefix: d1 accepted after d0 was rejected
    monkeypatch.setattr(
        verify_module,
        "_prefix_count",
        lambda accept_K, valid_K: jnp.sum(accept_K & valid_K).astype(jnp.int32),
    )
    assert _chi2(_two_token_joint(verify_rejection, 4000), joint)[0] > CHI2_CRIT_15


def test_rejection_zero_residual_falls_back_to_target_draw():
    # p == q and the draft token has q = 0 -> rejected with zero residual -> target's own draw,
    # which is what match emits for a token it can never sample.
    probs = np.array([0.5, 0.0, 0.3, 0.2], np.float32)
    logits_TV = jnp.asarray(np.stack([_log(probs)] * 2))
    params = SamplingParams.create(temperature=1.0, **PLAIN, seed=5)
    draft_K, valid_K = jnp.asarray([1], jnp.int32), jnp.ones((1,), bool)
    verify_rej, verify_mat = jax.jit(verify_rejection), jax.jit(verify_match)
    for pos0 in range(5):
        rej = verify_rej(
            logits_TV, draft_K, valid_K, jnp.asarray(probs)[None], params, jnp.int32(pos0)
        )
        ref = verify_mat(logits_TV, draft_K, valid_K, params, jnp.int32(pos0))
        assert int(rej.n_accepted) == 0
        assert int(rej.next_token) == int(ref.next_token)


# --------------------------------------------------------------------------------------------
# match


def test_match_greedy_accepts_argmax_chain_and_stops_at_mismatch():
    rng = np.random.default_rng(1)
    logits_TV = jnp.asarray(rng.normal(size=(5, 10)).astype(np.float32))
    argmax_T = np.argmax(np.asarray(logits_TV), axis=-1)
    params = SamplingParams.create(temperature=0.0, seed=3)
    match = jax.jit(verify_match)
    full = match(logits_TV, jnp.asarray(argmax_T[:4]), jnp.ones(4, bool), params, jnp.int32(9))
    assert int(full.n_accepted) == 4
    np.testing.assert_array_equal(np.asarray(full.tokens), argmax_T)

    wrong = argmax_T[:4].copy()
    wrong[2] = (wrong[2] + 1) % 10
    out = match(logits_TV, jnp.asarray(wrong), jnp.ones(4, bool), params, jnp.int32(9))
    assert int(out.n_accepted) == 2 and int(out.next_token) == argmax_T[2]
    np.testing.assert_array_equal(np.asarray(out.tokens), [*argmax_T[:3], PAD_TOKEN, PAD_TOKEN])

    short = match(
        logits_TV, jnp.asarray(wrong), jnp.asarray([True, True, False, False]), params, jnp.int32(9)
    )
    assert int(short.n_accepted) == 2 and int(short.next_token) == argmax_T[2]


def test_match_reproduces_plain_sampled_stream():
    """At temperature 0.8 (with a repeat penalty on row 0), match-verified speculative decoding
    emits exactly the tokens of plain decoding with the same keys and penalty windows."""
    vocab, k, n_gen, batch, width = 12, 3, 30, 2, 4
    table = jnp.asarray(np.random.default_rng(2).normal(size=(vocab, vocab)).astype(np.float32)) * 2
    params = SamplingParams.create(
        batch,
        temperature=0.8,
        top_k=8,
        top_p=0.95,
        min_p=0.02,
        repeat_penalty=jnp.asarray([1.5, 1.0]),
        seed=jnp.asarray([17, 4]),
    )
    prefix = [[7, 1, 2, 3], [0, 0, 9, 5]]  # sampler history; the last token is id_last
    pos_start = np.array([6, 9])  # position of id_last

    @jax.jit
    def step(recent_W, row, pos):
        logits = apply_penalties(
            table[recent_W[-1]], recent_W, jnp.ones(width, bool), row.repeat_penalty
        )
        return sample_token(logits, row, make_key(row.seed, pos, ROLE_SAMPLE))

    plain = []
    for b in range(batch):
        row = jax.tree.map(lambda x, b=b: x[b], params)
        hist = list(prefix[b])
        for i in range(n_gen * (k + 1) + k + 1):
            hist.append(int(step(jnp.asarray(hist[-width:]), row, pos_start[b] + 1 + i)))
        plain.append(hist[width:])

    verify = jax.jit(verify_rows)
    rng = np.random.default_rng(3)
    out = [[] for _ in range(batch)]
    pos0 = pos_start.copy()
    n_accepted_total, n_rejected_total = 0, 0
    while min(len(o) for o in out) < n_gen:
        tokens = np.zeros((batch, k), np.int32)
        valid = np.zeros((batch, k), bool)
        recent = np.zeros((batch, width), np.int32)
        for b in range(batch):
            done = len(out[b])
            truth = plain[b][done : done + k]
            tokens[b, :] = [t if rng.random() < 0.7 else int(rng.integers(vocab)) for t in truth]
            valid[b, : int(rng.integers(0, k + 1))] = True
            recent[b] = (prefix[b] + out[b])[-width:]
        ids = np.concatenate([recent[:, -1:], tokens], axis=1)
        res = verify(
            table[ids],
            DraftOutput(tokens=jnp.asarray(tokens), valid=jnp.asarray(valid)),
            params,
            jnp.asarray(pos0),
            recent_BW=jnp.asarray(recent),
            recent_valid_BW=jnp.ones((batch, width), bool),
        )
        n_acc = np.asarray(res.n_accepted)
        for b in range(batch):
            out[b].extend(np.asarray(res.tokens[b, : n_acc[b] + 1]).tolist())
            n_accepted_total += int(n_acc[b])
            n_rejected_total += int(n_acc[b] < valid[b].sum())
        pos0 = pos0 + n_acc + 1
    for b in range(batch):
        assert out[b][:n_gen] == plain[b][:n_gen]
    assert n_accepted_total > 5 and n_rejected_total > 2


# --------------------------------------------------------------------------------------------
# synthetic


def test_resolve_synthetic_rates_edge_cases():
    np.testing.assert_array_equal(resolve_synthetic_rates(4, length=5.0), np.ones(4))
    np.testing.assert_array_equal(resolve_synthetic_rates(4, length=1.0), np.zeros(4))
    a = synthetic_acceptance_rates(5, length=3.4)
    p = a[0]
    assert abs(sum(p ** (j + 1) for j in range(5)) - 2.4) < 1e-8
    np.testing.assert_allclose(a, [p ** (j + 1) for j in range(5)], rtol=1e-12)
    np.testing.assert_allclose(resolve_synthetic_rates(5, length=3.4), np.full(5, p), rtol=1e-12)
    np.testing.assert_allclose(resolve_synthetic_rates(3, rates=[0.8, 0.4, 0.0]), [0.8, 0.5, 0.0])
    np.testing.assert_array_equal(resolve_synthetic_rates(3, rates=[0.0, 0.0, 0.0]), np.zeros(3))
    assert resolve_synthetic_rates(3) is None
    assert resolve_synthetic_rates(3, length=-1.0, rates=[]) is None


@pytest.mark.parametrize(
    ("k", "length", "rates", "message"),
    [
        (3, 2.0, [0.5, 0.4, 0.3], "mutually exclusive"),
        (0, 1.5, None, "at least one speculative token"),
        (3, None, [0.5, 0.4], "must contain 3 values, got 2"),
        (2, None, [1.5, 0.4], "finite and within \\[0, 1\\]"),
        (2, None, [float("nan"), 0.4], "finite and within \\[0, 1\\]"),
        (2, None, [0.4, 0.5], "monotonically non-increasing"),
        (3, 4.5, None, "within \\[1, 4\\]"),
        (3, 0.5, None, "within \\[1, 4\\]"),
        (3, float("inf"), None, "within \\[1, 4\\]"),
    ],
)
def test_resolve_synthetic_rates_rejects_invalid(k, length, rates, message):
    with pytest.raises(ValueError, match=message):
        resolve_synthetic_rates(k, length=length, rates=rates)


def test_synthetic_mean_acceptance_length_and_no_eog():
    k, vocab, n = 5, 6, 8000
    rates = jnp.asarray(resolve_synthetic_rates(k, length=3.4), jnp.float32)
    logits_TV = jnp.asarray(np.random.default_rng(4).normal(size=(k + 1, vocab)).astype(np.float32))
    params = SamplingParams.create(temperature=0.8, seed=21)
    eog_V = jnp.zeros(vocab, bool).at[5].set(True)

    @jax.jit
    def run(draft_K, rates_K):
        def one(pos0):
            return verify_synthetic(
                logits_TV, draft_K, jnp.ones(k, bool), params, pos0, rates_K, eog_V
            )

        return jax.vmap(one)(jnp.arange(n, dtype=jnp.int32) * (k + 1))

    res = run(jnp.asarray([0, 1, 2, 3, 4], jnp.int32), rates)
    mean_len = float(np.mean(np.asarray(res.n_accepted) + 1))
    assert abs(mean_len - 3.4) < 0.08, mean_len

    # an EOG draft token at position 2 is never accepted, even with rate 1
    res = run(jnp.asarray([0, 1, 5, 3, 4], jnp.int32), jnp.ones(k, jnp.float32))
    assert np.all(np.asarray(res.n_accepted) == 2)
    # the correction is the target's own draw at row 2 (position pos0 + 3 = 3 for trial 0)
    own = jax.jit(sample_token)(logits_TV[2], params, make_key(21, 3, ROLE_SAMPLE))
    assert int(res.next_token[0]) == int(own)


def test_replay_accepts_everything_valid():
    rng = np.random.default_rng(5)
    logits_TV = jnp.asarray(rng.normal(size=(4, 7)).astype(np.float32))
    params = SamplingParams.create(temperature=0.0)
    draft = jnp.asarray([6, 6, 6], jnp.int32)  # not what the target wants
    argmax_T = np.argmax(np.asarray(logits_TV), axis=-1)
    assert argmax_T[0] != 6
    replay = jax.jit(verify_replay)
    for n_valid in range(4):
        valid = jnp.arange(3) < n_valid
        out = replay(logits_TV, draft, valid, params, jnp.int32(0))
        assert int(out.n_accepted) == n_valid
        assert int(out.next_token) == argmax_T[n_valid]


# --------------------------------------------------------------------------------------------
# verify_rows: branch order, per-row equivalence, one trace


def test_verify_rows_branch_order_and_single_trace():
    b, k, vocab = 4, 3, 8
    rng = np.random.default_rng(6)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logits, draft, params, pos0, replay, has_q):
        return verify_rows(logits, draft, params, pos0, replay_B=replay, has_q_B=has_q)

    @jax.jit
    def refs(logits, tokens, valid, q, params, pos0):
        def one(lg, tk, vd, qq, pr, p0):
            return (
                verify_match(lg, tk, vd, pr, p0),
                verify_rejection(lg, tk, vd, qq, pr, p0),
                verify_replay(lg, tk, vd, pr, p0),
            )

        return jax.vmap(one)(logits, tokens, valid, q, params, pos0)

    for round_ in range(3):
        logits = jnp.asarray(rng.normal(size=(b, k + 1, vocab)).astype(np.float32))
        q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, vocab)).astype(np.float32)))
        tokens = jnp.asarray(rng.integers(vocab, size=(b, k)).astype(np.int32))
        if round_ == 1:  # greedy drafts -> all accepted on match rows
            tokens = jnp.argmax(logits[:, :k], axis=-1).astype(jnp.int32)
        valid = jnp.arange(k)[None, :] < jnp.asarray([3, 2, 3, 1])[:, None]
        draft = DraftOutput(tokens=tokens, valid=valid, q=q)
        temps = jnp.asarray([0.0, 0.9, 0.9, 0.5 + 0.2 * round_])
        params = SamplingParams.create(b, temperature=temps, seed=jnp.arange(b) + round_)
        replay = jnp.asarray([False, False, False, round_ == 2])
        has_q = jnp.asarray([True, True, False, True])
        pos0 = jnp.asarray([3, 8, 1, 20]) + round_
        out = step(logits, draft, params, pos0, replay, has_q)

        want_branch = [
            BRANCH_MATCH,
            BRANCH_REJECTION,
            BRANCH_MATCH,
            BRANCH_REPLAY if round_ == 2 else BRANCH_REJECTION,
        ]
        np.testing.assert_array_equal(np.asarray(out.branch), want_branch)
        by_branch = dict(
            zip(
                (BRANCH_MATCH, BRANCH_REJECTION, BRANCH_REPLAY),
                refs(logits, tokens, valid, q, params, pos0),
            )
        )
        for row in range(b):
            ref = by_branch[want_branch[row]]
            np.testing.assert_array_equal(np.asarray(out.tokens[row]), np.asarray(ref.tokens[row]))
            assert int(out.n_accepted[row]) == int(ref.n_accepted[row])
        if round_ == 1:
            assert int(out.n_accepted[0]) == 3  # greedy row accepted the argmax chain


def test_verify_rows_synthetic_switch_keeps_replay_rows():
    b, k, vocab = 2, 2, 5
    logits = jnp.zeros((b, k + 1, vocab), jnp.float32)
    draft = DraftOutput(
        tokens=jnp.asarray([[1, 2], [1, 2]], jnp.int32), valid=jnp.ones((b, k), bool)
    )
    params = SamplingParams.create(b, temperature=0.0)
    out = jax.jit(verify_rows)(
        logits,
        draft,
        params,
        jnp.asarray([0, 0]),
        replay_B=jnp.asarray([False, True]),
        synth_rates_K=jnp.zeros(k, jnp.float32),
        eog_V=jnp.zeros(vocab, bool),
    )
    np.testing.assert_array_equal(np.asarray(out.branch), [BRANCH_SYNTHETIC, BRANCH_REPLAY])
    np.testing.assert_array_equal(np.asarray(out.n_accepted), [0, 2])
    with pytest.raises(ValueError, match="eog_V"):
        verify_rows(logits, draft, params, jnp.asarray([0, 0]), synth_rates_K=jnp.zeros(k))


def test_verify_greedy_equals_verify_rows_at_temperature_zero() -> None:
    """The engine's greedy fast path must be bit-identical to the general verifier."""
    from specjax.decode.verify import first_argmax, verify_greedy, verify_rows
    from specjax.drafters.base import DraftOutput
    from specjax.sampling import SamplingParams

    b, k, v = 6, 4, 9
    rng = np.random.default_rng(0)
    # small integer logits: plenty of ties, which must resolve to the lowest index
    logits = jnp.asarray(rng.integers(0, 3, (b, k + 1, v)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    tokens = argmax[:, :k].copy()
    tokens[1, 2] = (tokens[1, 2] + 1) % v  # reject at position 2
    tokens[2, 0] = (tokens[2, 0] + 1) % v  # reject at once
    valid = np.ones((b, k), bool)
    valid[3, 2:] = False  # a short draft, fully accepted
    valid[4] = False  # no draft at all
    draft = DraftOutput(tokens=jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    params = SamplingParams.create(batch=b, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    # compiled, as the engine runs them (op by op, each jnp op would compile its own program)
    fast = jax.jit(lambda lg, d: verify_greedy(first_argmax(lg), d))(logits, draft)
    full = jax.jit(verify_rows)(logits, draft, params, jnp.arange(b, dtype=jnp.int32) + 10)
    for name in ("n_accepted", "next_token", "tokens", "branch"):
        np.testing.assert_array_equal(
            np.asarray(getattr(fast, name)), np.asarray(getattr(full, name))
        )
    np.testing.assert_array_equal(np.asarray(fast.n_accepted), [4, 2, 0, 2, 0, 4])


def test_first_argmax_is_argmax_with_lowest_index_on_ties() -> None:
    from specjax.decode.verify import first_argmax

    rng = np.random.default_rng(1)
    ties = rng.integers(0, 3, (7, 5, 11)).astype(np.float32)  # many ties
    wide = rng.standard_normal((3, 2, 2048)).astype(np.float32)
    for x in (ties, wide, -np.abs(ties) - 1e30):
        for axis in (-1, 1):
            np.testing.assert_array_equal(
                np.asarray(first_argmax(jnp.asarray(x), axis=axis)), np.argmax(x, axis=axis)
            )
