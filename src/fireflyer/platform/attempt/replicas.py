"""``python -m fireflyer.platform.attempt.replicas ATTEMPT_DIR``: a fault-tolerant attempt's manager: every node a torchft replica group, a lost node replaced.

A task submitted with ``--fault-tolerant`` runs each of its nodes as a replica of the job
(``fireflyer train --fault-tolerant``'s design, :mod:`fireflyer.train.fault_tolerant`): the
supervisor starts torchft's Lighthouse for the attempt, then each node's ranks as a
torch.distributed world of their own, which find the others through the Lighthouse. When a
replica's ranks die (its node died) or its node is drained, only that replica ends: the others
go on in a smaller quorum, and the attempt is not failed. The daemon then grants a healthy free
node (:class:`~fireflyer.platform.state.policy.Decisions` ``grants``); the supervisor runs the node's
health check (the platform's ``prolog``) and starts the replica there, which loads the newest
checkpoint, joins the quorum and heals from a live replica.

The daemon and the supervisor talk through the attempt's folder, as for every attempt:

* ``replicas.json`` (the supervisor's): each replica's slot, node, start, state and detail, the
  nodes that failed their check when granted (``rejected``), and the Lighthouse's last quorum;
* ``control/release.SLOT`` (the daemon's): the replica's node was drained, stop it;
* ``control/replace.SLOT.START`` (the daemon's, holding a node's name): start the lost replica there.

The attempt ends ``STOP`` once no replica runs and one finished (its ranks exited 0), and
``FAILED`` (restarted from its checkpoint as any failed task) once every replica was lost.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fireflyer.platform import env as names
from fireflyer.platform.executors.base import Launch
from fireflyer.platform.layout import AttemptDir, write_json
from fireflyer.platform.attempt.starters import Procs, replica_ranks
from fireflyer.platform.state.store import StopCode
from fireflyer.platform.attempt.supervisor import Supervisor, exit_text, read_spec, stop_processes
from fireflyer.lighthouse import start_lighthouse
from fireflyer.ports import free_port

QUORUM_EVERY_S = 1.0
"""How often the supervisor reads the Lighthouse's status for the quorum it shows."""
LOSE_GRACE_S = 2.0
"""A lost replica's remaining ranks get this long after SIGTERM before SIGKILL."""
_QUORUM_ID = re.compile(r"Current quorum_id:\s*(-?\d+)")
_MEMBER = re.compile(r"(node\d+):[0-9a-f]{8}-[0-9a-f]{4}-")


def parse_status(html: str) -> dict | None:
    """The Lighthouse's ``/status`` page as ``{"id": quorum id, "replicas": [node0, ...]}``: the replicas of
    its last quorum (each named by its slot, ``node{slot}``); None when the page is not what torchft 0.2 serves."""
    found = _QUORUM_ID.search(html)
    if found is None:
        return None
    part = html.split("Previous Quorum", 1)[1] if "Previous Quorum" in html else ""
    part = part.split("Heartbeats", 1)[0]
    members = sorted(set(_MEMBER.findall(part)), key=lambda n: int(n[4:]))
    return {"id": int(found.group(1)), "replicas": members}


@dataclass
class Replica:
    """One replica of the attempt, as its supervisor sees it."""

    slot: int
    node: str
    start: int = 0
    state: str = "starting"
    """``running``, ``done`` (its ranks exited 0), ``lost``."""
    started_at: float | None = None
    ended_at: float | None = None
    detail: str = ""
    procs: Procs = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        return {"slot": self.slot, "node": self.node, "start": self.start, "state": self.state,
                "started_at": self.started_at, "ended_at": self.ended_at, "detail": self.detail}


class ReplicaSupervisor(Supervisor):
    """The :class:`~fireflyer.platform.attempt.supervisor.Supervisor` of a fault-tolerant attempt (local executor)."""

    def __init__(self, adir: AttemptDir, launch: Launch) -> None:
        super().__init__(adir, launch)
        self.replicas: list[Replica] = []
        self.rejected: list[dict] = []
        self.lighthouse: subprocess.Popen | None = None
        self.address = ""
        self.quorum: dict | None = None
        self._handled: set[str] = set()
        self._quorum_at = 0.0

    @property
    def record(self) -> Path:
        return self.adir.root / "replicas.json"

    # ------------------------------------------------------------------ starting
    def _start(self) -> None:
        self.lighthouse, self.address = start_lighthouse(self.adir.logs / "lighthouse.log",
                                                         wait_s=self.t.unschedulable)
        (self.adir.root / "ft" / "ready").mkdir(parents=True, exist_ok=True)
        self.replicas = [Replica(slot=i, node=node) for i, node in enumerate(self.launch.nodes)]
        for r in self.replicas:
            self._start_replica(r)
        self._write()

    def _start_replica(self, r: Replica) -> None:
        extra = {names.LIGHTHOUSE: self.address, names.FT_READY: str(self.adir.root / "ft" / "ready"),
                 "RUST_LOG": "warn"}
        r.procs = replica_ranks(self.launch, self.adir, slot=r.slot, node=r.node, start=r.start,
                                master_port=free_port(), extra=extra)
        self.procs += r.procs
        r.state, r.started_at, r.ended_at, r.detail = "running", time.time(), None, ""

    def _write(self) -> None:
        try:
            write_json(self.record, {"lighthouse": self.address, "at": time.time(), "quorum": self.quorum,
                                     "replicas": [r.to_json() for r in self.replicas],
                                     "rejected": self.rejected}, sort_keys=True)
        except OSError as exc:  # a full disk: the next change writes it again
            print(f"fireflyer supervisor: cannot write {self.record}: {exc.strerror}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the watch
    def _ranks_ended(self, now: float) -> tuple[StopCode, str] | None:
        changed = self._requests()
        for r in self.replicas:
            if r.state != "running":
                continue
            codes = [(label, p.poll()) for label, p in r.procs]
            for label, code in codes:
                if code is not None:
                    self.exit_codes[label] = code
            failed = [(label, code) for label, code in codes if code not in (None, 0)]
            if failed:
                label, code = failed[0]
                self._lose(r, f"{label} {exit_text(code)}")
                changed = True
            elif all(code == 0 for _, code in codes):
                r.state, r.ended_at = "done", time.time()
                changed = True
        if now - self._quorum_at >= QUORUM_EVERY_S:
            self._quorum_at = now
            changed |= self._read_quorum()
        if changed:
            self._write()
        if any(r.state == "running" for r in self.replicas):
            return None
        replaced = sum(r.start for r in self.replicas)
        if any(r.state == "done" for r in self.replicas):
            return StopCode.STOP, "all replicas finished" + (f" ({replaced} replaced on the way)" if replaced else "")
        lost = "; ".join(f"replica {r.slot} on {r.node}: {r.detail}" for r in self.replicas)
        return StopCode.FAILED, f"every replica was lost ({lost})"

    def _requests(self) -> bool:
        """The daemon's ``release`` and ``replace`` requests not yet acted on; whether anything changed."""
        try:
            names_ = sorted(n for n in os.listdir(self.adir.control) if n.startswith(("release.", "replace.")))
        except OSError:
            return False
        changed = False
        for name in names_:
            if name in self._handled:
                continue
            self._handled.add(name)
            try:
                text = self.adir.flag(name).read_text().strip()
                parts = name.split(".")
                r = self.replicas[int(parts[1])]
            except (OSError, ValueError, IndexError):
                continue
            if parts[0] == "release" and r.state == "running":
                self._lose(r, text or f"its node {r.node} was drained")
                changed = True
            elif parts[0] == "replace" and r.state == "lost" and len(parts) == 3 and text:
                changed |= self._replace(r, int(parts[2]), text)
        return changed

    def _replace(self, r: Replica, start: int, node: str) -> bool:
        """Start lost replica ``r`` on ``node`` once the node passes its health check."""
        failed = self._prolog(node)
        if failed is not None:
            _, detail, _ = failed
            self.rejected.append({"slot": r.slot, "start": start, "node": node, "detail": detail, "at": time.time()})
            return True
        r.node, r.start = node, start
        try:
            self._start_replica(r)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            r.state, r.ended_at, r.detail = "lost", time.time(), f"its ranks could not start on {node}: {exc}"
        return True

    def _lose(self, r: Replica, detail: str) -> None:
        """End replica ``r``: its ranks still running get SIGTERM, then SIGKILL after :data:`LOSE_GRACE_S`."""
        stop_processes(r.procs, LOSE_GRACE_S, self.exit_codes)
        r.state, r.ended_at, r.detail = "lost", time.time(), detail

    def _read_quorum(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.address}/status", timeout=1) as answer:
                quorum = parse_status(answer.read(1 << 20).decode(errors="replace"))
        except (OSError, ValueError):
            return False
        if quorum is None or (self.quorum is not None and {**quorum, "at": 0} == {**self.quorum, "at": 0}):
            return False
        self.quorum = {**quorum, "at": time.time()}
        return True

    def _stop_ranks(self) -> None:
        try:
            super()._stop_ranks()
        finally:
            if self.lighthouse is not None and self.lighthouse.poll() is None:
                self.lighthouse.kill()
                self.lighthouse.wait()
            if self.replicas:
                for r in self.replicas:
                    if r.state == "running":
                        r.state, r.ended_at = "stopped", time.time()
                self._write()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m fireflyer.platform.attempt.replicas ATTEMPT_DIR", file=sys.stderr)
        return 2
    adir = AttemptDir(Path(args[0]))
    spec = read_spec(adir)
    if spec is None:
        return 0 if adir.status.exists() else 1
    ReplicaSupervisor(adir, Launch.from_json(spec)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
