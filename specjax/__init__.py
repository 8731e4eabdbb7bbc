"""specjax: llama.cpp's speculative decoding as pure JAX.

Public API (see README.md):

    model = specjax.load("models/code-target/code-target-f16.gguf")
    result = specjax.generate(model, ["def fib(n):"], max_new_tokens=64)
    result = specjax.generate(model, prompts, max_new_tokens=64,
                              spec=specjax.SpecConfig(types=("ngram-mod", "draft-simple")),
                              draft=specjax.load("models/code-draft/code-draft-f16.gguf"))
    print(result.text[0]); print(result.stats)
    gen = specjax.Generator(model, spec=spec, draft=draft, n_ctx=512, batch=4)  # drafter
    result = gen.generate(prompts, max_new_tokens=64)         # state kept across calls

Importing specjax turns on JAX's persistent compilation cache (see `specjax.decode.compile_cache`):
`specjax.set_compile_cache(path | None)` or `SPECJAX_COMPILE_CACHE=0|DIR` change that.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

from specjax.api import (
    GenerationResult,
    Generator,
    Model,
    SpecReport,
    forward,
    generate,
    init_model,
    load,
)
from specjax.config import SpecConfig, types_from_names
from specjax.decode.compile_cache import enable_default as _enable_compile_cache
from specjax.decode.compile_cache import set_compile_cache
from specjax.errors import CacheOverflowError, ModelFileError, SpecjaxError, VocabMismatchError
from specjax.jobs.batch import BatchInputError, BatchSummary
from specjax.jobs.batch import batch as batch
from specjax.memory.kv import KVCache
from specjax.models.config import ModelConfig, RopeScaling

__version__ = "0.1.0"

_enable_compile_cache()

#: Modules that moved into the layer packages, by their old names: importing an old name gives
#: the module where it lives now, with a DeprecationWarning.
MOVED_MODULES = {
    "specjax.adaptive": "specjax.decode.governor",
    "specjax.batch_cli": "specjax.cli.batch",
    "specjax.batch_sharding": "specjax.jobs.sharding",
    "specjax.batching": "specjax.jobs.batch",
    "specjax.cache": "specjax.memory.kv",
    "specjax.compile_cache": "specjax.decode.compile_cache",
    "specjax.continuous": "specjax.jobs.continuous",
    "specjax.cpu_kernels": "specjax.kernels.cpu",
    "specjax.data": "specjax.train.data",
    "specjax.engine": "specjax.decode.engine",
    "specjax.hybrid_memory": "specjax.memory.hybrid",
    "specjax.lookup": "specjax.io.lookup",
    "specjax.lookup_index": "specjax.drafters.lookup_index",
    "specjax.objectives": "specjax.train.objectives",
    "specjax.prices": "specjax.decode.prices",
    "specjax.slot_checkpoint": "specjax.memory.checkpoint",
    "specjax.slots": "specjax.jobs.slots",
    "specjax.stats": "specjax.decode.stats",
    "specjax.tokenizer": "specjax.io.tokenizer",
    "specjax.train_dflash": "specjax.train.dflash",
    "specjax.train_draft": "specjax.train.draft",
    "specjax.train_eagle3": "specjax.train.eagle3",
    "specjax.train_hybrid": "specjax.train.hybrid",
    "specjax.train_mtp": "specjax.train.mtp",
    "specjax.verify": "specjax.decode.verify",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `MOVED_MODULES`' old names: the module object is the new one."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass


sys.meta_path.append(_MovedModules())

__all__ = [
    "BatchInputError",
    "BatchSummary",
    "CacheOverflowError",
    "GenerationResult",
    "Generator",
    "KVCache",
    "Model",
    "ModelConfig",
    "ModelFileError",
    "RopeScaling",
    "SpecConfig",
    "SpecReport",
    "SpecjaxError",
    "VocabMismatchError",
    "batch",
    "forward",
    "generate",
    "init_model",
    "load",
    "set_compile_cache",
    "types_from_names",
]
