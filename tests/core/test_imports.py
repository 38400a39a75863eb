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


def test_no_two_modules_import_each_other():
    graph = _imports(ROOT / "src")
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})
    assert not pairs, f"modules that import each other (even lazily): {pairs}"
