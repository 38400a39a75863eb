"""The documents: the site builds with ``mkdocs build --strict``, and every repository path they name exists."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_site_builds_strict(tmp_path):
    # --strict: a broken link, a missing figure, a page outside the nav's files or a docstring
    # mkdocstrings cannot read is a warning, and any warning fails the build.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "hfreduce" / "index.html").is_file()


# `src/...`, `tests/...`, `benchmarks/...`, `docs/...` or `.ci/...` in backticks, possibly with a glob.
_PATH = re.compile(r"`((?:src|tests|benchmarks|docs|\.ci)/[\w.*/-]+)`")
# `python -m fireflyer.x.y` in backticks or a code block.
_MODULE = re.compile(r"python3? -m (fireflyer(?:\.\w+)*)")
# A relative Markdown link or image, ](target) or ](target#anchor); mkdocs checks docs/, this the README too.
_LINK = re.compile(r"\]\((?![a-z]+:|#)([^)#\s]+)")


def _named(page: Path) -> tuple[set[str], set[str]]:
    text = page.read_text()
    links = {os.path.relpath(os.path.normpath(page.parent / t), ROOT) for t in _LINK.findall(text)}
    return set(_PATH.findall(text)) | links, set(_MODULE.findall(text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page):
    paths, modules = _named(page)
    missing = [p for p in sorted(paths) if not glob.glob(str(ROOT / p.rstrip("/")))]
    for mod in sorted(modules):
        base = ROOT / "src" / Path(*mod.split("."))
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            missing.append(f"python -m {mod}")
    assert not missing, f"{page.relative_to(ROOT)} names what this tree does not have: {missing}"
