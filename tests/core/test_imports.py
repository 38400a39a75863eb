"""The import rules of docs/architecture.md: import-linter's contracts in pyproject.toml, run on this tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RUN = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def test_import_contracts_hold():
    # A fresh interpreter with this tree's src first on the path, so the graph is of these files,
    # whatever is installed; no cache, so nothing is written into the repository.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"lint-imports: broken import rules (docs/architecture.md)\n{proc.stdout}{proc.stderr}"


def _imports(src: Path) -> dict[str, set[str]]:
    """Each module of fireflyer and the fireflyer modules it imports anywhere (lazily too), by ast."""
    import ast

    names = {}
    for path in (src / "fireflyer").rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for mod, path in names.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        seen = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                seen |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    seen.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base)
        graph[mod] = {m for m in seen if m in names and m != mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of any length: the strongly connected components of more than one module
    (Tarjan's algorithm, iterative, so a deep import chain cannot reach Python's recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            mod, deps = work[-1]
            for dep in deps:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph.get(dep, ())))))
                    break
                if dep in on_stack:
                    low[mod] = min(low[mod], index[dep])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[mod])
                if low[mod] == index[mod]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == mod:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_circles_of_every_length():
    assert _circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"a"}, "e": {"a"}}) == [["a", "b", "c", "d"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    long = {f"m{i}": {f"m{(i + 1) % 3000}"} for i in range(3000)}
    assert [len(c) for c in _circles(long)] == [3000]


def test_no_modules_import_each_other_in_a_circle():
    circles = _circles(_imports(ROOT / "src"))
    assert not circles, f"modules that import each other in a circle (even lazily): {circles}"
