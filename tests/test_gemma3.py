"""Gemma 3 (text) targets: the forward against a float64 NumPy statement of transformers'
Gemma3ForCausalLM (tests/oracles/gemma3_reference.py), loading and its errors, and the
sliding-window memory (specjax.memory.swa: the windowed layers' cells in a ring of
window - 1 + k_max + 1) against a full cache, against speculative decoding's rollbacks, and
against a transcription of llama.cpp's SWA KV cache (tests/oracles/kv_swa_reference.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from oracles import gemma3_reference as ref
from oracles import kv_swa_reference as llama_swa
from tokenizers import models, pre_tokenizers

import specjax
from specjax.api import Model, generate
from specjax.cli.options import _load_options as cli_options
from specjax.config import SpecConfig
from specjax.decode.engine import Engine
from specjax.errors import ModelFileError
from specjax.io import load_hf
from specjax.io.gguf_io import _gemma3_keys
from specjax.io.hf_io import config_from_hf
from specjax.io.tokenizer import Tokenizer
from specjax.memory import ops
from specjax.memory.swa import SWACache
from specjax.memory.target import KVTargetMemory, SWATargetMemory
from specjax.models.llama import commit_kv, forward_fn, new_cache
from specjax.testing import noisy_copy

V, D, F, H, G, E, L = 64, 32, 64, 4, 2, 16, 3
WINDOW = 8
HF_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": V,
    "hidden_size": D,
    "intermediate_size": F,
    "num_hidden_layers": L,
    "num_attention_heads": H,
    "num_key_value_heads": G,
    "head_dim": E,
    "query_pre_attn_scalar": 24,  # not head_dim: the query scale shows
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_theta": 10000.0,
    "rope_local_base_freq": 100.0,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "final_logit_softcapping": 5.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random Gemma3ForCausalLM tensors, norms in Hugging Face's convention (scale 1 + w)."""
    rng = np.random.default_rng(seed)
    t = {
        "model.embed_tokens.weight": rng.normal(0, 0.05, (V, D)),
        "model.norm.weight": rng.normal(0, 0.3, (D,)),
    }
    for i in range(L):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t |= {
            a + "q_proj.weight": rng.normal(0, 0.4, (H * E, D)),
            a + "k_proj.weight": rng.normal(0, 0.4, (G * E, D)),
            a + "v_proj.weight": rng.normal(0, 0.4, (G * E, D)),
            a + "o_proj.weight": rng.normal(0, 0.4, (D, H * E)),
            a + "q_norm.weight": rng.normal(0, 0.3, (E,)),
            a + "k_norm.weight": rng.normal(0, 0.3, (E,)),
            p + "input_layernorm.weight": rng.normal(0, 0.3, (D,)),
            p + "post_attention_layernorm.weight": rng.normal(0, 0.3, (D,)),
            p + "pre_feedforward_layernorm.weight": rng.normal(0, 0.3, (D,)),
            p + "post_feedforward_layernorm.weight": rng.normal(0, 0.3, (D,)),
            p + "mlp.gate_proj.weight": rng.normal(0, 0.4, (F, D)),
            p + "mlp.up_proj.weight": rng.normal(0, 0.4, (F, D)),
            p + "mlp.down_proj.weight": rng.normal(0, 0.4, (D, F)),
        }
    return {k: v.astype(np.float32) for k, v in t.items()}


def write_folder(folder, config: dict, tensors: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"\u2581w{i}" for i in range(4, V)]
    hf = tokenizers.Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=3))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    Tokenizer(hf, bos_id=2, eos_id=1, pad_id=0, add_bos=False).save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def tensors() -> dict[str, np.ndarray]:
    return hf_tensors(0)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tensors) -> Model:
    folder = tmp_path_factory.mktemp("gemma3")
    write_folder(folder, HF_CONFIG, tensors)
    config, params, tok = load_hf(folder)
    return Model(config=config, params=params, tokenizer=tok, eog=(1,))


_forward = jax.jit(forward_fn, static_argnums=0)


def full_cache_logits(model: Model, ids: list[int], pad_to: int = 0) -> np.ndarray:
    """Logits [T, V] of one row at positions 0.. over a plain KVCache (every cell kept);
    `pad_to`: the row padded to that length (one compiled shape for every length)."""
    T = max(len(ids), pad_to)
    tokens = np.zeros((1, T), np.int32)
    tokens[0, : len(ids)] = ids
    positions = np.where(np.arange(T) < len(ids), np.arange(T), -1)[None].astype(np.int32)
    out = _forward(
        model.config,
        model.params,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        new_cache(model.config, 1, T, "float32"),
    )
    return np.asarray(out.logits[0, : len(ids)])


# ------------------------------------------------------------------------ the forward
def test_forward_matches_float64_reference(target, tensors):
    ids = random.Random(0).choices(range(V), k=24)  # three times the window
    want = ref.forward(HF_CONFIG, tensors, ids)
    got = full_cache_logits(target, ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert target.config.sliding_window == WINDOW
    assert target.config.swa_layers == (True, False, True)


def test_reference_sees_every_gemma3_feature(tensors):
    """The oracle's logits move with each Gemma 3 specific (so the comparison above tests
    them): the query scale, the local RoPE base, linear scaling, the soft-cap, the window."""
    ids = random.Random(1).choices(range(V), k=20)
    base = ref.forward(HF_CONFIG, tensors, ids)
    for change in (
        {"query_pre_attn_scalar": E},
        {"rope_local_base_freq": 10000.0},
        {"rope_scaling": None},
        {"final_logit_softcapping": None},
        {"sliding_window": 64},
    ):
        assert np.abs(ref.forward({**HF_CONFIG, **change}, tensors, ids) - base).max() > 1e-3


def test_conditional_generation_text_part(tmp_path, tensors):
    """Gemma3ForConditionalGeneration: the language model under model.language_model.*,
    config under text_config; the vision tower is left out, logits as the CausalLM's."""
    multi = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    multi["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros(
        (4, 3), np.float32
    )
    text = {k: v for k, v in HF_CONFIG.items() if k not in ("architectures", "model_type")}
    write_folder(
        tmp_path,
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {**text, "model_type": "gemma3_text"},
        },
        multi,
    )
    config, params, _ = load_hf(tmp_path)
    ids = [3, 9, 27, 5, 5, 40, 12, 7, 8, 9, 10, 11]
    np.testing.assert_allclose(
        full_cache_logits(Model(config=config, params=params), ids),
        ref.forward(HF_CONFIG, tensors, ids),
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "Gemma2ForCausalLM"),
        ({"architectures": ["Gemma3nForCausalLM"], "model_type": "gemma3n"}, "Gemma3n"),
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "'yarn'"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window=0"),
    ],
)
def test_unsupported_gemma_variants_are_clear_errors(change, message):
    with pytest.raises(ModelFileError, match=message):
        config_from_hf({**HF_CONFIG, **change})


def test_transformers_default_layer_pattern():
    """Without layer_types: transformers' sliding_window_pattern (6: every sixth layer global),
    which is also llama.cpp's default for gemma3 GGUFs without a pattern."""
    hf = {k: v for k, v in HF_CONFIG.items() if k != "layer_types"} | {"num_hidden_layers": 7}
    assert config_from_hf(hf).swa_layers == (True,) * 5 + (False, True)


# ------------------------------------------------------------------------ the ring memory
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [3, 4],  # 34 tokens: four windows
    [20, 21, 22, 20, 21, 22, 20, 21, 22, 30],
    [40, 41, 42],
]
MAX_NEW = [40, 44, 30]


@pytest.fixture(scope="module")
def plain(target):
    return generate(target, PROMPTS, max_new_tokens=MAX_NEW, cache_type_k="f32", cache_type_v="f32")


def test_engine_picks_the_ring_for_windowed_targets(target):
    engine = Engine(target=target.config, k_max=4, capacity=128, out_capacity=64)
    assert isinstance(engine.memory, SWATargetMemory)
    assert engine.memory.seq_rm_type == "PART" and not engine.memory.checkpoints
    full = Engine(target=target.config, k_max=4, capacity=128, out_capacity=64, swa_full=True)
    assert isinstance(full.memory, KVTargetMemory)


def test_ring_memory_bytes(target):
    """Per row at S = 128, k_max 4, f16 K/V: the two windowed layers keep 8 - 1 + 5 = 12
    cells instead of 128 (the full layer keeps 128)."""
    mem = SWATargetMemory(target.config, 5, "float16", "float16").init(1, 128)
    full = KVTargetMemory(target.config, "float16", "float16").init(1, 128)
    assert mem.ring_cells == 12
    kv_bytes = lambda cells: 2 * G * cells * E * 2  # noqa: E731  (K and V, f16)
    assert full.nbytes == 3 * kv_bytes(128) + 128 * 4 + 1
    assert mem.nbytes == kv_bytes(128) + 128 * 4 + 1 + 2 * kv_bytes(12) + 12 * 4 + 1
    assert mem.nbytes < 0.41 * full.nbytes


def test_ring_greedy_equals_full_cache_greedy(target, plain):
    """Plain greedy through the engine's ring memory == greedy over a full KVCache, far past
    the window (prompts and generations several windows long); prompts prefilled in chunks
    of 5 (n_ubatch) through the ring too."""
    chunked = generate(
        target, PROMPTS, max_new_tokens=MAX_NEW, n_ubatch=5, cache_type_k="f32", cache_type_v="f32"
    )
    assert chunked.tokens == plain.tokens
    for prompt, n, tokens in zip(PROMPTS, MAX_NEW, plain.tokens):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(np.argmax(full_cache_logits(target, ids, pad_to=96)[-1])))
        assert tokens == ids[len(prompt) :]
        assert len(prompt) + n > 4 * WINDOW


def test_swa_full_keeps_every_cell_and_gives_the_same_tokens(target, plain):
    """`swa_full=True` (llama.cpp's --swa-full; `specjax generate --swa-full`): a full cache
    for every layer, the same greedy ids, more KV bytes."""
    full = generate(
        target, PROMPTS, max_new_tokens=MAX_NEW, swa_full=True, cache_type_k="f32",
        cache_type_v="f32",
    )  # fmt: skip
    assert full.tokens == plain.tokens
    assert plain.timings["kv_cache_bytes"] < 0.75 * full.timings["kv_cache_bytes"]
    assert cli_options(["-m", "x", "--swa-full"])["swa_full"] is True
    assert cli_options(["-m", "x"])["swa_full"] is False


def check_spec(target, plain, spec, draft=None):
    out = generate(
        target,
        PROMPTS,
        max_new_tokens=MAX_NEW,
        spec=spec,
        draft=draft,
        cache_type_k="f32",
        cache_type_v="f32",
    )
    assert out.tokens == plain.tokens
    stats = out.stats.to_dict()
    # drafts made, some accepted and some rejected (rolled back in the ring)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    return stats


def test_draft_simple_on_the_ring_is_lossless(target, plain):
    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=4)
    check_spec(target, plain, spec, noisy_copy(target, 0.2))


def test_ngram_simple_on_the_ring_is_lossless(target, plain):
    spec = SpecConfig(
        types=("ngram-simple",),
        adaptive=False,
        k_max=6,
        ngram_simple_size_n=1,
        ngram_simple_size_m=6,
    )
    check_spec(target, plain, spec)


# ------------------------------------------------------------------------ seq_rm semantics
def swa_cache(ring: int) -> SWACache:
    return SWACache.init(
        batch=1,
        capacity=256,
        ring_cells=ring,
        swa=(True, False),
        window=WINDOW,
        n_kv_heads=1,
        head_dim=2,
        inv_freq=(1.0,),
        inv_freq_swa=(1.0,),
    )


_commit = jax.jit(commit_kv)
_seq_rm = jax.jit(lambda c, p0, p1: ops.seq_rm(c, 0, p0, p1))


def write(cache: SWACache, positions: list[int]) -> SWACache:
    kv = (jnp.zeros((1, len(positions), 1, 2)),) * 2
    return _commit(cache, jnp.asarray([positions], jnp.int32), kv, kv)


def ring_visible(cache: SWACache, q: int) -> set[int]:
    return {int(p) for p in np.asarray(cache.ring.pos[0]) if 0 <= p <= q and q - p < WINDOW}


@pytest.mark.parametrize("width", [1, 3, 5])
def test_seq_rm_follows_llama_cpps_swa_cache(width):
    """Speculative rounds (a verify batch of up to `width` tokens, then seq_rm of the
    rejected tail, at most the whole batch) on the ring (window - 1 + width cells) and on
    llama.cpp's SWA cache (n_swa + n_ubatch cells, lazy reuse of masked cells, purge):
    seq_rm succeeds on both, and the next token sees the same positions on both: the whole
    window of the history."""
    rng = random.Random(width)
    ours = swa_cache(WINDOW - 1 + width)
    theirs = llama_swa.SwaKvCache(WINDOW + width, WINDOW)
    prompt = list(range(19))
    ours = write(ours, prompt)  # one batch; llama.cpp splits it in ubatches of n_ubatch
    for start in range(0, len(prompt), width):
        assert theirs.decode(prompt[start : start + width])
    length = len(prompt)
    for _ in range(40):
        t = rng.randint(1, width)
        batch = list(range(length, length + t))
        ours = write(ours, batch)
        assert theirs.decode(batch)
        # id_last and the accepted drafts (the engine's rollback), or the whole batch gone
        keep = length + rng.randint(0, t)
        ours, ok = _seq_rm(ours, keep, -1)
        assert bool(ok) and theirs.seq_rm(keep, -1)
        length = keep
        window = set(range(max(0, length - WINDOW + 1), length))
        assert ring_visible(ours, length) == theirs.visible(length) == window
        assert int(ours.seq_pos_max(0)) == theirs.seq_pos_max() == length - 1


def test_rollback_probe_reports_part():
    """llama.cpp's probe (decode two tokens, seq_rm(0, 1, -1)) succeeds on an iSWA cache:
    PART; so does the ring's seq_rm, whatever it removes (llama.cpp's returns true too)."""
    assert llama_swa.can_seq_rm(WINDOW + 4, WINDOW) == "PART"
    cache = write(swa_cache(WINDOW + 3), [0, 1])
    cache, ok = _seq_rm(cache, 1, -1)
    assert bool(ok) and int(cache.seq_pos_max(0)) == 0
    # below the ring's reach (k_max 3: a rollback removes at most 4 positions): succeeds on
    # both, and both report a lowest position above what a token at 34 needs (34 - 8 + 1),
    # the check llama.cpp's server makes before re-processing a prompt
    deep = write(swa_cache(WINDOW + 3), list(range(40)))
    deep, ok = _seq_rm(deep, 34, -1)
    assert bool(ok) and int(deep.seq_pos_min(0)) > 34 - WINDOW + 1
    theirs = llama_swa.SwaKvCache(WINDOW + 4, WINDOW)
    for start in range(0, 40, 4):
        assert theirs.decode(list(range(start, start + 4)))
    assert theirs.seq_rm(34, -1) and theirs.seq_pos_min() > 34 - WINDOW + 1


def test_unsupported_memory_operations_say_so():
    cache = swa_cache(12)
    with pytest.raises(NotImplementedError, match="seq_add"):
        ops.seq_add(cache, 0, 0, -1, 3)
    assert not cache.can_shift


# ------------------------------------------------------------------------ recorded reference
REFERENCE = Path(__file__).resolve().parent / "fixtures" / "references" / "gemma3"
NGRAM_1_4 = dict(ngram_simple_size_n=1, ngram_simple_size_m=4)


def _recorded() -> tuple[list[int], list[int]]:
    with np.load(REFERENCE / "reference.npz") as z:
        prompt, greedy = z["prompt_ids"].tolist(), z["greedy_ids"].tolist()
        assert z["llamacpp_ids"].tolist() == greedy  # llama-server's ids for the GGUF
    return prompt, greedy


_RECORDED_RUN = dict(n_ctx=128, cache_type_k="f32", cache_type_v="f32")


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_recorded_gemma3_generates_transformers_ids(source):
    """The recorded Gemma3ForCausalLM (tests/fixtures/references/gemma3: six layers, the
    last global, window 8, a 34-token prompt) from its folder and from llama.cpp's
    conversion: greedy through the ring gives transformers' greedy ids (= llama-server's)."""
    prompt, greedy = _recorded()
    model = specjax.load(str(REFERENCE if source == "folder" else REFERENCE / "model.gguf"))
    assert model.config.arch == "gemma3" and model.config.swa_layers == (True,) * 5 + (False,)
    out = specjax.generate(model, [prompt], max_new_tokens=len(greedy), **_RECORDED_RUN)
    assert out.tokens[0] == greedy


@pytest.mark.slow  # ~1 min of compiles; the tiny model's speculative tests above run by default
def test_recorded_gemma3_speculative_gives_transformers_ids():
    """Speculative greedy on the recorded model (ngram-simple; draft-simple with a noisy copy
    as the draft), drafts accepted and rejected: transformers' greedy ids."""
    prompt, greedy = _recorded()
    model = specjax.load(str(REFERENCE))
    for spec, draft in (
        (SpecConfig(types=("ngram-simple",), adaptive=False, k_max=4, **NGRAM_1_4), None),
        (
            SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=4),
            noisy_copy(model, 0.3),
        ),
    ):
        out = specjax.generate(
            model, [prompt], max_new_tokens=len(greedy), spec=spec, draft=draft, **_RECORDED_RUN
        )
        assert out.tokens[0] == greedy
        stats = out.stats.to_dict()
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], spec.types


@pytest.mark.slow  # ~30 s of compiles
def test_batch_job_slots_on_the_ring(target, plain, tmp_path):
    """Continuous batching (specjax.batch: slots taken and put back, prompts prefilled in
    chunks of 6 through the ring, two slots for three requests) gives generate's tokens."""
    requests = [
        {"id": i, "tokens": p, "n_predict": n} for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))
    ]
    out = tmp_path / "out.jsonl"
    specjax.batch(
        target,
        requests,
        out,
        n_parallel=2,
        n_ctx=96,
        prefill_chunk=6,
        cache_type_k="f32",
        cache_type_v="f32",
        progress=False,
        spec=SpecConfig(types=("ngram-simple",), adaptive=False, k_max=6, ngram_simple_size_n=1),
    )
    got = {r["id"]: r["tokens"] for r in json_lines(out)}
    assert [got[i] for i in range(len(PROMPTS))] == plain.tokens


def json_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow  # ~1 min of compiles
def test_batch_job_mesh_on_the_ring(target, plain, tmp_path):
    """The batch job's shardings place the ring's and the full part's K/V as a KV cache's
    (rows over data, KV heads over model): on 2 devices (tests/conftest.py), data=2 and
    model=2 give generate's tokens."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    requests = [
        {"id": i, "tokens": p, "n_predict": n} for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))
    ]
    for name, n_parallel, mesh in (
        ("data2", 2, {"data": 2, "model": 1}),
        ("model2", 1, {"data": 1, "model": 2}),
    ):
        out = tmp_path / f"{name}.jsonl"
        specjax.batch(
            target, requests, out, n_parallel=n_parallel, n_ctx=96, prefill_chunk=16,
            cache_type_k="f32", cache_type_v="f32", progress=False, mesh=mesh,
        )  # fmt: skip
        got = {r["id"]: r["tokens"] for r in json_lines(out)}
        assert [got[i] for i in range(len(PROMPTS))] == plain.tokens, name


def test_slot_save_refuses_a_ring_target(target, tmp_path):
    with pytest.raises(ValueError, match="slot save / restore is not supported for a gemma3"):
        generate(
            target, [PROMPTS[2]], max_new_tokens=2, slot_save_path=str(tmp_path), slot_save="a"
        )


def test_gguf_query_scale_follows_llama_cpp():
    """llama.cpp's gemma3 loader scales queries by 1/sqrt(head_dim), except for the 62-layer
    (27B) model: 1/sqrt(dim / n_heads) (there head_dim 128, query_pre_attn_scalar 168)."""

    def key(name, default=None, cast=float):
        return {"rope.freq_base_swa": 10000.0, "final_logit_softcapping": 0.0}.get(name, default)

    assert _gemma3_keys("f", key, "none", 1152, 4, 26, 256)["attn_scale"] == 0.0
    assert _gemma3_keys("f", key, "none", 5376, 32, 62, 128)["attn_scale"] == 168**-0.5
    scaled = _gemma3_keys(
        "f",
        lambda n, d=None, c=float: 8.0 if n == "rope.scaling.factor" else d,
        "linear",
        2560,
        8,
        34,
        256,
    )
    assert scaled["rope_factors"] == (8.0,) * 128
    with pytest.raises(ModelFileError, match="'yarn'"):
        _gemma3_keys("f", key, "yarn", 2560, 8, 34, 256)
