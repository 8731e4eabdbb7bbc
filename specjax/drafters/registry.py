"""Builds the drafter chain for a SpecConfig, in llama.cpp's fixed priority order.

Adding a drafter type means: a module with a subclass of `base.Drafter` (its `from_spec`
builds it from a SpecConfig), and one entry in `_TYPES` (its name also in `DRAFTER_TYPES` /
`PRIORITY`, llama.cpp's lists). The engine never changes.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from specjax.config import SpecConfig
from specjax.drafters.base import PRIORITY, Drafter

#: Each implemented type's drafter class, as "module:class" under `specjax.drafters` (imported
#: when first asked for: a chain loads only its own drafters' modules).
_TYPES: dict[str, str] = {
    "draft-simple": "draft_simple:DraftSimple",
    "draft-eagle3": "eagle3:Eagle3Drafter",
    "draft-mtp": "draft_mtp:MtpDrafter",
    "draft-dflash": "dflash:DFlashDrafter",
    "draft-dspark": "dflash:DSparkDrafter",
    "ngram-simple": "ngram_simple:NgramSimple",
    "ngram-mod": "ngram_mod:NgramMod",
    "ngram-map-k": "ngram_map:NgramMapK",
    "ngram-map-k4v": "ngram_map:NgramMapK4V",
    "ngram-cache": "ngram_cache:NgramCache",
}


def drafter_class(name: str) -> type[Drafter]:
    """The drafter class of the speculative type `name` (a `DRAFTER_TYPES` name)."""
    where = _TYPES.get(name)
    if where is None:
        raise ValueError(f"speculative type {name} is not implemented in specjax yet")
    module, cls = where.split(":")
    found: type[Drafter] = getattr(importlib.import_module(f"specjax.drafters.{module}"), cls)
    return found


def _classes(types: Iterable[str]) -> list[type[Drafter]]:
    return [drafter_class(t) for t in types if t in _TYPES]


def price_terms(types: Iterable[str]) -> frozenset[str]:
    """The union of the types' `Drafter.prices` (the governor's price terms of the chain)."""
    return frozenset().union(*(c.prices for c in _classes(types)))


def reads_target_hidden(types: Iterable[str]) -> bool:
    """Whether a type of `types` runs on the target's hidden states
    (`Drafter.reads_target_hidden`)."""
    return any(c.reads_target_hidden for c in _classes(types))


def build_drafters(
    spec: SpecConfig | None, target: Any, draft: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(drafters, their params) in relay priority order; empty when speculation is off."""
    if spec is None or not spec.enabled:
        return (), ()
    drafters, params = [], []
    for name in PRIORITY:
        if name not in spec.types:
            continue
        d, p = drafter_class(name).from_spec(spec, target, draft)
        drafters.append(d)
        params.append(p)
    return tuple(drafters), tuple(params)
