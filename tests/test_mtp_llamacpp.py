"""draft-mtp in llama.cpp on the shipped hybrid GGUF: `llama-speculative-simple --spec-type
draft-mtp` (the GGUF's own nextn block is the drafter) runs, and at temperature 0 its mean
acceptance length on the same prompt is within 10% of specjax's (benchmarks/heads.py mtp does the
same run and prints both; skipped without SPECJAX_LLAMACPP_BIN or the shipped GGUF)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

import specjax

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "code-hybrid" / "code-hybrid-f16.gguf"
PROMPT = ROOT / "benchmarks" / "prompts" / "repetitive.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_mtp", ROOT / "benchmarks" / "heads.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.peers
def test_llama_cpp_draft_mtp_has_the_same_acceptance_length() -> None:
    bin_dir = os.environ.get("SPECJAX_LLAMACPP_BIN")
    if not (bin_dir and shutil.which("llama-speculative-simple", path=bin_dir)):
        pytest.skip("llama-speculative-simple not found (set SPECJAX_LLAMACPP_BIN)")
    if not MODEL.exists():
        pytest.skip("models/code-hybrid is not shipped")
    model = specjax.load(str(MODEL))
    if getattr(model.config, "n_nextn", 0) < 1:
        pytest.skip("the shipped code-hybrid GGUF has no nextn block")
    bench = _bench()
    n_new, n_max, n_ctx = 128, 3, 1024
    peer = bench.llama_cpp(MODEL, PROMPT, n_new, n_max, n_ctx)
    ours = bench.specjax_mtp(model, bench.prompt_ids(model, PROMPT), n_new, n_max, n_ctx, 0)
    assert ours["same_tokens_as_plain"]
    assert peer["rounds"] > 0 and ours["rounds"] > 0
    a, b = ours["mean_acceptance_length"], peer["mean_acceptance_length"]
    assert abs(a - b) <= 0.1 * b, (a, b)
