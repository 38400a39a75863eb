"""Shared pieces of the command line: an argument parser whose errors are one line."""

from __future__ import annotations

import argparse

from fireflyer.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises :class:`UserError`, which ``fireflyer`` prints as one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see {self.prog} --help)")
