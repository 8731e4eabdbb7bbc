"""Plain-Python reference of llama.cpp's ngram-cache (lookup decoding, spec 5.8).

This is the executable statement of upstream's behaviour that the JAX drafter
(`specjax.drafters.ngram_cache`) is checked against. The host algorithms themselves
(`ngram_cache_update/draft/merge`, libstdc++ iteration order) are `specjax.io.lookup`'s plain-Python
ones, imported rather than kept twice: what makes them an oracle is that
tests/test_conformance_ngram_cache.py checks them, through `NgramCacheImplRef`, against vectors
recorded from llama.cpp's own code, and the peers tests against llama.cpp's lookup tools.

Data model (invariants):
* A cache is `dict[ngram, part]` with `ngram` a 4-tuple of int32 tokens (unused slots -1 =
  `LLAMA_TOKEN_NULL`) and `part` a `dict[token, count]`, counts > 0, parts non-empty.
* Python dict order = the **insertion sequence** of the C++ `std::unordered_map`. Upstream
  breaks ties ("first maximum wins") in the map's *iteration* order, which for libstdc++ is a
  deterministic function of the insertion sequence and the bucket growth policy;
  `stl_iteration_order` reproduces it (bucket counts 13, 29, 59, 127, 257, ..., buckets =
  hash % count, a new key goes to the front of its bucket's group or, for an empty bucket, to the
  front of the list; a rehash re-inserts the nodes in list order). Copies keep both the order
  and the bucket count, so "a copied part" is modelled by copying its dict.
* A cache loaded from a file has the file's record order as its insertion sequence, and a save
  writes the iteration order (`to_file_order`).
* Arithmetic follows upstream's int32 (`count * 100 * static_count` wraps like the C++ code).

The speculative impl (`NgramCacheImplRef`) reproduces `common_speculative_impl_ngram_cache`:
the context cache is updated at each draft call with the tokens that arrived since the last
call, *as a separate sequence* (n-grams crossing the old/new boundary are never counted), and
`begin` keeps the per-sequence cache unless `reset_on_begin=True` (upstream bug #27852).
Upstream reads out of bounds when a primary n-gram would start before position 0 (|inp| < 4);
here such an n-gram simply never matches.
"""

from __future__ import annotations

from collections.abc import Sequence

from specjax.io.lookup import (  # noqa: F401  (re-exported for the tests)
    MIN_PERCENT_LAX,
    MIN_PERCENT_STRICT,
    MIN_SAMPLE_LAX,
    MIN_SAMPLE_STRICT,
    NGRAM_MAX,
    NGRAM_MIN,
    NGRAM_STATIC,
    TOKEN_NULL,
    build_cache,
    copy_cache,
    make_ngram,
    ngram_cache_draft,
    ngram_cache_merge,
    ngram_cache_update,
)
from specjax.io.lookup_file import (  # noqa: F401  (re-exported for the tests)
    BUCKET_CHAIN,
    Cache,
    Ngram,
    Part,
    cache_keys,
    i32,
    ngram_hash,
    part_items,
    stl_iteration_order,
    to_file_order,
    token_hash,
)

N_DRAFT = 8


class NgramCacheImplRef:
    """One `common_speculative_impl_ngram_cache` (all sequences), with the relay's impl API
    `begin(seq, prompt)`, `draft_one(seq, prompt, id_last) -> draft`, `accept(...)`."""

    def __init__(
        self,
        n_seq: int = 1,
        *,
        n_draft: int = N_DRAFT,
        static: Cache | None = None,
        dynamic: Cache | None = None,
        reset_on_begin: bool = False,
    ) -> None:
        self.n_draft = n_draft
        self.reset_on_begin = reset_on_begin
        self.cache_size = [0] * n_seq
        self.context: list[Cache] = [{} for _ in range(n_seq)]
        self.dynamic: list[Cache] = [copy_cache(dynamic or {}) for _ in range(n_seq)]
        self.static: list[Cache] = [copy_cache(static or {}) for _ in range(n_seq)]

    def begin(self, seq: int, prompt: Sequence[int]) -> None:
        del prompt
        if self.reset_on_begin:
            self.cache_size[seq] = 0
            self.context[seq] = {}

    def draft_one(self, seq: int, prompt: Sequence[int], id_last: int) -> list[int]:
        n = len(prompt)
        if self.cache_size[seq] < n + 1:
            new = [int(t) for t in prompt[self.cache_size[seq] :]] + [int(id_last)]
            ngram_cache_update(self.context[seq], NGRAM_MIN, NGRAM_MAX, new, len(new))
            self.cache_size[seq] = n + 1
        inp = [int(t) for t in prompt] + [int(id_last)]
        draft = [int(id_last)]
        ngram_cache_draft(
            inp,
            draft,
            self.n_draft,
            NGRAM_MIN,
            NGRAM_MAX,
            self.context[seq],
            self.dynamic[seq],
            self.static[seq],
        )
        return draft[1:]

    def accept(self, seq: int, n_accepted: int, is_other: bool) -> None:
        del seq, n_accepted, is_other
