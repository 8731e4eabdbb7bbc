"""Kernels beside XLA's: `cpu` builds and calls the C++ sources beside it (attention, linear,
top-k, ngram-cache) as XLA CPU custom calls; `gpu` is attention as one Pallas kernel
(Triton-lowered) for GPUs. Imports nothing of specjax but `types`."""
