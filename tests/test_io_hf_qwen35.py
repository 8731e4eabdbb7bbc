"""specjax.io.hf_qwen35: what a Qwen3.5 folder may and may not hold (the recorded reference
folders in tests/fixtures/references, edited). Logits, greedy ids and the tensor mapping itself
are checked against transformers and llama.cpp's converter in tests/test_references.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from specjax.errors import ModelFileError
from specjax.io import load_hf, load_model_files
from specjax.io.hf_qwen35 import is_qwen35_folder, load_qwen35_hf
from specjax.models.qwen35 import Qwen35Config

REFS = Path(__file__).resolve().parent / "fixtures" / "references"


def _copy(tmp_path: Path, case: str = "qwen35-mtp") -> Path:
    shutil.copytree(REFS / case, tmp_path / case, ignore=shutil.ignore_patterns("*.gguf", "*.npz"))
    return tmp_path / case


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, drop: str = "", add: dict | None = None) -> None:
    path = folder / "model.safetensors"
    t = {
        k: v
        for k, v in safetensors.numpy.load_file(path).items()
        if not (drop and k.startswith(drop))
    }
    safetensors.numpy.save_file({**t, **(add or {})}, path, metadata={"format": "pt"})


def test_both_layouts_load_the_same_text_model() -> None:
    """The released layout (ConditionalGeneration: text_config, model.language_model.*, a
    vision tower that is not loaded) gives a Qwen35Config like the CausalLM layout."""
    for case in ("qwen35-mtp", "qwen35-vl-mtp"):
        assert is_qwen35_folder(REFS / case)
        config, _, _ = load_model_files(REFS / case)
        assert isinstance(config, Qwen35Config)
        assert (config.L, config.full_attention_interval, config.n_nextn) == (4, 4, 1)
        assert (config.Hk, config.Hv, config.S, config.n_rot) == (2, 4, 16, 8)
        assert config.rope_sections == (2, 1, 1, 0)
    assert not is_qwen35_folder(REFS / "qwen3")
    gguf_config, _, _ = load_model_files(REFS / "qwen35-mtp" / "model.gguf")
    assert gguf_config == load_model_files(REFS / "qwen35-mtp")[0]


def test_folder_without_mtp_tensors_loads_the_trunk(tmp_path: Path) -> None:
    """transformers drops mtp.* when it re-saves a checkpoint: the trunk loads, n_nextn = 0."""
    folder = _copy(tmp_path)
    _edit_tensors(folder, drop="mtp.")
    config, params, _ = load_qwen35_hf(folder)
    _, full_params, _ = load_qwen35_hf(REFS / "qwen35-mtp")
    assert config.n_nextn == 0 and "nextn" not in params
    np.testing.assert_array_equal(params["layers"][3]["wq"], full_params["layers"][3]["wq"])


@pytest.mark.parametrize(
    ("config_changes", "message"),
    [
        (
            {
                "layer_types": [
                    "linear_attention",
                    "full_attention",
                    "linear_attention",
                    "full_attention",
                ][::-1]
            },
            r"do not follow a full-attention interval",
        ),
        ({"linear_value_head_dim": 32}, r"linear_value_head_dim 32 != linear_key_head_dim 16"),
        ({"mtp_num_hidden_layers": 2}, r"mtp_num_hidden_layers=2 but the weights hold 1"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantized checkpoint \(quant_method 'fp8'\) is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7}},
            r"RoPE type 'yarn' is not supported",
        ),
    ],
)
def test_bad_configs_are_named(tmp_path: Path, config_changes: dict, message: str) -> None:
    folder = _copy(tmp_path)
    _edit_config(folder, **config_changes)
    with pytest.raises(ModelFileError, match=message):
        load_qwen35_hf(folder)


def test_unknown_and_missing_tensors_are_named(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    _edit_tensors(folder, add={"model.layers.0.linear_attn.extra.weight": np.zeros(4, np.float32)})
    with pytest.raises(ModelFileError, match=r"no slot for: model\.layers\.0\.linear_attn\.extra"):
        load_qwen35_hf(folder)
    folder = _copy(tmp_path / "b")
    _edit_tensors(folder, drop="model.layers.1.linear_attn.A_log")
    with pytest.raises(
        ModelFileError, match=r"missing tensor model\.layers\.1\.linear_attn\.A_log"
    ):
        load_qwen35_hf(folder)


def test_load_hf_points_qwen35_folders_to_the_hybrid_loader() -> None:
    with pytest.raises(
        ModelFileError, match=r"hybrid \(qwen35\) model: load it with specjax\.load"
    ):
        load_hf(REFS / "qwen35-mtp")
