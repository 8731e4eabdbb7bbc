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

Importing specjax turns on JAX's persistent compilation cache (see `specjax.compile_cache`):
`specjax.set_compile_cache(path | None)` or `SPECJAX_COMPILE_CACHE=0|DIR` change that.
"""

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
from specjax.batching import BatchInputError, BatchSummary
from specjax.batching import batch as batch
from specjax.cache import KVCache
from specjax.compile_cache import enable_default as _enable_compile_cache
from specjax.compile_cache import set_compile_cache
from specjax.config import SpecConfig, types_from_names
from specjax.errors import CacheOverflowError, ModelFileError, SpecjaxError, VocabMismatchError
from specjax.models.config import ModelConfig, RopeScaling

__version__ = "0.1.0"

_enable_compile_cache()

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
