"""What loading the GGUF formats of the heads and the qwen35 model shares: reading a file
(`GGUFFile`: its metadata keys, its tensors consumed one by one, the d2t table, the tokenizer).
Their saves are `specjax.io.gguf_io.gguf_saver`'s, like `save_gguf`.

Used by `specjax.io.eagle3_gguf`, `specjax.io.dflash_gguf` and `specjax.io.gguf_qwen35`.
Invariants: a load names the file and the key or tensor in every error (`ModelFileError`);
`refuse_unused` fails a load that left a tensor unread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.errors import ModelFileError, file_error
from specjax.io.gguf_io import (
    _config_dtype,
    _f32,
    _field_values,
    _open_reader,
    _tensor_to_numpy,
    rope_factors_from_tensor,
)
from specjax.io.tokenizer import Tokenizer
from specjax.types import Array


class GGUFFile:
    """A GGUF file opened for reading as architecture `arch` (ModelFileError otherwise):
    `fields` (metadata), `tensors` (by name) and the names `get` has consumed."""

    def __init__(self, path: str | os.PathLike[str], arch: str) -> None:
        self.path = os.fspath(path)
        reader = _open_reader(self.path)
        self.fields: dict[str, Any] = _field_values(reader)
        found = self.fields.get("general.architecture")
        if found != arch:
            raise ModelFileError(f"{self.path}: architecture {found!r} is not {arch!r}")
        self.arch = arch
        self.tensors: dict[str, Any] = {t.name: t for t in reader.tensors}
        self.used: set[str] = set()

    def error(self, message: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {message}")

    def key(self, name: str, default: Any = ..., cast: Any = int, per_layer: bool = False) -> Any:
        """`{arch}.{name}` through `cast`; `default` when absent (`...`: required). With
        `per_layer`, a list value must repeat one value (else not supported) and gives it."""
        full = f"{self.arch}.{name}"
        if full not in self.fields:
            if default is ...:
                raise self.error(f"missing metadata key {full}")
            return default
        value = self.fields[full]
        if per_layer and isinstance(value, list) and cast is not list:
            if not value or any(v != value[0] for v in value):
                raise self.error(f"per-layer values for {full} are not supported")
            value = value[0]
        return cast(value)

    def attention_dims(self) -> tuple[int, int, int, int]:
        """(D, H, G, E) from the attention keys; a value length other than E is refused."""
        D = self.key("embedding_length")
        H = self.key("attention.head_count")
        G = self.key("attention.head_count_kv", H)
        E = self.key("attention.key_length", D // H if H else 0)
        if self.key("attention.value_length", E) != E:
            raise self.error("key_length != value_length is not supported")
        return D, H, G, E

    def head_fields(self, vocab_size: int, n_draft: int, dtype: str | None) -> dict[str, Any]:
        """The config fields a feature head's file gives the same way (EAGLE-3, DFlash):
        vocabularies, widths, head split, RoPE base, norm epsilon, context, dtype (`dtype`,
        else the file's)."""
        D, H, G, E = self.attention_dims()
        return {
            "vocab_size": vocab_size,
            "draft_vocab": 0 if n_draft == vocab_size else n_draft,
            "dim": D,
            "n_heads": H,
            "n_kv_heads": G,
            "ffn_dim": self.key("feed_forward_length"),
            "head_dim": 0 if (D % H == 0 and E == D // H) else E,
            "rope_theta": self.key("rope.freq_base", 10000.0, _f32),
            "norm_eps": self.key("attention.layer_norm_rms_epsilon", cast=_f32),
            "max_position": self.key("context_length", 4096),
            "dtype": dtype or _config_dtype(self.tensors),
        }

    def vocab_size(self) -> int:
        """The tokenizer's token count, else the `vocab_size` key."""
        if "tokenizer.ggml.tokens" in self.fields:
            return len(self.fields["tokenizer.ggml.tokens"])
        return int(self.key("vocab_size"))

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor `name` in numpy order (consumed), checked against `shape` when given (a
        1-D `shape` reshapes a tensor of that size)."""
        if name not in self.tensors:
            raise self.error(f"missing tensor {name}")
        self.used.add(name)
        arr = _tensor_to_numpy(self.path, self.tensors[name])
        if shape is None:
            return arr
        if arr.size == int(np.prod(shape)) and len(shape) == 1:
            arr = arr.reshape(shape)
        if arr.shape != shape:
            raise self.error(f"tensor {name} has shape {arr.shape} (numpy order), expected {shape}")
        return arr

    def rope_factors(self, n_pairs: int) -> tuple[float, ...]:
        """The `rope_freqs.weight` tensor (consumed) as a config's `rope_factors`: per-pair
        RoPE divisors as stored (a llama3-scaled target's head has them); () without one."""
        if "rope_freqs.weight" not in self.tensors:
            return ()
        return rope_factors_from_tensor(self.path, self.get("rope_freqs.weight", (n_pairs,)))

    def d2t(self, n_draft: int, vocab_size: int) -> Array | None:
        """The head's d2t table as int32 ids (consumed), None when the file has none."""
        if "d2t" not in self.tensors:
            return None
        self.used.add("d2t")
        d2t = np.asarray(self.tensors["d2t"].data).reshape(-1).astype(np.int64)
        if d2t.shape != (n_draft,) or np.any((d2t < 0) | (d2t >= vocab_size)):
            raise self.error(f"d2t target ids out of range for vocabulary {vocab_size}")
        return jnp.asarray(d2t.astype(np.int32))

    def refuse_unused(self, what: str, sep: str = "") -> None:
        """ModelFileError naming up to 8 tensors `get` never consumed (`what`: the model)."""
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            listed = sep.join(unused[:8]) if sep else str(unused[:8])
            raise self.error(f"tensors {what} has no slot for: {listed}")

    def tokenizer(self) -> Tokenizer:
        with file_error(self.path, "invalid tokenizer metadata"):
            return Tokenizer.from_gguf_fields(self.fields, source=self.path)

    def hparams(self, make: Callable[[], Any], what: str) -> Any:
        """`make()` (a config constructor) with its ValueError as a ModelFileError naming
        the file and `what` ("EAGLE-3", "qwen35")."""
        with file_error(self.path, f"invalid {what} hyper-parameters"):
            return make()
