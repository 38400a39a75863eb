"""Shared pieces of the command line: an argument parser whose errors are one line, and sizes read from flags."""

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
