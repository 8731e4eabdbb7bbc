"""specjax.io.tokenizer: byte-level BPE and SPM vocabularies, GGUF metadata and tokenizer.json I/O."""

from __future__ import annotations

import random

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from specjax.errors import ModelFileError
from specjax.io.tokenizer import (
    SUPPORTED_PRE,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    Tokenizer,
)

_TEXT = (
    "the cat sat on a mat while dogs ran far über café naïve 東京 😀 12345 don't it's hello world "
    "speculative decoding draft target tokens accept reject"
)
WORDS = _TEXT.split()


def train_bpe(vocab_size: int = 300) -> Tokenizer:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return Tokenizer(tok, bos_id=0, eos_id=0, add_bos=False)


def gguf_fields(tmp_path, tokenizer: Tokenizer, n_vocab: int | None = None) -> dict:
    """Write the tokenizer's GGUF metadata to a real file and read the fields back."""
    path = tmp_path / f"tok{random.random()}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tokenizer.write_gguf_metadata(writer, n_vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe()


@pytest.fixture(scope="module")
def bpe_copies(bpe, tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    tmp = tmp_path_factory.mktemp("tok")
    via_gguf = Tokenizer.from_gguf_fields(gguf_fields(tmp, bpe))
    bpe.save(tmp / "tokenizer.json")
    via_json = Tokenizer.from_file(tmp / "tokenizer.json")
    return via_gguf, via_json


# ------------------------------------------------------------------ byte-level BPE
def test_bpe_properties(bpe):
    assert bpe.vocab_type == "gpt2"
    assert bpe.pre == "gpt-2"
    assert bpe.vocab_size == 300
    assert bpe.bos_id == 0 and bpe.eos_id == 0 and bpe.pad_id is None
    assert bpe.eog_ids == {0, 1}  # eos plus "<|im_end|>" (llama.cpp's EOG name list)
    assert bpe.token_types[:3] == (TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_NORMAL)
    ids = bpe.encode(" the")
    assert "".join(bpe.token_text(i) for i in ids) == "Ġthe"  # GGUF/byte-level spelling
    assert bpe.token_text(ids[0]).startswith("Ġ")
    with pytest.raises(ValueError, match=r"outside the vocabulary of 300"):
        bpe.token_text(300)


def test_vocabulary_facts_are_the_constructors_and_read_only(bpe):
    tok = Tokenizer(bpe.hf_tokenizer, bos_id=2, eos_id=1, pad_id=3, unk_id=4, add_eos=True)
    facts = (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id, tok.add_bos, tok.add_eos)
    assert facts == (2, 1, 3, 4, False, True)
    for name in ("bos_id", "eog_ids", "add_bos", "pre", "vocab_type", "add_space_prefix"):
        with pytest.raises(AttributeError, match=rf"{name}"):
            setattr(tok, name, None)
    assert tok.bos_id == 2


def test_bpe_special_and_bos(bpe):
    assert bpe.encode("a<|im_end|>b") == [*bpe.encode("a"), 1, *bpe.encode("b")]
    plain = bpe.encode("<|im_end|>", parse_special=False)
    assert 1 not in plain and bpe.decode(plain) == "<|im_end|>"
    assert bpe.encode("hi", add_bos=True) == [0, *bpe.encode("hi")]
    assert bpe.decode([0, *bpe.encode("hi")], skip_special=True) == "hi"
    no_bos = Tokenizer(bpe.hf_tokenizer, eos_id=0)
    with pytest.raises(ValueError, match=r"no BOS"):
        no_bos.encode("hi", add_bos=True)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_bpe_round_trips_unicode(bpe, bpe_copies, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    for copy in bpe_copies:  # through GGUF metadata and through tokenizer.json
        assert copy.encode(text) == ids
        assert copy.decode(ids) == text


def test_bpe_metadata_round_trip(bpe, bpe_copies, tmp_path):
    via_gguf, via_json = bpe_copies
    for copy in (via_gguf, via_json):
        assert copy.vocab_type == "gpt2" and copy.pre == "gpt-2"
        assert [copy.token_text(i) for i in range(300)] == [bpe.token_text(i) for i in range(300)]
        assert copy.token_types == bpe.token_types
        assert (copy.bos_id, copy.eos_id, copy.add_bos, copy.eog_ids) == (0, 0, False, {0, 1})
    assert via_gguf.merges() == bpe.merges()
    fields = gguf_fields(tmp_path, bpe)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.merges"][0] == " ".join(bpe.merges()[0])
    assert fields["tokenizer.ggml.add_bos_token"] is False


def test_bpe_padding_to_model_vocab(bpe, tmp_path):
    fields = gguf_fields(tmp_path, bpe, n_vocab=310)
    assert len(fields["tokenizer.ggml.tokens"]) == 310
    assert fields["tokenizer.ggml.tokens"][305] == "[PAD305]"
    assert fields["tokenizer.ggml.token_type"][305] == 5  # UNUSED
    padded = Tokenizer.from_gguf_fields(fields)
    assert padded.vocab_size == 310
    assert padded.encode("the cat 東京") == bpe.encode("the cat 東京")
    with pytest.raises(ValueError, match=r"300 tokens but the model vocabulary is 299"):
        gguf_fields(tmp_path, bpe, n_vocab=299)


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["abc", "Ġ12345"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
        ("starcoder", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizers(bpe, tmp_path, pre, pieces):
    fields = gguf_fields(tmp_path, bpe)
    fields["tokenizer.ggml.pre"] = pre
    del fields["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer.from_gguf_fields(fields)
    got = [p for p, _ in tok.hf_tokenizer.pre_tokenizer.pre_tokenize_str("abc 12345")]
    assert got == pieces
    text = "Ünïcode 😀 and 1234 digits\n\n  spaces"
    assert tok.decode(tok.encode(text)) == text
    assert tok.add_bos is (pre == "llama-bpe")  # llama.cpp's default for llama3 vocabularies
    tok.save(tmp_path / "tokenizer.json")
    again = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert again.pre == pre
    assert again.encode(text) == tok.encode(text)


def test_unsupported_vocab_metadata(bpe, tmp_path):
    fields = gguf_fields(tmp_path, bpe)
    fields["tokenizer.ggml.pre"] = "nonsense-pre"
    with pytest.raises(ModelFileError, match=r"unsupported pre-tokenizer.*'nonsense-pre'"):
        Tokenizer.from_gguf_fields(fields)
    assert "gpt-2" in SUPPORTED_PRE and "qwen2" in SUPPORTED_PRE
    fields["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ModelFileError, match=r"unsupported tokenizer model.*'bert'"):
        Tokenizer.from_gguf_fields(fields)
    with pytest.raises(ModelFileError, match=r"no tokenizer"):
        Tokenizer.from_gguf_fields({})


def test_from_file_errors(tmp_path):
    with pytest.raises(ModelFileError, match=r"not found"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelFileError, match=r"not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path)


# ------------------------------------------------------------------ SentencePiece ("llama")
SPM_PIECES = [
    # (piece, score): merged pieces must be reachable from characters through other pieces.
    ("▁", -1.0),
    ("t", -2.0),
    ("h", -3.0),
    ("e", -4.0),
    ("c", -5.0),
    ("a", -6.0),
    ("s", -7.0),
    ("o", -8.0),
    ("n", -9.0),
    ("at", -10.0),
    ("▁t", -11.0),
    ("▁th", -12.0),
    ("▁the", -13.0),
    ("▁c", -14.0),
    ("▁cat", -15.0),
    ("▁s", -16.0),
    ("he", -17.0),
    ("▁on", -18.0),
    ("▁o", -19.0),
    ("on", -20.0),
    ("ca", -21.0),
    ("ts", -22.0),
    ("▁a", -23.0),
    ("▁at", -24.0),
]


def spm_fields() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for piece, score in SPM_PIECES:
        tokens.append(piece)
        types.append(TOKEN_NORMAL)
        scores.append(score)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def spm_reference(fields: dict, text: str) -> list[int]:
    """llama.cpp's llm_tokenizer_spm: repeatedly merge the best-scoring adjacent pair."""
    tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
    types = fields["tokenizer.ggml.token_type"]
    index = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_NORMAL}
    symbols = list("▁" + text.replace(" ", "▁")) if text else []
    while True:
        best = None
        for i in range(len(symbols) - 1):
            j = index.get(symbols[i] + symbols[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for s in symbols:
        if s in index:
            out.append(index[s])
        else:
            out.extend(tokens.index(f"<0x{b:02X}>") for b in s.encode("utf-8"))
    return out


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_gguf_fields(spm_fields())


def test_spm_encodes_sentence(spm):
    assert spm.vocab_type == "llama" and spm.add_space_prefix
    assert (spm.bos_id, spm.eos_id, spm.unk_id, spm.add_bos) == (1, 2, 0, True)
    assert 2 in spm.eog_ids
    ids = spm.encode("the cat sat on a mat", add_bos=True)
    pieces = [spm.token_text(i) for i in ids]
    assert pieces == ["<s>", "▁the", "▁cat", "▁s", "at", "▁on", "▁a", "▁", "<0x6D>", "at"]
    assert spm.decode(ids, skip_special=True) == "the cat sat on a mat"
    # characters outside the vocabulary fall back to their UTF-8 bytes
    ids = spm.encode("é")
    assert [spm.token_text(i) for i in ids] == ["▁", "<0xC3>", "<0xA9>"]
    assert spm.decode(ids) == "é"


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="thecasonm é", max_size=30))
def test_spm_matches_llama_cpp_algorithm(spm, text):
    fields = spm_fields()
    assert spm.encode(text) == spm_reference(fields, text)
    assert spm.decode(spm.encode(text)) == text


def test_spm_gguf_and_json_round_trip(spm, tmp_path):
    fields = gguf_fields(tmp_path, spm)
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.scores"][-1] == pytest.approx(SPM_PIECES[-1][1])
    again = Tokenizer.from_gguf_fields(fields)
    spm.save(tmp_path / "tokenizer.json")
    via_json = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert via_json.vocab_type == "llama" and via_json.add_space_prefix
    assert (via_json.bos_id, via_json.eos_id, via_json.add_bos) == (1, 2, True)
    assert via_json.token_types == spm.token_types
    # tokenizer.json has no scores: they are re-derived from merge ranks for GGUF export
    rederived = Tokenizer.from_gguf_fields(gguf_fields(tmp_path, via_json))
    for text in ("the cat sat on a mat", "éa thats notes", " leading  spaces "):
        ids = spm.encode(text)
        assert again.encode(text) == ids
        assert via_json.encode(text) == ids
        assert rederived.encode(text) == ids
        assert via_json.decode(ids) == text


def test_spm_requires_scores():
    fields = spm_fields()
    del fields["tokenizer.ggml.scores"]
    with pytest.raises(ModelFileError, match=r"without tokenizer.ggml.scores"):
        Tokenizer.from_gguf_fields(fields)
