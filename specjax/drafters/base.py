"""Drafter protocol: a frozen, hashable config object + pure functions over an explicit state.

Every drafter type (llama.cpp's `common_speculative_impl`) is a frozen dataclass holding only
static configuration (it can be a jit static argument) and implementing:

    init(batch, capacity)                         -> state     host-side, shapes static
    begin(state, history)                         -> state     once per request, after prefill
    process(params, state, batch)                 -> state     after EVERY target forward
    draft(params, state, inp, k_max)              -> (state, DraftOutput)
    accept(state, n_accepted, is_other, active)   -> state     feedback after verification
    rollback(state, keep)                         -> state     seq_rm(row, keep[row], -1) on own memory
    get_state(state, row) -> bytes | None                      optional per-row checkpoint blob
    set_state(state, row, blob) -> state                       (ignores a blob of the wrong size)
    spec_state(state) -> pytree                                optional, in-jit form of get_state:
    set_spec_state(state, saved, rows_B) -> state              every row's blob ([B] leading
                                                               leaves); restores rows_B (see
                                                               take_spec_state / load_spec_state)
    renew(state) -> state                                      optional (`can_renew`): a fresh
                                                               state (what
                                                               `init` gives at its shapes) made
                                                               in an old one's buffers, so that
                                                               one-shot `generate` calls need
                                                               not allocate large state again
                                                               (`engine.prefill`'s spare)

Every capability the engine, the API and the governor read (static facts: `hidden_layers`,
`max_draft_len`, `idle_noop`, `idle_record`, `ask_steps`, `prices`, ...) is declared, with its
default and what it means, on the base class `Drafter`, from which every drafter type derives.
* `hidden_layers`: target layer ids whose features `process` reads from
  `TargetBatch.hidden` (a dict keyed by layer id: id i < L is the input of layer i, id L the
  last layer's output before the final norm, llama.cpp's rule for an id equal to n_layer).
  The engine evaluates the union over the chain; each drafter reads its own ids by key.
* `idle_record`: a drafter whose `process` must see every verify batch (it reads the
  target's features of each row, e.g. EAGLE-3, DFlash) offers instead
      record(params, state, batch) -> state   in a round in which no row may draft
  which keeps the batch's rows (at most one evaluated token per row: no draft was verified)
  for later and returns quickly. The rows are applied, in order, by the next `process` or
  `draft` before anything else (and by `record` itself when its log is full), so every call
  gives what it would give had each batch been processed (up to float rounding of batched
  products); `rollback` drops recorded rows at positions >= keep, as it drops cache cells.
  The engine then treats such a round as an idle one (`idle_rounds_are_plain`), calling
  only `record`.

Conventions (all arrays are per row, B = batch):
* `history.tokens [B, S]` holds the tokens in the target's memory, positions 0..length-1;
  `length [B]` == llama.cpp's `n_past`/`pos0` == position of `last_token` (`id_last`), which
  is NOT yet in memory. Cells at index >= length are garbage.
* A draft is always `[B, K]` (K = the engine's static K_max) with a prefix validity mask.
  A drafter that has nothing for a row returns `valid[row] = False` everywhere, passing the
  row to the next drafter in priority order (llama.cpp's "chain").
* `inp.drafting [B]` says which rows this drafter is asked to draft for (rows not yet won by
  a higher-priority drafter, with a positive budget). Side effects of `draft` on per-row state
  (n-gram ingestion, counters) must only apply to drafting rows, as upstream only calls an
  impl for sequences still drafting.
* `accept` is called once per verification round for rows that verified a non-empty draft
  (`active`), with `is_other[row] = True` when another drafter produced that row's draft.
* Drafters never see the engine's other state; params (for model drafters) are a separate
  pytree argument, None for model-free drafters.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.pytree import pytree_dataclass, static_field
from specjax.types import Array

#: llama.cpp's enum order (COUNT = 11); also the CLI's names.
DRAFTER_TYPES: tuple[str, ...] = (
    "none",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
)

#: llama.cpp's fixed relay priority (`common_speculative_init`): model-free drafters first.
PRIORITY: tuple[str, ...] = (
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
)


@pytree_dataclass
class TokenHistory:
    tokens: Array  # [B, S] int32
    length: Array  # [B] int32


@pytree_dataclass
class TargetBatch:
    """Rows the target just evaluated (prefill chunk or verify batch), as llama.cpp's batch."""

    tokens: Array  # [B, T] int32
    positions: Array  # [B, T] int32, -1 = padding (not evaluated)
    #: {layer id: [B, T, D]} for every layer the chain asked for (keys static)
    hidden: dict[int, Array] = dataclasses.field(default_factory=dict)
    #: True for the prompt (prefill), False for a verify batch (static).
    is_prompt: bool = static_field(default=False)


@pytree_dataclass
class DraftInput:
    history: TokenHistory
    last_token: Array  # [B] int32, id_last (at position history.length)
    n_max: Array  # [B] int32, caller-side budget (relay truncates to it); 0 = no drafting
    drafting: Array  # [B] bool, rows this drafter is asked for
    n_min: Array  # [] int32, draft-model drafters clear drafts shorter than this
    p_min: Array  # [] float32, draft-model drafters stop when top-1 prob < p_min
    temperature: Array  # [B] float32, target temperature (probabilistic drafting when > 0)
    #: [B] target seeds: drafters derive keys as make_key(seed, position, ROLE_DRAFT) so a
    #: replay is exact (draft-simple mixes in llama.cpp's 0x85ebca6b first).
    seed: Array | None = None
    #: [] int32, the draft model's own `draft.n_max` (model drafters stop there); None = K
    draft_n_max: Array | None = None


@pytree_dataclass
class DraftOutput:
    tokens: Array  # [B, K] int32
    valid: Array  # [B, K] bool, a prefix mask
    #: [B, K, V] float32 draft distribution of each drafted token, or None (greedy / n-gram).
    q: Array | None = None

    @property
    def length(self) -> Array:
        return jnp.sum(self.valid, axis=1).astype(jnp.int32)


def empty_draft(batch: int, k_max: int) -> DraftOutput:
    return DraftOutput(
        tokens=jnp.zeros((batch, k_max), jnp.int32), valid=jnp.zeros((batch, k_max), bool)
    )


class Drafter:
    """The drafter protocol, written down: the six methods every drafter implements, and
    every capability the engine, the API and the governor read, each with its default (see
    the module docstring). Every drafter type derives from it (a frozen dataclass holding
    static configuration), so the engine reads each capability as a plain attribute.

    Adding a drafter type is a module with a subclass (its `from_spec` builds it from a
    `SpecConfig`) plus one entry in `registry._TYPES`.
    """

    #: llama.cpp's type name (`DRAFTER_TYPES`): the CLI's name, the statistics' key.
    name: ClassVar[str] = ""
    #: Target layer ids whose features this drafter reads in `process` (static; a class
    #: attribute or, for drafters whose layers come from their model file, per instance).
    hidden_layers: tuple[int, ...] = ()
    #: The longest draft it produces; the engine's static draft width K is the maximum over
    #: the chain (`chain_width`). None: the width comes from the spec's per-type rule
    #: (`SpecConfig.resolved_k_max`).
    max_draft_len: int | None = None
    #: Rows at temperature > 0 sample their drafts (with their draft distribution `q`) and are
    #: verified by rejection sampling; False: drafts verified by match.
    probabilistic: bool = False
    #: A round in which no row may draft leaves the state as it is, so the engine may skip
    #: every call in such a round (`engine.idle_rounds_are_plain`).
    idle_noop: ClassVar[bool] = False
    #: `process` must see every verify batch, and `record` keeps it for later in a round in
    #: which no row may draft (see the module docstring); such a round is then an idle one.
    idle_record: ClassVar[bool] = False
    #: `process`, `accept` and `rollback` leave the state as it is in a round in which no row
    #: got a draft, so `engine.spec_step` may finish such a round without them
    #: (`engine.empty_rounds_are_plain`).
    quiet_without_draft: ClassVar[bool] = False
    #: `process` of a prompt may be skipped (continuous batching defers it): `draft` catches
    #: up from the token history before it drafts.
    lazy_prompt: ClassVar[bool] = False
    #: Reads the hybrid target's nextn hidden state (`draft_mtp.H_NEXTN` in
    #: `TargetBatch.hidden`) rather than trunk layers by id.
    reads_nextn: ClassVar[bool] = False
    #: Runs on the target's hidden states (a head over its features, or its own nextn
    #: block): a hybrid target keeps draft n_max rollback planes for it upstream
    #: (`registry.reads_target_hidden`, `common_params_speculative::need_n_rs_seq`).
    reads_target_hidden: ClassVar[bool] = False
    #: `renew(state)` exists: a fresh state (what `init` gives at its shapes) made in an old
    #: one's buffers (`engine.renewed`); without it a fresh state is `init`'s.
    can_renew: ClassVar[bool] = False
    #: What one ask for a draft costs on CPU, in plain rounds of the shipped target
    #: (benchmarks/governor.py ask): the draft governor's price of asking this drafter
    #: (`prices.chain_call_price`, used when `SpecConfig.cost_call` is None).
    ask_steps: ClassVar[float] = 0.0
    #: The governor's price terms beyond an ask (`prices.cost_model`, `prices.chain_cost`):
    #: "draft_step", a draft-model step per drafted token (priced from the draft model's
    #: size); "catch_up", the model skips the rounds it is not asked in and catches up
    #: before it drafts.
    prices: ClassVar[frozenset[str]] = frozenset()
    #: The form of its parameters it drafts fastest with (`weights.drafter_decode_params`):
    #: "as_is"; "model", a draft model's (the target's decode form, `weights.decode_params`);
    #: "head", `{"head", "shared"}` with the head in `head_kernel_params`'s form and the
    #: shared LM head as a `KernelWeight` (CPU with the native kernel only).
    params_form: ClassVar[str] = "as_is"

    @classmethod
    def from_spec(cls, spec: Any, target: Any, draft: Any) -> tuple[Drafter, Any]:
        """(the drafter, its parameters) for `spec` (a `SpecConfig`), the target model and
        the draft model (or None), with the type's checks (`registry.build_drafters`)."""
        raise NotImplementedError(f"speculative type {cls.name} is not implemented yet")

    @property
    def min_draft_len(self) -> int:
        """The shortest draft it gives when it drafts at all (ngram-mod: its n_min)."""
        return 1

    def lookup_size(self) -> int | None:
        """The length n of the n-gram the drafter looks up: it can draft only where the last n
        tokens of the stream occurred earlier in it (`specjax.drafters.lookup_index`); None = no such
        condition (a drafter that may draft from other sources: a model, ngram-cache's
        files)."""
        return None

    def lookup_gap(self) -> int:
        """How recent an earlier occurrence of that n-gram may be and still give a draft: it
        must end at a position <= L - 1 - gap (L = `TokenHistory.length`; the stream's last
        token sits at L). 0 = any earlier occurrence."""
        return 0

    @staticmethod
    def head_kernel_params(head: Any) -> Any:
        """`params_form` "head": the head's parameters as `KernelWeight`s."""
        return head

    def init(self, batch: int, capacity: int) -> Any:
        """A fresh state for `batch` rows of `capacity` positions (host-side, static)."""
        raise NotImplementedError

    def begin(self, state: Any, history: TokenHistory) -> Any:
        """Once per request, after prefill."""
        raise NotImplementedError

    def process(self, params: Any, state: Any, batch: TargetBatch) -> Any:
        """After every target forward (prefill chunk or verify batch)."""
        raise NotImplementedError

    def draft(
        self, params: Any, state: Any, inp: DraftInput, k_max: int
    ) -> tuple[Any, DraftOutput]:
        """A `[B, k_max]` draft for the rows `inp.drafting`."""
        raise NotImplementedError

    def accept(self, state: Any, n_accepted: Array, is_other: Array, active: Array) -> Any:
        """Feedback after verification, for the rows `active` that verified a draft."""
        raise NotImplementedError

    def rollback(self, state: Any, keep: Array) -> Any:
        """`seq_rm(row, keep[row], -1)` on its own memory."""
        raise NotImplementedError

    def record(self, params: Any, state: Any, batch: TargetBatch) -> Any:
        """`idle_record` drafters: keep a verify batch of a round no row may draft in."""
        raise NotImplementedError(f"{self.name} has no idle_record")

    def spec_state(self, state: Any) -> Any:
        """The in-jit form of `get_state` (every row's checkpoint data, `[B]` leading
        leaves); {} for a drafter that keeps none."""
        del state
        return {}

    def set_spec_state(self, state: Any, saved: Any, rows_B: Array) -> Any:
        """`set_state` for the rows `rows_B` from `spec_state`'s data (other rows kept)."""
        del saved, rows_B
        return state

    def get_state(self, state: Any, row: int) -> bytes | None:
        """llama.cpp's per-row checkpoint blob; None: the drafter keeps none."""
        del state, row
        return None

    def set_state(self, state: Any, row: int, blob: bytes) -> Any:
        """Row `row` from `get_state`'s blob (a blob of the wrong size is ignored)."""
        del row, blob
        return state


def hidden_by_layer(layers: Sequence[int], hidden: Sequence[Array]) -> dict[int, Array]:
    """The target forward's hiddens (in `layers` order) as `TargetBatch.hidden`."""
    return dict(zip(layers, hidden))


def chain_width(drafters: Sequence[Drafter], fallback: int) -> int:
    """Static draft width K: the maximum `max_draft_len` over the chain; drafters without one
    count as `fallback` (the spec's per-type width)."""
    widths = [fallback if d.max_draft_len is None else int(d.max_draft_len) for d in drafters]
    return max([1, *widths]) if drafters else fallback


class ModelFreeDrafter(Drafter):
    """Base of the model-free drafters: the no-op methods they share."""

    #: `process`, `accept` and `rollback` leave the state as it is in a round in which no row
    #: got a draft (`accept` only touches a row's own verified draft), so `engine.spec_step`
    #: may finish such a round without them (`engine.empty_rounds_are_plain`). A subclass
    #: whose feedback does more must set it False.
    quiet_without_draft: ClassVar[bool] = True
    #: The fields `from_spec` sets from the SpecConfig: field f from `<name>_<f>` (the type
    #: name with "_" for "-"; llama.cpp's `--spec-<name>-<f>`), e.g. ngram-mod's n_max from
    #: `SpecConfig.ngram_mod_n_max` (`--spec-ngram-mod-n-max`).
    spec_options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_spec(cls, spec: Any, target: Any, draft: Any) -> tuple[Drafter, Any]:
        """The drafter with its `spec_options` from `spec`; no parameters."""
        prefix = cls.name.replace("-", "_") + "_"
        return cls(**{field: getattr(spec, prefix + field) for field in cls.spec_options}), None

    def process(self, params: Any, state: Any, batch: TargetBatch) -> Any:
        del params, batch
        return state

    def rollback(self, state: Any, keep: Array) -> Any:
        del keep
        return state

    def begin(self, state: Any, history: TokenHistory) -> Any:
        del history
        return state

    def accept(self, state: Any, n_accepted: Array, is_other: Array, active: Array) -> Any:
        del n_accepted, is_other, active
        return state


def per_row_leaves(drafter: Any, capacity: int) -> list[bool]:
    """Per leaf of `drafter`'s state: True when its leading axis is the batch (a row each),
    False when the rows share it (ngram-mod's pool), from `init` at two batch sizes."""
    a = jax.tree.leaves(jax.eval_shape(lambda: drafter.init(2, capacity)))
    b = jax.tree.leaves(jax.eval_shape(lambda: drafter.init(3, capacity)))
    return [x.ndim > 0 and x.shape[0] != y.shape[0] for x, y in zip(a, b)]


def prefix_mask(valid_BK: Array) -> Array:
    """Force a validity mask to be a prefix (cumulative AND along K)."""
    return jnp.cumprod(valid_BK.astype(jnp.int32), axis=1).astype(bool)


def select_rows(mask_B: Array, new: Any, old: Any) -> Any:
    """Per-row select between two pytrees whose leaves all have leading dimension B."""
    import jax

    def pick(n: Array, o: Array) -> Array:
        m = mask_B.reshape(mask_B.shape + (1,) * (n.ndim - 1))
        return jnp.where(m, n, o)

    return jax.tree.map(pick, new, old)


def take_spec_state(drafter: Drafter, state: Any) -> Any:
    """The drafter's per-row checkpoint data (a checkpoint's `data_spec`, the traced form of
    `get_state` for every row at once); {} for drafters that keep none."""
    return drafter.spec_state(state)


def load_spec_state(drafter: Drafter, state: Any, saved: Any, rows_B: Array) -> Any:
    """`set_state` for the rows `rows_B` from `take_spec_state`'s data (other rows kept)."""
    return drafter.set_spec_state(state, saved, rows_B)


def boundary_blob(pos: int, vector_D: Any) -> bytes | None:
    """llama.cpp's drafter state blob for one row: int32 position + D float32 (None: pos < 0)."""
    if pos < 0:
        return None
    return struct.pack("<i", pos) + np.asarray(vector_D).astype("<f4").tobytes()


def read_boundary_blob(blob: bytes, dim: int) -> tuple[int, Array] | None:
    """(position, float32 [D]) from `boundary_blob`'s bytes; None for a blob of the wrong size."""
    if len(blob) != 4 + 4 * dim:
        return None
    (pos,) = struct.unpack("<i", blob[:4])
    return pos, jnp.asarray(np.frombuffer(blob[4:], "<f4").astype(np.float32))


def put_scratch_kv(scratch_BGKE: Array, i: Array, new_BTGE: Array) -> Array:
    """Write one token's [B, 1, G, E] K or V into slot i of a draft head's scratch cache."""
    return jax.lax.dynamic_update_slice_in_dim(
        scratch_BGKE, new_BTGE.transpose(0, 2, 1, 3).astype(scratch_BGKE.dtype), i, 2
    )
