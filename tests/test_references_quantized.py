"""Quantized GGUFs of the recorded reference cases (tests/fixtures/references, see
test_references.py): every case's llama.cpp-converted model.gguf, rewritten by gguf-py with its
weight matrices in Q8_0 and in Q4_0, loads into specjax with the values the file holds and
stays as close to the recorded logits as its quantization error allows.

The copy keeps every metadata field (general.file_type set to llama.cpp's MOSTLY_Q8_0 /
MOSTLY_Q4_0) and every tensor; it quantizes the tensors llama-quantize quantizes
(src/llama-quant.cpp, tensor_allows_quantization, for these architectures: 2-D/3-D tensors named
`*weight`, except `*_norm.weight`, the MoE router `ffn_gate_inp.weight` and `ssm_conv1d`), all
in the one type (llama-quantize mixes in Q8_0 for some tensors of a Q4_0 file; here every
quantizable tensor takes the tested type). The Q8_0/Q4_0 bytes come from gguf.quants.quantize;
checked once against llama-quantize on these fixtures: the same set of tensors quantized, and
byte-identical Q8_0 and Q4_0 blocks.

* types: the rewritten file reads back with exactly those tensors in the quantized type and
  the rest as they were, and the same metadata.
* dequantization: specjax's parameters from the quantized file equal, bit for bit, its
  parameters from an F32 twin holding this test's own decoding of the file's blocks (ggml's
  block_q8_0 / block_q4_0 layout, written out below in NumPy), and those decoded values are
  within the rounding step of the recorded f32 weights. Any wrong block layout, sign or scale
  fails here; test_broken_dequantization_is_caught checks that it does.
* logits: the teacher-forced logits stay within 3x the logit error of a control model whose
  weights carry the same per-element error magnitudes with random signs (two seeds, max).
  Rounding error behaves like that noise, so the control measures how much these tiny random
  models amplify an error of this size (a lot: ~0.2 of a logit scale of ~5 for Q8_0 dense
  cases, O(1) for qwen35 / qwen3moe, whose recurrence or router are that sensitive; at Q4_0
  every case is perturbed on the scale of the logits themselves). Observed error / control:
  0.46-1.44. The greedy path (argmax of these logits) is the reference's up to the first
  position where the reference's top-1/top-2 gap is within twice the observed error; these
  random checkpoints have near-ties (gaps 0.01-0.18) from the first token on, so that prefix
  is 0-6 tokens at Q8_0 and empty at Q4_0: the bit-exact parameter check carries the weight.
  The reference is transformers' logits, or for a GGUF that follows llama.cpp (mistral-swa:
  the GGUF cannot carry the sliding window), the f32 GGUF's logits on llama.cpp's recorded
  greedy path (test_references checks those against llama.cpp).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from test_references import CASES, ROOT, _leaves, _reference, _teacher_forced_logits

import specjax

QTYPES = ("Q8_0", "Q4_0")
FILE_TYPE = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
BLOCK = 32  # elements per block of both types
# |dequantized - f32| <= BOUND * max|block|: half a step (max/127, resp. max/8) plus the
# float16 rounding of the scale (2^-11 relative) times the largest quant (127, resp. 8); Q4_0's
# +8 end is clipped to +7, a whole step.
ROUNDING_BOUND = {"Q8_0": (0.5 + 127 * 2**-11) / 127, "Q4_0": (1.0 + 8 * 2**-11) / 8}
CONTROL_FACTOR = 3.0
# the matrices llama-quantize leaves F32 in these cases (seen in its Q8_0 / Q4_0 output)
KEPT_F32 = {
    "qwen3moe": {"ffn_gate_inp.weight"},
    "qwen35-mtp": {"ssm_conv1d.weight"},
    "qwen35-vl-mtp": {"ssm_conv1d.weight"},
}
CONTROL_SEEDS = (0, 1)


def _llama_quantizes(t: gguf.ReaderTensor) -> bool:
    """Whether llama-quantize quantizes this tensor (the rule of src/llama-quant.cpp that
    applies to these architectures) and its rows split into whole blocks."""
    name = t.name
    return (
        len(t.shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and "ssm_conv1d" not in name
        and int(t.shape[0]) % BLOCK == 0
    )


def _rewrite(
    src: Path, dst: Path, tensor: Callable[[gguf.ReaderTensor], tuple[np.ndarray, QT]], ftype: int
) -> None:
    """Copy `src` to `dst` with every metadata field (general.file_type := `ftype`) and each
    tensor as `tensor(t)` gives it: (data in numpy order, its GGML type)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = ftype if field.name == "general.file_type" else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data, qtype = tensor(t)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _decode_blocks(raw: np.ndarray, qtype: str) -> np.ndarray:
    """The f32 values of a row-major array of ggml blocks [..., row bytes] (ggml-common.h):
    block_q8_0 = {f16 d; int8 qs[32]}, x[j] = d * qs[j]; block_q4_0 = {f16 d; u8 qs[16]},
    x[j] = d * ((qs[j] & 15) - 8), x[j + 16] = d * ((qs[j] >> 4) - 8)."""
    nbytes = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2}[qtype]
    blocks = np.ascontiguousarray(raw, np.uint8).reshape(-1, nbytes)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    qs = blocks[:, 2:]
    if qtype == "Q8_0":
        q = qs.view(np.int8).astype(np.float32)
    else:
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32) - 8
    return (d * q).reshape(*raw.shape[:-1], -1)


class Quantized:
    """One case's GGUF in one type: the quantized file, the F32 twin with this test's decoding
    of its blocks, and the recorded f32 weights of the tensors it quantized."""

    def __init__(self, case: str, qtype: str, folder: Path) -> None:
        self.case, self.qtype = case, qtype
        src = ROOT / case / "model.gguf"
        self.path = folder / f"{case}-{qtype}.gguf"
        self.twin = folder / f"{case}-{qtype}-decoded-f32.gguf"
        self.f32: dict[str, np.ndarray] = {}

        def quantize(t: gguf.ReaderTensor) -> tuple[np.ndarray, QT]:
            if not _llama_quantizes(t):
                return np.asarray(t.data), t.tensor_type
            assert t.tensor_type == QT.F32, (t.name, t.tensor_type)
            self.f32[t.name] = np.array(t.data, np.float32)
            return gguf.quants.quantize(self.f32[t.name], QT[qtype]), QT[qtype]

        _rewrite(src, self.path, quantize, FILE_TYPE[qtype])
        self.decoded = {
            t.name: _decode_blocks(np.asarray(t.data), qtype)
            for t in gguf.GGUFReader(self.path).tensors
            if t.name in self.f32
        }
        self.control_paths = []
        for seed in CONTROL_SEEDS:
            rng = np.random.default_rng(seed)
            path = folder / f"{case}-{qtype}-control{seed}.gguf"

            def control(t: gguf.ReaderTensor, rng: np.random.Generator = rng) -> tuple:
                if t.name not in self.f32:
                    return np.asarray(t.data), t.tensor_type
                w = self.f32[t.name]
                sign = rng.choice(np.float32([-1.0, 1.0]), w.shape)
                return w + sign * (self.decoded[t.name] - w), QT.F32

            _rewrite(src, path, control, int(gguf.LlamaFileType.ALL_F32))
            self.control_paths.append(path)

        def twin(t: gguf.ReaderTensor) -> tuple[np.ndarray, QT]:
            if t.name in self.decoded:
                return self.decoded[t.name], QT.F32
            return np.asarray(t.data), t.tensor_type

        _rewrite(src, self.twin, twin, int(gguf.LlamaFileType.ALL_F32))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Quantized]:
    folder = tmp_path_factory.mktemp("quantized")
    return functools.cache(lambda case, qtype: Quantized(case, qtype, folder))


def _reference_path(case: str) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt, greedy ids, logits [T, V] at prompt + greedy[:-1]) the GGUF is held to."""
    ref = _reference(case)
    prompt = ref["prompt_ids"].tolist()
    if "gguf_follows" in ref and str(ref["gguf_follows"]) == "llama.cpp":
        greedy = ref["llamacpp_ids"].tolist()
        f32 = specjax.load(str(ROOT / case / "model.gguf"), dtype="float32")
        return prompt, greedy, _teacher_forced_logits(f32, prompt + greedy[:-1])
    return prompt, ref["greedy_ids"].tolist(), ref["logits"]


def _logit_error(path: Path, ids: list[int], want: np.ndarray) -> tuple[float, np.ndarray]:
    logits = _teacher_forced_logits(specjax.load(str(path), dtype="float32"), ids)
    return float(np.abs(logits - want).max()), logits


def _assert_loads_decoded_values(q: Quantized) -> None:
    got = _leaves(specjax.load(str(q.path), dtype="float32").params)
    want = _leaves(specjax.load(str(q.twin), dtype="float32").params)
    assert sorted(got) == sorted(want)
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{q.case} {q.qtype} {name}")


def _assert_logits_within_control(q: Quantized) -> tuple[float, float, int]:
    """(error, bound, greedy prefix checked); AssertionError when the bound is exceeded."""
    prompt, greedy, want = _reference_path(q.case)
    ids = prompt + greedy[:-1]
    control = max(_logit_error(p, ids, want)[0] for p in q.control_paths)
    bound = CONTROL_FACTOR * control
    err, logits = _logit_error(q.path, ids, want)
    assert err <= bound, (
        f"{q.case} {q.qtype}: max |logit - reference| = {err:.3g} > {CONTROL_FACTOR} x "
        f"{control:.3g} (random-sign control with the same error magnitudes)"
    )
    top2 = np.sort(want[len(prompt) - 1 :], axis=-1)[:, -2:]
    near_tie = [int(k) for k in np.flatnonzero(top2[:, 1] - top2[:, 0] <= 2 * err)]
    safe = near_tie[0] if near_tie else len(greedy)
    path = logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert path[:safe] == greedy[:safe], f"{q.case} {q.qtype}: greedy differs before a near-tie"
    return err, bound, safe


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("case", CASES)
def test_quantized_gguf_holds_the_quantized_types(quantized, case: str, qtype: str) -> None:
    q = quantized(case, qtype)
    src = gguf.GGUFReader(ROOT / case / "model.gguf")
    out = gguf.GGUFReader(q.path)
    types = {t.name: QT(int(t.tensor_type)) for t in out.tensors}
    assert list(types) == [t.name for t in src.tensors]
    want = {t.name: QT[qtype] if _llama_quantizes(t) else t.tensor_type for t in src.tensors}
    assert types == want
    kept = {
        re.sub(r"^blk\.\d+\.", "", t.name)
        for t in out.tensors
        if len(t.shape) >= 2 and types[t.name] == QT.F32
    }
    assert kept == KEPT_F32.get(case, set())
    assert all(types[t.name] == QT.F32 for t in out.tensors if len(t.shape) == 1)
    assert "token_embd.weight" in q.f32 and len(q.f32) >= 4
    assert all(t.n_bytes < t.n_elements * 4 for t in out.tensors if t.name in q.f32)
    fields = {k: f.contents() for k, f in out.fields.items() if not k.startswith("GGUF.")}
    before = {k: f.contents() for k, f in src.fields.items() if not k.startswith("GGUF.")}
    assert fields.pop("general.file_type") == FILE_TYPE[qtype]
    before.pop("general.file_type", None)
    assert fields == before


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("case", CASES)
def test_quantized_gguf_loads_its_dequantized_values(quantized, case: str, qtype: str) -> None:
    q = quantized(case, qtype)
    for name, w in q.f32.items():
        blocks = np.abs(w).reshape(-1, BLOCK).max(-1, keepdims=True)
        err = np.abs(q.decoded[name] - w).reshape(-1, BLOCK)
        assert (err <= ROUNDING_BOUND[qtype] * blocks + 1e-12).all(), f"{name}: {err.max():.3g}"
        assert (q.decoded[name] != w).any()  # really rounded
    _assert_loads_decoded_values(q)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("case", CASES)
def test_quantized_gguf_logits_within_quantization_error(quantized, case: str, qtype: str) -> None:
    _assert_logits_within_control(quantized(case, qtype))


def _broken_dequantize(original: Callable) -> Callable:
    """gguf.quants.dequantize with classic bugs: Q8_0 quants read unsigned, Q4_0 nibbles
    interleaved (x[2j], x[2j+1] instead of x[j], x[j+16])."""

    def broken(data: np.ndarray, qtype: QT) -> np.ndarray:
        if qtype not in (QT.Q8_0, QT.Q4_0):
            return original(data, qtype)
        nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks = np.ascontiguousarray(data, np.uint8).reshape(-1, nbytes)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)
        qs = blocks[:, 2:]
        if qtype == QT.Q8_0:
            q = qs.astype(np.float32)
        else:
            q = np.stack([qs & 15, qs >> 4], axis=-1).reshape(len(qs), -1).astype(np.float32) - 8
        return (d * q).reshape(*data.shape[:-1], -1)

    return broken


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("case", CASES)
def test_broken_dequantization_is_caught(
    quantized, monkeypatch: pytest.MonkeyPatch, case: str, qtype: str
) -> None:
    """The checks above fail for a loader that decodes the blocks wrongly: always the
    parameter comparison; the logit bound too wherever it is below half the logit scale."""
    q = quantized(case, qtype)
    _, _, want = _reference_path(case)
    monkeypatch.setattr(gguf.quants, "dequantize", _broken_dequantize(gguf.quants.dequantize))
    with pytest.raises(AssertionError):
        _assert_loads_decoded_values(q)
    try:
        _, bound, _ = _assert_logits_within_control(q)
    except AssertionError:
        return
    assert bound >= np.abs(want).max() / 2, f"{case} {qtype}: bound {bound:.3g} missed the bug"
