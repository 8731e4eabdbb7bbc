# ruff: noqa: UP031  (printf formats are kept verbatim from llama.cpp)
"""Speculative decoding counters (llama.cpp §4.4-4.5, §7.5, §8) updated inside jit.

`SpecStats` holds int32 counters (int64 is unavailable without jax x64):

* per drafter implementation, indexed by the drafter's position `i` in the engine's chain
  (llama.cpp's `impls`, fixed priority order), shape `[n_impl]`:
  n_call_begin, n_call_draft, n_call_accept, n_gen_drafts, n_acc_drafts, n_gen_tokens,
  n_acc_tokens; and n_acc_tokens_per_pos `[n_impl, K]`. Like upstream these are global to the
  speculative object: aggregated over all rows and requests.
* server totals (llama.cpp's per-slot `stats`, summed over rows): n_draft_tokens,
  n_draft_accepted, n_verif_steps (scalars) and n_accepted_per_pos `[K]`.

Invariants maintained by the update functions (and tested): for each impl
n_acc_drafts <= n_call_accept, n_acc_tokens <= n_gen_tokens when every accept follows its draft,
n_acc_tokens_per_pos[i] is non-increasing along K and sums to n_acc_tokens, and
n_acc_tokens_per_pos[i, 0] == n_acc_drafts; the same for the server totals.

Upstream grows `n_acc_tokens_per_pos` to the longest accepted run; the fixed `[K]` array holds the
same counts padded with zeros, and `format_impl_lines` prints only the grown prefix (the non-zero
entries, since counts are non-increasing). The server's per-position list is sized K
(`common_speculative_n_max`) and printed in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.memory.target import ROLLBACK_PATHS, part_rollback_counts
from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array, axis_size


def rollback_dict(counts: Any) -> dict[str, int]:
    """`{path: count}` over ROLLBACK_PATHS from an array ordered as ROLLBACK_PATHS."""
    return {name: int(x) for name, x in zip(ROLLBACK_PATHS, np.asarray(counts).tolist())}


_IMPL_FIELDS = (
    "n_call_begin",
    "n_call_draft",
    "n_call_accept",
    "n_gen_drafts",
    "n_acc_drafts",
    "n_gen_tokens",
    "n_acc_tokens",
)


@pytree_dataclass
class SpecStats:
    # per implementation [n_impl]
    n_call_begin: Array
    n_call_draft: Array
    n_call_accept: Array
    n_gen_drafts: Array
    n_acc_drafts: Array
    n_gen_tokens: Array
    n_acc_tokens: Array
    n_acc_tokens_per_pos: Array  # [n_impl, K]
    # server totals
    n_draft_tokens: Array  # []
    n_draft_accepted: Array  # []
    n_verif_steps: Array  # []
    n_accepted_per_pos: Array  # [K]
    #: [len(ROLLBACK_PATHS)] row-rounds per rollback path (`record_rollback`)
    n_rollback: Array

    @classmethod
    def create(cls, n_impl: int, k: int) -> SpecStats:
        """All-zero counters for `n_impl` drafters and draft width `k`."""
        if n_impl < 0 or k < 1:
            raise ValueError(f"SpecStats needs n_impl >= 0 and k >= 1, got {n_impl}, {k}")
        zeros_i = jnp.zeros((n_impl,), jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        return cls(
            **{name: zeros_i for name in _IMPL_FIELDS},
            n_acc_tokens_per_pos=jnp.zeros((n_impl, k), jnp.int32),
            n_draft_tokens=zero,
            n_draft_accepted=zero,
            n_verif_steps=zero,
            n_accepted_per_pos=jnp.zeros((k,), jnp.int32),
            n_rollback=jnp.zeros((len(ROLLBACK_PATHS),), jnp.int32),
        )

    n_impl = axis_size("n_call_begin", 0)
    k = axis_size("n_accepted_per_pos", 0)

    def to_host(self) -> SpecStats:
        """The same counters as numpy int64 arrays (after one device_get)."""
        return jax.tree.map(lambda x: np.asarray(x, np.int64), jax.device_get(self))

    def to_dict(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        """Summary with vLLM's metric names, plus per-drafter llama.cpp counters.

        num_drafts = verification steps, num_draft_tokens = drafted tokens, num_accepted_tokens,
        mean_acceptance_length = 1 + accepted / steps (1.0 without steps), acceptance_rate =
        accepted / drafted (0.0 without drafts), accepted_per_position (counts, length K) and
        acceptance_rate_per_position (counts / steps). `drafters` maps each name (default
        `impl{i}`) to its counters, mean_acc_len and acc_rate_per_pos as llama.cpp prints them.
        """
        host = self.to_host()
        names = _names(names, host.n_impl)
        steps = int(host.n_verif_steps)
        drafted = int(host.n_draft_tokens)
        accepted = int(host.n_draft_accepted)
        per_pos = [int(x) for x in host.n_accepted_per_pos]
        drafters: dict[str, Any] = {}
        for i, name in enumerate(names):
            entry: dict[str, Any] = {f: int(getattr(host, f)[i]) for f in _IMPL_FIELDS}
            calls = entry["n_call_accept"]
            pos_i = [int(x) for x in host.n_acc_tokens_per_pos[i]]
            entry["n_acc_tokens_per_pos"] = pos_i
            entry["mean_acc_len"] = 1.0 + entry["n_acc_tokens"] / calls if calls else None
            entry["acc_rate_per_pos"] = [x / calls for x in _grown(pos_i)] if calls else []
            drafters[name] = entry
        return {
            "num_drafts": steps,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "accepted_per_position": per_pos,
            "acceptance_rate_per_position": [x / steps for x in per_pos] if steps else [],
            "rollback": rollback_dict(host.n_rollback),
            "drafters": drafters,
        }


# --------------------------------------------------------------------------------------------
# in-jit updates


def _impl_onehot(impl_idx_B: Array, mask_B: Array, n_impl: int) -> Array:
    """[B, n_impl] int32: row b counts for impl i iff mask_B[b] and impl_idx_B[b] == i."""
    ids_I = jnp.arange(n_impl, dtype=jnp.int32)
    hit_BI = (impl_idx_B.astype(jnp.int32)[:, None] == ids_I[None, :]) & mask_B[:, None]
    return hit_BI.astype(jnp.int32)


def record_begin(stats: SpecStats, begin_B: Array) -> SpecStats:
    """`common_speculative_begin` for the rows in `begin_B`: every impl's n_call_begin += rows."""
    n = jnp.sum(begin_B.astype(jnp.int32))
    return replace(stats, n_call_begin=stats.n_call_begin + n)


def record_draft(
    stats: SpecStats, impl_idx_B: Array, draft_len_B: Array, drafting_B: Array
) -> SpecStats:
    """The relay's counters for one `common_speculative_draft` round (llama.cpp §4.4, §7.3).

    impl_idx_B:  int32 [B], chain index of the drafter whose draft the row got, -1 for none.
    draft_len_B: int32 [B], that draft's length after truncation to the row's n_max.
    drafting_B:  bool [B], rows that asked for a draft this round.

    Impl i is called (n_call_draft += 1) iff some drafting row had no draft from impls 0..i-1,
    i.e. the relay had not stopped yet. The winning impl of a row with a non-empty draft gets
    n_gen_drafts += 1 and n_gen_tokens += length. The server's n_draft_tokens grows by the draft
    length of every drafting row.
    """
    n_impl = stats.n_impl
    drafting_B = drafting_B.astype(bool)
    impl_idx_B = impl_idx_B.astype(jnp.int32)
    len_B = jnp.where(drafting_B, draft_len_B.astype(jnp.int32), 0)
    got_B = drafting_B & (impl_idx_B >= 0) & (len_B > 0)
    winner_B = jnp.where(got_B, impl_idx_B, jnp.int32(n_impl))  # n_impl = "nobody"
    ids_I = jnp.arange(n_impl, dtype=jnp.int32)
    still_BI = drafting_B[:, None] & (winner_B[:, None] >= ids_I[None, :])
    called_I = jnp.any(still_BI, axis=0).astype(jnp.int32)
    won_BI = _impl_onehot(impl_idx_B, got_B, n_impl)
    return replace(
        stats,
        n_call_draft=stats.n_call_draft + called_I,
        n_gen_drafts=stats.n_gen_drafts + jnp.sum(won_BI, axis=0),
        n_gen_tokens=stats.n_gen_tokens + jnp.sum(won_BI * len_B[:, None], axis=0),
        n_draft_tokens=stats.n_draft_tokens + jnp.sum(len_B),
    )


def record_accept(
    stats: SpecStats,
    impl_idx_B: Array,
    n_accepted_B: Array,
    active_B: Array,
    replay_B: Array | None = None,
) -> SpecStats:
    """`common_speculative_accept` + the server's commit counters (llama.cpp §4.5, §7.5).

    impl_idx_B:   int32 [B], `impl_last` of the row (the drafter of the verified draft).
    n_accepted_B: int32 [B], accepted draft tokens (`|accepted| - 1`).
    active_B:     bool [B], rows that verified a non-empty draft and committed this round (not
                  rows that went to a checkpoint restore).
    replay_B:     bool [B], rows whose round replayed a checkpoint: the server (not the impl)
                  then counts one accepted token less when n_accepted > 0 (PR #26320).

    Impl counters: n_call_accept += 1 per row (0-accept rounds included), n_acc_drafts += 1 when
    n > 0, n_acc_tokens += n, per-position counts +1 for positions < n. Server: n_verif_steps += 1,
    n_draft_accepted += n', n_accepted_per_pos[j] += 1 for j < n'.
    """
    n_impl = stats.n_impl
    k = stats.k
    active_B = active_B.astype(bool)
    n_B = jnp.where(active_B, n_accepted_B.astype(jnp.int32), 0)
    mine_BI = _impl_onehot(impl_idx_B, active_B & (impl_idx_B >= 0), n_impl)
    pos_K = jnp.arange(k, dtype=jnp.int32)
    below_BK = (pos_K[None, :] < n_B[:, None]).astype(jnp.int32)
    positive_B = (n_B > 0).astype(jnp.int32)

    if replay_B is None:
        n_srv_B = n_B
    else:
        n_srv_B = n_B - (replay_B.astype(bool) & (n_B > 0)).astype(jnp.int32)
    srv_below_BK = (pos_K[None, :] < n_srv_B[:, None]) & active_B[:, None]

    return replace(
        stats,
        n_call_accept=stats.n_call_accept + jnp.sum(mine_BI, axis=0),
        n_acc_drafts=stats.n_acc_drafts + jnp.sum(mine_BI * positive_B[:, None], axis=0),
        n_acc_tokens=stats.n_acc_tokens + jnp.sum(mine_BI * n_B[:, None], axis=0),
        n_acc_tokens_per_pos=stats.n_acc_tokens_per_pos
        + jnp.einsum("bi,bk->ik", mine_BI, below_BK),
        n_draft_accepted=stats.n_draft_accepted + jnp.sum(n_srv_B),
        n_verif_steps=stats.n_verif_steps + jnp.sum(active_B.astype(jnp.int32)),
        n_accepted_per_pos=stats.n_accepted_per_pos
        + jnp.sum(srv_below_BK.astype(jnp.int32), axis=0),
    )


def record_rollback(stats: SpecStats, verified_B: Array, n_rollback_B: Array) -> SpecStats:
    """Rollback path counters of an attention-only (PART) target for one round: rows that
    verified a draft (`verified_B`) and dropped `n_rollback_B` rejected draft cells count in
    `seq_rm` when that is > 0, else in `full_accept` (`memory.target.part_rollback_counts`,
    what the KV memory's `settle` reports)."""
    return add_rollback(stats, part_rollback_counts(verified_B, n_rollback_B))


def add_rollback(stats: SpecStats, counts: Array) -> SpecStats:
    """The round's row counts per rollback path (`TargetMemory.settle`'s) added up."""
    return replace(stats, n_rollback=stats.n_rollback + counts)


def format_rollback_line(counts: dict[str, int]) -> str:
    """specjax's line: how many verified rounds rolled back by each path."""
    return (
        f"rollback: {counts.get('seq_rm', 0)} by seq_rm, {counts.get('rs_plane', 0)} by RS "
        f"plane, {counts.get('checkpoint', 0)} by checkpoint + replay "
        f"({counts.get('replay', 0)} replay rounds), {counts.get('full_accept', 0)} fully "
        "accepted"
    )


# --------------------------------------------------------------------------------------------
# host-side formatting


def _names(names: Sequence[str] | None, n_impl: int) -> list[str]:
    if names is None:
        return [f"impl{i}" for i in range(n_impl)]
    if len(names) != n_impl:
        raise ValueError(f"got {len(names)} drafter names for {n_impl} implementations")
    return list(names)


def _grown(per_pos: Sequence[int]) -> list[int]:
    """Upstream's grown vector: the leading non-zero counts."""
    out: list[int] = []
    for x in per_pos:
        if x == 0:
            break
        out.append(int(x))
    return out


def format_impl_lines(
    stats: SpecStats,
    names: Sequence[str],
    durations_ms: Sequence[Sequence[float]] | None = None,
) -> list[str]:
    """`common_speculative_print_stats`: one line per impl (without the log-macro prefix).

    `names` are the dash spellings (`draft-simple`, `ngram-mod`), one per chain index;
    `durations_ms` holds (begin, draft, accept) wall times per impl in ms (default zeros).
    """
    host = stats.to_host()
    names = _names(names, host.n_impl)
    if durations_ms is None:
        durations_ms = [(0.0, 0.0, 0.0)] * host.n_impl
    if len(durations_ms) != host.n_impl:
        raise ValueError(f"got {len(durations_ms)} durations for {host.n_impl} implementations")
    lines = []
    for i, name in enumerate(names):
        c = {f: int(getattr(host, f)[i]) for f in _IMPL_FIELDS}
        line = (
            "statistics %16s: #calls(b,g,a) = %4d %6d %6d, #gen drafts = %6d, #acc drafts = %5d, "
            "#gen tokens = %6d, #acc tokens = %5d"
            % (
                name,
                c["n_call_begin"],
                c["n_call_draft"],
                c["n_call_accept"],
                c["n_gen_drafts"],
                c["n_acc_drafts"],
                c["n_gen_tokens"],
                c["n_acc_tokens"],
            )
        )
        calls = c["n_call_accept"]
        if calls > 0:
            mean = 1.0 + c["n_acc_tokens"] / calls
            rates = ", ".join(
                "%.3f" % (x / calls) for x in _grown([int(v) for v in host.n_acc_tokens_per_pos[i]])
            )
            line += ", #mean acc len = %.2f, #acc rate/pos = (%s)" % (mean, rates)
        b, g, a = (float(x) for x in durations_ms[i])
        line += ", dur(b,g,a) = %.3f, %.3f, %.3f ms" % (b, g, a)
        lines.append(line)
    return lines


def format_server_lines(stats: SpecStats) -> list[str]:
    """The server's per-slot `print_timings` speculative lines (empty when nothing was drafted).

    `draft acceptance = %0.5f (%5d accepted / %5d generated), mean len = %5.2f` with the ratio
    computed in float32 as upstream, then `     acc per pos = (...)` (upstream logs it at TRACE).
    """
    host = stats.to_host()
    return format_acceptance_lines(
        int(host.n_draft_accepted),
        int(host.n_draft_tokens),
        int(host.n_verif_steps),
        [int(x) for x in host.n_accepted_per_pos],
    )


def format_acceptance_lines(
    accepted: int, drafted: int, steps: int, per_pos: Sequence[int] = ()
) -> list[str]:
    """The acceptance lines of every target and drafter (`format_server_lines` from plain
    counts): empty when nothing was drafted, else `draft acceptance = ...` and `acc per pos`,
    the rate per draft position up to the longest accepted run (as the per-drafter lines:
    not a column of zeros for the positions never reached; `none` when nothing was
    accepted). No ratio is printed without its denominator, so never `nan`."""
    if drafted <= 0:
        return []
    ratio = float(np.float32(accepted) / np.float32(drafted))
    mean_len = 1.0 + accepted / steps if steps > 0 else 1.0
    grown = _grown([int(x) for x in per_pos]) if steps > 0 else []
    shown = ", ".join("%.3f" % (x / steps) for x in grown) if grown else "none"
    return [
        "draft acceptance = %0.5f (%5d accepted / %5d generated), mean len = %5.2f"
        % (ratio, accepted, drafted, mean_len),
        "     acc per pos = (%s)" % shown,
    ]


def format_governor_lines(governor: dict[str, Any]) -> list[str]:
    """The draft governor's lines (specjax only): its rounds, and each drafter it left out
    of the run with why. Empty for a run without a governor record."""
    if not governor:
        return []
    state = "on" if governor.get("enabled") else "off"
    lines = [
        f"draft governor: {state}, drafting shortened in {int(governor.get('throttled', 0))} "
        f"and off in {int(governor.get('off', 0))} of {int(governor.get('rounds', 0))} rounds"
    ]
    for name, why in (governor.get("dropped") or {}).items():
        lines.append(f"draft governor: {name} off for this run: {why}")
    return lines
