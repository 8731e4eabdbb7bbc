"""Control flow shared by the engine, the models and the drafters, chosen by backend here.

XLA CPU and the accelerators want different shapes of the same computation, and this module is
the one place that chooses (at trace time, from the backend the program is traced for):

* `run_once(pred, body, carry)`: a while loop run 0 or 1 times on every backend. Its carry is
  aliased, so `body` updates the KV caches and drafter pools in place (a `lax.cond` branch
  copies the operands it updates: on an H100 a draft model's cache, every round). A GPU runs
  it inside its command buffer (`compiler_options`), not from the host.
* `cpu_control_flow()`: the models' attention reads the cached cells in chunks up to the
  used cells on CPU (a loop with a traced trip count: its cost follows the context used), and
  in one masked pass over every cell on accelerators (no loop: a few kernels per layer)
  where `attention_kernel()` names no kernel.
* `attention_kernel()`: where the models' attention over the cache runs in one kernel per
  layer (`specjax.kernels.gpu`, Pallas lowered by Triton, on GPUs: every segment by position,
  each row read to its own high-water mark by a loop inside the kernel) instead of XLA's
  ops; None on CPU and TPU.
* `draft_steps_in_cache()`: a draft model's k-step loop writes each step's K/V straight into
  its cache on a TPU (the cache is then loop-carried and updated in place), and into a small
  scratch beside the read-only cache elsewhere (committed after the loop). XLA TPU (v6e)
  gives a cache that a loop only reads the layout its products prefer (cells minor), so it
  re-laid out the whole draft cache before every draft loop; a cache the loop writes keeps
  its stored layout. CPU and GPU attend the scratch in their kernels (native, Pallas).
* `unroll_stacking_scans()`: a short scan that stacks a per-step value (a hybrid target's
  per-token recurrent states in its verify forward) unrolled on a GPU, looped elsewhere.
* `put_prefix(base, x, axis)`: `x` over `base`'s first entries, in place on CPU and TPU,
  by a concatenation on a GPU (an update at offset 0 became a host-driven copy there).
* `compiler_options(platform)`: what the project's executables are compiled with by default
  on each platform (GPU: loops and conditionals captured in CUDA graphs, however few the
  thunks around them, so no loop of a round runs from the host); a flag the user sets in
  XLA_FLAGS wins.
* `at_row(x_B, r)`: `x_B[r]` for a row index `r` that a loop counts (a `fori_loop` over
  rows): a dynamic slice on CPU, a one-hot reduction on accelerators. XLA GPU makes a
  dynamic slice whose offset follows a loop's counter a copy whose offset the host works out
  at every iteration (a `kDynamicSliceFusion`): that loop, and every loop around it, then
  runs from the host.
* `moe_dispatch(pairs, n_experts)`: how a mixture-of-experts layer (`specjax.models.moe`)
  runs its experts over `pairs` token-expert pairs (see its docstring for the figures).

Invariant: `run_once` never copies what its body updates in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from specjax.types import Array

#: XLA GPU command buffers (CUDA graphs) by default, plus while loops and conditionals: a
#: loop or conditional outside a command buffer reads its predicate back to the host at
#: every iteration. Needs CUDA >= 12.3 (conditional graph nodes).
GPU_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
#: The fewest consecutive capturable thunks XLA GPU makes a command buffer of (its default
#: 5). XLA counts the thunks of one sequence, not what they hold: a capturable loop with
#: fewer than that many thunks beside it (a draft loop between two kernels, say) stayed out
#: of every command buffer, and so did every loop in its body (5 of the 9 host-driven loops
#: of ngram-mod + draft-simple at B = 32 on the H100). 1: every capturable run is captured.
GPU_MIN_GRAPH_SIZE = "1"


def cpu_control_flow() -> bool:
    """Whether the program being traced is for XLA CPU (else a GPU or a TPU)."""
    return jax.default_backend() == "cpu"


#: `attention_kernel()` values: the Pallas kernel compiled for the GPU, or run in Pallas's
#: interpreter (any backend: the tests' check of the GPU path on CPU).
PALLAS_GPU = "pallas-gpu"
PALLAS_INTERPRET = "pallas-interpret"


def attention_kernel() -> str | None:
    """The kernel the models' attention over cached cells runs on for the backend being
    traced: `PALLAS_GPU` on a GPU (`specjax.kernels.gpu.attend`: one launch per layer, every
    segment by position, cells read up to each row's high-water mark); None elsewhere: XLA
    CPU keeps its chunk loop and native kernels, a TPU the masked pass (`models.llama`)."""
    return PALLAS_GPU if jax.default_backend() in ("gpu", "cuda") else None


def draft_steps_in_cache() -> bool:
    """Whether a draft model's steps write their K/V into its cache as they run (TPU) rather
    than into a scratch committed (draft-simple) or dropped (draft-eagle3) after the loop
    (CPU, GPU). Deviceless, tiny configuration, B = 32 and 4096 cells
    (benchmarks/accelerators.py): on a TPU v6e the scratch form copies a cache-sized buffer
    in every round (draft-simple 1, draft-eagle3 2, on the v5e too), this form none."""
    return jax.default_backend() == "tpu"


def unroll_stacking_scans() -> bool:
    """Whether a short scan that stacks a value per step (a hybrid target's verify forward
    keeps the recurrent state after each of its k + 1 tokens: `models.qwen35.delta_recurrent`)
    is unrolled (GPU) rather than looped (CPU, TPU). XLA GPU writes a loop's stacked output
    at the loop's counter with a `kDynamicSliceFusion` that no command buffer holds (as
    `at_row`): deviceless, tiny configuration, the qwen35 hybrid with draft-mtp on the H100,
    that loop and the two around it ran from the host; unrolled, they do not."""
    return jax.default_backend() in ("gpu", "cuda")


def run_once(pred: Array, body: Callable[[Any], Any], carry: Any) -> Any:
    """`body(carry)` if `pred`, else `carry`: a while loop run 0 or 1 times. Not `lax.cond` or
    `lax.switch`: their branches would copy the KV cache, and every branch must return the
    same shapes, so a narrow branch pads its logits and K/V to the widest one's."""
    return jax.lax.while_loop(
        lambda c: c[0], lambda c: (jnp.zeros((), bool), body(c[1])), (pred, carry)
    )[1]


def at_row(x_B: Array, r: Array) -> Array:
    """`x_B[r]` (a scalar: `x_B` is `[B]`, `r` a traced row index, 0 <= r < B). On
    accelerators a one-hot reduction, not a dynamic slice: XLA GPU lowers a dynamic slice
    indexed by a loop's counter to a copy whose offset the host computes at every iteration
    (a `kDynamicSliceFusion`, `dynamic_slice_config.loop_index` in the optimised HLO), which
    no command buffer holds (jaxlib 0.10.2: not in a loop that is not unrolled, and not below
    CUDA 12.9 at all), so the loops around it run from the host. Its values are `x_B[r]`'s."""
    if cpu_control_flow():
        return x_B[r]
    hit_B = jnp.arange(x_B.shape[0]) == r
    if x_B.dtype == jnp.bool_:
        return jnp.any(hit_B & x_B)
    return jnp.sum(jnp.where(hit_B, x_B, jnp.zeros_like(x_B)), dtype=x_B.dtype)


def put_prefix(base: Array, x: Array, axis: int) -> Array:
    """`base` with its first `x.shape[axis]` entries along `axis` replaced by `x` (a narrow
    verify's hidden states in the widest one's buffer). An update in place at offset 0 on
    CPU and TPU; on a GPU a concatenation: XLA GPU made that update, when `x` was a copy (the
    embedding rows a layer-0 feature is), a `kDynamicSliceFusion`, which no command buffer
    holds, so the loops around it ran from the host (deviceless, tiny configuration,
    draft-eagle3 at B = 1 on the H100: 3 such loops). `base` is small there: [B, k + 1, D]."""
    n = x.shape[axis]
    if n == base.shape[axis]:
        return x
    if jax.default_backend() not in ("gpu", "cuda"):
        return jax.lax.dynamic_update_slice_in_dim(base, x, 0, axis)
    rest = jax.lax.slice_in_dim(base, n, base.shape[axis], axis=axis)
    return jnp.concatenate([x, rest], axis=axis)


def compiler_options(platform: str) -> dict[str, str]:
    """Default XLA options of the project's executables on `platform` ("cpu", "gpu" or
    "cuda", "tpu"), less those the user set in XLA_FLAGS."""
    user = os.environ.get("XLA_FLAGS", "")
    options: dict[str, str] = {}
    if platform in ("gpu", "cuda"):
        if "xla_gpu_enable_command_buffer" not in user:
            options["xla_gpu_enable_command_buffer"] = GPU_COMMAND_BUFFER
        if "xla_gpu_graph_min_graph_size" not in user:
            options["xla_gpu_graph_min_graph_size"] = GPU_MIN_GRAPH_SIZE
    return options


#: Most token-expert pairs per expert that XLA CPU runs pair by pair ("pairs"); beyond, every
#: expert over every token ("dense"). benchmarks/moe_dispatch.py on the 2-core shared host,
#: medium layer (D 768, 32 experts, top-4, F' 384, float32), pairs / dense: 4.4 / 21.9 ms at
#: 1 token, 17.3 / 34.5 at 9, 35.7 / 40.4 at 17 (2.1 pairs per expert), 109 / 56 at 33 (4.1
#: per expert), 131 / 79 at 64. A tiny layer (D 64, 8 experts, top-2) is launch-bound: dense
#: won at every size there (7.5 / 10.8 us at 1 token).
CPU_PAIRS_PER_EXPERT = 2
#: The same on a GPU, where no grouped matmul is used: pair by pair while the pairs read
#: fewer expert matrices than the dense dispatch (every expert), so up to one per expert.
GPU_PAIRS_PER_EXPERT = 1


def moe_dispatch(pairs: int, n_experts: int) -> str:
    """The dispatch (`specjax.models.moe.DISPATCHES`) of a MoE layer over `pairs` (static)
    token-expert pairs of `n_experts` experts, for the backend being traced for.

    * CPU: "pairs" (a loop over the pairs reading only the experts they use) up to
      CPU_PAIRS_PER_EXPERT pairs per expert (decode, verify, short prompts), else "dense"
      (Qwen3-30B-A3B's 128 experts, top-8: pair by pair up to 32 tokens).
      XLA CPU has no grouped matmul: `lax.ragged_dot` expands there to a masked product of
      every expert with every pair, k times the dense dispatch's work (tiny layer: 2-3x the
      other dispatches' time at every size).
    * TPU: "ragged": XLA TPU runs `lax.ragged_dot` as a grouped matmul (Mosaic custom
      calls): a Qwen3-30B-A3B layer over 256 tokens costs 19.5 GFLOP, the dense dispatch 310.
    * GPU: "pairs" up to GPU_PAIRS_PER_EXPERT per expert, else "dense": XLA GPU (jax 0.10.2)
      expands `lax.ragged_dot` to the masked product of every expert with every pair (dots
      over the expert axis, k times the dense dispatch's arithmetic), and a decode step's
      pairs read k of the X expert matrices where the dense dispatch reads all X (a
      Qwen3-30B-A3B layer: 8 of 128, 75 MB of 1.2 GB). Deviceless figures
      (benchmarks/moe_dispatch.py --aot): no loop from the host, 10-11 kernels for "pairs".
    """
    backend = jax.default_backend()
    if backend == "cpu":
        return "pairs" if pairs <= CPU_PAIRS_PER_EXPERT * n_experts else "dense"
    if backend == "tpu":
        return "ragged"
    return "pairs" if pairs <= GPU_PAIRS_PER_EXPERT * n_experts else "dense"
