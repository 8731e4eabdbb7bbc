"""Model file I/O: GGUF files (llama.cpp) and Hugging Face directories, one entry point.

Every loader returns ``(ModelConfig, params, Tokenizer)`` with params in the layout documented
in specjax.models.config; every problem with a file raises specjax.errors.ModelFileError.
"""

from __future__ import annotations

import os

from specjax.errors import ModelFileError
from specjax.io.gguf_io import load_gguf, save_gguf
from specjax.io.hf_io import load_hf, save_hf
from specjax.io.tokenizer import Tokenizer
from specjax.models.config import ModelConfig
from specjax.types import Params

__all__ = ["load_gguf", "load_hf", "load_model_files", "save_gguf", "save_hf"]


def load_model_files(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[ModelConfig, Params, Tokenizer]:
    """Load a `.gguf` file or a Hugging Face model directory (config.json + safetensors).

    EAGLE-3 / DFlash GGUFs return their head configs; qwen35 GGUFs and Qwen3.5 folders
    (specjax.io.hf_qwen35) a Qwen35Config."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from specjax.io.hf_qwen35 import is_qwen35_folder, load_qwen35_hf

        if is_qwen35_folder(path):  # the hybrid target: (Qwen35Config, ...)
            return load_qwen35_hf(path, dtype=dtype)  # type: ignore[return-value]
        return load_hf(path, dtype=dtype)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
        if is_gguf:
            from specjax.io.eagle3_gguf import ARCH, gguf_architecture, load_eagle3_gguf

            arch = gguf_architecture(path)
            if arch == ARCH:  # an EAGLE-3 head: (Eagle3Config, ...)
                return load_eagle3_gguf(path, dtype=dtype)  # type: ignore[return-value]
            if arch == "qwen35":  # the hybrid target: (Qwen35Config, ...)
                from specjax.io.gguf_qwen35 import load_qwen35_gguf

                return load_qwen35_gguf(path, dtype=dtype)  # type: ignore[return-value]
            if arch == "dflash":  # a DFlash / DSpark head: (DFlashConfig, ...)
                from specjax.io.dflash_gguf import load_dflash_gguf

                return load_dflash_gguf(path, dtype=dtype)  # type: ignore[return-value]
            return load_gguf(path, dtype=dtype)
        if path.lower().endswith(".gguf"):
            return load_gguf(path, dtype=dtype)
        raise ModelFileError(f"{path}: neither a .gguf file nor a Hugging Face model directory")
    raise ModelFileError(f"{path}: no such file or directory")
