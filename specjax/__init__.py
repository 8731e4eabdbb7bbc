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

Using specjax turns on JAX's persistent compilation cache (see `specjax.decode.compile_cache`;
it is set up when that module is first imported, which any compiling module does):
`specjax.set_compile_cache(path | None)` or `SPECJAX_COMPILE_CACHE=0|DIR` change that.
`import specjax` itself imports nothing heavy: the public names load on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from specjax.decode.compile_cache import set_compile_cache
    from specjax.errors import (
        CacheOverflowError,
        ModelFileError,
        SpecjaxError,
        VocabMismatchError,
    )
    from specjax.jobs.batch import BatchInputError, BatchSummary, batch
    from specjax.memory.kv import KVCache
    from specjax.models.config import ModelConfig, RopeScaling

__version__ = "0.1.0"

#: The public names, by the module that defines them. They load on first use (PEP 562), so
#: `import specjax` stays cheap until a name is used: the `specjax` command can then catch a
#: Ctrl-C that comes while JAX itself is still being imported (`specjax.cli.main`).
_PUBLIC = {
    **dict.fromkeys(
        (
            "GenerationResult",
            "Generator",
            "Model",
            "SpecReport",
            "forward",
            "generate",
            "init_model",
            "load",
        ),
        "specjax.api",
    ),
    "SpecConfig": "specjax.config",
    "types_from_names": "specjax.config",
    "set_compile_cache": "specjax.decode.compile_cache",
    **dict.fromkeys(
        ("CacheOverflowError", "ModelFileError", "SpecjaxError", "VocabMismatchError"),
        "specjax.errors",
    ),
    **dict.fromkeys(("BatchInputError", "BatchSummary", "batch"), "specjax.jobs.batch"),
    "KVCache": "specjax.memory.kv",
    **dict.fromkeys(("ModelConfig", "RopeScaling"), "specjax.models.config"),
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'specjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


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
