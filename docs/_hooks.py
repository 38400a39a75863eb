"""mkdocs hooks for the fireflyer site (mkdocs.yml names this file; it is not a page).

* The benchmarks write their figures to ``benchmarks/results/``, outside ``docs/``. The pages link
  them as ``../benchmarks/results/NAME.png``, which is right on GitHub too; here those files are
  added to the site under ``benchmarks/results/`` so the same links resolve in the build.
* Docstrings use Sphinx roles (``:class:`~fireflyer.x.Y```), which Markdown shows as the role's
  name before the code; the role is dropped and ``~`` keeps the last name, as Sphinx does.
"""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File, InclusionLevel

_OUTSIDE = ("benchmarks/results",)  # repository folders whose files the pages may link to
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def on_files(files, config):
    root = os.path.dirname(config.config_file_path)
    for folder in _OUTSIDE:
        base = os.path.join(root, folder)
        if not os.path.isdir(base):
            continue
        for name in sorted(os.listdir(base)):
            if name.startswith("."):
                continue
            f = File(f"../{folder}/{name}", config.docs_dir, config.site_dir, config.use_directory_urls,
                     dest_uri=f"{folder}/{name}", inclusion=InclusionLevel.INCLUDED)
            files.append(f)
    return files


def _role(match: re.Match) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html, page, config, files):
    return _ROLE.sub(_role, html)
