"""Decoding: the one engine (prefill, the speculative round, the on-device loop), its
verification and statistics, the draft governor and its prices, and the host side of a call
(request checks, weight layouts, the executable caches). Imports `memory`, `models` and
`drafters`, never `jobs`, `cli` or `api`."""
