"""specjax: llama.cpp's speculative decoding as pure JAX."""
