"""Plain-Python transcription of llama.cpp's draft-eagle3 boundary bookkeeping (spec 5.2,
`common_speculative_impl_draft_eagle3` in common/speculative.cpp), no JAX.

The draft memory of a sequence is a list of cells `(pos, token, g)` -- the decoder input pair
written at `pos` (its K/V are a function of exactly that pair and position). The encoder is
`g = f @ fc.T` (float64) over the features interleaved per row. The drafting loop itself is
not modelled: `draft` performs the seq_rm and the seed write; the drafted rows are removed
again by the caller (speculative-simple's `seq_rm(draft, pos_max + 1, -1)`), so they never
persist and are omitted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Eagle3BoundaryRef:
    def __init__(self, n_seq: int, n_embd_dec: int, fc: np.ndarray) -> None:
        self.n_seq = n_seq
        self.fc = np.asarray(fc, np.float64)
        self.mem: list[list[tuple[int, int, np.ndarray]]] = [[] for _ in range(n_seq)]
        self.pending_g = [np.zeros(n_embd_dec) for _ in range(n_seq)]
        self.pending_pos = [-1] * n_seq
        self.verify_g: list[list[np.ndarray]] = [[] for _ in range(n_seq)]
        self.verify_pos_first = [-1] * n_seq
        self.verify_g_rows = [0] * n_seq

    def pos_max(self, seq: int) -> int:
        return max((c[0] for c in self.mem[seq]), default=-1)

    def seq_rm(self, seq: int, p0: int) -> None:
        self.mem[seq] = [c for c in self.mem[seq] if c[0] < p0]

    def process(self, rows: Sequence[tuple[int, int, int, np.ndarray]]) -> None:
        """`rows`: the batch as (token, pos, seq, features) in batch order."""
        if not rows:
            return
        g = [self.fc @ np.asarray(f, np.float64) for (_, _, _, f) in rows]
        beg = [-1] * self.n_seq
        end = [-1] * self.n_seq
        for k, (_, _, seq, _) in enumerate(rows):
            end[seq] = k
            if beg[seq] < 0:
                beg[seq] = k
        added: list[tuple[int, int, int, np.ndarray]] = []
        for seq in range(self.n_seq):
            b, e = beg[seq], end[seq]
            if b < 0 or e < 0:
                continue
            pending = self.pending_pos[seq]
            if pending >= 0 and pending + 1 == rows[b][1]:  # noqa: SIM102 - as upstream
                if pending > self.pos_max(seq):
                    added.append((seq, pending, rows[b][0], self.pending_g[seq].copy()))
            for k in range(b, e):
                added.append((seq, rows[k][1], rows[k + 1][0], g[k]))
            self.verify_pos_first[seq] = rows[b][1]
            self.pending_pos[seq] = rows[e][1]
            self.verify_g_rows[seq] = e - b + 1
            self.verify_g[seq] = [x.copy() for x in g[b : e + 1]]
            self.pending_g[seq] = g[e].copy()
        for seq, pos, tok, gv in added:  # one decode of all added rows
            self.mem[seq].append((pos, tok, gv))

    def draft(self, seq: int, id_last: int, drafting: bool = True) -> bool:
        """The seed of a draft; False when the sequence has no boundary (no draft)."""
        if not drafting or self.pending_pos[seq] < 0:
            return False
        self.seq_rm(seq, self.pending_pos[seq])
        self.mem[seq].append((self.pending_pos[seq], id_last, self.pending_g[seq].copy()))
        return True

    def accept(self, seq: int, n_accepted: int) -> None:
        n_rows = self.verify_g_rows[seq]
        if n_rows <= 0:
            return
        i = min(n_accepted, n_rows - 1)
        self.pending_pos[seq] = self.verify_pos_first[seq] + i
        self.pending_g[seq] = self.verify_g[seq][i].copy()

    def get_state(self, seq: int) -> bytes | None:
        if self.pending_pos[seq] < 0:
            return None
        pos = np.asarray([self.pending_pos[seq]], "<i4").tobytes()
        return pos + np.asarray(self.pending_g[seq], "<f4").tobytes()
