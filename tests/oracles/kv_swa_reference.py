"""Plain-Python transcription of llama.cpp's SWA KV cache for one sequence (no JAX):
`llama_kv_cache` of src/llama-kv-cache.cpp with `swa_type` STANDARD, as the SWA half of
`llama_kv_cache_iswa` holds it, plus `common_context_can_seq_rm`'s probe (common/common.cpp).

* `find_slot` (non-continuous, one sequence): starting at `head` (reset to 0 when more than
  `used + 2 * n_tokens` cells lie before it), wrapping around, a cell is usable when empty or
  when it is SWA-masked for the sequence's next token: `is_masked_swa(n_swa, pos_cell,
  seq_pos_max + 1)`, i.e. seq_pos_max + 1 - pos_cell >= n_swa (seq_pos_max before the
  ubatch). Fails (decode error) when fewer than n_tokens cells are usable.
* `apply_ubatch`: overwrites those cells; then purges [seq_pos_min, the largest overwritten
  position] so the sequence's positions stay contiguous; head = last cell + 1.
* `seq_rm(p0, p1)`: removes cells with p0 <= pos < p1 (p0 < 0 -> 0, p1 < 0 -> infinity),
  head moves back to the first freed cell; returns True (always, for a KV cache).
* The mask: a query at q sees a cell at p iff p <= q and not is_masked_swa(n_swa, p, q).
"""

from __future__ import annotations

INF = 2**31 - 1


def is_masked_swa(n_swa: int, p0: int, p1: int) -> bool:
    """LLAMA_SWA_TYPE_STANDARD: masked when p1 - p0 >= n_swa."""
    return p1 - p0 >= n_swa


class SwaKvCache:
    def __init__(self, size: int, n_swa: int):
        self.pos: list[int | None] = [None] * size
        self.n_swa = n_swa
        self.head = 0

    def used(self) -> int:
        return sum(p is not None for p in self.pos)

    def seq_pos_min(self) -> int:
        held = [p for p in self.pos if p is not None]
        return min(held) if held else -1

    def seq_pos_max(self) -> int:
        held = [p for p in self.pos if p is not None]
        return max(held) if held else -1

    def find_slot(self, n_tokens: int) -> list[int] | None:
        size = len(self.pos)
        head = self.head
        if head > self.used() + 2 * n_tokens:
            head = 0
        if n_tokens > size:
            return None
        pos_max = self.seq_pos_max()
        idxs: list[int] = []
        n_tested = 0
        while True:
            if head + 1 > size:
                n_tested += size - head
                head = 0
                continue
            idx = head
            head += 1
            n_tested += 1
            p = self.pos[idx]
            if p is None or is_masked_swa(self.n_swa, p, pos_max + 1):
                idxs.append(idx)
            if len(idxs) == n_tokens:
                return idxs
            if n_tested >= size:
                return None

    def decode(self, positions: list[int]) -> bool:
        """One ubatch of the sequence's tokens at `positions`; False when no slot is found."""
        idxs = self.find_slot(len(positions))
        if idxs is None:
            return False
        max_rm = -1
        for idx, p in zip(idxs, positions):
            if self.pos[idx] is not None:
                max_rm = max(max_rm, self.pos[idx])  # type: ignore[type-var]
            self.pos[idx] = p
        if max_rm >= 0 and self.seq_pos_min() <= max_rm:
            self.seq_rm(self.seq_pos_min(), max_rm + 1)
        self.head = idxs[-1] + 1
        return True

    def seq_rm(self, p0: int, p1: int) -> bool:
        p0 = max(p0, 0)
        p1 = INF if p1 < 0 else p1
        new_head = len(self.pos)
        for i, p in enumerate(self.pos):
            if p is not None and p0 <= p < p1:
                self.pos[i] = None
                new_head = min(new_head, i)
        if new_head != len(self.pos) and new_head < self.head:
            self.head = new_head
        return True

    def visible(self, q: int) -> set[int]:
        """Positions a query at q sees among the cells."""
        return {
            p for p in self.pos if p is not None and p <= q and not is_masked_swa(self.n_swa, p, q)
        }


def can_seq_rm(size: int, n_swa: int) -> str:
    """`common_context_can_seq_rm` on an iSWA memory (n_rs_seq 0): decode two tokens, then
    `seq_rm(0, 1, -1)`: PART when it succeeds, FULL when it fails (both halves are KV caches,
    whose seq_rm returns True)."""
    base, swa = SwaKvCache(size, INF), SwaKvCache(size, n_swa)
    if not (base.decode([0, 1]) and swa.decode([0, 1])):
        return "NO"
    ok = base.seq_rm(1, -1) & swa.seq_rm(1, -1)
    return "PART" if ok else "FULL"
