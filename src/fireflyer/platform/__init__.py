"""HAI Platform: a time-sharing scheduler for whole-node tasks, on emulated nodes or a Slurm cluster.

In rooms, each importing only the rooms below it (the ``platform-layers`` contract):

* :mod:`.commands`: ``fireflyer platform ...`` and the task commands, over HTTP too, and how they print.
* :mod:`.server`: the HTTP API (one router) and the dashboard.
* :mod:`.scheduler`: the daemon (one cycle a tick) and the API users act through (:class:`~.scheduler.api.PlatformApi`).
* :mod:`.attempt`: one attempt on its nodes: its supervisor, how its ranks start, the rank shim, the replicas
  of a fault-tolerant task.
* :mod:`.executors`: where attempts run: the ``Executor`` Protocol, local and Slurm.
* :mod:`.state`: the SQLite store, the pure policy (priorities, quotas, turn-taking, zones), and the policy
  over a synthetic day.

Beside them: :mod:`.config` (``platform.json``), :mod:`.env` (the variables set and read), :mod:`.layout`
(where things live on disk), :mod:`.accounts` (tasks as their owners' Unix accounts) and :mod:`.client` (what
a task's own code calls: the suspend handshake).
"""
