"""Drafters: one module per llama.cpp speculative type, all behind `specjax.drafters.base`."""
