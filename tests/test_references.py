"""Recorded transformers / llama.cpp references (tests/fixtures/references, written by its
record.py): every case's Hugging Face folder and llama.cpp-converted GGUF load into specjax and
reproduce transformers' logits (within 1e-4, float32) and greedy ids.

Each case folder holds a tiny random checkpoint as transformers saved it, model.gguf from
llama.cpp's convert_hf_to_gguf.py, and reference.npz (see record.py). The cases are found by
listing the folder, so a newly recorded case is tested without editing this file; a case whose
architecture specjax cannot load fails (it is never skipped).

* folder / GGUF: teacher-forced logits of prompt + greedy[:-1] in one forward equal
  transformers' within 1e-4 and their argmax is transformers' greedy path, which for the GGUF
  is also llama.cpp's greedy path on the same file (recorded by llama-server); where the case
  says the GGUF follows llama.cpp (a Mistral sliding window the GGUF cannot carry), the GGUF's
  argmax path is llama.cpp's recorded path instead.
* generate: specjax.generate from the folder, greedy with an f32 KV cache, gives
  transformers' greedy ids (one case by default, every case with -m slow).
* parameters: the folder and the GGUF load to the same pytree (llama.cpp's converter is the
  independent reading of the folder's tensor layout, the Qwen3.5 MTP block included).
* Qwen3.5: the folder loads as the hybrid target with its MTP block; draft-mtp drafts with it
  and speculative greedy gives transformers' ids; `specjax generate -m <folder>` runs it.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.models.config import ModelConfig

ROOT = Path(__file__).resolve().parent / "fixtures" / "references"
CASES = sorted(p.name for p in ROOT.iterdir() if (p / "reference.npz").is_file())
ATOL = 1e-4


def _reference(case: str) -> dict:
    with np.load(ROOT / case / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def _teacher_forced_logits(model: specjax.Model, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of one row at positions 0.. in a single forward (f32 cache). A model
    family with a config class of its own needs its forward here (else its cases fail)."""
    tokens = np.asarray([ids], np.int32)
    positions = np.arange(len(ids), dtype=np.int32)[None]
    if isinstance(model.config, ModelConfig):
        cache = model.new_cache(1, 128, "f32", "f32")
        logits, _ = specjax.forward(model, tokens, positions, cache)
        return np.asarray(logits[0], np.float32)
    if getattr(model.config, "arch", None) == "qwen35":
        from specjax.models import qwen35

        state = qwen35.new_state(model.config, 1, 128, "float32")
        out = qwen35.forward(
            model.config, model.params, jnp.asarray(tokens), jnp.asarray(positions), state
        )
        return np.asarray(out.logits[0], np.float32)
    raise AssertionError(f"no forward for {type(model.config).__name__} in this test")


def test_cases_are_recorded() -> None:
    mine = {"llama3-tied", "llama-untied", "mistral", "mistral-swa", "qwen2", "qwen3", "qwen3moe"}
    assert mine | {"qwen35-mtp", "qwen35-vl-mtp", "gemma3"} <= set(CASES), CASES


@pytest.mark.parametrize("source", ["folder", "gguf"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case: str, source: str) -> None:
    ref = _reference(case)
    path = ROOT / case if source == "folder" else ROOT / case / "model.gguf"
    model = specjax.load(str(path), dtype="float32")
    prompt = ref["prompt_ids"].tolist()
    greedy = ref["greedy_ids"].tolist()
    follows = str(ref["gguf_follows"]) if "gguf_follows" in ref else "transformers"
    if source == "gguf" and follows == "llama.cpp":
        # the GGUF cannot carry what transformers applies: llama.cpp's path is its reference
        lc = ref["llamacpp_ids"].tolist()
        logits = _teacher_forced_logits(model, prompt + lc[:-1])
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == lc
        # ...and it is not transformers' (else the case would not need the exception)
        assert _teacher_forced_logits(model, prompt + greedy[:-1]).shape == ref["logits"].shape
        assert lc != greedy
        return
    logits = _teacher_forced_logits(model, prompt + greedy[:-1])
    want = ref["logits"]
    assert logits.shape == want.shape
    err = float(np.abs(logits - want).max())
    assert err <= ATOL, f"{case} {source}: max |logit - transformers| = {err:.2e}"
    path_ids = logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert path_ids == greedy
    if source == "gguf" and "llamacpp_ids" in ref:  # llama.cpp on the same file agrees
        assert path_ids == ref["llamacpp_ids"].tolist()


# one case in the default run: the window (16) is shorter than prompt + generation, so the
# cache's window masking and decode are checked; the others run with -m slow
FAST_GENERATE = "mistral-swa"


@pytest.mark.parametrize(
    "case",
    [c if c == FAST_GENERATE else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def test_generate_from_folder_gives_greedy_ids(case: str) -> None:
    ref = _reference(case)
    model = specjax.load(str(ROOT / case), dtype="float32")
    prompt = ref["prompt_ids"].tolist()
    greedy = ref["greedy_ids"].tolist()
    res = specjax.generate(
        model,
        [prompt],
        max_new_tokens=len(greedy),
        n_ctx=128,
        cache_type_k="f32",
        cache_type_v="f32",
    )
    eog = set(model.eog_ids)
    cut = next((k for k, t in enumerate(greedy) if t in eog), len(greedy))
    assert res.tokens[0] == greedy[:cut]  # the row stops at an end-of-generation id


def _leaves(params: object) -> dict[str, np.ndarray]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(k): np.asarray(v, np.float32) for k, v in flat}


@pytest.mark.parametrize("case", CASES)
def test_folder_and_gguf_hold_the_same_parameters(case: str) -> None:
    """specjax's reading of the folder == its reading of llama.cpp's conversion of it: the
    same pytree (MTP block included), equal up to float32 rounding of the converter's
    transforms (1 + w norms, -exp(A_log))."""
    folder = specjax.load(str(ROOT / case), dtype="float32")
    gguf = specjax.load(str(ROOT / case / "model.gguf"), dtype="float32")
    assert type(folder.config) is type(gguf.config)
    a, b = _leaves(folder.params), _leaves(gguf.params)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=0, err_msg=name)


QWEN35 = "qwen35-mtp"


def test_qwen35_folder_is_the_hybrid_target_with_its_mtp_block() -> None:
    from specjax.models.qwen35 import Qwen35Config

    model = specjax.load(str(ROOT / QWEN35))
    assert isinstance(model.config, Qwen35Config)
    gguf = specjax.load(str(ROOT / QWEN35 / "model.gguf"))
    assert model.config == gguf.config
    assert model.config.n_nextn == 1 and len(model.params["nextn"]) == 1
    assert model.config.Hk < model.config.Hv  # the v-head reordering is exercised


@pytest.mark.slow  # 15 s; the MTP tensors' mapping is checked against llama.cpp's above
def test_qwen35_folder_drafts_with_its_mtp_block() -> None:
    """draft-mtp from the folder's own mtp.* tensors: drafts are made and checked, and
    speculative greedy gives transformers' greedy ids."""
    model = specjax.load(str(ROOT / QWEN35), dtype="float32")
    ref = _reference(QWEN35)
    prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()
    spec = specjax.SpecConfig(types=("draft-mtp",), draft_n_max=3)
    res = specjax.generate(
        model,
        [prompt],
        max_new_tokens=len(greedy),
        n_ctx=128,
        spec=spec,
        cache_type_k="f32",
        cache_type_v="f32",
    )
    assert res.tokens[0] == greedy
    d = res.stats.to_dict()
    assert list(d["drafters"]) == ["draft-mtp"]
    assert d["num_draft_tokens"] > 0


def test_cli_generate_runs_a_qwen35_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from specjax.cli import command as cli

    out = tmp_path / "out.jsonl"
    n = 6
    argv = ["generate", "-m", str(ROOT / QWEN35), "-p", "def add(a, b):", "-n", str(n)]
    assert cli.main([*argv, "--out", str(out)]) == 0
    capsys.readouterr()
    record = json.loads(out.read_text())
    model = specjax.load(str(ROOT / QWEN35))
    assert record["prompt_tokens"] == model.encode("def add(a, b):")
    assert len(record["tokens"]) == n


def test_unsupported_folder_names_its_architecture(tmp_path: Path) -> None:
    import json
    import shutil

    from specjax.errors import ModelFileError

    shutil.copytree(ROOT / "qwen3", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(architectures=["Phi3ForCausalLM"], model_type="phi3")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"unsupported architecture \['Phi3ForCausalLM'\]"):
        specjax.load(str(tmp_path / "m"))
