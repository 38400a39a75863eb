"""hfreduce's exceptions. Every failure a collective can meet ends in one of these, never a hang."""

from fireflyer.errors import FireflyerError


class HFReduceError(FireflyerError, RuntimeError):
    """A collective failed. The process group is unusable afterwards: tear it down and restart the job."""


class PeerFailure(HFReduceError):
    """A peer rank died, closed its connections, or aborted."""


class CollectiveTimeout(HFReduceError):
    """A collective did not finish within its timeout."""


class CollectiveMismatch(HFReduceError):
    """Ranks called different collectives, or the same one with different sizes, dtypes or ops."""
