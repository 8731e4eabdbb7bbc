"""The `specjax` command: `generate` and its llama.cpp-style flags (`command`), `batch` jobs
(`batch`). The top of the house: imports `api` and `jobs`; nothing imports it."""

from specjax.cli.command import main

__all__ = ["main"]
