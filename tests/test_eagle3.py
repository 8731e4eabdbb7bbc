"""draft-eagle3: lossless engine runs, the deferred boundary against a plain-Python
transcription of llama.cpp (spec 5.2), get/set_state, GGUF round trip, and the training
rollout against the drafter it trains."""

from __future__ import annotations

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.eagle3_reference import Eagle3BoundaryRef

from specjax.api import Model, generate
from specjax.config import SpecConfig
from specjax.drafters.base import DraftInput, TargetBatch, TokenHistory
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.models import eagle3 as e3
from specjax.testing import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40]]
MAX_NEW = [24, 24, 10, 24]


def echo_head(target: Model, seed: int = 3, **overrides: object) -> Model:
    """A head that drafts (roughly) the token two positions back: fc copies the target's
    layer-0 input (the embedding of t_P) into g and the LM head is the target's embedding,
    so the seed step proposes t_P -- right inside the period-2 loops a tiny random target
    falls into, wrong elsewhere (drafts both accepted and rejected)."""
    tc = target.config
    fields: dict[str, object] = dict(
        vocab_size=tc.V,
        dim=tc.D,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        target_hidden=tc.D,
        target_layers=(0, 1, tc.L),
        own_lm_head=True,
    )
    fields.update(overrides)
    cfg = e3.Eagle3Config(**fields)  # type: ignore[arg-type]
    p = e3.init_params(cfg, jax.random.key(seed))
    fc = np.zeros((cfg.D, 3 * tc.D), np.float32)
    fc[:, : tc.D] = np.eye(tc.D)
    p["fc"] = jnp.asarray(fc)
    p["lm_head"] = target.params["embed"]
    return Model(config=cfg, params=p, tokenizer=target.tokenizer)


@pytest.fixture(scope="module")
def target() -> Model:
    return tiny_model(0)


@pytest.fixture(scope="module")
def head(target: Model) -> Model:
    return echo_head(target)


@pytest.fixture(scope="module")
def plain(target: Model):
    return generate(target, PROMPTS, max_new_tokens=MAX_NEW)


# ------------------------------------------------------------------------------ engine
def test_greedy_b4_is_lossless_with_drafts_accepted_and_rejected(target, head, plain):
    for n_max in (1, 3):  # n_max is traced: one compiled program
        spec = SpecConfig(types=("draft-eagle3",), adaptive=False, draft_n_max=n_max)
        out = generate(target, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, draft=head)
        assert out.tokens == plain.tokens
        st = out.stats.to_dict()
        assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"]
        if n_max == 1:
            assert st["num_draft_tokens"] <= out.stats.stats.n_gen_drafts.sum()


def test_on_cpu_the_head_runs_on_the_native_kernels(target, head):
    """With the CPU kernel, the engine gets the head's linear weights and the shared LM head
    as `KernelWeight`s (made once per set of weights), and the compiled decoder then calls
    the kernels for its products and attention instead of XLA's dots."""
    from specjax import api
    from specjax.drafters.registry import build_drafters
    from specjax.kernels import cpu as cpu_kernels
    from specjax.models import eagle3 as e3
    from specjax.models import llama

    if not cpu_kernels.available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    spec = SpecConfig(types=("draft-eagle3",), adaptive=False)
    (drafter,), (params,) = build_drafters(spec, target, head)
    form = api.drafter_decode_params(drafter.name, params)
    assert form is api.drafter_decode_params(drafter.name, params)
    linear = [k for k in e3.LINEAR_WEIGHTS if k in params["head"]]
    assert {"fc", "wqkv", "wo", "w_gate_up", "w_down"} <= set(linear)
    assert all(isinstance(form["head"][k], llama.KernelWeight) for k in linear)
    if "lm_head" in params["shared"]:
        assert isinstance(form["shared"]["lm_head"], llama.KernelWeight)
    cfg, cache = drafter.config, drafter.init(1, 32).cache
    tokens, g = jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1, cfg.D), cfg.dtype)

    def lowered(p):
        fn = jax.jit(
            lambda p, c: e3.decoder_compute(
                cfg, p["head"], p["shared"], tokens, g, jnp.zeros((1, 1), jnp.int32), c
            )
        )
        return fn.lower(p, cache).as_text()

    assert "specjax_linear" in lowered(form) and "specjax_attend_cache" in lowered(form)
    assert "specjax_" not in lowered(params)


def test_head_of_another_architecture_is_refused(target):
    spec = SpecConfig(types=("draft-eagle3",), adaptive=False)
    with pytest.raises(ValueError, match="architecture eagle3"):
        generate(target, PROMPTS[:1], max_new_tokens=2, spec=spec, draft=target)
    with pytest.raises(ValueError, match=r"draft-eagle3 needs an EAGLE-3 head \(-md/"):
        generate(target, PROMPTS[:1], max_new_tokens=2, spec=spec)
    dflash = SpecConfig(types=("draft-dflash",), adaptive=False)
    with pytest.raises(ValueError, match=r"draft-dflash needs a DFlash head \(-md/"):
        generate(target, PROMPTS[:1], max_new_tokens=2, spec=dflash)
    with pytest.raises(ValueError, match="draft-dflash needs a draft model of architecture dflash"):
        generate(target, PROMPTS[:1], max_new_tokens=2, spec=dflash, draft=target)
    bad = echo_head(target, target_layers=(0, 1, target.config.L + 1))
    with pytest.raises(ValueError, match="exceeds target n_layer"):
        generate(target, PROMPTS[:1], max_new_tokens=2, spec=spec, draft=bad)


# ---------------------------------------------------------------- boundary vs upstream
def _features(rng: np.random.Generator, B: int, T: int, D: int, layers) -> dict[int, np.ndarray]:
    return {i: rng.standard_normal((B, T, D)).astype(np.float32) for i in layers}


def test_boundary_sequence_matches_plain_python_transcription(target, head):
    """Chunked prefill (bridge), drafts, verify batches with partial / full / no acceptance,
    a row another drafter won, rollbacks: every pending boundary and every cell of the head's
    memory (K of the pair written there) equals the transcription of upstream's code."""
    cfg = head.config
    drafter = Eagle3Drafter(config=cfg, hidden_layers=cfg.target_layers, max_draft_len=3)
    shared = e3.shared_weights(cfg, target.params, False)
    params = {"head": head.params, "shared": shared}
    B, T, S, K = 2, 4, 32, 3
    rng = np.random.default_rng(0)
    ref = Eagle3BoundaryRef(B, cfg.D, np.asarray(head.params["fc"]))
    state = drafter.init(B, S)
    process = jax.jit(lambda s, b: drafter.process(params, s, b))
    accept = jax.jit(lambda s, n, a: drafter.accept(s, n, jnp.zeros_like(a), a))
    rollback = jax.jit(drafter.rollback)
    draft = jax.jit(lambda s, inp: drafter.draft(params, s, inp, K))
    qkv = jax.jit(lambda t, g, p: e3.decoder_qkv(cfg, head.params, shared, t, g, p).k)

    def run_process(tokens: np.ndarray, pos: np.ndarray):
        nonlocal state
        feats = _features(rng, B, T, cfg.target_hidden, cfg.target_layers)
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

    def run_draft(id_last: list[int], n_past: list[int], drafting: list[bool]):
        nonlocal state
        inp = DraftInput(
            history=TokenHistory(
                tokens=jnp.zeros((B, S), jnp.int32), length=jnp.asarray(n_past, jnp.int32)
            ),
            last_token=jnp.asarray(id_last, jnp.int32),
            n_max=jnp.full((B,), K, jnp.int32),
            drafting=jnp.asarray(drafting),
            n_min=jnp.asarray(0, jnp.int32),
            p_min=jnp.asarray(0.0, jnp.float32),
            temperature=jnp.zeros((B,), jnp.float32),
            draft_n_max=jnp.asarray(K, jnp.int32),
        )
        state, out = draft(state, inp)
        for b in range(B):
            made = ref.draft(b, id_last[b], drafting[b])
            assert bool(out.valid[b, 0]) == made

    def check():
        np.testing.assert_array_equal(np.asarray(state.pending_pos), ref.pending_pos)
        np.testing.assert_allclose(
            np.asarray(state.pending_g), np.stack(ref.pending_g), rtol=1e-4, atol=1e-4
        )
        cache_pos = np.asarray(state.cache.pos)
        cache_k = np.asarray(state.cache.k[0])  # [B, G, S, E]
        for b in range(B):
            want = sorted(c[0] for c in ref.mem[b])
            assert sorted(int(p) for p in cache_pos[b] if p >= 0) == want
            for pos, tok, g in ref.mem[b]:
                (cell,) = np.nonzero(cache_pos[b] == pos)[0]
                k = qkv(
                    jnp.asarray([[tok]], jnp.int32),
                    jnp.asarray(g[None, None], jnp.float32),
                    jnp.asarray([[pos]], jnp.int32),
                )
                np.testing.assert_allclose(cache_k[b, :, cell], np.asarray(k[0, 0]), atol=1e-4)

    tok = rng.integers(3, cfg.V, (B, 64))
    # prefill: row 0 has 7 prompt tokens in chunks of 4 + 3 (the bridge), row 1 has 3
    run_process(tok[:, 0:4], np.array([[0, 1, 2, 3], [0, 1, 2, -1]]))
    check()
    run_process(tok[:, 4:8], np.array([[4, 5, 6, -1], [-1, -1, -1, -1]]))
    check()
    n_past = [7, 3]
    # round 1: both draft; row 0 verifies 3 drafts and accepts 1, row 1 drafted nothing
    # in the verify (only id_last) and accepts 0
    id_last = [int(tok[0, 10]), int(tok[1, 10])]
    run_draft(id_last, n_past, [True, True])
    check()
    v_tok = np.array([[id_last[0], 1, 2, 3], [id_last[1], 0, 0, 0]])
    v_pos = np.array([[7, 8, 9, 10], [3, -1, -1, -1]])
    run_process(v_tok, v_pos)
    check()
    state = accept(state, jnp.asarray([1, 0]), jnp.asarray([True, True]))
    for b, n in enumerate([1, 0]):
        ref.accept(b, n)
    keep = [7 + 1 + 1, 3 + 0 + 1]
    state = rollback(state, jnp.asarray(keep, jnp.int32))
    for b in range(B):
        ref.seq_rm(b, keep[b])
    check()
    # round 2: another drafter won row 0 (not drafting here), which accepts all 3 drafts;
    # row 1 drafts, verifies 2 and accepts 2
    n_past = keep
    id_last = [int(tok[0, 20]), int(tok[1, 20])]
    run_draft(id_last, n_past, [False, True])
    check()
    v_tok = np.array([[id_last[0], 4, 5, 6], [id_last[1], 7, 8, 0]])
    v_pos = np.array([[9, 10, 11, 12], [4, 5, 6, -1]])
    run_process(v_tok, v_pos)
    state = accept(state, jnp.asarray([3, 2]), jnp.asarray([True, True]))
    for b, n in enumerate([3, 2]):
        ref.accept(b, n)
    keep = [9 + 3 + 1, 4 + 2 + 1]
    state = rollback(state, jnp.asarray(keep, jnp.int32))
    for b in range(B):
        ref.seq_rm(b, keep[b])
    check()
    # round 3: row 0's boundary is bridged by process (all accepted last time); row 1 drafts
    n_past = keep
    id_last = [int(tok[0, 30]), int(tok[1, 30])]
    run_draft(id_last, n_past, [False, True])
    v_tok = np.array([[id_last[0], 9, 0, 0], [id_last[1], 0, 0, 0]])
    v_pos = np.array([[13, 14, -1, -1], [7, -1, -1, -1]])
    run_process(v_tok, v_pos)
    check()
    # (upstream clamps n_accepted to the rows process saw: row 1 verified only id_last)
    state = accept(state, jnp.asarray([0, 2]), jnp.asarray([True, True]))
    for b, n in enumerate([0, 2]):
        ref.accept(b, n)
    check()
    # get_state agrees with upstream's blob
    for b in range(B):
        blob = drafter.get_state(state, b)
        want = ref.get_state(b)
        assert blob is not None and want is not None and blob[:4] == want[:4]
        np.testing.assert_allclose(
            np.frombuffer(blob[4:], "<f4"), np.frombuffer(want[4:], "<f4"), atol=1e-4
        )


# --------------------------------------------------------------------- get/set_state
def test_get_set_state_round_trip(head):
    cfg = head.config
    drafter = Eagle3Drafter(config=cfg, hidden_layers=cfg.target_layers, max_draft_len=4)
    state = drafter.init(3, 16)
    assert drafter.get_state(state, 0) is None  # no boundary yet: upstream fails
    g = np.arange(cfg.D, dtype=np.float32) * 0.5 - 3.0
    blob = struct.pack("<i", 11) + g.astype("<f4").tobytes()
    assert len(blob) == 4 + 4 * cfg.D
    state = drafter.set_state(state, 1, blob)
    assert drafter.get_state(state, 1) == blob
    assert drafter.get_state(state, 0) is None and drafter.get_state(state, 2) is None
    np.testing.assert_array_equal(np.asarray(state.pending_pos), [-1, 11, -1])
    # a blob of the wrong size is ignored
    same = drafter.set_state(state, 1, blob[:-4])
    assert drafter.get_state(same, 1) == blob
    other = drafter.set_state(state, 2, blob + b"\0\0\0\0")
    assert drafter.get_state(other, 2) is None


# ------------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("variant", ["shared", "own"])
def test_gguf_round_trip(tmp_path, variant):
    from specjax.io import load_model_files
    from specjax.io.eagle3_gguf import load_eagle3_gguf, save_eagle3_gguf
    from specjax.io.tokenizer import Tokenizer

    tok = Tokenizer.from_file("models/tokenizer/tokenizer.json")
    V = 2048
    extra: dict[str, object] = {}
    if variant == "own":  # every optional piece: own embeddings and head, d2t, both norms
        extra = dict(
            own_embed=True,
            own_lm_head=True,
            draft_vocab=300,
            norm_before_fc=True,
            norm_before_residual=True,
            head_dim=16,
            # a llama3-scaled target's head: llama.cpp's rope_freqs, stored per pair
            rope_factors=(1.0, 2.44, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0),
        )
    cfg = e3.Eagle3Config(
        vocab_size=V,
        dim=48,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=40,
        target_hidden=32,
        target_layers=(7, 0, 8),
        rope_theta=50000.0,
        max_position=512,
        **extra,  # type: ignore[arg-type]
    )
    params = e3.init_params(cfg, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), 32))
    params = {  # non-trivial norms, so a swapped or dropped tensor shows
        k: (v + 0.1 * jax.random.normal(next(keys), v.shape) if k != "d2t" else v)
        for k, v in params.items()
    }
    if cfg.has_d2t:
        perm = np.random.default_rng(0).permutation(V)[: cfg.Vd]
        params["d2t"] = jnp.asarray(perm, jnp.int32)
    path = tmp_path / "head.gguf"
    save_eagle3_gguf(path, cfg, params, tok, dtype="f32")
    cfg2, params2, _ = load_eagle3_gguf(path)
    assert cfg2 == cfg
    assert set(params2) == set(params)
    for k in params:
        np.testing.assert_array_equal(np.asarray(params2[k]), np.asarray(params[k]), err_msg=k)
    assert isinstance(load_model_files(path)[0], e3.Eagle3Config)
    # llama.cpp's names and keys, read back with gguf-py directly
    import gguf

    from specjax.models.config import rope_frequencies

    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    assert {"fc.weight", "blk.0.attn_norm_2.weight", "blk.0.attn_q.weight"} <= names
    assert ("d2t" in names) == cfg.has_d2t
    assert ("rope_freqs.weight" in names) == bool(cfg.rope_factors)
    if cfg.rope_factors:  # the decoder layer turns pair i at theta^(-2i/E) / factor_i
        inv = [50000.0 ** (-2 * i / 16) / f for i, f in enumerate(cfg.rope_factors)]
        np.testing.assert_allclose(rope_frequencies(cfg2.layer_config), inv, rtol=1e-12)
    assert r.fields["general.architecture"].contents() == "eagle3"
    assert r.fields["eagle3.target_layers"].contents() == [7, 0, 8]
    assert r.fields["eagle3.target_hidden_size"].contents() == 32
    assert r.fields["eagle3.norm_before_fc"].contents() == cfg.norm_before_fc
    save_eagle3_gguf(path, cfg, params, tok, dtype="f16")
    cfg3, params3, _ = load_eagle3_gguf(path, dtype="float32")
    assert cfg3 == cfg
    np.testing.assert_allclose(np.asarray(params3["wqkv"]), np.asarray(params["wqkv"]), atol=2e-3)


# --------------------------------------------------------- training rollout == drafting
@pytest.mark.slow  # suite time: a training-side consistency check
def test_training_rollout_drafts_what_the_drafter_drafts(target, head):
    """The training-time test rollout (`ttt_rollout`) fed the drafter's own tokens proposes
    the drafter's tokens at every step, and its logits match the drafter's."""
    from specjax.train.eagle3 import target_outputs, ttt_rollout

    cfg = head.config
    shared = e3.shared_weights(cfg, target.params, False)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    n = len(prompt)
    spec = SpecConfig(types=("draft-eagle3",), adaptive=False, draft_n_max=3)
    drafter = Eagle3Drafter(config=cfg, hidden_layers=cfg.target_layers, max_draft_len=3)
    params = {"head": head.params, "shared": shared}
    toks = jnp.asarray([prompt], jnp.int32)
    _, hidden = target_outputs(target.config, target.params, cfg.target_layers, toks)
    state = drafter.init(1, 32)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    state = drafter.process(params, state, TargetBatch(tokens=toks, positions=pos, hidden=hidden))
    id_last = 42
    inp = DraftInput(
        history=TokenHistory(tokens=jnp.zeros((1, 32), jnp.int32), length=jnp.asarray([n])),
        last_token=jnp.asarray([id_last], jnp.int32),
        n_max=jnp.asarray([3], jnp.int32),
        drafting=jnp.asarray([True]),
        n_min=jnp.asarray(0, jnp.int32),
        p_min=jnp.asarray(0.0, jnp.float32),
        temperature=jnp.zeros((1,), jnp.float32),
        draft_n_max=jnp.asarray(spec.draft_n_max, jnp.int32),
    )
    _, out = drafter.draft(params, state, inp, 3)
    drafted = [int(t) for t in np.asarray(out.tokens[0])]
    assert bool(np.all(np.asarray(out.valid)))
    # the rollout from anchor P = n - 1 reads t_{P+1} = id_last, then the drafts
    seq = jnp.asarray([prompt + [id_last] + drafted], jnp.int32)
    feats = e3.gather_features(
        cfg, {i: jnp.pad(h, ((0, 0), (0, 4), (0, 0))) for i, h in hidden.items()}
    )
    logits = ttt_rollout(cfg, 3, head.params, shared, seq, feats)
    proposed = [int(jnp.argmax(lg[0, n - 1])) for lg in logits]
    assert proposed == drafted


# --------------------------------------------------------------- sampling at T > 0
def test_probabilistic_drafts_are_verified_by_rejection(target, head):
    spec = SpecConfig(
        types=("draft-eagle3",), adaptive=False, draft_n_max=3, draft_sampling="probabilistic"
    )
    kw = dict(max_new_tokens=MAX_NEW, spec=spec, draft=head, temperature=0.7, seed=[1, 2, 3, 4])
    a = generate(target, PROMPTS, **kw)  # type: ignore[arg-type]
    b = generate(target, PROMPTS, **kw)  # type: ignore[arg-type]
    assert a.tokens == b.tokens  # keys from (seed, position, role): exact replay
    st = a.stats.to_dict()
    assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"]
    assert [len(t) for t in a.tokens] == MAX_NEW


# ----------------------------------------------------------------------- chunked prefill
def _cells(state, b: int) -> dict[int, np.ndarray]:
    pos = np.asarray(state.cache.pos)[b]
    k = np.asarray(state.cache.k[0])[b]
    return {int(p): k[:, i] for i, p in enumerate(pos) if p >= 0}


def test_chunked_prefill_drafts_like_a_whole_prefill(target, head, plain):
    """Prompts prefilled in chunks of 3 (`-ub 3`: uneven, through the cross-ubatch bridge)
    give the same drafts, acceptances and final head memory as one whole prefill."""
    spec = SpecConfig(types=("draft-eagle3",), adaptive=False, draft_n_max=3)
    kw = dict(max_new_tokens=MAX_NEW, spec=spec, draft=head, return_drafter_states=True)
    whole = generate(target, PROMPTS, **kw)
    chunked = generate(target, PROMPTS, **kw, n_ubatch=3)
    assert chunked.tokens == whole.tokens == plain.tokens
    a, b = whole.stats.to_dict(), chunked.stats.to_dict()
    assert a == b and a["num_draft_tokens"] > 0
    sa, sb = whole.drafter_states["draft-eagle3"], chunked.drafter_states["draft-eagle3"]
    np.testing.assert_array_equal(np.asarray(sa.pending_pos), np.asarray(sb.pending_pos))
    np.testing.assert_allclose(np.asarray(sa.pending_g), np.asarray(sb.pending_g), atol=1e-4)
    for row in range(len(PROMPTS)):
        ca, cb = _cells(sa, row), _cells(sb, row)
        assert sorted(ca) == sorted(cb)
        for p in ca:
            np.testing.assert_allclose(ca[p], cb[p], atol=1e-3)


# ------------------------------------------------------------------- CLI, chain, GGUF
@pytest.mark.slow  # suite time: chunked prefill is covered by test_chunked_prefill_drafts_like_a_whole_prefill
def test_cli_chain_with_ngram_mod_and_chunked_prefill(tmp_path, capsys):
    """`specjax generate -m T -md HEAD.gguf --spec-type draft-eagle3,ngram-mod -ub 4`: the
    head goes through its GGUF file, the chain and the chunked prefill; greedy output is the
    plain output and both drafters draft."""
    import json

    from specjax.cli import command as cli
    from specjax.io.eagle3_gguf import save_eagle3_gguf
    from specjax.io.gguf_io import save_gguf
    from specjax.testing import tiny_model_with_tokenizer

    model = tiny_model_with_tokenizer(0)
    head = echo_head(model)
    t_path, h_path = tmp_path / "t.gguf", tmp_path / "h.gguf"
    save_gguf(str(t_path), model.config, model.params, model.tokenizer, dtype="f32")
    save_eagle3_gguf(h_path, head.config, head.params, model.tokenizer, dtype="f32")
    prompt = "x = 1\nx = 1\nx = 1\nx = 1\nx = 1\n"  # n-grams to match
    base = ["generate", "-m", str(t_path), "-p", prompt, "-n", "24"]
    assert cli.main([*base, "--out", str(tmp_path / "plain.jsonl")]) == 0
    spec = [
        *("-md", str(h_path), "--spec-type", "draft-eagle3,ngram-mod", "-ub", "4"),
        *("--spec-ngram-mod-n-match", "2", "--spec-ngram-mod-n-min", "1"),
        *("--spec-ngram-mod-n-max", "4", "--spec-draft-n-max", "3", "--spec-governor", "off"),
    ]
    assert cli.main([*base, *spec, "--out", str(tmp_path / "spec.jsonl")]) == 0
    err = capsys.readouterr().err
    plain = json.loads((tmp_path / "plain.jsonl").read_text())
    got = json.loads((tmp_path / "spec.jsonl").read_text())
    assert got["tokens"] == plain["tokens"] and len(got["tokens"]) == 24
    drafters = got["stats"]["drafters"]
    assert drafters["draft-eagle3"]["n_gen_drafts"] > 0 and "ngram-mod" in drafters
    assert "draft-eagle3" in err


@pytest.mark.slow
def test_chain_with_ngram_mod_both_draft_and_stay_lossless(target, head, plain):
    """`draft-eagle3,ngram-mod`: ngram-mod (first in priority) wins a row that repeats an
    earlier occurrence, the head drafts the other rows; greedy output stays plain."""
    prompts = [PROMPTS[0] + plain.tokens[0][:12] + PROMPTS[0], *PROMPTS[1:]]
    ref = generate(target, prompts, max_new_tokens=MAX_NEW)
    spec = SpecConfig(
        types=("draft-eagle3", "ngram-mod"),
        adaptive=False,
        draft_n_max=3,
        ngram_mod_n_match=4,
        ngram_mod_n_min=1,
        ngram_mod_n_max=8,
    )
    out = generate(target, prompts, max_new_tokens=MAX_NEW, spec=spec, draft=head)
    assert out.tokens == ref.tokens
    d = out.stats.to_dict()["drafters"]
    assert d["draft-eagle3"]["n_gen_drafts"] > 0 and d["ngram-mod"]["n_gen_drafts"] > 0
    assert 0 < out.stats.to_dict()["num_accepted_tokens"] < out.stats.to_dict()["num_draft_tokens"]
