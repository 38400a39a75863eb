"""hfreduce as torchft's process group: ``ProcessGroupHFReduce``, reconfigured on every quorum change.

torchft (Meta's fault-tolerant training: a Lighthouse that forms a quorum of replica groups
every step, a ``Manager`` per replica group, live recovery from a healthy replica) drives a
process group through four calls beyond the collectives: ``configure`` (a new store prefix,
rank and world size for each quorum), ``abort`` (end what waits on a dead peer now),
``errored`` (an error that needs a new quorum) and ``shutdown``. This module gives it
:class:`~fireflyer.hfreduce.backend.process_group.HFReduceProcessGroup` behind that interface:

- ``configure`` aborts the previous quorum's group and builds a new one on the quorum's
  store, so every quorum has its own communicator, arena and sockets;
- ``abort`` fails every collective in flight here and on every live peer at once (hfreduce's
  own abort, as NCCL's), then releases threads, sockets and shared memory;
- ``errored`` reports the named hfreduce error (``PeerFailure``, ``CollectiveTimeout``) that
  failed the group, so the Manager does not commit a step computed with it.

torchft is an optional dependency (``pip install fireflyer[ft]``); importing this module
without it raises ImportError naming the extra.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("fireflyer.hfreduce.backend.fault_tolerance needs torchft: pip install 'fireflyer[ft]' "
                      f"(torchft==0.2.0); {exc}") from exc

import torch.distributed as dist

from fireflyer.hfreduce.config import HFReduceConfig
from fireflyer.hfreduce.errors import HFReduceError
from fireflyer.hfreduce.backend.process_group import HFReduceProcessGroup

__all__ = ["ProcessGroupHFReduce"]


class ProcessGroupHFReduce(ProcessGroupWrapper):
    """A reconfigurable hfreduce process group for ``torchft.Manager(pg=ProcessGroupHFReduce(), ...)``.

    ``timeout`` bounds each quorum's set-up (the store's waits) and is the collectives' default;
    ``config`` is hfreduce's (the canonical order, chunk sizes); its timeout is replaced by ``timeout``.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), config: HFReduceConfig | None = None) -> None:
        super().__init__(timeout=timeout)
        self._config = config

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        base = self._config if self._config is not None else HFReduceConfig.from_env()
        config = dataclasses.replace(base, timeout=self._timeout.total_seconds())
        # torchft names each member by its rank inside its own replica group (all 0 for one-rank groups): the
        # flight recorder's global ranks are kept only where they tell the members apart
        ranks = self._global_ranks
        if ranks is not None and (len(ranks) != world_size or len(set(ranks)) != world_size):
            ranks = None
        return HFReduceProcessGroup(store, rank, world_size, config=config,
                                    group_name=f"torchft-quorum-{self._quorum_id}", global_ranks=ranks)

    @property
    def quorum_id(self) -> int | None:
        """The quorum this group was last configured for (None before the first)."""
        return getattr(self, "_quorum_id", None)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "torchft-hfreduce"

    def abort(self, errored: bool = True) -> None:
        """End every collective in flight on this quorum's group, here and on the live peers, and drop the group."""
        pg = self._pg
        if isinstance(pg, HFReduceProcessGroup):
            pg.abort()
        super().abort(errored=errored)

    def shutdown(self) -> None:
        pg = self._pg
        if isinstance(pg, HFReduceProcessGroup):
            pg.shutdown()
        super().shutdown()

    def errored(self) -> Exception | None:
        """The hfreduce error that failed this quorum's group (a dead or absent peer, a timeout), or None."""
        pg = self._pg
        if isinstance(pg, HFReduceProcessGroup):
            error = pg.comm.error
            return error if isinstance(error, HFReduceError) else None
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        pg = self._pg
        if isinstance(pg, HFReduceProcessGroup):
            pg.set_timeout(timeout)
