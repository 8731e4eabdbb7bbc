"""The target's memory: what a model keeps of a sequence, and llama.h's operations on it.

`kv` (the attention KV cache: cells with positions, PART rollback), `ops` (llama.h's
`seq_rm` / `seq_cp` / `seq_keep` / `seq_add` / `seq_div` on it), `hybrid` (a qwen35 hybrid's
KV cache + recurrent state with snapshot planes, and the NO / PART / FULL / RS probe), `swa`
(a KV cache whose sliding-window layers keep a ring of cells, llama.cpp's iSWA cache, PART),
`target` (the one interface the engine's round uses, over any of them), `checkpoint` (orbax
PARTIAL_ONLY checkpoints of slots). Imports nothing above `models`.

`specjax.memory.seq_rm` and the other operations stay reachable here (they lived in a
module of this name).
"""

from specjax.memory.ops import (
    Memory,
    can_shift,
    clear,
    seq_add,
    seq_cp,
    seq_div,
    seq_keep,
    seq_pos_max,
    seq_pos_min,
    seq_rm,
)

__all__ = [
    "Memory",
    "can_shift",
    "clear",
    "seq_add",
    "seq_cp",
    "seq_div",
    "seq_keep",
    "seq_pos_max",
    "seq_pos_min",
    "seq_rm",
]
