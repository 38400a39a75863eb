"""``fireflyer bench PART --help`` reads as plain text: no reStructuredText from the docstrings, help for every flag."""

from __future__ import annotations

import re

import pytest

from fireflyer.cli import BENCHES
from fireflyer.cliutil import doc_summary, plain_text
from fireflyer.testing.cli import fireflyer

MARKUP = re.compile(r"``|:(?:[a-z]+:)?(?:func|mod|class|meth|attr|data|ref|doc|exc|obj):`")


def options_without_help(text: str) -> list[str]:
    """The flags of an argparse ``--help`` whose entry has no help text."""
    section = text.split("options:\n", 1)[1]
    bare, entry = [], None
    for line in section.splitlines():
        if re.match(r"^  -", line):
            if entry is not None and not entry[1]:
                bare.append(entry[0])
            parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            entry = [parts[0], parts[1] if len(parts) > 1 else ""]
        elif entry is not None and line.startswith("    ") and line.strip():
            entry[1] += line.strip()
        elif not line.strip() or not line.startswith(" "):  # the end of the options (an epilog)
            if entry is not None and not entry[1]:
                bare.append(entry[0])
            entry = None
    if entry is not None and not entry[1]:
        bare.append(entry[0])
    return bare


def test_plain_text_takes_out_roles_and_literals():
    assert plain_text("``fireflyer bench x``: :func:`fireflyer.launch.run_local` and :class:`~a.b.MoEGPT`") == \
        "fireflyer bench x: fireflyer.launch.run_local and MoEGPT"
    assert plain_text(":ref:`the page <target>`, :py:meth:`f`, **bold**") == "the page, f, bold"
    assert doc_summary("``a``\nb  c\n\nmore") == "a b c"


def test_the_checker_finds_a_flag_without_help():
    text = "usage: x\n\noptions:\n  -h, --help   show\n  --json PATH\n  --png PATH   where\n                 it goes\n"
    assert options_without_help(text) == ["--json PATH"]


@pytest.mark.parametrize("args", [[part] for part in BENCHES] + [["allreduce", "--order", "canonical"]],
                         ids=lambda a: " ".join(a))
def test_bench_help_is_plain_text_with_help_for_every_flag(args):
    done = fireflyer("bench", *args, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: fireflyer bench"), done.stdout
    assert not MARKUP.search(done.stdout), done.stdout
    assert options_without_help(done.stdout) == [], done.stdout
