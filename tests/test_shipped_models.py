"""Shipped assets in models/: the code tokenizer round-trips validation sources byte for byte.

Uses `tokenizers` directly (no GGUF reader needed). Tests of the shipped GGUF weights (load,
deterministic greedy generation) live with the loader's tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specjax.train.data import (
    SPECIAL_TOKENS,
    encode_documents,
    load_tokenizer,
    read_texts,
    split_files,
    stdlib_files,
    token_byte_lengths,
)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
TOKENIZER = MODELS / "tokenizer" / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if not TOKENIZER.exists():
        pytest.fail(f"{TOKENIZER} is missing")
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def val_texts() -> list[str]:
    _, val = split_files(stdlib_files())
    return read_texts(val)


def test_tokenizer_layout(tokenizer: Any) -> None:
    assert tokenizer.get_vocab_size() == 2048
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(s) == i
    spec = json.loads(TOKENIZER.read_text())
    assert spec["model"]["type"] == "BPE"
    assert spec["normalizer"] is None
    pre = spec["pre_tokenizer"]
    assert pre["type"] == "ByteLevel" and pre["use_regex"] and not pre["add_prefix_space"]
    cfg = json.loads((TOKENIZER.parent / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == SPECIAL_TOKENS
    assert cfg["add_bos_token"] is True


def test_validation_files_round_trip_byte_for_byte(tokenizer: Any, val_texts: list[str]) -> None:
    assert len(val_texts) >= 20
    encodings = tokenizer.encode_batch(val_texts, add_special_tokens=False)
    for text, enc in zip(val_texts, encodings):
        decoded = tokenizer.decode(enc.ids, skip_special_tokens=False)
        assert decoded.encode("utf-8") == text.encode("utf-8")
    n_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    n_tokens = sum(len(e.ids) for e in encodings)
    assert n_bytes / n_tokens > 2.8  # measured 3.11 bytes/token on CPython 3.11's stdlib


def test_token_byte_lengths_account_for_every_byte(tokenizer: Any, val_texts: list[str]) -> None:
    """bpb's denominator: per-token byte lengths sum to the UTF-8 size of the documents."""
    lengths = token_byte_lengths(tokenizer)
    assert lengths[:3].tolist() == [0, 0, 0] and lengths[3:].min() >= 1
    texts = val_texts[:5]
    tokens = encode_documents(tokenizer, texts)
    assert tokens.dtype == np.uint16
    assert int((tokens == 0).sum()) == int((tokens == 1).sum()) == len(texts)
    assert int(lengths[tokens].sum()) == sum(len(t.encode("utf-8")) for t in texts)


def test_models_folder_stays_small() -> None:
    total = sum(p.stat().st_size for p in MODELS.rglob("*") if p.is_file())
    assert total < 40 * 1024 * 1024, total
    for name in ("code-target", "code-draft", "code-hybrid"):
        assert (MODELS / name / "MODEL_CARD.md").exists()
        assert list((MODELS / name).glob("*.gguf")), name


@pytest.mark.slow
@pytest.mark.skipif(
    sys.version_info[:3] != (3, 11, 7), reason="tokenizer recipe ran on CPython 3.11.7"
)
def test_tokenizer_recipe_reproduces_shipped_file(tmp_path: Path) -> None:
    from specjax.train.data import TokenizerConfig, train_tokenizer

    out = tmp_path / "tokenizer.json"
    train_tokenizer(TokenizerConfig(output=str(out)))
    assert out.read_bytes() == TOKENIZER.read_bytes()
