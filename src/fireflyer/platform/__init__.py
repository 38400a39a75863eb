"""HAI Platform: a time-sharing scheduler for whole-node tasks, on emulated nodes or a Slurm cluster.

* The scheduler: :mod:`.policy` (the pure cycle: priorities, quotas, turn-taking, zones),
  :mod:`.store` (the SQLite state), :mod:`.daemon` (one cycle a tick), :mod:`.config`
  (``platform.json``), and :mod:`.simulate` (the policy over a synthetic day).
* Running attempts: :mod:`.executor` (the Protocol), :mod:`.local` and :mod:`.slurm`
  (the executors), :mod:`.supervisor` (one attempt's watch), :mod:`.starters` (how its
  ranks start), :mod:`.rank` (the rank shim), :mod:`.layout` (where things live on disk),
  :mod:`.accounts` (running tasks as their owners' Unix accounts).
* What users call: :mod:`.api` (the ``Api`` Protocol and :class:`~.api.PlatformApi`),
  :mod:`.remote` (the same over HTTP), :mod:`.server` (the HTTP server and dashboard), the
  commands in :mod:`.task_cli` and :mod:`.daemon_cli` (dispatched by :mod:`.cli`, printed
  by :mod:`.render`), and :mod:`.client` (what a task's own code calls: the suspend handshake).
* :mod:`.env`: the environment variables the platform sets and reads.
"""
