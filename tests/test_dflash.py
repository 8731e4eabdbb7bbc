"""draft-dflash / draft-dspark: lossless engine runs, upstream's clamp and its warning, and a
process/draft sequence replayed against a plain-Python transcription of spec 5.4."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.dflash_reference import DFlashRef

from specjax.api import Model, generate
from specjax.config import SpecConfig
from specjax.drafters.base import DraftInput, TargetBatch, TokenHistory
from specjax.drafters.dflash import make_drafter
from specjax.models import dflash as df
from specjax.testing import tiny_block_head as block_head
from specjax.testing import tiny_model

MODELS = Path(__file__).resolve().parent.parent / "models"

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40]]
MAX_NEW = [24, 24, 10, 24]


@pytest.fixture(scope="module")
def target() -> Model:
    return tiny_model(0)


@pytest.fixture(scope="module")
def plain(target: Model):
    return generate(target, PROMPTS, max_new_tokens=MAX_NEW)


# ------------------------------------------------------------------------------ engine
# draft-dflash's engine path is draft-dspark's without the Markov head: only one runs by default
@pytest.mark.parametrize(
    "kind", [pytest.param("draft-dflash", marks=pytest.mark.slow), "draft-dspark"]
)
def test_greedy_b4_is_lossless_with_drafts_made_and_rejected(target, plain, kind):
    head = block_head(target, kind == "draft-dspark", sample_from_anchor=False)
    for n_max in (1, 3):  # n_max is traced: one compiled program
        spec = SpecConfig(types=(kind,), adaptive=False, draft_n_max=n_max)
        out = generate(target, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, draft=head)
        assert out.tokens == plain.tokens
        st = out.stats.to_dict()
        assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"], st


@pytest.mark.slow
def test_chained_with_ngram_drafter_is_lossless(target, plain):
    head = block_head(target, False)
    spec = SpecConfig(types=("ngram-simple", "draft-dflash"), adaptive=False, draft_n_max=3)
    out = generate(target, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, draft=head)
    assert out.tokens == plain.tokens


@pytest.mark.parametrize("dspark", [False, True])
def test_on_cpu_the_heads_products_run_on_the_native_kernel(target, dspark):
    """With the CPU kernel, the engine gets `fc`, the layers' linear weights and the LM head
    as `KernelWeight`s (made once per set of weights): a block's few-row products then call
    the kernel instead of XLA's dots (~1 ms of a round on a 2-core CPU before), with the
    same drafts."""
    from specjax import api
    from specjax.drafters.registry import build_drafters
    from specjax.kernels import cpu as cpu_kernels
    from specjax.models import llama

    if not cpu_kernels.available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    head = block_head(target, dspark)
    kind = "draft-dspark" if dspark else "draft-dflash"
    spec = SpecConfig(types=(kind,), adaptive=False)
    (drafter,), (params,) = build_drafters(spec, target, head)
    form = api.drafter_decode_params(drafter.name, params)
    assert form is api.drafter_decode_params(drafter.name, params)
    # made once per set of weights: a new build wraps the same arrays in new dicts (made
    # again every call, the copies' churn slowed the next decode loop ~5%)
    (_,), (rebuilt,) = build_drafters(spec, target, head)
    assert rebuilt is not params and api.drafter_decode_params(drafter.name, rebuilt) is form
    assert isinstance(form["head"]["fc"], llama.KernelWeight)
    assert isinstance(form["head"]["lm_head"], llama.KernelWeight)
    for layer in form["head"]["layers"]:
        assert all(isinstance(layer[k], llama.KernelWeight) for k in llama.LINEAR_WEIGHTS)
    cfg = drafter.config
    feats = jax.random.normal(jax.random.key(3), (1, 3, cfg.n_embd_enc))
    pos = jnp.arange(3, dtype=jnp.int32)[None]

    def block(p):
        g = df.encode(cfg, p["head"], feats)
        kv = df.inject_kv(cfg, p["head"], g, pos)
        ctx = (kv, pos)
        tokens = jnp.asarray([[5, cfg.mask_token_id, cfg.mask_token_id]], jnp.int32)
        out = df.block_forward(
            cfg, p["head"], p["shared"], tokens, pos + 3, jnp.full((1, 3), 5), None, ctx
        )
        return out.logits

    fn = jax.jit(block)
    assert "specjax_linear" in fn.lower(form).as_text()
    assert "specjax_" not in fn.lower(params).as_text()
    np.testing.assert_allclose(fn(form), fn(params), rtol=2e-3, atol=2e-3)

    # the engine's path: the context in the head's cache (as the drafter keeps it), the
    # block's attention on the attention kernel too; padding rows (position -1) excluded,
    # as the drafter never reads them
    def cached_block(p):
        g = df.encode(cfg, p["head"], feats)
        kv = df.inject_kv(cfg, p["head"], g, pos)
        cache = llama.commit_kv(llama.new_cache(cfg.layer_config, 1, 16), pos, kv.k, kv.v)
        tokens = jnp.asarray([[5, cfg.mask_token_id, cfg.mask_token_id, 0]], jnp.int32)
        block_pos = jnp.asarray([[3, 4, 5, -1]], jnp.int32)
        mask_pos = jnp.asarray([[5, 5, 5, -1]], jnp.int32)
        out = df.block_forward(cfg, p["head"], p["shared"], tokens, block_pos, mask_pos, cache)
        return out.logits[:, :3]

    fn = jax.jit(cached_block)
    assert "specjax_attend_cache" in fn.lower(form).as_text()
    assert "specjax_" not in fn.lower(params).as_text()
    np.testing.assert_allclose(fn(form), fn(params), rtol=2e-3, atol=2e-3)


def test_clamp_warns_and_limits_the_draft_width(target):
    from specjax.drafters.registry import build_drafters

    head = block_head(target, True)  # block 4: DFlash drafts <= 3, DSpark (anchor) <= 4
    with pytest.warns(UserWarning, match=r"n_max=9, n_min=5.*clamping to 3"):
        (d,), _ = build_drafters(
            SpecConfig(types=("draft-dflash",), draft_n_max=9, draft_n_min=5), target, head
        )
    assert d.max_draft_len == 3 and d.block_width == 4
    with pytest.warns(UserWarning, match="clamping to 4"):
        (d,), _ = build_drafters(SpecConfig(types=("draft-dspark",), draft_n_max=9), target, head)
    assert d.max_draft_len == 4 and d.block_width == 4
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_drafters(SpecConfig(types=("draft-dflash",), draft_n_max=3), target, head)
    plain_head = block_head(target, False)
    with pytest.raises(ValueError, match="DSpark head"):
        build_drafters(SpecConfig(types=("draft-dspark",)), target, plain_head)


def test_dspark_without_confidence_head_refuses_p_min(target):
    from specjax.drafters.registry import build_drafters

    head = block_head(target, True, has_confidence=False)
    with pytest.raises(ValueError, match="no confidence head"):
        build_drafters(SpecConfig(types=("draft-dspark",), draft_p_min=0.5), target, head)


# ----------------------------------------------------------------- spec 5.4 sequence
VARIANTS = {
    "dflash": dict(markov_rank=0),
    "dspark": dict(markov_rank=6),
    "dspark-bonus-d2t": dict(markov_rank=6, sample_from_anchor=False, draft_vocab=40),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_process_draft_sequence_matches_plain_python_transcription(variant):
    """Prefill with padding, drafts at several p_min (cut drafts), rows not drafting, verify
    batches re-injected with partial / full / no acceptance, rollbacks, n_max / n_min above
    the block (clamped): every draft and every block logit / confidence equals the
    transcription of upstream's code (float64)."""
    dspark = variant != "dflash"
    V, Dt = 53, 12
    cfg = df.DFlashConfig(
        vocab_size=V,
        dim=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=24,
        target_hidden=Dt,
        target_layers=(2, 0),  # any count >= 1, in the file's order
        block_size=5,
        mask_token_id=V - 2,
        **VARIANTS[variant],  # type: ignore[arg-type]
    )
    key = jax.random.key(7)
    params = dict(df.init_params(cfg, key))
    params["final_norm"] = params["final_norm"] * 1.5  # peaky logits: p_min cuts somewhere
    # strong attention: the mask rows differ by position and context (non-causality shows)
    params["layers"] = tuple(
        {**lay, "wqkv": lay["wqkv"] * 12.0, "wo": lay["wo"] * 12.0} for lay in params["layers"]
    )
    if cfg.has_d2t:
        rng0 = np.random.default_rng(3)
        params["d2t"] = jnp.asarray(np.sort(rng0.choice(V, cfg.Vd, replace=False)), jnp.int32)
    if dspark:
        params["conf_proj"] = params["conf_proj"] * 40.0
        params["markov_w1"] = params["markov_w1"] * 30.0
        params["markov_w2"] = params["markov_w2"] * 20.0  # the bias moves the argmax
    shared = {
        "embed": jax.random.normal(jax.random.key(8), (V, cfg.D)) * 0.05,
        "lm_head": jax.random.normal(jax.random.key(9), (cfg.Vd, cfg.D)) * 0.3,
    }
    n_max, n_min = 9, 2  # above the block: clamped to 4 (DFlash) / 5 (DSpark anchor) / 4
    drafter, warning = make_drafter(cfg, dspark, n_max, n_min, None)
    assert warning is not None
    all_params = {"head": params, "shared": shared}
    ref = DFlashRef(cfg, params, shared, 2, dspark, n_max, n_min)
    assert ref.warned and ref.n_max == drafter.max_draft_len
    B, T, S, K = 2, 6, 48, drafter.max_draft_len
    rng = np.random.default_rng(0)
    state = drafter.init(B, S)
    process = jax.jit(lambda s, b: drafter.process(all_params, s, b))
    rollback = jax.jit(drafter.rollback)
    draft = jax.jit(lambda s, inp: drafter.draft(all_params, s, inp, K))

    def block(s, inp):
        tokens, pos, mask_pos, _ = drafter.block_inputs(inp, K)
        cache = jax.tree.map(lambda x: x, s.cache)
        out = df.block_forward(cfg, params, shared, tokens, pos, mask_pos, cache)
        return out.logits, out.conf

    block = jax.jit(block)

    def run_process(tokens: np.ndarray, pos: np.ndarray) -> None:
        nonlocal state
        feats = {i: rng.standard_normal((B, T, Dt)).astype(np.float32) for i in (0, 2)}
        batch = TargetBatch(
            tokens=jnp.asarray(tokens, jnp.int32),
            positions=jnp.asarray(pos, jnp.int32),
            hidden={i: jnp.asarray(f) for i, f in feats.items()},
        )
        state = process(state, batch)
        rows = []
        for b in range(B):
            for t in range(T):
                if pos[b, t] >= 0:
                    f = np.concatenate([feats[i][b, t] for i in cfg.target_layers])
                    rows.append((int(tokens[b, t]), int(pos[b, t]), b, f))
        ref.process(rows)

    # prefill: row 0 six tokens, row 1 three (padding after)
    n_past = [6, 3]
    tok = rng.integers(0, V - 2, (B, T))
    pos = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]])
    run_process(tok, pos)
    n_cut = n_full = 0
    p_mins = [0.0, 0.5, 0.9, 0.3, 0.0, 0.7, 0.95, 0.2, 0.22, 0.18]
    for r, p_min in enumerate(p_mins):
        id_last = [int(x) for x in rng.integers(0, V - 2, B)]
        drafting = [True, r % 3 != 1]
        if r >= 7:  # a p_min between two of a row's read values: that draft is cut at >= 2
            nb = ref.n_max + (0 if dspark and cfg.sample_from_anchor else 1)
            first = 0 if dspark and cfg.sample_from_anchor else 1
            reads = []
            for b in range(B):
                lg, cf = ref._block(b, [id_last[b]] + [cfg.mask_token_id] * (nb - 1), n_past[b])
                reads.append([cf[i] if dspark else ref._top(lg[i])[1] for i in range(first, nb)])
            for cand in sorted(v + 1e-6 for vals in reads for v in vals):
                lens = [
                    next((i for i, v in enumerate(vals) if v < cand), len(vals)) for vals in reads
                ]
                if any(2 <= n < len(vals) for n, vals in zip(lens, reads)):
                    p_min = float(cand)
                    break
        inp = DraftInput(
            history=TokenHistory(
                tokens=jnp.zeros((B, S), jnp.int32), length=jnp.asarray(n_past, jnp.int32)
            ),
            last_token=jnp.asarray(id_last, jnp.int32),
            n_max=jnp.full((B,), 100, jnp.int32),
            drafting=jnp.asarray(drafting),
            n_min=jnp.asarray(n_min, jnp.int32),
            p_min=jnp.asarray(p_min, jnp.float32),
            temperature=jnp.zeros((B,), jnp.float32),
            draft_n_max=jnp.asarray(n_max, jnp.int32),
        )
        state, out = draft(state, inp)
        logits, conf = block(state, inp)
        toks, valid = np.asarray(out.tokens), np.asarray(out.valid)
        drafts = []
        for b in range(B):
            got = [int(t) for t, v in zip(toks[b], valid[b]) if v]
            if not drafting[b]:
                assert got == []
                drafts.append(got)
                continue
            want = ref.draft(b, id_last[b], n_past[b], p_min, cfg.mask_token_id)
            assert got == want, (r, b, got, want)
            nb = ref.last_logits[b].shape[0]
            lg = np.asarray(logits[b, :nb], np.float64)
            fin = np.isfinite(ref.last_logits[b])
            np.testing.assert_array_equal(np.isfinite(lg), fin)
            np.testing.assert_allclose(lg[fin], ref.last_logits[b][fin], rtol=2e-4, atol=2e-4)
            if dspark:
                beg = 0 if cfg.sample_from_anchor else 1
                np.testing.assert_allclose(
                    np.asarray(conf[b, beg:nb]), ref.last_conf[b][beg:], atol=1e-4
                )
            n_cut += 0 < len(want) < drafter.max_draft_len
            n_full += len(want) == drafter.max_draft_len
            drafts.append(got)
        # verify batch [id_last, d1..dk] at n_past..; process; accept some; trim (seq_rm)
        vt = np.zeros((B, T), np.int64)
        vp = np.full((B, T), -1)
        for b in range(B):
            row = [id_last[b]] + drafts[b]
            row = row[:T]
            vt[b, : len(row)] = row
            vp[b, : len(row)] = n_past[b] + np.arange(len(row))
        run_process(vt, vp)
        for b in range(B):
            k = len(drafts[b])
            n_acc = [0, k, int(rng.integers(0, k + 1))][r % 3] if k else 0
            n_past[b] += n_acc + 1
            ref.seq_rm(b, n_past[b])
        state = rollback(state, jnp.asarray(n_past, jnp.int32))
    assert n_cut > 0 and n_full > 0  # p_min cut drafts short, others ran to the clamp


# ------------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("variant", ["dflash", "dspark-d2t-bonus"])
def test_gguf_round_trip(tmp_path, variant):
    from specjax.io import load_model_files
    from specjax.io.dflash_gguf import save_dflash_gguf
    from specjax.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    V = tok.vocab_size  # type: ignore[attr-defined]
    extra: dict[str, object] = (
        dict(
            markov_rank=5,
            sample_from_anchor=False,
            draft_vocab=V // 2,
            own_lm_head=True,
            markov_w2_scale=True,
            rope_factors=(1.0, 3.5),  # llama.cpp's rope_freqs of a llama3-scaled target
        )
        if variant != "dflash"
        else dict(own_embed=True, own_lm_head=True, fc_scale=True)
    )
    cfg = df.DFlashConfig(
        vocab_size=V,
        dim=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=24,
        target_hidden=8,
        target_layers=(3, 1, 2),
        block_size=6,
        mask_token_id=V - 1,
        **extra,  # type: ignore[arg-type]
    )
    params = dict(df.init_params(cfg, jax.random.key(2)))
    params = jax.tree.map(lambda x: x + 0.01 if x.dtype != jnp.int32 else x, params)
    if cfg.has_d2t:
        params["d2t"] = jnp.asarray(np.arange(cfg.Vd) * 2, jnp.int32)
    path = tmp_path / "head.gguf"
    save_dflash_gguf(path, cfg, params, tok, dtype="f32")
    cfg2, params2, tok2 = load_model_files(path)
    assert cfg2 == cfg
    assert tok2.vocab_size == tok.vocab_size  # type: ignore[attr-defined]
    if cfg.rope_factors:
        import gguf

        from specjax.models.config import rope_frequencies

        stored = {t.name: t for t in gguf.GGUFReader(path).tensors}["rope_freqs.weight"]
        np.testing.assert_array_equal(np.asarray(stored.data), [1.0, 3.5])
        theta = cfg.rope_theta
        np.testing.assert_allclose(
            rope_frequencies(cfg2.layer_config), [1.0, theta ** (-2 / 4) / 3.5], rtol=1e-12
        )
    flat1, tree1 = jax.tree.flatten(params)
    flat2, tree2 = jax.tree.flatten(params2)
    assert tree1 == tree2
    for a, b in zip(flat1, flat2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gguf_save_refuses_before_writing(tmp_path):
    """A head llama.cpp cannot express (own embeddings, the target's LM head) and a tokenizer
    larger than the head's vocabulary are refused with the numbers, and no file is written."""
    import dataclasses

    from specjax.io.dflash_gguf import save_dflash_gguf
    from specjax.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    V = tok.vocab_size  # type: ignore[attr-defined]
    cfg = tiny_training_head(V, 8, 4, dspark=False)
    params = df.init_params(cfg, jax.random.key(0))
    path = tmp_path / "head.gguf"
    untied = dataclasses.replace(cfg, own_lm_head=False)
    with pytest.raises(ValueError, match=r"own token embeddings but the target's LM head"):
        save_dflash_gguf(path, untied, df.init_params(untied, jax.random.key(0)), tok)
    small = dataclasses.replace(cfg, vocab_size=V - 3, mask_token_id=V - 4)
    with pytest.raises(ValueError, match=rf"{V} tokens but the head's vocabulary is {V - 3}$"):
        save_dflash_gguf(path, small, df.init_params(small, jax.random.key(0)), tok)
    with pytest.raises(ValueError, match=r"dtype must be one of f32, f16, bf16, q8_0"):
        save_dflash_gguf(path, cfg, params, tok, dtype="q4_k")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- training
def tiny_training_head(V: int, Dt: int, W: int, dspark: bool) -> df.DFlashConfig:
    """A head with its own embeddings and LM head, for the trainer's block tests."""
    return df.DFlashConfig(
        vocab_size=V, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=24,
        target_hidden=Dt, target_layers=(0,), block_size=W, mask_token_id=V - 1,
        markov_rank=4 if dspark else 0, own_embed=True, own_lm_head=True,
    )  # fmt: skip


@pytest.mark.parametrize("dspark", [True, False])
def test_training_scores_each_row_against_the_logits_that_verify_it(dspark):
    """The drafter writes draft index i (block row beg + i) at n + 1 + i, where the target's
    logits at n + i verify it: the trainer scores that row against exactly those logits, and
    no row past the window or before the first drafted row."""
    from specjax.train.dflash import anchor_blocks

    V, Dt, T, W = 41, 12, 10, 4
    cfg = tiny_training_head(V, Dt, W, dspark)
    params = df.init_params(cfg, jax.random.key(0))
    drafter, _ = make_drafter(cfg, dspark, W, 0, None)
    beg = 0 if drafter.anchor else 1
    inputs = jnp.arange(T, dtype=jnp.int32)[None]
    f = jnp.ones((1, T, Dt), jnp.float32)
    anchors = jnp.asarray([[2, 6, 8]], jnp.int32)
    _, _, tgt_idx, valid = jax.jit(anchor_blocks, static_argnums=0)(
        cfg, params, {}, inputs, f, anchors
    )
    for a, n in enumerate([2, 6, 8]):
        assert np.asarray(tgt_idx)[a, beg:].tolist() == [n + i for i in range(W - beg)]
        want = [r >= beg and n + r - beg <= T - 1 for r in range(W)]
        assert np.asarray(valid)[a].tolist() == want


@pytest.mark.parametrize("dspark", [False, True])
def test_generated_rows_are_not_scored_past_their_length(dspark):
    """A generated row ends early (0-padded after the target's end of generation): with its
    length, the block loss is the same whatever the padding holds, and rows past it are not
    scored; without the length the padding would count."""
    from specjax.train.dflash import LoopConfig, block_loss

    V, Dt, T, W, L = 41, 12, 16, 4, 9
    cfg = tiny_training_head(V, Dt, W, dspark)
    params = df.init_params(cfg, jax.random.key(0))
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    inputs = jax.random.randint(k1, (1, T), 0, V - 1)
    feats = jax.random.normal(k2, (1, T, Dt))
    logits = jax.random.normal(k3, (1, T, V))
    # the padding: other tokens, features and target logits from position L on
    past = jnp.arange(T)[None, :] >= L
    inputs2 = jnp.where(past, (inputs + 7) % (V - 1), inputs)
    feats2 = jnp.where(past[..., None], -feats, feats)
    logits2 = jnp.where(past[..., None], logits[..., ::-1], logits)
    anchors = jnp.asarray([[1, 4, 6, 7]], jnp.int32)  # blocks that reach past L
    loss = jax.jit(block_loss, static_argnums=(0, 1))
    lengths = jnp.asarray([L], jnp.int32)
    loop = LoopConfig()
    a, _ = loss(cfg, loop, params, {}, inputs, feats, logits, anchors, lengths)
    b, _ = loss(cfg, loop, params, {}, inputs2, feats2, logits2, anchors, lengths)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    c, _ = loss(cfg, loop, params, {}, inputs, feats, logits, anchors)
    d, _ = loss(cfg, loop, params, {}, inputs2, feats2, logits2, anchors)
    assert abs(float(c) - float(d)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("dspark", [False, True])
def test_training_blocks_are_the_drafters_blocks(dspark):
    """The trainer's block (context = the window's K/V at positions < n, attended besides
    the block) equals the drafter's block over a cache filled by `process`; one optax step
    lowers the loss."""
    import optax

    from specjax.drafters.dflash import make_drafter
    from specjax.train.dflash import LoopConfig, block_loss

    V, Dt, T, W = 41, 12, 10, 4
    cfg = df.DFlashConfig(
        vocab_size=V, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=24,
        target_hidden=Dt, target_layers=(0, 1), block_size=W, mask_token_id=V - 1,
        markov_rank=4 if dspark else 0, own_embed=True, own_lm_head=True,
    )  # fmt: skip
    params = df.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    inputs = jnp.asarray(rng.integers(0, V - 1, (1, T)), jnp.int32)
    feats = {i: jnp.asarray(rng.standard_normal((1, T, Dt)), jnp.float32) for i in (0, 1)}
    n = 6
    # the drafter: process rows 0..n-1, then draft from id_last = inputs[n] at n_past = n
    drafter, _ = make_drafter(cfg, dspark, W, 0, None)
    state = drafter.init(1, 32)
    pos = jnp.where(jnp.arange(T) < n, jnp.arange(T), -1)[None].astype(jnp.int32)
    state = drafter.process(
        {"head": params, "shared": {}},
        state,
        TargetBatch(tokens=inputs, positions=pos, hidden=feats),
    )
    inp = DraftInput(
        history=TokenHistory(tokens=inputs, length=jnp.asarray([n], jnp.int32)),
        last_token=inputs[:, n],
        n_max=jnp.asarray([W]),
        drafting=jnp.asarray([True]),
        n_min=jnp.asarray(0),
        p_min=jnp.asarray(0.0),
        temperature=jnp.zeros((1,)),
        draft_n_max=jnp.asarray(W),
    )
    tokens, positions, mask_pos, _ = drafter.block_inputs(inp, W)
    want = df.block_forward(cfg, params, {}, tokens, positions, mask_pos, state.cache)
    # the trainer's graph for anchor n
    loop = LoopConfig(anchors=1)
    f = df.gather_features(cfg, feats)
    t_logits = jnp.asarray(rng.standard_normal((1, T, V)), jnp.float32)
    g = df.encode(cfg, params, f)
    kv = df.inject_kv(cfg, params, g, jnp.arange(T)[None])
    ctx_pos = jnp.where(jnp.arange(T) < n, jnp.arange(T), -1)[None]
    h = df.block_forward(cfg, params, {}, tokens, positions, mask_pos, None, (kv, ctx_pos)).hidden
    np.testing.assert_allclose(np.asarray(h), np.asarray(want.hidden), rtol=1e-5, atol=1e-5)
    anchors = jnp.asarray([[n]])
    # the trainer's blocks (anchor_blocks) propose the drafter's first token, and the row
    # whose token the drafter writes at n + 1 + i (draft index i, block row beg + i) is
    # scored against the target's logits that verify it, at n + i
    from specjax.train.dflash import anchor_blocks

    blocks = jax.jit(anchor_blocks, static_argnums=0)  # one program, not op by op
    logits, _, tgt_idx, valid = blocks(cfg, params, {}, inputs, f, anchors)
    beg = 0 if drafter.anchor else 1
    np.testing.assert_allclose(
        np.asarray(logits[:, beg]), np.asarray(want.logits[:, beg]), rtol=1e-4, atol=1e-4
    )
    k = W - beg
    assert np.asarray(tgt_idx)[0, beg:].tolist() == [n + i for i in range(k)]
    assert np.asarray(valid)[0].tolist() == [r >= beg and n + r - beg <= T - 1 for r in range(W)]
    loss_fn = lambda p: block_loss(cfg, loop, p, {}, inputs, f, t_logits, anchors)[0]  # noqa: E731
    opt = optax.adam(1e-2)
    l0, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    with jax.numpy_dtype_promotion("standard"):
        upd, _ = opt.update(grads, opt.init(params), params)
        stepped = optax.apply_updates(params, upd)
    assert float(loss_fn(stepped)) < float(l0)


# ------------------------------------------------------------------------ shipped heads
@pytest.mark.parametrize(
    "name, dspark, n_params", [("code-dflash", False, 545_088), ("code-dspark", True, 545_097)]
)
def test_shipped_heads_load_as_their_cards_say(name, dspark, n_params):
    import specjax

    root = MODELS / name
    head = specjax.load(str(root / f"{name}-f16.gguf"))
    cfg = head.config
    assert isinstance(cfg, df.DFlashConfig)
    assert cfg.num_params() == n_params and f"{n_params:,}" in (root / "MODEL_CARD.md").read_text()
    assert (cfg.is_dspark, cfg.block_size, cfg.target_layers) == (dspark, 8, (1, 4, 7))
    assert cfg.max_draft(dspark) == (8 if dspark else 7)


# A short function in the style of the training corpus, not in it (the shipped heads' floor).
SHIPPED_PROMPT = """def _parse_header(line):
    \"\"\"Split 'Name: value' into a lower-case name and a stripped value.\"\"\"
    name, sep, value = line.partition(":")
    if not sep:
        raise ValueError("not a header line: %r" % (line,))
    return name.strip().lower(), value.strip()


def _read_headers(lines):
"""


def offline_walk(n_max: int, seq: list[int], start: int, drafts: np.ndarray) -> tuple[int, int]:
    """(accepted tokens, rounds) of greedy speculation along `seq` (prompt + greedy output, the
    first output token at `start`) when the block anchored at n drafts `drafts[n]` (the tokens
    for n + 1 ..): each round keeps the leading drafts equal to the text and the target adds
    one token; a round drafts at most what is left to generate but the target's own token."""
    accepted = rounds = 0
    n = start
    while n + 1 < len(seq):
        k = min(n_max, len(seq) - 2 - n)
        run = 0
        while run < k and drafts[n, run] == seq[n + 1 + run]:
            run += 1
        accepted, rounds, n = accepted + run, rounds + 1, n + run + 1
    return accepted, rounds


@pytest.mark.parametrize(
    "name, kind", [("code-dflash", "draft-dflash"), ("code-dspark", "draft-dspark")]
)
def test_shipped_heads_accept_what_their_training_blocks_predict(name, kind):
    """The engine with a shipped head accepts what the trainer's block (`anchor_blocks`, the
    code the head was trained and validated with) predicts along the same greedy text, and
    that is well above a useless head's 1.0: a broken export, feature wiring or injection
    fails here, while the lossless tests above pass whatever the drafts are."""
    import specjax
    from specjax.train.dflash import anchor_blocks
    from specjax.train.eagle3 import target_outputs

    target = specjax.load(str(MODELS / "code-target" / "code-target-f16.gguf"))
    head = specjax.load(str(MODELS / name / f"{name}-f16.gguf"))
    cfg = head.config
    prompt = target.encode(SHIPPED_PROMPT)
    n_new, n_max = 64, 4
    f32 = dict(cache_type_k="f32", cache_type_v="f32")  # the trainer's K/V are float32
    plain = generate(target, [prompt], max_new_tokens=n_new, **f32)
    spec = SpecConfig(types=(kind,), draft_n_max=n_max, adaptive=False)
    out = generate(target, [prompt], max_new_tokens=n_new, spec=spec, draft=head, **f32)
    assert out.tokens == plain.tokens
    seq = prompt + plain.tokens[0]
    T, P = len(seq), len(prompt)

    inputs = jnp.asarray([seq], jnp.int32)
    _, hidden = target_outputs(target.config, target.params, cfg.target_layers, inputs)
    shared = df.shared_weights(cfg, target.params, target.config.tie_embeddings)
    anchors = jnp.arange(P, T - 1, dtype=jnp.int32)[None, :]
    logits, _, _, _ = anchor_blocks(
        cfg, head.params, shared, inputs, df.gather_features(cfg, hidden), anchors
    )
    first = 0 if cfg.is_dspark else 1  # the block row drafting the token at n + 1
    rows = np.asarray(jnp.argmax(logits, -1))[:, first : first + n_max]
    drafts = np.zeros((T, n_max), np.int64)
    drafts[P : T - 1] = rows
    accepted, rounds = offline_walk(n_max, seq, P, drafts)

    st = out.stats.to_dict()["drafters"][kind]
    assert 0 < st["n_acc_tokens"] < st["n_gen_tokens"], st
    # the same walk; one token or round may differ where two logits nearly tie
    assert abs(st["n_acc_tokens"] - accepted) <= 1, (st, accepted, rounds)
    assert abs(st["n_call_accept"] - rounds) <= 1, (st, accepted, rounds)
    # a head that drafts nothing useful scores ~1.0 (the heads: 1.31 / 1.17 on this prompt)
    assert 1 + accepted / rounds >= 1.1, (accepted, rounds)


def test_head_recipes_parse_and_stay_within_eagle3s_budget():
    """The shipped heads' recipes: stage 2 starts from stage 1's run on the target's greedy
    text, and every head fits code-eagle3's parameter budget (the issue's equal budget)."""
    from specjax.models.config import ModelConfig
    from specjax.train.dflash import head_config, load_config

    root = MODELS.parent / "configs" / "train"
    target = ModelConfig(
        vocab_size=2048, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=688
    )  # code-target's width, depth and vocabulary: all a head's size depends on
    for name in ("code-dflash", "code-dspark"):
        one = load_config(root / f"{name}.yaml")
        two = load_config(root / f"{name}-stage2.yaml")
        assert one.generated is None and two.generated is not None
        assert two.generated.temperature == 0.0 and two.train.init_from == one.train.run_dir
        assert two.head == one.head
        assert head_config(one.head, target).num_params() <= 545_792
