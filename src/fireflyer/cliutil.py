"""Shared pieces of the command line: an argument parser whose errors are one line, sizes read from flags,
plain-text descriptions from docstrings, and counted nouns."""

from __future__ import annotations

import argparse
import re

from fireflyer.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises :class:`UserError`, which ``fireflyer`` prints as one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see {self.prog} --help)")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, *, example: str = "64M", positive: bool = False) -> int:
    """Bytes from ``"1048576"``, ``"512K"``, ``"64M"``, ``"64MiB"``, ``"1G"`` (binary units); a flag's value.

    ``example`` is the size the error message suggests; ``positive``: 0 is refused too."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UserError(f"cannot read size {text!r}; write bytes or a number with K, M or G (e.g. {example})")
    value = float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower())
    if value != int(value) or positive and value < 1:
        raise UserError(f"size {text!r} is not a whole{', positive' if positive else ''} number of bytes")
    return int(value)


# :func:`name`, :class:`~pkg.mod.Name`, :meth:`text <target>`: a Sphinx role, with or without the domain (:py:func:).
_ROLE_RE = re.compile(r":(?:[a-z]+:)?[a-z]+:`([^`]*)`")
_LITERAL_RE = re.compile(r"``(.+?)``", re.DOTALL)
_STRONG_RE = re.compile(r"\*\*(.+?)\*\*", re.DOTALL)


def _role_text(m: re.Match) -> str:
    body = m.group(1).strip()
    titled = re.fullmatch(r"(.+?)\s*<[^<>]+>", body, re.DOTALL)
    if titled:  # :ref:`the text <target>` shows the text
        return titled.group(1)
    if body.startswith("~"):  # :class:`~a.b.Name` shows Name
        return body[1:].rsplit(".", 1)[-1]
    return body.lstrip("!")


def plain_text(text: str) -> str:
    """``text`` with its reStructuredText markup taken out, for a terminal.

    Roles (``:func:`x` ``, ``:class:`~a.b.C` ``) become their name, double backticks and
    bold stars are dropped; the words stay as written."""
    text = _ROLE_RE.sub(_role_text, text)
    text = _LITERAL_RE.sub(r"\1", text)
    return _STRONG_RE.sub(r"\1", text)


def doc_summary(doc: str | None) -> str:
    """A command's ``--help`` description from its module docstring: the first paragraph, as plain text."""
    first = (doc or "").strip().split("\n\n")[0]
    return plain_text(" ".join(first.split()))


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 node"``, ``"2 nodes"``, ``"0 nodes"``: a count and its noun, singular only for exactly one.

    ``nouns`` is the plural where adding ``s`` is wrong (``plural(n, "copy", "copies")``)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
