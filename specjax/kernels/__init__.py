"""Native kernels: `cpu` builds and calls the C++ sources beside it (attention, linear,
top-k, ngram-cache) as XLA CPU custom calls. Imports nothing of specjax but `types`."""
