"""The package's import graph has no cycle, counting imports placed inside functions too (an
import moved into a function to dodge a cycle still ties the two modules together).

The graph is read from the sources with `ast`, independently of what Python happens to import
first: an edge A -> B for every `import specjax.B` / `from specjax[.x] import B` in A, at any
depth. `from specjax.pkg import name` counts as an edge to `specjax.pkg.name` when that is a
module, else to `specjax.pkg`; a package's `__init__` is a module like the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specjax"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: modules of the package it imports} for every .py file under `root`."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]  # fmt: skip
            for target in targets:
                while target and target not in files:  # `import specjax.x.y` -> nearest module
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("specjax"):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_finder_sees_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "specjax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from specjax import b\n")
    (pkg / "b.py").write_text("def f():\n    from specjax.a import g\n")
    (pkg / "c.py").write_text("import specjax.b\n")
    graph = module_graph(pkg)
    assert graph["specjax.c"] == {"specjax.b"}
    assert find_cycle(graph) == ["specjax.a", "specjax.b", "specjax.a"]


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_moved_module_keeps_its_old_name_with_a_warning() -> None:
    import importlib
    import sys
    import warnings

    import specjax
    from specjax.decode import engine

    for new in specjax.MOVED_MODULES.values():
        assert importlib.util.find_spec(new) is not None, new
    sys.modules.pop("specjax.engine", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("specjax.engine")
    assert old is engine
    assert any("specjax.engine moved to specjax.decode.engine" in str(w.message) for w in caught)
