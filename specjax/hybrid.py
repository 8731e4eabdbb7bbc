"""Deprecated: `generate_hybrid` is `specjax.generate` on a qwen35 model.

Hybrid recurrent targets run through the one engine (`specjax.decode.engine`) over their
`HybridTargetMemory` (`specjax.memory.target`); this name is kept for code that called it.
"""

from __future__ import annotations

import warnings
from typing import Any

from specjax.api import generate


def generate_hybrid(model: Any, prompts: Any, **kwargs: Any) -> Any:
    """`specjax.generate(model, prompts, **kwargs)` (deprecated name)."""
    warnings.warn(
        "specjax.hybrid.generate_hybrid is deprecated: call specjax.generate",
        DeprecationWarning,
        stacklevel=2,
    )
    return generate(model, prompts, **kwargs)
