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
