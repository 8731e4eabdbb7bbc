"""Builds the drafter chain for a SpecConfig, in llama.cpp's fixed priority order.

Adding a drafter type means: a module implementing the protocol in `base.py`, and one entry
in `_BUILDERS`. The engine never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specjax.config import SpecConfig
from specjax.drafters.base import PRIORITY


def _draft_simple(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    from specjax.drafters.draft_simple import DraftSimple, check_vocab_compatible

    if draft is None:
        raise ValueError("draft-simple needs a draft model (-md/--spec-draft-model)")
    if target.tokenizer is not None and draft.tokenizer is not None:
        check_vocab_compatible(target.tokenizer, draft.tokenizer, target.config.V, draft.config.V)
    elif abs(target.config.V - draft.config.V) > 128:
        from specjax.errors import VocabMismatchError

        raise VocabMismatchError(
            f"draft vocab size {draft.config.V} differs from the target's {target.config.V} "
            "by more than 128"
        )
    # "greedy" (default, as upstream): argmax drafts verified by match, so output equals plain
    # sampling with the same seed. "probabilistic": rows at temperature > 0 sample their drafts
    # and are verified by rejection sampling; rows at temperature 0 still draft the argmax, so
    # one static drafter serves every temperature without recompiling.
    probabilistic = spec.draft_sampling == "probabilistic"
    if getattr(draft.config, "arch", None) == "qwen35":
        # a recurrent draft context: FULL (n_rs_seq 0, as upstream's draft contexts)
        from specjax.drafters.draft_simple_recurrent import DraftSimpleRecurrent

        recurrent = DraftSimpleRecurrent(
            config=draft.config, target_vocab=target.config.V, probabilistic=probabilistic
        )
        return recurrent, draft.params
    drafter = DraftSimple(
        config=draft.config, target_vocab=target.config.V, probabilistic=probabilistic
    )
    return drafter, draft.params


def _draft_eagle3(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    from specjax.config import DRAFT_K_MIN
    from specjax.drafters.eagle3 import Eagle3Drafter
    from specjax.models.eagle3 import Eagle3Config, shared_weights

    if draft is None:
        raise ValueError("draft-eagle3 needs an EAGLE-3 head (-md/--spec-draft-model)")
    cfg = draft.config
    if not isinstance(cfg, Eagle3Config):
        raise ValueError(
            "draft-eagle3 needs a draft model of architecture eagle3 (expected 3 extract "
            f"layers), got {getattr(cfg, 'arch', type(cfg).__name__)!r}"
        )
    tc = target.config
    if cfg.target_hidden != tc.D:
        raise ValueError(
            f"EAGLE-3 head expects target hidden size {cfg.target_hidden}, the target has {tc.D}"
        )
    for layer in cfg.target_layers:
        if layer > tc.L:
            raise ValueError(f"EAGLE3: target layer id {layer} exceeds target n_layer {tc.L}")
    if cfg.V != tc.V:
        raise ValueError(f"EAGLE-3 head vocabulary {cfg.V} differs from the target's {tc.V}")
    if not cfg.own_embed and cfg.D != tc.D:
        raise ValueError(
            f"EAGLE-3 head of width {cfg.D} has no token embeddings and cannot use the "
            f"target's (width {tc.D})"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        from specjax.drafters.draft_simple import check_vocab_compatible

        check_vocab_compatible(target.tokenizer, draft.tokenizer, tc.V, cfg.V)
    drafter = Eagle3Drafter(
        config=cfg,
        hidden_layers=tuple(sorted(set(cfg.target_layers))),
        max_draft_len=max(spec.draft_n_max, DRAFT_K_MIN) if spec.k_max is None else spec.k_max,
        probabilistic=spec.draft_sampling == "probabilistic",
    )
    params = {
        "head": draft.params,
        "shared": shared_weights(cfg, target.params, tc.tie_embeddings),
    }
    return drafter, params


def _draft_mtp(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    """The target's own nextn block(s) (upstream creates the MTP context on the target model
    when no draft path is given; a separate draft GGUF holding the block also works)."""
    from specjax.drafters.draft_mtp import MtpDrafter

    source = target if draft is None else draft
    cfg = source.config
    if getattr(cfg, "arch", None) != "qwen35" or target.config.arch != "qwen35":
        raise ValueError(
            "draft-mtp runs the nextn block of a qwen35 model; got target "
            f"{getattr(target.config, 'arch', '?')!r}, draft {getattr(cfg, 'arch', '?')!r}"
        )
    if cfg.n_nextn < 1:
        raise ValueError(
            "draft-mtp needs a model with a nextn (MTP) block; "
            f"{'the target' if draft is None else 'the draft'} has none"
        )
    if cfg.D != target.config.D or cfg.V != target.config.V:
        raise ValueError(
            f"MTP block width/vocabulary ({cfg.D}, {cfg.V}) differ from the target's "
            f"({target.config.D}, {target.config.V})"
        )
    # the drafter stops at draft n_max (upstream); an explicit k_max caps it
    n_max = spec.draft_n_max if spec.k_max is None else min(spec.draft_n_max, spec.k_max)
    if cfg.n_nextn > 1:  # chain heads: one draft step per head (upstream clamps n_max)
        n_max = min(n_max, cfg.n_nextn)
    return MtpDrafter(config=cfg, max_draft_len=max(1, n_max)), source.params


def _draft_block(dspark: bool) -> Callable[[SpecConfig, Any, Any], tuple[Any, Any]]:
    """draft-dflash / draft-dspark: one builder, upstream's shared implementation."""

    def build(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
        import warnings

        from specjax.drafters.dflash import make_drafter
        from specjax.models.dflash import DFlashConfig, shared_weights

        kind = "draft-dspark" if dspark else "draft-dflash"
        if draft is None:
            raise ValueError(f"{kind} needs a DFlash head (-md/--spec-draft-model)")
        cfg = draft.config
        if not isinstance(cfg, DFlashConfig):
            raise ValueError(
                f"{kind} needs a draft model of architecture dflash, got "
                f"{getattr(cfg, 'arch', type(cfg).__name__)!r}"
            )
        if dspark and not cfg.is_dspark:
            raise ValueError(f"{kind} needs a DSpark head (markov_w1/markov_w2); this is DFlash")
        if dspark and spec.draft_p_min > 0 and not cfg.has_confidence:
            raise ValueError("DSpark draft has no confidence head: please set --spec-draft-p-min 0")
        tc = target.config
        if cfg.target_hidden != tc.D:
            raise ValueError(
                f"DFlash head expects target hidden size {cfg.target_hidden}, the target has {tc.D}"
            )
        for layer in cfg.target_layers:
            if layer > tc.L:
                raise ValueError(f"DFlash: target layer id {layer} exceeds target n_layer {tc.L}")
        if cfg.V != tc.V:
            raise ValueError(f"DFlash head vocabulary {cfg.V} differs from the target's {tc.V}")
        if (not cfg.own_embed or not cfg.own_lm_head) and cfg.D != tc.D:
            raise ValueError(
                f"DFlash head of width {cfg.D} shares the target's embeddings / LM head "
                f"(width {tc.D})"
            )
        drafter, warning = make_drafter(cfg, dspark, spec.draft_n_max, spec.draft_n_min, spec.k_max)
        if warning is not None:
            warnings.warn(f"{kind}: {warning}", stacklevel=3)
        params = {
            "head": draft.params,
            "shared": shared_weights(cfg, target.params, tc.tie_embeddings),
        }
        return drafter, params

    return build


def _ngram_simple(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    from specjax.drafters.ngram_simple import NgramSimple

    return NgramSimple(size_n=spec.ngram_simple_size_n, size_m=spec.ngram_simple_size_m), None


def _ngram_mod(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    from specjax.drafters.ngram_mod import NgramMod

    return NgramMod(
        n_match=spec.ngram_mod_n_match,
        n_min=spec.ngram_mod_n_min,
        n_max=spec.ngram_mod_n_max,
        pool_size=spec.ngram_mod_pool_size,
    ), None


def _ngram_map_k(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    from specjax.drafters.ngram_map import NgramMapK

    return NgramMapK(
        size_n=spec.ngram_map_k_size_n,
        size_m=spec.ngram_map_k_size_m,
        min_hits=spec.ngram_map_k_min_hits,
    ), None


def _ngram_map_k4v(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    from specjax.drafters.ngram_map import NgramMapK4V

    return NgramMapK4V(
        size_n=spec.ngram_map_k4v_size_n,
        size_m=spec.ngram_map_k4v_size_m,
        min_hits=spec.ngram_map_k4v_min_hits,
    ), None


def _ngram_cache(spec: SpecConfig, target: Any, draft: Any) -> tuple[Any, Any]:
    from specjax.drafters.ngram_cache import NgramCache
    from specjax.lookup import load_tables

    # the registry does the IO: the drafter only receives the device tables
    drafter = NgramCache(n_draft=spec.ngram_cache_n_draft)
    return drafter, load_tables(spec.lookup_cache_static, spec.lookup_cache_dynamic)


_BUILDERS: dict[str, Callable[[SpecConfig, Any, Any], tuple[Any, Any]]] = {
    "draft-simple": _draft_simple,
    "draft-eagle3": _draft_eagle3,
    "draft-mtp": _draft_mtp,
    "draft-dflash": _draft_block(False),
    "draft-dspark": _draft_block(True),
    "ngram-simple": _ngram_simple,
    "ngram-mod": _ngram_mod,
    "ngram-map-k": _ngram_map_k,
    "ngram-map-k4v": _ngram_map_k4v,
    "ngram-cache": _ngram_cache,
}


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
        builder = _BUILDERS.get(name)
        if builder is None:
            raise ValueError(f"speculative type {name} is not implemented in specjax yet")
        d, p = builder(spec, target, draft)
        drafters.append(d)
        params.append(p)
    return tuple(drafters), tuple(params)
