"""hfreduce's exceptions. Every failure a collective can meet ends in one of these, never a hang."""

from fireflyer.errors import FireflyerError


class HFReduceError(FireflyerError, RuntimeError):
    """A collective failed. The process group is unusable afterwards: tear it down and restart the job."""

    #: True when another rank found this error and this rank only passed it on (:func:`error_from_text`):
    #: its diagnosis, and telling the other ranks, were that rank's work.
    relayed: bool = False


class PeerFailure(HFReduceError):
    """A peer rank died, closed its connections, or aborted."""

    #: True when this rank only saw a symptom (a closed connection) whose cause may be
    #: reported by another rank; the engine waits briefly for that report before raising.
    secondary: bool = False


class ConnectionLost(PeerFailure):
    """A link to a peer closed. The peer died, or aborted for a reason it reports separately."""

    secondary = True


class CollectiveTimeout(HFReduceError):
    """A collective did not finish within its timeout."""


class CollectiveMismatch(HFReduceError):
    """Ranks called different collectives, or the same one with different sizes, dtypes or ops."""


_BY_NAME = {cls.__name__: cls for cls in (HFReduceError, PeerFailure, ConnectionLost, CollectiveTimeout, CollectiveMismatch)}


def error_to_text(exc: HFReduceError) -> str:
    """Serialise an error to pass it to other ranks: ``"ClassName|message"``."""
    return f"{type(exc).__name__}|{exc}"


def error_from_text(text: str, default: type[HFReduceError] = PeerFailure) -> HFReduceError:
    """Rebuild an error passed on by another rank, keeping its class."""
    name, sep, msg = text.partition("|")
    error = _BY_NAME[name](msg) if sep and name in _BY_NAME else default(text)
    error.relayed = True
    return error


def fresh(error: BaseException) -> BaseException:
    """A new exception of the same class and message.

    A group's first error is handed to every later collective; raising one object again
    and again would grow its traceback with every raise (and torch formats it whole each
    time an error crosses its C++), so each caller gets its own copy.
    """
    try:
        copy = type(error)(*error.args)
    except Exception:  # noqa: BLE001 - a class with an unusual constructor: hand out the original
        return error
    copy.__cause__ = error.__cause__
    if getattr(error, "relayed", False):
        copy.relayed = True
    return copy
