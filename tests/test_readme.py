"""Every ```python block of README.md runs, in order, as one script.

The README's blocks build on each other (the first loads the models the later ones use), so
they share one namespace, as a reader pasting them into one session would. They run in a
temporary directory that links the shipped `models/`, so files the blocks write (slots,
results.jsonl) never land in the checkout. Keep the blocks cheap: small `max_new_tokens`,
the shipped models.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    """The README's ```python blocks, in order."""
    return [m.group(1) for m in _BLOCK.finditer(text)]


def test_readme_has_python_blocks() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3, "README.md lost its Python examples"
    assert all(block.strip() for block in blocks)


def test_readme_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models").symlink_to(ROOT / "models", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks(README.read_text()), 1):
        code = compile(block, f"README.md python block {i}", "exec")
        try:
            exec(code, namespace)  # the README's own examples
        except Exception as exc:  # name the block, keep the traceback
            raise AssertionError(f"README.md python block {i} failed:\n{block}") from exc
    assert os.path.exists("results.jsonl")
