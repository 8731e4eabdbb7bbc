"""Test oracles: plain-Python statements of llama.cpp's behaviour (no JAX), which the library
is checked against. Not library code: nothing under `specjax/` imports them.

* `reference`: ngram-simple, ngram-map-k / -k4v and ngram-mod, statement by statement.
* `ngram_cache_reference`: ngram-cache (lookup decoding) and its cache files.
* `relay_reference`: the relay driver (`common_speculative_{begin,draft,accept}`) and the
  conformance vectors' replay.

Tests import them as `oracles.*` (pytest puts `tests/` on the import path).
"""
