"""qwen35 GGUF read/write (specjax.io.gguf_qwen35): names and keys as llama.cpp's qwen35 loader
reads them, exact round trips, clear errors, and (peers) llama.cpp loading a random-init tiny
qwen35 written by specjax and producing the same greedy continuation as specjax."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.errors import ModelFileError
from specjax.io.gguf_qwen35 import load_qwen35_gguf, save_qwen35_gguf
from specjax.io.tokenizer import Tokenizer
from specjax.models import qwen35 as q
from specjax.testing import tiny_qwen35_config

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(ROOT / "models" / "tokenizer" / "tokenizer.json")


def _config(**kw: object) -> q.Qwen35Config:
    """`tiny_qwen35_config` wider, with an MTP block and a slow RoPE base: every rotated pair
    turns by > 0.1 rad per position."""
    base: dict[str, object] = dict(
        vocab_size=_tokenizer().vocab_size, dim=64, ffn_dim=96, rope_theta=100.0,
        ssm_state_size=16, n_nextn=1, max_position=512,
    )  # fmt: skip
    base.update(kw)
    return tiny_qwen35_config(**base)


def _save(tmp_path: Path, cfg: q.Qwen35Config, dtype: str = "f32") -> tuple[Path, dict]:
    params = q.init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    path = tmp_path / "tiny-qwen35.gguf"
    save_qwen35_gguf(path, cfg, params, _tokenizer(), dtype)
    return path, params


def test_names_and_keys_are_llamacpp_qwen35(tmp_path: Path) -> None:
    """Names written out from llama_model_qwen35::load_arch_hparams / load_arch_tensors."""
    cfg = _config()
    path, _ = _save(tmp_path, cfg, "f16")
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items()}
    assert fields["general.architecture"] == "qwen35"
    expect = {
        "qwen35.block_count": 5,  # 4 trunk + 1 nextn
        "qwen35.nextn_predict_layers": 1,
        "qwen35.embedding_length": 64,
        "qwen35.feed_forward_length": 96,
        "qwen35.attention.head_count": 4,
        "qwen35.attention.head_count_kv": 2,
        "qwen35.attention.key_length": 16,
        "qwen35.attention.value_length": 16,
        "qwen35.rope.dimension_count": 8,
        "qwen35.rope.dimension_sections": [2, 1, 1, 0],
        "qwen35.ssm.conv_kernel": 4,
        "qwen35.ssm.inner_size": 64,  # state_size * time_step_rank
        "qwen35.ssm.state_size": 16,
        "qwen35.ssm.time_step_rank": 4,
        "qwen35.ssm.group_count": 2,
        "qwen35.full_attention_interval": 2,
    }
    for k, v in expect.items():
        assert fields[k] == v, k
    t = {x.name: x for x in r.tensors}
    ne = {n: [int(d) for d in x.shape] for n, x in t.items()}  # ggml order [in, out]
    D, conv_dim = 64, 2 * 2 * 16 + 4 * 16
    assert ne["blk.0.attn_qkv.weight"] == [D, conv_dim]
    assert ne["blk.0.attn_gate.weight"] == [D, 64]
    assert ne["blk.0.ssm_conv1d.weight"] == [4, conv_dim]
    assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert ne["blk.0.ssm_a"] == [4] and ne["blk.0.ssm_dt.bias"] == [4]
    assert ne["blk.0.ssm_beta.weight"] == [D, 4] and ne["blk.0.ssm_alpha.weight"] == [D, 4]
    assert ne["blk.0.ssm_norm.weight"] == [16] and ne["blk.0.ssm_out.weight"] == [64, D]
    assert ne["blk.1.attn_q.weight"] == [D, 2 * 4 * 16]  # q and gate per head
    assert ne["blk.1.attn_k.weight"] == [D, 2 * 16]
    assert ne["blk.1.attn_q_norm.weight"] == [16]
    assert "blk.1.ssm_a" not in t and "blk.0.attn_q.weight" not in t
    assert ne["blk.3.post_attention_norm.weight"] == [D]
    assert ne["blk.4.nextn.eh_proj.weight"] == [2 * D, D]
    assert "blk.4.nextn.enorm.weight" in t and "blk.4.nextn.hnorm.weight" in t
    assert "blk.4.attn_q.weight" in t and "blk.4.ffn_down.weight" in t
    assert "blk.4.nextn.shared_head_head.weight" not in t  # optional, absent here


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_is_exact(tmp_path: Path, tie: bool) -> None:
    cfg = _config(tie_embeddings=tie, n_nextn=0 if tie else 1)
    path, params = _save(tmp_path, cfg)
    cfg2, params2, tok = load_qwen35_gguf(path)
    assert cfg2 == cfg
    assert tok.vocab_size == _tokenizer().vocab_size
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_f16_file_loads_as_float16(tmp_path: Path) -> None:
    path, params = _save(tmp_path, _config(n_nextn=0), "f16")
    cfg2, params2, _ = load_qwen35_gguf(path)
    assert cfg2.dtype == "float16"
    conv = params2["layers"][0]["conv"]  # stored F32 in the file, loaded in the model dtype
    np.testing.assert_allclose(
        np.asarray(conv, np.float32), np.asarray(params["layers"][0]["conv"]), atol=1e-3
    )


def test_missing_tensor_and_bad_layer_pattern_are_named(tmp_path: Path) -> None:
    cfg = _config(n_nextn=0)
    params = q.init_params(cfg, jax.random.PRNGKey(0))
    layers = list(params["layers"])
    layers[0] = {k: v for k, v in layers[0].items() if k != "a"}
    with pytest.raises(ValueError, match=r"parameter layers\.0\.a is missing"):
        save_qwen35_gguf(
            tmp_path / "x.gguf", cfg, {**params, "layers": tuple(layers)}, _tokenizer()
        )
    assert not (tmp_path / "x.gguf").exists()
    # a file saying layer 0 is attention while the interval says recurrent
    path, _ = _save(tmp_path, cfg)
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen35")
    r = gguf.GGUFReader(str(path))
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), vt, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), vt)
    w.add_array("qwen35.attention.recurrent_layers", [False, True, True, False])
    for t in r.tensors:
        w.add_tensor(
            t.name,
            np.asarray(t.data),
            raw_shape=[int(x) for x in reversed(t.shape.tolist())],
            raw_dtype=t.tensor_type,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"recurrent_layers .* full_attention_interval=2"):
        load_qwen35_gguf(tmp_path / "bad.gguf")


def _greedy_by_steps(
    cfg: q.Qwen35Config, params: dict, ids: list[int], n: int, capacity: int = 64
) -> list[int]:
    """Greedy continuation by explicit forward calls: prefill, then one token at a time."""
    fwd = jax.jit(lambda t, p, s: q.forward(cfg, params, t, p, s))
    out = fwd(jnp.asarray([ids]), jnp.arange(len(ids))[None], q.new_state(cfg, 1, capacity))
    gen = [int(jnp.argmax(out.logits[0, -1]))]
    state = out.state
    for i in range(n - 1):
        out = fwd(jnp.asarray([[gen[-1]]]), jnp.asarray([[len(ids) + i]]), state)
        state = out.state
        gen.append(int(jnp.argmax(out.logits[0, -1])))
    return gen


def test_generate_refuses_what_the_recurrent_target_does_not_support(tmp_path: Path) -> None:
    import specjax

    path, _ = _save(tmp_path, _config(n_nextn=0))
    model = specjax.load(str(path))
    assert isinstance(model.config, q.Qwen35Config)
    spec = specjax.SpecConfig(types=("ngram-mod",))
    # temperature > 0 is supported (tests/test_hybrid_sampling.py); repeat penalties are not
    with pytest.raises(ValueError, match=r"repeat_penalty 1\.1 is not supported on qwen35"):
        specjax.generate(model, ["x = 1"], max_new_tokens=4, spec=spec, repeat_penalty=1.1)
    with pytest.raises(ValueError, match=r"repeat_penalty 1\.1 is not supported on qwen35"):
        specjax.generate(model, ["x = 1"], max_new_tokens=4, repeat_penalty=1.1)
    with pytest.raises(ValueError, match=r"Model\.new_cache is for attention-only models"):
        model.new_cache(1, 16)


@pytest.mark.slow
def test_generate_equals_step_by_step_greedy(tmp_path: Path) -> None:
    """specjax.load + generate (2 rows of different lengths, one on-device loop) == explicit
    forward calls per row; max_new_tokens per row."""
    import specjax

    cfg = _config(n_nextn=0)
    path, params = _save(tmp_path, cfg)
    model = specjax.load(str(path))
    prompts = ["def fib(n):\n", "import os"]
    res = specjax.generate(model, prompts, max_new_tokens=[12, 7], n_ctx=64)
    for b, (p, n) in enumerate(zip(prompts, (12, 7))):
        want = _greedy_by_steps(cfg, params, model.encode(p), n)
        eog = set(model.eog_ids)
        cut = next((k for k, t in enumerate(want) if t in eog), None)
        want = want if cut is None else want[:cut]
        assert res.tokens[b] == want


# ------------------------------------------------------------------------------- llama.cpp peers
BIN = os.environ.get("SPECJAX_LLAMACPP_BIN")


LONG = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(12))


@pytest.mark.peers
@pytest.mark.parametrize(("prompt", "n_ctx"), [("def fib(n):\n", 64), (LONG, 512)])
def test_peer_llamacpp_same_greedy_tokens(tmp_path: Path, prompt: str, n_ctx: int) -> None:
    """llama-completion loads the specjax-written file (MTP block included) and continues the
    prompt greedily with the same text as specjax's forward (prefill chunked, decode 1 token).
    The long prompt (> 64 tokens) crosses both implementations' delta-net chunk size."""
    tool = shutil.which("llama-completion", path=BIN) if BIN else None
    if not tool:
        pytest.skip("llama-completion not found (set SPECJAX_LLAMACPP_BIN to llama.cpp's bin)")
    cfg = _config()
    path, params = _save(tmp_path, cfg)
    n_predict = 24
    tok = _tokenizer()
    ids = tok.encode(prompt, add_bos=tok.add_bos)
    assert n_ctx == 64 or len(ids) > 2 * q.CHUNK
    gen = _greedy_by_steps(cfg, params, ids, n_predict, n_ctx)
    theirs = llamacpp_greedy_text(tool, path, prompt, n_predict, n_ctx, tmp_path)
    assert theirs.rstrip("\n") == tok.decode(gen).rstrip("\n")


def llamacpp_greedy_text(
    tool: str, path: Path, prompt: str, n_predict: int, n_ctx: int, tmp_path: Path
) -> str:
    """llama-completion's greedy continuation (text only) of `prompt` with the GGUF at `path`.
    Shared with the shipped code-hybrid peer test (tests/test_shipped_gguf.py)."""
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt + "\n")  # -f drops one trailing newline
    res = subprocess.run(
        [tool, "-m", str(path), "-f", str(prompt_file), "-n", str(n_predict), "--temp", "0"]
        + ["-c", str(n_ctx), "-no-cnv", "--no-display-prompt", "--seed", "0", "-t", "2"],
        capture_output=True,
        check=True,
    )
    return res.stdout.decode("utf-8", errors="replace")
