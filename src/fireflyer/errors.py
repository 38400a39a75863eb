"""Exceptions shared by every part. Messages say what went wrong and what to do next."""


class FireflyerError(Exception):
    """Base class of fireflyer's own errors."""


class UserError(FireflyerError, ValueError):
    """Bad input from a user: a flag, a config field, a file. The CLI prints it as one line."""


class UserTypeError(UserError, TypeError):
    """Input of the wrong kind (a tensor of the wrong dtype, a string where a number belongs)."""


class CannotWrite(FireflyerError, OSError):
    """The system refused a write fireflyer needed: a folder it cannot create, a full disk, a
    read-only file system. The errno and the path are kept, so ``errno.ENOSPC`` handlers still work."""

    def __init__(self, path: object, exc: OSError) -> None:
        super().__init__(exc.errno, f"cannot write {path}: {exc.strerror or exc}")
        self.filename = str(path)

    def __str__(self) -> str:
        return str(self.strerror)


class UsageError(FireflyerError, RuntimeError):
    """An API called in a state that does not allow it (a closed wrapper, outside a platform task)."""


class TimedOut(FireflyerError, TimeoutError):
    """A bounded wait ran out: a job, a prefetch, a save in flight. The message says what was waited for."""


class NotPermitted(FireflyerError, PermissionError):
    """A file or folder that is not the owner's it must be, or a request fireflyer refuses on purpose."""


class JobFailed(FireflyerError, RuntimeError):
    """A job fireflyer started ended without what it had to produce; the message says where its logs are."""
