"""Host-side configuration mirroring llama.cpp's `common_params_speculative`.

Validated once, on the host, with errors naming the offending values. Sizes that shape arrays
(K_max) are derived here; every knob a user may change per call (n_max, n_min, p_min) travels
to the jitted step as an array. The static draft width of the draft-model types is at least
`DRAFT_K_MIN`, so draft n_max, n_min and p_min changes up to it never recompile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from specjax.drafters.base import DRAFTER_TYPES, PRIORITY
from specjax.pytree import check_known_keys

#: ngram-cache drafts a fixed number of tokens upstream ("TODO get from config").
NGRAM_CACHE_N_DRAFT = 8
#: Smallest static draft width K of the draft-model types (draft-simple): n_max is traced,
#: so any n_max <= max(n_max, DRAFT_K_MIN) shares one compiled program.
DRAFT_K_MIN = 16
#: `--spec-draft-sampling`: how draft-simple picks its tokens (see SpecConfig.draft_sampling).
DRAFT_SAMPLING = ("greedy", "probabilistic")


def _type_list(names: str | Iterable[str]) -> list[str]:
    """One `--spec-type` value as upstream's `common_speculative_types_from_names`: names in
    order, a `none` returns `["none"]` at once (later names unchecked), an unknown name raises."""
    if isinstance(names, str):
        names = [names]
    flat: list[str] = []
    for item in names:
        flat.extend(part.strip() for part in str(item).split(",") if part.strip())
    types: list[str] = []
    for name in flat:
        if name not in DRAFTER_TYPES:
            raise ValueError(
                f"unknown speculative type: {name}; valid types: {', '.join(DRAFTER_TYPES)}"
            )
        if name == "none":
            return ["none"]
        types.append(name)
    return types


def _by_priority(types: Iterable[str]) -> tuple[str, ...]:
    enabled = set(types)
    return tuple(t for t in PRIORITY if t in enabled)


def types_from_names(names: str | Iterable[str]) -> tuple[str, ...]:
    """llama.cpp's `common_speculative_types_from_names` on ONE list (a comma string or a list
    of names): `none` anywhere in the list empties it, an unknown name raises ValueError.

    Returns the enabled types in llama.cpp's fixed relay priority order (empty = disabled).
    """
    return _by_priority(_type_list(names))


def types_from_values(values: str | Iterable[str]) -> tuple[str, ...]:
    """Several `--spec-type` values (the flag given several times), as llama.cpp's arg parser:
    each value is one comma list parsed by `types_from_names`, so `none` empties only the list
    it appears in, and the lists' types are appended together (upstream keeps `none` entries,
    which enable nothing). `--spec-type ngram-mod --spec-type none` keeps ngram-mod.
    """
    if isinstance(values, str):
        values = [values]
    return _by_priority(t for value in values for t in _type_list(value) if t != "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """Speculative decoding settings (llama.cpp defaults)."""

    types: tuple[str, ...] = ()
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    #: draft-simple's token choice. "greedy" (default, as upstream): the draft model's
    #: argmax, verified by match, so at any temperature the output equals plain sampling
    #: with the same seed. "probabilistic": at temperature > 0 tokens are sampled from the
    #: draft's tempered top-k and verified by rejection sampling (same distribution, not
    #: the same tokens).
    draft_sampling: str = "greedy"
    ngram_simple_size_n: int = 12
    ngram_simple_size_m: int = 48
    ngram_map_k_size_n: int = 12
    ngram_map_k_size_m: int = 48
    ngram_map_k_min_hits: int = 1
    ngram_map_k4v_size_n: int = 12
    ngram_map_k4v_size_m: int = 48
    ngram_map_k4v_min_hits: int = 1
    ngram_mod_n_match: int = 24
    ngram_mod_n_min: int = 48
    ngram_mod_n_max: int = 64
    ngram_mod_pool_size: int = 4 * 1024 * 1024
    ngram_cache_n_draft: int = NGRAM_CACHE_N_DRAFT
    lookup_cache_static: str | None = None
    lookup_cache_dynamic: str | None = None
    synth_len: float = -1.0
    synth_rates: tuple[float, ...] = ()
    #: Static upper bound on draft length (array width); None = derived from the types.
    k_max: int | None = None
    #: The draft governor (specjax.decode.governor): shorten or skip drafts that do not pay under
    #: the cost model below. False = llama.cpp's behaviour (always draft the full budget).
    adaptive: bool = True
    #: Extra cost of each extra token in a target forward, in 1-token steps (None = backend
    #: default: 0.4 on CPU, 0.01 on accelerators).
    cost_verify_token: float | None = None
    #: Cost of one draft-model step in 1-token target steps (None = the draft's share of the
    #: target's layers, at least its share of parameters).
    cost_draft_step: float | None = None
    #: Fixed cost of a round in which the drafters are asked, in 1-token target steps. None =
    #: the chain's price (`prices.chain_call_price`): on CPU the engine's own part of an asked
    #: round plus each drafter's measured `ask_steps` (benchmarks/governor.py ask); elsewhere
    #: the engine's part alone.
    cost_call: float | None = None
    #: Measure `cost_verify_token` and `cost_draft_step` (draft-simple) on this device at the
    #: run's batch size before decoding (`specjax.decode.prices`; prices given above win). None =
    #: on accelerators, and on CPU for a mixture-of-experts target: on CPU the defaults are
    #: medians of many runs on dense targets, and one measurement on a shared host is noisy. The first run of a shape compiles 3-5 small
    #: timing programs (a forward filling the cache, loops of 1- and W-token forwards).
    cost_calibrate: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "types", types_from_names(self.types) if self.types else ())
        if self.draft_n_max < 0:
            raise ValueError(f"draft n_max must be >= 0, got {self.draft_n_max}")
        if self.draft_n_min < 0:
            raise ValueError(f"draft n_min must be >= 0, got {self.draft_n_min}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft p_min must be in [0, 1], got {self.draft_p_min}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(
                f"draft sampling must be one of {', '.join(DRAFT_SAMPLING)}, "
                f"got {self.draft_sampling!r}"
            )
        for name in ("ngram_simple", "ngram_map_k", "ngram_map_k4v"):
            for part in ("size_n", "size_m"):
                value = getattr(self, f"{name}_{part}")
                if not 1 <= value <= 1024:
                    raise ValueError(f"{name} {part} must be in 1..1024, got {value}")
        for name in ("ngram_map_k_min_hits", "ngram_map_k4v_min_hits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.ngram_mod_n_match <= 1024:
            raise ValueError(f"ngram-mod n_match must be in 1..1024, got {self.ngram_mod_n_match}")
        for part in ("n_min", "n_max"):
            value = getattr(self, f"ngram_mod_{part}")
            if not 0 <= value <= 1024:
                raise ValueError(f"ngram-mod {part} must be in 0..1024, got {value}")
        if self.synth_len >= 0 and self.synth_rates:
            raise ValueError(
                "--spec-synthetic-acceptance-length and --spec-synthetic-acceptance-rates "
                "are mutually exclusive"
            )
        if self.synth_len >= 0 and not math.isfinite(self.synth_len):
            raise ValueError(f"synthetic acceptance length must be finite, got {self.synth_len}")
        if self.k_max is not None and self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        for name in ("cost_verify_token", "cost_draft_step", "cost_call"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def enabled(self) -> bool:
        return bool(self.types)

    @property
    def synthetic(self) -> bool:
        return self.synth_len >= 0 or bool(self.synth_rates)

    def n_max(self) -> int:
        """`common_speculative_n_max`: the longest draft any enabled type can produce."""
        best = 0
        for t in self.types:
            if t.startswith("draft-"):
                best = max(best, self.draft_n_max)
            elif t == "ngram-simple":
                best = max(best, self.ngram_simple_size_m)
            elif t == "ngram-map-k":
                best = max(best, self.ngram_map_k_size_m)
            elif t == "ngram-map-k4v":
                best = max(best, self.ngram_map_k4v_size_m)
            elif t == "ngram-mod":
                best = max(best, self.ngram_mod_n_max)
            elif t == "ngram-cache":
                best = max(best, self.ngram_cache_n_draft)
        return best

    def resolved_k_max(self) -> int:
        """Static draft width K: explicit k_max, else n_max() with the draft-model types
        counted as max(draft_n_max, DRAFT_K_MIN) (at least 1). Their n_max is traced
        (`RunParams.n_max`), so n_max, n_min and p_min changes below K never recompile."""
        if self.k_max is not None:
            return self.k_max
        best = self.n_max()
        if any(t.startswith("draft-") for t in self.types):
            best = max(best, self.draft_n_max, DRAFT_K_MIN)
        return max(1, best)

    @staticmethod
    def default() -> SpecConfig:
        """`--spec-default`: ngram-mod with n_match 24, n_min 48, n_max 64."""
        return SpecConfig(
            types=("ngram-mod",), ngram_mod_n_match=24, ngram_mod_n_min=48, ngram_mod_n_max=64
        )

    def replace(self, **changes: Any) -> SpecConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecConfig:
        check_known_keys(cls, data, "unknown speculative config keys")
        data = dict(data)
        for key in ("types", "synth_rates"):
            if key in data and isinstance(data[key], list):
                data[key] = tuple(data[key])
        return cls(**data)


def output_limits(n_batch: int, n_parallel: int, n_draft: int) -> tuple[int, int]:
    """`common_speculative_get_output_limits` -> (total, per_seq), both clamped to n_batch."""
    per_seq = 1 + max(0, n_draft)
    total = n_parallel * per_seq
    return min(total, n_batch), min(per_seq, n_batch)


#: (SpecConfig field, its CLI flag, the type it limits) of the draft lengths `fit_draft_limits`
#: clamps.
_DRAFT_LIMITS = (
    ("draft_n_max", "--spec-draft-n-max", "draft-"),
    ("ngram_simple_size_m", "--spec-ngram-simple-size-m", "ngram-simple"),
    ("ngram_map_k_size_m", "--spec-ngram-map-k-size-m", "ngram-map-k"),
    ("ngram_map_k4v_size_m", "--spec-ngram-map-k4v-size-m", "ngram-map-k4v"),
    ("ngram_mod_n_max", "--spec-ngram-mod-n-max", "ngram-mod"),
    ("ngram_cache_n_draft", "ngram-cache's n_draft", "ngram-cache"),
)


def fit_draft_limits(
    spec: SpecConfig | None, room: int, why: str
) -> tuple[SpecConfig | None, list[str]]:
    """(`spec` with every draft-length limit of its types clamped to `room`, the notes saying
    what changed). `room`: the tokens a draft can still be verified in (what the context and
    the tokens to generate leave; `why` says so in words). The draft-model types leave the
    chain when draft_n_max is 0 (they draft nothing); the spec is None when nothing is left
    to draft. A static draft width sized from a limit beyond the context only costs compile
    time (a 1,000-token draft width compiled for 211 s with a 512-token context)."""
    if spec is None:
        return None, []
    notes: list[str] = []
    if spec.draft_n_max <= 0 and any(t.startswith("draft-") for t in spec.types):
        gone = [t for t in spec.types if t.startswith("draft-")]
        rest = tuple(t for t in spec.types if not t.startswith("draft-"))
        notes.append(f"--spec-draft-n-max 0 drafts nothing: {', '.join(gone)} left out")
        if not rest:
            notes[-1] += ", speculation off"
            return None, notes
        spec = dataclasses.replace(spec, types=rest)
    if room < 1:
        notes.append(f"no room for a draft ({why}): speculation off")
        return None, notes
    changes: dict[str, Any] = {}
    clamped: list[str] = []
    for field, flag, kind in _DRAFT_LIMITS:
        value = int(getattr(spec, field))
        if value > room and any(t.startswith(kind) for t in spec.types):
            changes[field] = room
            clamped.append(f"{flag} {value} -> {room}")
    if "draft_n_max" in changes and spec.draft_n_min > room:
        changes["draft_n_min"] = room
    if "ngram_mod_n_max" in changes and spec.ngram_mod_n_min > room:
        changes["ngram_mod_n_min"] = room
    if changes:
        spec = dataclasses.replace(spec, **changes)
        notes.append(f"draft limits clamped to what is left ({why}): {', '.join(clamped)}")
    return spec, notes
