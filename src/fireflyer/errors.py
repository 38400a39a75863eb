"""Exceptions shared by every part. Messages say what went wrong and what to do next."""


class FireflyerError(Exception):
    """Base class of fireflyer's own errors."""


class UserError(FireflyerError, ValueError):
    """Bad input from a user: a flag, a config field, a file. The CLI prints it as one line."""
