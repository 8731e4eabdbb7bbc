"""The decode path's performance invariants, as behaviour: attention reads only the used cells
(chunked online softmax) and changes nothing, compiled loops copy no cache buffer, and the
draft governor only changes draft lengths, by the rule specjax.decode.governor states.

Independent sources: a float64 NumPy attention over every cell, a plain-Python transcription
of the governor's rule, and the engine's own greedy output at another capacity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.decode import executables
from specjax.decode import governor as adaptive
from specjax.kernels import cpu as cpu_kernels
from specjax.models import llama
from specjax.testing import noisy_copy, tiny_model

# -------------------------------------------------------------------- chunked attention


def _np_attention(q, k, v, q_pos, k_pos):
    """float64 softmax attention of one query row over every visible cell (positions only)."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = (k @ q) * scale
    s = np.where((k_pos >= 0) & (k_pos <= q_pos), s, -np.inf)
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v


@pytest.mark.parametrize("native", [False, True], ids=["xla_loop", "cpu_kernel"])
@pytest.mark.parametrize("capacity", [300, 1024])
def test_chunked_attention_matches_float64_over_every_cell(capacity, native):
    """300 used cells: two chunks at capacity 1024; at capacity 300 (not a multiple of the
    chunk) the last chunk starts early and its overlap must be masked, not counted twice.
    The native kernel's states (new token, cache) merged must agree too."""
    if native and not cpu_kernels.available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    rng = np.random.default_rng(0)
    B, G, R, E, used = 2, 2, 2, 8, 290
    k_c = np.zeros((B, G, capacity, E), np.float32)
    v_c = np.zeros((B, G, capacity, E), np.float32)
    pos = np.full((B, capacity), -1, np.int32)
    k_c[:, :, :used] = rng.normal(size=(B, G, used, E))
    v_c[:, :, :used] = rng.normal(size=(B, G, used, E))
    pos[0, :used] = np.arange(used)
    pos[1, : used - 40] = np.arange(used - 40)  # row 1 holds fewer cells
    pos[0, 17] = -1  # a hole (mid-range seq_rm) stays invisible
    q = rng.normal(size=(B, G, R, 1, E)).astype(np.float32)
    k_new = rng.normal(size=(B, G, 1, E)).astype(np.float32)
    v_new = rng.normal(size=(B, G, 1, E)).astype(np.float32)
    q_pos = np.array([[used], [used - 40]], np.int32)
    n_chunks = jnp.asarray(-(-used // min(llama.CACHE_CHUNK, capacity)), jnp.int32)
    own = [(jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(q_pos))]
    cache = (jnp.asarray(k_c), jnp.asarray(v_c), jnp.asarray(pos))
    if native:
        used_cells = jnp.asarray(used, jnp.int32)
        out = llama._attend_native(jnp.asarray(q), own, jnp.asarray(q_pos), 0, cache, used_cells)
    else:
        out = llama._attend(jnp.asarray(q), own, jnp.asarray(q_pos), 0, cache, n_chunks)
    for b in range(B):
        for g in range(G):
            keys = np.concatenate([k_c[b, g], k_new[b, g]]).astype(np.float64)
            vals = np.concatenate([v_c[b, g], v_new[b, g]]).astype(np.float64)
            kpos = np.concatenate([pos[b], q_pos[b]])
            for r in range(R):
                want = _np_attention(
                    q[b, g, r, 0].astype(np.float64), keys, vals, q_pos[b, 0], kpos
                )
                np.testing.assert_allclose(np.asarray(out[b, g, r, 0]), want, atol=2e-5)


def test_prompt_chunk_over_a_cache_on_the_kernel_matches_float64():
    """A prompt chunk (`n_ubatch`) of 160 tokens with 2 heads per group is 320 query rows per
    group over 290 cached cells and the chunk itself, all on the kernel."""
    if not cpu_kernels.available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    rng = np.random.default_rng(2)
    B, G, R, T, E, S, used = 1, 2, 2, 160, 12, 512, 290
    k_c = np.zeros((B, G, S, E), np.float16)
    v_c = np.zeros((B, G, S, E), np.float16)
    k_c[:, :, :used] = rng.normal(size=(B, G, used, E))
    v_c[:, :, :used] = rng.normal(size=(B, G, used, E))
    pos = np.full((B, S), -1, np.int32)
    pos[0, :used] = np.arange(used)
    q = rng.normal(size=(B, G, R, T, E)).astype(np.float32)
    k_new = rng.normal(size=(B, G, T, E)).astype(np.float16)
    v_new = rng.normal(size=(B, G, T, E)).astype(np.float16)
    q_pos = (used + np.arange(T, dtype=np.int32))[None]
    own = [(jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(q_pos))]
    cache = (jnp.asarray(k_c), jnp.asarray(v_c), jnp.asarray(pos))
    out = llama._attend_native(
        jnp.asarray(q), own, jnp.asarray(q_pos), 0, cache, jnp.asarray(used, jnp.int32)
    )
    out = np.asarray(out)
    for g in range(G):
        keys = np.concatenate([k_c[0, g], k_new[0, g]]).astype(np.float64)
        vals = np.concatenate([v_c[0, g], v_new[0, g]]).astype(np.float64)
        kpos = np.concatenate([pos[0], q_pos[0]])
        for r in range(R):
            for t in range(T):
                want = _np_attention(
                    q[0, g, r, t].astype(np.float64), keys, vals, q_pos[0, t], kpos
                )
                np.testing.assert_allclose(out[0, g, r, t], want, atol=2e-5)


@pytest.mark.parametrize("native", [False, True], ids=["xla_blocks", "cpu_kernel"])
@pytest.mark.parametrize("window", [0, 50])
def test_prompt_attention_matches_float64_causal(window, native, monkeypatch):
    """A prompt into an empty cache, 300 tokens, row 1 padded after 250. On the kernel: one
    call over the prompt's own cells, which skips each chunk of cells (128 here, the last
    one partial) a quad of rows cannot see. On XLA: query blocks (64 tokens here, the last
    one partial) that score only the cells up to the block's end. A skipped chunk or cell
    that was visible, or a padded row that leaked, would show against a float64 attention
    over the whole prompt."""
    if native and not cpu_kernels.available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    monkeypatch.setattr(llama, "PROMPT_BLOCK", 64)
    rng = np.random.default_rng(1)
    B, G, R, T, E = 2, 2, 2, 300, 12
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    pos[1, 250:] = -1
    q = rng.normal(size=(B, G, R, T, E)).astype(np.float32)
    k = rng.normal(size=(B, G, T, E)).astype(np.float16)
    v = rng.normal(size=(B, G, T, E)).astype(np.float16)

    def prompt_attention(q, k, v, pos):
        if native:
            return llama._attend_native(q, [(k, v, pos)], pos, window, None, None)
        return llama._attend_prompt(q, k, v, pos, window)

    out = np.asarray(
        jax.jit(prompt_attention)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos))
    )
    assert out.shape == q.shape
    for b in range(B):
        for g in range(G):
            keys, vals = k[b, g].astype(np.float64), v[b, g].astype(np.float64)
            for t in range(T):
                if pos[b, t] < 0:
                    continue
                kpos = pos[b] if window == 0 else np.where(pos[b] > t - window, pos[b], -1)
                for r in range(R):
                    want = _np_attention(q[b, g, r, t].astype(np.float64), keys, vals, t, kpos)
                    np.testing.assert_allclose(out[b, g, r, t], want, atol=2e-5)


def test_greedy_tokens_do_not_depend_on_capacity():
    """Same prompt and output at capacities 64, 300 and 1024 (one chunk, an overlapping last
    chunk, several chunks of which only the used ones are read): identical tokens."""
    model = tiny_model(3)
    prompts = [list(range(5, 45)), list(range(7, 20))]
    outs = [generate(model, prompts, max_new_tokens=20, n_ctx=n).tokens for n in (64, 300, 1024)]
    assert outs[0] == outs[1] == outs[2]


# -------------------------------------------------------------------- no cache copies


def _cache_copies(hlo: str, capacity: int) -> list[str]:
    """`copy` ops of arrays with a capacity-sized dimension (K/V buffers, positions)."""
    pattern = r"= (\w+\[[0-9,]*\b" + str(capacity) + r"\b[0-9,]*\])\{[0-9,]+\} copy\("
    return [s for s in re.findall(pattern, hlo) if s.count(",") >= 3]  # rank >= 4: K or V


@pytest.mark.parametrize("types", [(), ("draft-simple",)])
def test_generation_loop_copies_no_kv_buffer(types):
    """The optimised HLO of the compiled generation loop holds no copy of a K/V buffer (the
    reads come before the in-place writes; nothing re-lays the cache out per step)."""
    capacity = 320
    target = tiny_model(4)
    draft = noisy_copy(target, 0.3)
    spec = SpecConfig(types=types, draft_n_max=3) if types else None
    executables._COMPILED.clear()
    generate(target, [[1, 2, 3]], max_new_tokens=8, n_ctx=capacity, spec=spec, draft=draft)
    loops = [
        exe for key, exe in executables._COMPILED.items() if key[0] is api.eng.generate_loop_jit
    ]
    assert len(loops) == 1
    hlo = loops[0].as_text()
    assert f",{capacity}," in hlo  # the cache buffers are in the program ...
    assert _cache_copies(hlo, capacity) == []  # ... and never copied


def test_plain_decode_passes_over_the_cells_only_where_it_must():
    """Per-step work over all S cells of a row is what makes decode cost grow with the
    capacity. The plain generation loop's optimised HLO holds five fusions producing a
    [B, S] array: the occupancy count and the high-water mark (once, shared by the
    forward's attention and the slot assignment), the position and history writes (in
    place), and the non-compact slot search's mask, a branch decode never takes. Three
    more were there before: the tail drop after a 1-token round (which drops nothing), a
    second high-water mark and the occupancy mask of the branch not taken."""
    capacity = 320
    target = tiny_model(4)
    executables._COMPILED.clear()
    generate(target, [[1, 2, 3]], max_new_tokens=8, n_ctx=capacity)
    loops = [
        exe for key, exe in executables._COMPILED.items() if key[0] is api.eng.generate_loop_jit
    ]
    hlo = loops[0].as_text()
    passes = re.findall(r"= \w+\[1," + str(capacity) + r"\]\{[0-9,]+\} fusion\(", hlo)
    assert 0 < len(passes) <= 5, passes


def test_round_without_a_draft_pads_nothing_to_the_widest_verify():
    """ngram-mod's chain is 64 long (verify widths 1, 5, 17, 65): each width runs its own
    forward, acceptance and cache write, so no logits or K/V are padded to 65 columns (a
    round in which nothing was drafted used to pay for them), and the cache is still updated
    in place."""
    capacity = 320
    target = tiny_model(4)
    spec = SpecConfig(types=("ngram-mod",))
    executables._COMPILED.clear()
    generate(target, [[1, 2, 3]], max_new_tokens=8, n_ctx=capacity, spec=spec)
    loops = [
        exe for key, exe in executables._COMPILED.items() if key[0] is api.eng.generate_loop_jit
    ]
    assert len(loops) == 1
    hlo = loops[0].as_text()
    V = target.config.V
    wide = rf"f32\[1,65,{V}\]"
    assert re.search(wide, hlo)  # the widest verify is in the program ...
    assert not re.findall(wide + r"\{[0-9,]+\} pad\(", hlo)  # ... and nothing is padded to it
    assert not re.findall(r"\[\d+,1,65,\d+,\d+\]\{[0-9,]+\} pad\(", hlo)
    assert _cache_copies(hlo, capacity) == []


@pytest.mark.parametrize("adaptive, temperature", [(False, 0.0), (True, 0.8)])
def test_round_without_drafts_ends_as_an_off_round(monkeypatch, adaptive, temperature):
    """For a model-free chain, a round in which the relay found a draft for no row is finished
    as an off round (1-token verify at top level, no drafter feedback): tokens, every
    statistic (per drafter, governor counters) and the number of rounds are those of the full
    round it stands for. Rounds with drafts, rejected drafts and rounds without occur."""
    from specjax.decode import compile_cache
    from specjax.drafters.base import ModelFreeDrafter

    target = tiny_model(2)
    prompts = [list(range(50, 62)), list(range(30, 37))]
    spec = SpecConfig(
        types=("ngram-simple", "ngram-map-k", "ngram-mod"),
        k_max=4,
        adaptive=adaptive,
        cost_verify_token=0.1,  # (priced so that the governor lets drafts through)
        **dict(ngram_simple_size_n=1, ngram_simple_size_m=4),
        **dict(ngram_map_k_size_n=2, ngram_map_k_size_m=4),
        **dict(ngram_mod_n_match=2, ngram_mod_n_min=1, ngram_mod_n_max=4),
        ngram_mod_pool_size=4096,
    )

    def run():
        executables._COMPILED.clear()  # (the shortcut is static: a program of its own, traced anew)
        jax.clear_caches()
        out = generate(
            target, prompts, max_new_tokens=40, spec=spec, temperature=temperature, seed=[3, 4]
        )
        (loop,) = [e for k, e in executables._COMPILED.items() if k[0] is api.eng.generate_loop_jit]
        return (out.tokens, out.stats.to_dict(), out.timings["n_rounds"]), loop.as_text()

    shortcut, with_shortcut = run()
    kept_dir = compile_cache.current()
    compile_cache.set_compile_cache(None)  # (stored executables do not key class attributes)
    try:
        monkeypatch.setattr(ModelFreeDrafter, "quiet_without_draft", False)
        full, without = run()
    finally:
        compile_cache.set_compile_cache(kept_dir)
        executables._COMPILED.clear()
        jax.clear_caches()
    assert with_shortcut != without  # two programs ...
    assert shortcut == full  # ... one result
    tokens, stats, n_rounds = shortcut
    drafts = sum(d["n_gen_drafts"] for d in stats["drafters"].values())
    assert drafts > 0 and n_rounds - drafts >= 5  # some rounds without a draft in any row
    if temperature == 0:
        assert tokens == generate(target, prompts, max_new_tokens=40).tokens
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # some rejected


# -------------------------------------------------------------------- input-major weights


def test_input_major_forward_matches_float64_and_the_stored_form():
    """`linear` equals the float64 product for both weight forms, and a forward on
    `input_major` weights equals the stored-form forward at T = 1 and T = 5."""
    model = tiny_model(4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    w = np.asarray(model.params["layers"][0]["w_gate_up"])
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    for weight in (jnp.asarray(w), llama.InputMajor(t=jnp.asarray(w.T))):
        np.testing.assert_allclose(
            llama.linear(jnp.asarray(x), weight), expected, rtol=1e-5, atol=1e-5
        )
    major = llama.input_major(model.params)
    assert isinstance(major["layers"][0]["wqkv"], llama.InputMajor)
    assert major["layers"][0]["w_gate_up"].t.shape == (32, 128)
    assert llama.input_major(major)["lm_head"] is major["lm_head"]  # idempotent
    cache = model.new_cache(1, 64)
    forward = jax.jit(llama.forward_compute, static_argnums=0)  # compiled, not op by op
    for T in (1, 5):
        tokens = jnp.asarray(rng.integers(0, model.config.V, (1, T)), jnp.int32)
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        a = forward(model.config, model.params, tokens, pos, cache).logits
        b = forward(model.config, major, tokens, pos, cache).logits
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [False, True], ids=["xla_dot", "cpu_kernel"])
def test_generate_runs_the_loop_on_decode_weights_made_once(kernel):
    """On CPU the compiled generation loop takes the decode form of the weights, made once per
    model and reused by the next call: without the native kernel the `[in, out]` copies (a
    128 x 32 gate/up weight arrives as f32[32,128]); with it, `KernelWeight`s."""
    if kernel and not cpu_kernels.available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    with contextlib.nullcontext() if kernel else cpu_kernels.disabled():
        _loop_on_decode_weights(kernel)


def _loop_on_decode_weights(kernel):
    model = tiny_model(4)
    executables._COMPILED.clear()
    first = generate(model, [[1, 2, 3]], max_new_tokens=4, n_ctx=64)
    params = api.decode_params(model.params)
    assert params is api.decode_params(model.params)
    loops = [
        exe for key, exe in executables._COMPILED.items() if key[0] is api.eng.generate_loop_jit
    ]
    shapes = loops[0].as_text().split("ENTRY", 1)[1].split("\n", 1)[0]
    if kernel:
        assert isinstance(params["layers"][0]["w_gate_up"], llama.KernelWeight)
        assert cpu_kernels.TARGET in loops[0].as_text()
    else:
        assert isinstance(params["layers"][0]["w_gate_up"], llama.InputMajor)
        assert "f32[32,128]" in shapes and "f32[128,32]" not in shapes
    again = generate(model, [[1, 2, 3]], max_new_tokens=4, n_ctx=64)
    assert again.tokens == first.tokens
    # a weight replaced in place (same dict) is seen: the copies follow the leaves
    model.params["lm_head"] = -model.params["lm_head"]
    assert api.decode_params(model.params) is not params
    flipped = generate(model, [[1, 2, 3]], max_new_tokens=4, n_ctx=64)
    assert flipped.tokens != first.tokens


# -------------------------------------------------------------------- draft governor


def _python_choice(
    hit, accept, budget, active, k_max, verify, draft_step, call, widths, catch_up=0.0, behind=None
):
    """Transcription of specjax.decode.governor's rule (module docstring)."""
    rows = [r for r in range(len(hit)) if active[r]]
    p_some = 1.0 - math.prod(1.0 - hit[r] for r in rows)
    n = len(rows)

    def fwd(tokens):
        return 1 + (tokens - 1) * verify

    best, best_value = 0, -1.0
    for k in range(k_max + 1):
        tokens = sum(
            1 + hit[r] * sum(accept[r] ** j for j in range(1, min(k, budget[r]) + 1)) for r in rows
        )
        width = min(w for w in widths if w >= k + 1)
        cost = p_some * fwd(n * width) + (1 - p_some) * fwd(n) + k * draft_step * fwd(n)
        cost += call if k > 0 else 0.0
        if k > 0 and behind is not None:  # a draft model's catch-up on the rows it asks
            cost += catch_up * sum(fwd(behind[r]) for r in rows if budget[r] > 0 and behind[r] > 0)
        if tokens / cost > best_value + 1e-6:
            best, best_value = k, tokens / cost
    return [min(b, best) for b in budget]


def test_expected_tokens_match_the_series_in_float64():
    """E_r(k) = 1 + h (a + ... + a^k), computed in closed form, against the plain sum, with
    acceptance rates at 0, at 1 and a float32 step below 1 (where 1 - a^k cancels)."""
    accept = np.array([0.0, 1e-6, 0.2, 0.5, 0.8, 0.99, 0.9999, 0.99999994, 1.0], np.float32)
    hit = np.linspace(0.1, 1.0, accept.size).astype(np.float32)
    K = 64
    got = np.asarray(adaptive.expected_tokens(jnp.asarray(hit), jnp.asarray(accept), K))
    a64, h64 = accept.astype(np.float64), hit.astype(np.float64)
    want = [
        [1 + h * sum(a**j for j in range(1, k + 1)) for k in range(K + 1)] for a, h in zip(a64, h64)
    ]
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "hit,accept,verify,draft_step",
    [
        ([0.9, 0.9, 0.9], [0.8, 0.8, 0.8], 0.12, 0.25),  # pays: long drafts
        ([0.9, 0.9, 0.9], [0.2, 0.1, 0.3], 0.12, 0.25),  # does not pay: off
        ([0.5, 0.95, 0.9], [0.6, 0.9, 0.7], 0.3, 0.0),  # in between: shortened
        ([0.0, 0.0, 0.0], [0.9, 0.9, 0.9], 0.01, 0.0),  # never drafts anything: off
        ([0.1, 0.05, 0.9], [0.9, 0.9, 0.9], 0.3, 0.0),  # rarely finds, accepted: drafts
    ],
)
@pytest.mark.parametrize("widths", [None, (1, 3, 7)])
def test_governor_choice_matches_the_stated_rule(hit, accept, verify, draft_step, widths):
    B, K = 3, 6
    budget = np.array([6, 3, 6], np.int32)
    active = np.array([True, True, False])
    gov = adaptive.Governor(
        hit_num=jnp.asarray(hit, jnp.float32),
        hit_den=jnp.ones((B,), jnp.float32),
        acc_num=jnp.asarray(accept, jnp.float32),
        acc_den=jnp.ones((B,), jnp.float32),
        idle=jnp.zeros((B,), jnp.int32),
        n_rounds=jnp.zeros((), jnp.int32),
        n_throttled=jnp.zeros((), jnp.int32),
        n_off=jnp.zeros((), jnp.int32),
        miss_streak=jnp.zeros((B,), jnp.int32),
        reach=jnp.zeros((B,), jnp.int32),
    )
    cost = adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(verify, jnp.float32),
        draft_step=jnp.asarray(draft_step, jnp.float32),
        call=jnp.asarray(0.02, jnp.float32),
    )
    got, gov2 = jax.jit(adaptive.choose_budget, static_argnums=(4, 5))(
        gov, cost, jnp.asarray(budget), jnp.asarray(active), K, widths
    )
    all_widths = widths or tuple(range(1, K + 2))
    want = _python_choice(hit, accept, budget, active, K, verify, draft_step, 0.02, all_widths)
    assert np.asarray(got).tolist() == want
    assert int(gov2.n_rounds) == 1
    assert int(gov2.n_off) == (max(want) == 0)
    assert int(gov2.n_throttled) == (max(want) > 0 and any(w < b for w, b in zip(want, budget)))
    off = adaptive.CostModel.off()
    full, _ = adaptive.choose_budget(gov, off, jnp.asarray(budget), jnp.asarray(active), K)
    assert np.asarray(full).tolist() == budget.tolist()


@pytest.mark.parametrize("behind", [[0, 0, 0], [3, 0, 9], [12, 40, 0], [2, 1, 5]])
def test_governor_weighs_a_draft_models_catch_up(behind):
    """draft-simple's model skips the rounds it is not asked in: asking it after m rounds off
    adds catch_up * fwd(m) per asked row to the round's cost. The choice is the transcribed
    rule's at the module's estimates (idle rows drift towards the prior: `estimates`), and
    a catch-up long enough turns drafting off that pays without it."""
    B, K, verify, draft_step, call = 3, 4, 0.4, 0.2, 0.08
    budget = np.array([4, 4, 4], np.int32)
    active = np.array([True, True, False])
    gov = adaptive.Governor.create(B)
    gov = dataclasses.replace(
        gov,
        acc_num=jnp.full((B,), 1.9, jnp.float32),  # accept 0.95 at idle 0
        idle=jnp.asarray(behind, jnp.int32),
    )
    cost = adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(verify, jnp.float32),
        draft_step=jnp.asarray(draft_step, jnp.float32),
        call=jnp.asarray(call, jnp.float32),
        catch_up=jnp.asarray(draft_step, jnp.float32),
    )
    widths = (1, K + 1)
    got, _ = adaptive.choose_budget(gov, cost, jnp.asarray(budget), jnp.asarray(active), K, widths)
    hit, accept = (np.asarray(x, np.float64).tolist() for x in adaptive.estimates(gov))
    want = _python_choice(
        hit, accept, budget, active, K, verify, draft_step, call, widths, draft_step, behind
    )
    assert np.asarray(got).tolist() == want
    plain = _python_choice(hit, accept, budget, active, K, verify, draft_step, call, widths)
    assert max(plain) > 0  # drafting pays without a catch-up ...
    if sum(behind[:2]) > 20:
        assert max(want) == 0  # ... and not after a long one


def _python_probes(rounds, hit_from, k_max, verify, call):
    """Transcription of the module docstring's estimates for one row whose relay drafts (one
    token, accepted) only the first time it is asked at or after round `hit_from`: the
    rounds it is asked."""
    prior_hit, prior_accept = adaptive.PRIOR_HIT, adaptive.PRIOR_ACCEPT
    num, den, streak, asked, seen = 2 * prior_hit, 2.0, 0, [], False
    a_num, a_den = 2 * prior_accept, 2.0
    for t in range(rounds):
        h, a = num / den, a_num / a_den
        # one row: P(some row drafts) = h; the verify of k + 1 tokens only when it drafts
        value = [
            (1 + h * sum(a**j for j in range(1, k + 1)))
            / (h * (1 + k * verify) + (1 - h) + (call if k > 0 else 0.0))
            for k in range(k_max + 1)
        ]
        k = max(range(k_max + 1), key=lambda i: (value[i], -i))
        if k > 0:
            asked.append(t)
            hit = t >= hit_from and not seen
            seen = seen or hit
            num, den = 0.9 * num + hit, 0.9 * den + 1
            if hit:  # one accepted of a 1-token draft: a full trial
                a_num, a_den = 0.9 * a_num + 1, 0.9 * a_den + 1
            else:
                pull = 0.03 / 2 ** min(streak, 5)
                a_num = (1 - pull) * a_num + pull * 2 * prior_accept
                a_den = (1 - pull) * a_den + pull * 2
            streak = 0 if hit else streak + 1
        else:
            pull = 0.03 / 2 ** min(streak, 5)
            num, den = (1 - pull) * num + pull * 2 * prior_hit, (1 - pull) * den + pull * 2
            a_num = (1 - pull) * a_num + pull * 2 * prior_accept
            a_den = (1 - pull) * a_den + pull * 2
    return asked


def test_governor_backs_off_probing_a_drafter_that_finds_nothing():
    """A drafter that never drafts is asked less and less often (the pull towards the prior
    halves with every miss in a row), a single hit restores the fast pull, and the rounds
    asked are those of the rule's plain-Python transcription."""
    K, rounds, hit_from = 4, 256, 150
    verify, call = api.CPU_VERIFY_TOKEN, api.ASK_OVERHEAD  # CPU prices (the engine part)
    cost = adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(verify, jnp.float32),
        draft_step=jnp.asarray(0.0, jnp.float32),
        call=jnp.asarray(call, jnp.float32),
    )

    @jax.jit
    def round_(gov, t, seen):
        budget, gov = adaptive.choose_budget(gov, cost, jnp.asarray([K]), jnp.asarray([True]), K)
        asked = budget > 0
        hit = asked & (t >= hit_from) & ~seen
        gov = adaptive.observe(gov, asked, hit.astype(jnp.int32), hit.astype(jnp.int32))
        return gov, asked[0], seen | hit[0]

    gov, asked, seen = adaptive.Governor.create(1), [], jnp.asarray(False)
    for t in range(rounds):
        gov, a, seen = round_(gov, jnp.asarray(t), seen)
        if bool(a):
            asked.append(t)
    assert asked == _python_probes(rounds, hit_from, K, verify, call)
    hit = min(t for t in asked if t >= hit_from)
    gaps = np.diff([t for t in asked if t < hit])
    assert gaps[0] == 1 and gaps[-1] >= 10  # asked at first, then backed off ...
    after = [t for t in asked if t > hit]
    assert after[:3] == [hit + 1, hit + 2, hit + 3]  # ... and a hit brings the probes back
    assert len(asked) <= rounds // 3


def test_off_rounds_planned_ahead_are_the_rounds_the_rule_turns_off():
    """`rounds_off_ahead`, called after a round's choice to draft nothing, counts exactly the rounds the
    plain-Python transcription of the rule leaves off before it asks again (up to the
    horizon), over a drafter that finds nothing (the backoff stretches the gaps) and then
    finds drafts; a row that is not active (done) changes nothing."""
    K, rounds, hit_from, horizon = 4, 256, 150, 16
    verify, call = api.CPU_VERIFY_TOKEN, api.ASK_OVERHEAD
    cost = adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(verify, jnp.float32),
        draft_step=jnp.asarray(0.0, jnp.float32),
        call=jnp.asarray(call, jnp.float32),
    )
    budget, active = jnp.asarray([K, K]), jnp.asarray([True, False])

    @jax.jit
    def round_(gov, t, seen):
        b, gov = adaptive.choose_budget(gov, cost, budget, active, K)
        ahead = adaptive.rounds_off_ahead(gov, cost, budget, active, K, horizon=horizon)
        asked = (b > 0) & active
        hit = asked & (t >= hit_from) & ~seen
        gov = adaptive.observe(gov, asked, hit.astype(jnp.int32), hit.astype(jnp.int32))
        return gov, asked[0], seen | hit[0], ahead

    want = _python_probes(rounds, hit_from, K, verify, call)
    gov, seen, predicted = adaptive.Governor.create(2), jnp.asarray(False), []
    for t in range(rounds):
        gov, a, seen, ahead = round_(gov, jnp.asarray(t), seen)
        assert bool(a) == (t in want)
        predicted.append(int(ahead))
    gaps = 0
    for t in [t for t in range(rounds - horizon - 1) if t not in want]:  # after an off choice
        off_after = next((j for j in range(1, horizon + 1) if t + j in want), horizon + 1) - 1
        assert predicted[t] == off_after, t
        gaps += off_after >= 10
    assert gaps > 20  # long runs of off rounds were planned, not just single ones


def test_governor_turns_off_a_draft_that_cannot_pay_and_output_is_unchanged():
    """A draft model as costly as the target (a self-draft) never pays, not even at the
    governor's prior: the run leaves it out (`prices.unpaying_drafters`; before, it carried it
    through 22 rounds all off), says so, and the tokens stay those of plain decoding; with
    the governor off every round drafts (llama.cpp's behaviour)."""
    target = tiny_model(5)
    prompts = [[3, 4, 5, 6], [9, 8]]
    plain = generate(target, prompts, max_new_tokens=24)
    on = SpecConfig(types=("draft-simple",), draft_n_max=3, cost_draft_step=1.0)
    off = on.replace(adaptive=False)
    governed = generate(target, prompts, max_new_tokens=24, spec=on, draft=target)
    always = generate(target, prompts, max_new_tokens=24, spec=off, draft=target)
    assert governed.tokens == plain.tokens == always.tokens
    g = governed.stats.governor
    assert g["enabled"] and g["rounds"] == 0 and list(g["dropped"]) == ["draft-simple"]
    assert "draft-simple off for this run" in governed.stats.lines()[-1]
    assert always.stats.governor["off"] == 0
    assert always.stats.to_dict()["num_draft_tokens"] > governed.stats.to_dict()["num_draft_tokens"]


@pytest.mark.parametrize("self_draft", [False, True])
def test_governor_does_not_resume_a_draft_model_whose_catch_up_costs_more(self_draft):
    """draft-simple priced at a tenth of the target, CPU verify prices. An unrelated draft
    (drafts rejected) is asked once: after rounds off, its catch-up would cost more than a
    round's drafts win (7 asks in 300 rounds when the catch-up was not priced). A draft that
    is always right (the target itself) keeps drafting, never falling behind. Tokens are
    plain decoding's."""
    target = tiny_model(5)
    draft = target if self_draft else tiny_model(7)
    prompts = [[3, 4, 5, 6]]
    plain = generate(target, prompts, max_new_tokens=300)
    spec = SpecConfig(types=("draft-simple",), draft_n_max=3, cost_draft_step=0.1)
    out = generate(target, prompts, max_new_tokens=300, spec=spec, draft=draft)
    assert out.tokens == plain.tokens
    g, counts = out.stats.governor, out.stats.to_dict()
    if self_draft:
        assert g["off"] == 0 and counts["num_accepted_tokens"] > 200
    else:
        assert counts["num_draft_tokens"] > 0 and counts["num_accepted_tokens"] == 0
        assert g["rounds"] - g["off"] == 1


def test_governor_keeps_drafting_that_pays():
    """A cheap draft that is always right (self-draft priced as free): drafts stay on."""
    target = tiny_model(5)
    spec = SpecConfig(types=("draft-simple",), draft_n_max=3, cost_draft_step=0.0)
    out = generate(target, [[3, 4, 5, 6]], max_new_tokens=24, spec=spec, draft=target)
    g = out.stats.governor
    assert g["off"] == 0 and out.stats.to_dict()["num_accepted_tokens"] > 10


def _python_reach(reach: int, caps: tuple[int, ...], drafted: int, accepted: int) -> int:
    """The reach rule of `adaptive.observe`, transcribed: a draft accepted whole at the cap
    opens the next cap; a rejection goes to the narrowest cap above the accepted tokens."""
    if drafted == 0:
        return reach
    top = len(caps) - 1
    if accepted >= drafted:
        return min(reach + 1, top) if drafted >= caps[reach] else reach
    return min(sum(c < accepted + 1 for c in caps), top)


def test_governor_reach_earns_wider_verifies_one_width_at_a_time():
    """A row's longest draft is earned: the reach moves as the transcribed rule says over a
    random sequence of rounds (two rows, one not asked), and the budget the governor gives is
    cut to the reach's cap; `Engine.draft_caps` keeps only the caps a chain's drafters can
    use (ngram-mod drafts n_min tokens or none)."""
    caps = (4, 16, 64)
    rng = np.random.default_rng(3)
    gov, want = adaptive.Governor.create(2), [0, 0]
    observe = jax.jit(adaptive.observe, static_argnames=("caps",))
    moved = set()
    for _ in range(200):
        drafted = int(rng.choice([0, 3, 4, 16, 40, 64]))
        accepted = int(rng.integers(0, drafted + 1)) if rng.random() < 0.5 else drafted
        asked = jnp.asarray([True, False])
        gov = observe(
            gov, asked, jnp.asarray([drafted, drafted]), jnp.asarray([accepted, accepted]), caps
        )
        want[0] = _python_reach(want[0], caps, drafted, accepted)
        assert [int(r) for r in gov.reach] == want
        moved.add(want[0])
    assert moved == {0, 1, 2}
    cost = adaptive.CostModel(
        enabled=jnp.asarray(True),
        verify_token=jnp.asarray(0.01, jnp.float32),
        draft_step=jnp.asarray(0.0, jnp.float32),
        call=jnp.asarray(0.0, jnp.float32),
    )
    fresh = adaptive.Governor.create(1)
    budget = jnp.asarray([64])
    widths = (1, 5, 17, 65)
    free, _ = adaptive.choose_budget(fresh, cost, budget, jnp.asarray([True]), 64, widths)
    capped, _ = adaptive.choose_budget(
        fresh, cost, budget, jnp.asarray([True]), 64, widths, caps=caps
    )
    assert int(free[0]) > 4 and int(capped[0]) == 4
    grown = dataclasses.replace(fresh, reach=jnp.asarray([1]))
    capped, _ = adaptive.choose_budget(
        grown, cost, budget, jnp.asarray([True]), 64, widths, caps=caps
    )
    assert int(capped[0]) == 16
    from specjax.decode.engine import Engine
    from specjax.drafters.ngram_mod import NgramMod
    from specjax.drafters.ngram_simple import NgramSimple

    target = tiny_model(5).config
    engine = Engine(target=target, drafters=(NgramSimple(),), k_max=48, capacity=64, out_capacity=8)
    assert engine.draft_caps() == (4, 16, 48)
    engine = dataclasses.replace(engine, drafters=(NgramMod(),), k_max=64)
    assert engine.draft_caps() == (64,)
    engine = dataclasses.replace(engine, drafters=(NgramMod(n_min=0),))
    assert engine.draft_caps() == (4, 16, 64)
