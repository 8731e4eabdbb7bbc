"""draft-mtp on the qwen35 hybrid target.

* The trunk's h_nextn (`forward(..., return_hidden=True)`) and the MTP block
  (`qwen35_mtp.nextn_forward`) against a float64 NumPy transcription of llama.cpp's graphs
  (tests/oracles/qwen35_reference.py, qwen35_mtp_reference.py).
* The drafter's pairing bookkeeping (process / accept / rollback / draft, standard and
  chain-heads modes) against a plain-Python transcription of upstream's driver built on that
  reference: (x_p, h_{p-1}) rows, pending_h = verify_h[n_accepted].
* Greedy speculative == plain greedy on the hybrid engine (B = 4 rows of different prompt
  lengths) on the RS path (n_rs_seq = 4; drafts of 6, and shorter ones where the budget cuts
  them, so both planes and checkpoints are taken) and the FULL path (checkpoint + replay),
  with the counters showing the path, drafts made and rejected.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.qwen35_mtp_reference import MtpReference, draft_chain, draft_standard, random_norms
from oracles.qwen35_reference import Reference

from specjax import api
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.drafters.base import DraftInput, TargetBatch, TokenHistory
from specjax.drafters.draft_mtp import H_NEXTN, MtpDrafter
from specjax.drafters.registry import build_drafters
from specjax.models import qwen35 as q
from specjax.models import qwen35_mtp as mtp
from specjax.testing import tiny_qwen35_config

CFG = tiny_qwen35_config(max_position=256, n_nextn=1)
CFG2 = q.Qwen35Config.from_dict({**CFG.to_dict(), "n_nextn": 2})
S = 32


@functools.lru_cache(maxsize=2)
def _params(n_nextn: int = 1) -> dict:
    cfg = CFG if n_nextn == 1 else CFG2
    return random_norms(q.init_params(cfg, jax.random.PRNGKey(0), std=0.2))


def _rows(lengths: tuple[int, ...], seed: int = 1) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, CFG.V, size=n) for n in lengths]


def _batch(rows: list[np.ndarray], start: list[int], width: int) -> tuple[np.ndarray, np.ndarray]:
    toks = np.zeros((len(rows), width), np.int32)
    pos = np.full((len(rows), width), -1, np.int32)
    for b, r in enumerate(rows):
        toks[b, : len(r)] = r
        pos[b, : len(r)] = start[b] + np.arange(len(r))
    return toks, pos


@functools.partial(jax.jit, static_argnames=("cfg",))
def _trunk(cfg, params, toks, pos, state):
    return q.forward(cfg, params, toks, pos, state, return_hidden=True)


def _trunk_reference(params: dict, tokens: np.ndarray) -> tuple[Reference, list[np.ndarray]]:
    ref = Reference(CFG, params)
    hs = []
    for p, t in enumerate(tokens):
        ref.step(int(t), p)
        hs.append(ref.h_nextn.copy())
    return ref, hs


@pytest.mark.slow  # the driver tests below also check h_nextn (their drafts read it)
def test_trunk_exports_final_normed_hidden() -> None:
    """h_nextn = output_norm(last layer's output) for every row; logits unchanged."""
    rows = _rows((11, 6))
    toks, pos = _batch(rows, [0, 0], 11)
    out = _trunk(CFG, _params(), jnp.asarray(toks), jnp.asarray(pos), q.new_state(CFG, 2, S))
    plain = jax.jit(q.forward, static_argnums=0)(
        CFG, _params(), jnp.asarray(toks), jnp.asarray(pos), q.new_state(CFG, 2, S)
    )
    assert plain.hidden is None
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(plain.logits))
    for b, r in enumerate(rows):
        _, hs = _trunk_reference(_params(), r)
        np.testing.assert_allclose(np.asarray(out.hidden[b, : len(r)]), np.stack(hs), atol=2e-4)


@jax.jit
def _nextn_prefill(params, toks, h, pos, cache):
    out = mtp.nextn_forward(CFG, params, 0, toks, h, pos, cache, cache_empty=True)
    return out, q.commit_kv(cache, pos, (out.k,), (out.v,))


@jax.jit
def _nextn_step(params, toks, h, pos, cache):
    out = mtp.nextn_forward(CFG, params, 0, toks, h, pos, cache)
    return out, q.commit_kv(cache, pos, (out.k,), (out.v,))


def test_nextn_block_matches_float64_reference() -> None:
    """7 rows at once into an empty block cache, then 2 one-row steps reading it; logits and
    the block's own h' (the next draft step's input) as llama.cpp's graph_mtp."""
    rng = np.random.RandomState(3)
    toks = rng.randint(0, CFG.V, size=9)
    hs = rng.standard_normal((9, CFG.D))
    ref = MtpReference(CFG, _params())
    want = [ref.step(int(t), h, p) for p, (t, h) in enumerate(zip(toks, hs))]
    cache = mtp.new_nextn_cache(CFG, 1, S)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out, cache = _nextn_prefill(
        _params(), jnp.asarray(toks[None, :7]), f32(hs[None, :7]), jnp.arange(7)[None], cache
    )
    got = [(np.asarray(out.logits[0, t]), np.asarray(out.hidden[0, t])) for t in range(7)]
    for p in (7, 8):
        out, cache = _nextn_step(
            _params(), jnp.asarray(toks[None, p : p + 1]), f32(hs[None, p : p + 1]),
            jnp.asarray([[p]]), cache,
        )  # fmt: skip
        got.append((np.asarray(out.logits[0, 0]), np.asarray(out.hidden[0, 0])))
    for (gl, gh), (wl, wh) in zip(got, want):
        np.testing.assert_allclose(gl, wl, atol=2e-4 * np.abs(wl).max())
        np.testing.assert_allclose(gh, wh, atol=2e-4)


def _inp(last: np.ndarray, length: np.ndarray, drafting: np.ndarray) -> DraftInput:
    B = len(last)
    return DraftInput(
        history=TokenHistory(
            tokens=jnp.zeros((B, S), jnp.int32), length=jnp.asarray(length, jnp.int32)
        ),
        last_token=jnp.asarray(last, jnp.int32),
        n_max=jnp.full((B,), 8, jnp.int32),
        drafting=jnp.asarray(drafting),
        n_min=jnp.zeros((), jnp.int32),
        p_min=jnp.zeros((), jnp.float32),
        temperature=jnp.zeros((B,), jnp.float32),
    )


W = 9  # every batch the drafter sees is padded to this width (one compiled `process`)


def _process(drafter: MtpDrafter, params, ds, toks, pos, h):
    pad = W - toks.shape[1]
    toks = np.pad(np.asarray(toks, np.int32), ((0, 0), (0, pad)))
    pos = np.pad(np.asarray(pos, np.int32), ((0, 0), (0, pad)), constant_values=-1)
    h = np.pad(np.asarray(h, np.float32), ((0, 0), (0, pad), (0, 0)))
    batch = TargetBatch(tokens=toks, positions=pos, hidden={H_NEXTN: h})
    return jax.jit(drafter.process)(params, ds, batch)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _accept_rollback(drafter: MtpDrafter, ds, n_acc, keep, accept: bool = True):
    if accept:
        B = n_acc.shape[0]
        ds = drafter.accept(ds, n_acc, jnp.zeros(B, bool), jnp.ones(B, bool))
    return drafter.rollback(ds, keep)


def _run_rounds(cfg, drafter: MtpDrafter, n_nextn: int) -> None:
    """Prompt (2 rows of 9 and 5 tokens) -> draft; a verify batch of 4 rows -> accept 1 ->
    rollback -> draft from a new token; every draft checked against the reference driver."""
    params = _params(n_nextn)
    prompts = _rows((9, 5), seed=7)
    toks, pos = _batch(prompts, [0, 0], 9)
    state = q.new_state(cfg, 2, S)
    out = _trunk(cfg, params, jnp.asarray(toks), jnp.asarray(pos), state)
    ds = drafter.init(2, S)
    ds = _process(drafter, params, ds, toks, pos, out.hidden)
    ref_blocks, ref_trunks, ref_h = [], [], []
    for r in prompts:
        blocks = [MtpReference(cfg, params, j) for j in range(n_nextn)]
        trunk, hs = _trunk_reference(params, r)
        for blk in blocks:  # process(): (x_p, h_{p-1}), h_{-1} = pending_h = 0
            for p, t in enumerate(r):
                blk.step(int(t), hs[p - 1] if p else np.zeros(cfg.D), p)
        ref_blocks.append(blocks)
        ref_trunks.append(trunk)
        ref_h.append(hs)

    def ref_draft(b: int, last: int, pending: np.ndarray, pos0: int) -> list[int]:
        if n_nextn == 1:
            return draft_standard(ref_blocks[b][0], last, pending, pos0, drafter.max_draft_len)
        return draft_chain(ref_blocks[b], last, pending, pos0, drafter.max_draft_len)

    first = np.asarray([5, 11])
    lengths = np.asarray([9, 5])
    K = 4
    run_draft = jax.jit(drafter.draft, static_argnums=3)
    ds, d = run_draft(params, ds, _inp(first, lengths, np.asarray([True, True])), K)
    for b in range(2):
        want = ref_draft(b, int(first[b]), ref_h[b][-1], int(lengths[b]))
        assert np.asarray(d.tokens[b])[: len(want)].tolist() == want
        assert int(d.length[b]) == drafter.max_draft_len
    # verify batch [first, 3 tokens] at lengths..lengths+3; accept 1 -> keep lengths + 2
    vrows = [np.asarray([first[b], 1, 2, 3]) for b in range(2)]
    vt, vp = _batch(vrows, list(lengths), 4)
    out = _trunk(cfg, params, jnp.asarray(vt), jnp.asarray(vp), out.state)
    ds = _process(drafter, params, ds, vt, vp, out.hidden)
    ds = _accept_rollback(drafter, ds, np.asarray([1, 1]), np.asarray(lengths + 2))
    nxt = np.asarray([7, 9])
    ds, d = run_draft(params, ds, _inp(nxt, lengths + 2, np.asarray([True, True])), K)
    for b in range(2):
        hv = []
        for i, t in enumerate(vrows[b]):
            ref_trunks[b].step(int(t), int(lengths[b]) + i)
            hv.append(ref_trunks[b].h_nextn.copy())
        for blk in ref_blocks[b]:
            for i, t in enumerate(vrows[b]):
                blk.step(int(t), hv[i - 1] if i else ref_h[b][-1], int(lengths[b]) + i)
            blk.truncate(int(lengths[b]) + 2)
        want = ref_draft(b, int(nxt[b]), hv[1], int(lengths[b]) + 2)
        got = np.asarray(d.tokens[b])[: len(want)].tolist()
        assert got == want, (b, got, want)
        ref_h[b] = hv
    # a checkpointed round: verify [nxt, 1, 2] (no accept), restore to lengths + 2, replay
    # [nxt, 4] and accept it. As the engine does, the checkpoint's data_spec (spec_state,
    # taken before the round) is loaded back, so the replay's first row pairs with h@lengths+1
    # again. The drafter only pairs rows, so the h rows here are arbitrary.
    rng = np.random.RandomState(5)
    hA = rng.standard_normal((2, 3, cfg.D)).astype(np.float32)
    hB = rng.standard_normal((2, 2, cfg.D)).astype(np.float32)
    L2 = lengths + 2
    for rows, hx, n_acc in (([nxt, [1] * 2, [2] * 2], hA, None), ([nxt, [4] * 2], hB, 1)):
        t = np.stack([np.asarray(r) for r in rows], axis=1).astype(np.int32)
        p = L2[:, None] + np.arange(t.shape[1])[None]
        saved = drafter.spec_state(ds)
        ds = _process(drafter, params, ds, t, p, hx)
        if n_acc is None:  # upstream skips accept() for a restored round
            ds = _accept_rollback(drafter, ds, np.asarray([0, 0]), L2, False)
            ds = drafter.set_spec_state(ds, saved, jnp.ones(2, bool))
        else:
            ds = _accept_rollback(drafter, ds, np.asarray([n_acc] * 2), L2 + n_acc + 1)
    last = np.asarray([6, 2])
    ds, d = run_draft(params, ds, _inp(last, L2 + 2, np.asarray([True, True])), K)
    for b in range(2):
        for blk in ref_blocks[b]:
            for toks_b, hx in (([nxt[b], 1, 2], hA[b]), ([nxt[b], 4], hB[b])):
                blk.truncate(int(L2[b]))
                for i, tk in enumerate(toks_b):
                    blk.step(int(tk), hx[i - 1] if i else ref_h[b][1], int(L2[b]) + i)
            blk.truncate(int(L2[b]) + 2)
        want = ref_draft(b, int(last[b]), hB[b][1], int(L2[b]) + 2)
        got = np.asarray(d.tokens[b])[: len(want)].tolist()
        assert got == want, ("replay", b, got, want)


def test_standard_mode_pairing_and_drafts_match_reference_driver() -> None:
    _run_rounds(CFG, MtpDrafter(config=CFG, max_draft_len=3), 1)


def _chain_drafter() -> MtpDrafter:
    spec = SpecConfig(types=("draft-mtp",), draft_n_max=5)
    (drafter,), _ = build_drafters(spec, api.Model(config=CFG2, params=_params(2)), None)
    return drafter


def test_chain_heads_clamp_n_max_to_the_head_count() -> None:
    drafter = _chain_drafter()
    assert drafter.chain_heads and drafter.max_draft_len == 2  # n_max 5 clamped to 2 heads
    (one,), _ = build_drafters(
        SpecConfig(types=("draft-mtp",), draft_n_max=5), api.Model(config=CFG, params=_params()),
        None,
    )  # fmt: skip
    assert not one.chain_heads and one.max_draft_len == 5


@pytest.mark.slow
def test_chain_heads_match_reference_driver() -> None:
    _run_rounds(CFG2, _chain_drafter(), 2)


def test_state_blob_round_trip_and_bad_sizes() -> None:
    d = MtpDrafter(config=CFG, max_draft_len=3)
    st = d.init(2, S)
    assert d.get_state(st, 0) is None  # no pairing yet
    h = np.arange(CFG.D, dtype=np.float32)
    blob = (12).to_bytes(4, "little", signed=True) + h.astype("<f4").tobytes()
    st2 = d.set_state(st, 1, blob)
    assert d.get_state(st2, 1) == blob and d.get_state(st2, 0) is None
    assert d.set_state(st, 1, blob[:-1]) is st  # a wrong-sized blob is ignored
    # the traced form (a checkpoint's data_spec) restores exactly the selected rows
    saved = d.spec_state(st2)
    back = d.set_spec_state(st, saved, jnp.asarray([False, True]))
    assert d.get_state(back, 1) == blob and d.get_state(back, 0) is None
    assert d.get_state(d.set_spec_state(st, saved, jnp.asarray([False, False])), 1) is None


def test_bad_models_are_refused_with_the_numbers() -> None:
    no_mtp = q.Qwen35Config.from_dict({**CFG.to_dict(), "n_nextn": 0})
    with pytest.raises(ValueError, match="nextn"):
        MtpDrafter(config=no_mtp, max_draft_len=3)
    with pytest.raises(ValueError, match=r"at most 2 tokens.*got max_draft_len 3"):
        MtpDrafter(config=CFG2, max_draft_len=3)


# ------------------------------------------------------------------------ hybrid engine
ECFG = q.Qwen35Config.from_dict({**CFG.to_dict(), "vocab_size": 8})
N_NEW = 64


@functools.lru_cache(maxsize=2)
def _model(n_nextn: int = 1) -> api.Model:
    cfg = q.Qwen35Config.from_dict({**ECFG.to_dict(), "n_nextn": n_nextn})
    return api.Model(config=cfg, params=q.init_params(cfg, jax.random.PRNGKey(1), std=0.2))


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(0)
    return [[int(t) for t in rng.randint(0, ECFG.V, size=n)] for n in (5, 12, 20, 9)]


@functools.lru_cache(maxsize=1)
def _plain() -> list[list[int]]:
    return generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128).tokens


def _check_drafted(d: dict) -> None:
    assert list(d["drafters"]) == ["draft-mtp"]
    assert d["num_draft_tokens"] > d["num_accepted_tokens"] > 0  # drafts made, some rejected
    assert d["rollback"]["seq_rm_failed"] == 0


@pytest.mark.slow  # suite time: tests/test_hybrid_shipped.py runs draft-mtp's RS path on the shipped model
def test_rs_path_equals_plain_greedy() -> None:
    """n_rs_seq = 4, draft n_max 6: full drafts roll back by checkpoint + replay; drafts the
    budget cuts to <= 4 near a row's end roll back by an RS plane."""
    spec = SpecConfig(types=("draft-mtp",), draft_n_max=6)
    res = generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=spec, n_rs_seq=4)
    assert res.tokens == _plain()
    d = res.stats.to_dict()
    _check_drafted(d)
    paths = d["rollback"]
    assert d["seq_rm_type"] == "RS" and d["n_rs_seq"] == 4
    assert paths["rs_plane"] > 0 and paths["checkpoint"] > 0
    assert paths["replay"] == paths["checkpoint"]


@pytest.mark.slow  # the RS test takes checkpoint + replay too; this one only them
def test_full_path_equals_plain_greedy() -> None:
    spec = SpecConfig(types=("draft-mtp",), draft_n_max=3)
    res = generate(_model(), _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=spec, n_rs_seq=0)
    assert res.tokens == _plain()
    d = res.stats.to_dict()
    _check_drafted(d)
    assert d["seq_rm_type"] == "FULL" and d["rollback"]["rs_plane"] == 0
    assert d["rollback"]["checkpoint"] > 0
    assert d["rollback"]["replay"] == d["rollback"]["checkpoint"]


@pytest.mark.slow
@pytest.mark.usefixtures("no_compile_cache")
def test_gpu_forms_equal_plain_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round as traced for a GPU where it differs from the CPU's for this target, run here
    on CPU: the verify scan unrolled (`control.unroll_stacking_scans`) and the narrow
    verify's hidden states concatenated into the widest one's buffer (`control.put_prefix`).
    Greedy equals plain greedy, with the CPU form's drafts (the same statistics)."""
    from specjax import aot, control
    from specjax.decode import engine

    def gpu_put_prefix(base: jax.Array, x: jax.Array, axis: int) -> jax.Array:
        with aot.backend_as("gpu"):
            return control.put_prefix(base, x, axis)

    spec = SpecConfig(types=("draft-mtp",), draft_n_max=3)
    kw = dict(max_new_tokens=N_NEW, n_ctx=128, spec=spec)
    cpu = generate(_model(), _prompts(), **kw)
    api.clear_compiled()
    jax.clear_caches()  # trace again, in the GPU's forms
    monkeypatch.setattr(q, "unroll_stacking_scans", lambda: True)
    monkeypatch.setattr(engine, "put_prefix", gpu_put_prefix)
    gpu = generate(_model(), _prompts(), **kw)
    api.clear_compiled()
    jax.clear_caches()
    assert gpu.tokens == _plain()
    _check_drafted(gpu.stats.to_dict())
    assert gpu.stats.to_dict() == cpu.stats.to_dict()


@pytest.mark.slow
def test_chain_heads_engine_equals_plain_greedy_with_drafts_of_two() -> None:
    spec = SpecConfig(types=("draft-mtp",), draft_n_max=6)
    model = _model(2)
    plain = generate(model, _prompts(), max_new_tokens=N_NEW, n_ctx=128).tokens
    res = generate(model, _prompts(), max_new_tokens=N_NEW, n_ctx=128, spec=spec,
                          n_rs_seq=4)  # fmt: skip
    assert res.tokens == plain
    d = res.stats.to_dict()
    _check_drafted(d)
    assert d["rollback"]["checkpoint"] == 0  # drafts of <= 2 always fit the 4 planes
    assert d["num_draft_tokens"] <= 2 * d["num_drafts"]
