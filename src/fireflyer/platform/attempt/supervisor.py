"""``python -m fireflyer.platform.attempt.supervisor ATTEMPT_DIR [--slurm]``: one attempt's manager.

HAI Platform runs a manager per task; this is ours. It starts the attempt's ranks, then
watches them until the attempt ends, and writes how it ended to ``status.json``:

* **all ranks exit 0**: ``STOP`` (the task is done);
* **a rank fails**: other failures are collected for :data:`COLLECT_S`, then every rank
  is stopped: ``FAILED`` (the daemon restarts it from its checkpoint, up to a limit);
* **suspend** (``control/suspend``, written by the daemon, or SIGTERM/SIGUSR1 from Slurm):
  the job must acknowledge within ``suspend_ack`` seconds (``receive_suspend_command``)
  or it is stopped; once it has, it has ``suspend_grace`` more seconds to save and call
  ``go_suspend``, and is stopped when it does or when time runs out: ``INTERRUPT``;
* **stop** (``control/stop``, a user's stop): ``MANUAL_STOP``;
* **no output** from any rank for ``watchdog`` seconds: ``FAILED | TIMEOUT``;
* **ranks that never all start** within ``unschedulable`` seconds, or a node prolog that
  times out: ``UNSCHEDULABLE``; a node whose prolog (health check) fails: ``HOOK_RESTART``
  with that node named, so the daemon drains it.

The supervisor runs in its own session, so it survives a scheduler killed with -9; the
daemon finds it again by its handle and reads ``status.json`` when it is done.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from fireflyer import lifetime
from fireflyer.errors import FireflyerError
from fireflyer.platform import env as names
from fireflyer.platform.executors.base import Launch
from fireflyer.platform.layout import AttemptDir, read_json, write_json
from fireflyer.platform.attempt.starters import Procs, Starter, local_ranks
from fireflyer.platform.state.store import StopCode, stop_text

COLLECT_S = 2.0
"""After a first rank failure, how long to wait for others (their exit codes tell more)."""
POLL_S = 0.05
WATCHDOG_EVERY_S = 1.0
"""How often the log-silence watchdog looks at the ranks' logs."""


def stop_processes(procs: list[tuple[str, subprocess.Popen]], grace: float, exit_codes: dict[str, int]) -> None:
    """Stop each ``(label, process)``'s process group: SIGTERM, then SIGKILL after ``grace`` seconds; the codes
    of those that ended go into ``exit_codes`` (a code already there is kept)."""
    alive = [p for _, p in procs if p.poll() is None]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(POLL_S)
        alive = [p for p in alive if p.poll() is None]
        if not alive:
            break
    for label, p in procs:
        if p.poll() is not None:
            exit_codes.setdefault(label, p.returncode)

class Supervisor:
    def __init__(self, adir: AttemptDir, launch: Launch, starter: Starter = local_ranks) -> None:
        self.adir, self.launch, self.starter = adir, launch, starter
        self.t = launch.timeouts
        self.procs: Procs = []
        self.exit_codes: dict[str, int] = {}
        self._signalled: str | None = None
        self._first_failure: float | None = None

    # ------------------------------------------------------------------ edges
    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signalled = signal.Signals(signum).name
        try:
            self.adir.raise_flag("suspend", f"signal {self._signalled}")
        except OSError:  # a full disk: the watch takes the signal itself as the request
            pass

    def _prologs(self) -> tuple[StopCode, str, list[str]] | None:
        for node in self.launch.nodes:
            failed = self._prolog(node)
            if failed is not None:
                return failed
        return None

    def _prolog(self, node: str) -> tuple[StopCode, str, list[str]] | None:
        """Run the node health check for ``node``; None when it passed (or there is none), else how it failed."""
        if not self.launch.prolog:
            return None
        env = {**os.environ, **self.launch.env, names.NODE_ID: node}
        try:
            done = subprocess.run(list(self.launch.prolog), env=env, cwd=self.launch.cwd, capture_output=True,
                                  text=True, timeout=self.t.unschedulable)
        except subprocess.TimeoutExpired:
            return StopCode.UNSCHEDULABLE, f"node {node}: prolog did not finish in {self.t.unschedulable:g} s", []
        except OSError as exc:
            return StopCode.INIT_FAILED, f"prolog {self.launch.prolog[0]!r} could not start: {exc.strerror}", []
        if done.returncode != 0:
            why = (done.stdout + done.stderr).strip().splitlines()
            return (StopCode.HOOK_RESTART, f"node {node} failed its health check (exit {done.returncode})"
                    f"{': ' + why[-1] if why else ''}", [node])
        return None

    def _last_output(self, since: float) -> float:
        last = since
        for log in self.adir.rank_logs():
            try:
                last = max(last, log.stat().st_mtime)
            except FileNotFoundError:
                pass
        return last

    def _all_started(self) -> bool:
        return all(self.adir.started_marker(r).exists() for r in range(self.launch.world_size))

    def _stop_ranks(self) -> None:
        stop_processes(self.procs, self.t.kill_grace, self.exit_codes)

    # ------------------------------------------------------------------ the watch
    def _start(self) -> None:
        """Start the attempt's ranks (``self.procs``)."""
        self.procs = self.starter(self.launch, self.adir)

    def _ranks_ended(self, now: float) -> tuple[StopCode, str] | None:
        """How the ranks ended the attempt: ``STOP`` when all exited 0, ``FAILED`` when one failed (after
        :data:`COLLECT_S` for the others' codes); None while they run."""
        for label, p in self.procs:
            if label not in self.exit_codes and p.poll() is not None:
                self.exit_codes[label] = p.returncode
        failed = {k: c for k, c in self.exit_codes.items() if c != 0}
        if failed:
            self._first_failure = now if self._first_failure is None else self._first_failure
            if len(self.exit_codes) == len(self.procs) or now - self._first_failure > COLLECT_S:
                label, code = min(failed.items(), key=lambda kv: _rank_order(kv[0]))
                more = f" ({len(failed)} of {len(self.procs)} failed)" if len(failed) > 1 else ""
                return StopCode.FAILED, f"{label} {exit_text(code)}{more}"
        elif len(self.exit_codes) == len(self.procs):
            return StopCode.STOP, "all ranks exited 0"
        return None

    def _watch(self) -> tuple[StopCode, str]:
        t0_wall, t0 = time.time(), time.monotonic()
        suspend_at: float | None = None
        all_started = False
        next_watchdog = t0
        while True:
            now = time.monotonic()
            if self.adir.has_flag("stop"):
                return StopCode.MANUAL_STOP, "stopped by its user"
            if suspend_at is None and (self._signalled or self.adir.has_flag("suspend")):
                suspend_at = now
            received = self.adir.has_flag("received")
            if suspend_at is not None:
                if self.adir.has_flag("can_suspend"):
                    return StopCode.INTERRUPT, "suspended: the job saved and called go_suspend"
                if not received and now - suspend_at > self.t.suspend_ack:
                    return StopCode.INTERRUPT, (f"suspended without acknowledgement in {self.t.suspend_ack:g} s: "
                                                "stopped, progress since its last checkpoint is lost")
                if received and now - suspend_at > self.t.suspend_ack + self.t.suspend_grace:
                    return StopCode.INTERRUPT, (f"suspended: the job acknowledged but did not call go_suspend "
                                                f"within {self.t.suspend_grace:g} s of grace; stopped")
            ended = self._ranks_ended(now)
            if ended is not None:
                if ended[0] == StopCode.STOP and suspend_at is not None and received:
                    return StopCode.INTERRUPT, "suspended: the job acknowledged and exited"
                return ended
            if not all_started and now - t0 > self.t.unschedulable:
                all_started = self._all_started()
                if not all_started:
                    missing = [r for r in range(self.launch.world_size)
                               if not self.adir.started_marker(r).exists()]
                    return StopCode.UNSCHEDULABLE, (f"ranks {_span(missing)} did not start within "
                                                    f"{self.t.unschedulable:g} s")
            if now >= next_watchdog:  # log mtimes: a stat per rank, so once a second is plenty
                next_watchdog = now + WATCHDOG_EVERY_S
                silent = time.time() - self._last_output(t0_wall)
                if silent > self.t.watchdog:
                    return StopCode.FAILED | StopCode.TIMEOUT, f"no output from any rank for {silent:.0f} s (watchdog)"
            time.sleep(POLL_S)

    def run(self) -> dict:
        started_at = time.time()
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        code, detail, failed_nodes = self._run_attempt(started_at)
        status = {
            "stop_code": int(code), "stop": stop_text(code), "detail": detail, "exit_codes": self.exit_codes,
            "failed_nodes": failed_nodes, "whole_life_state": read_whole_life_state(self.adir),
            "started_at": started_at, "finished_at": time.time(), "signal": self._signalled,
        }
        record_status(self.adir, status)
        return status

    def _run_attempt(self, started_at: float) -> tuple[StopCode, str, list[str]]:
        try:
            self.adir.create()
            write_json(self.adir.supervisor, {"pid": os.getpid(), "host": socket.gethostname(),
                                              "started_at": started_at}, sort_keys=True)
        except OSError as exc:  # a full disk: nothing ran, so nothing counts against the task
            return StopCode.UNSCHEDULABLE, f"could not record its start: {exc.strerror}", []
        prolog = self._prologs()
        if prolog is not None:
            return prolog
        # every process of the attempt carries one mark (the starter passes this process's environment on),
        # so whatever a rank started, in a session of its own too, is swept when the ranks are stopped
        mark = os.environ[lifetime.MARK] = lifetime.child_mark()
        try:
            self._start()
        except (OSError, ValueError, subprocess.SubprocessError, FireflyerError) as exc:
            self._stop_ranks()
            self.procs = []
            lifetime.sweep(mark)
            return StopCode.INIT_FAILED | StopCode.UNSCHEDULABLE, f"ranks could not start: {exc}", []
        try:
            code, detail = self._watch()
        finally:
            self._stop_ranks()
            lifetime.sweep(mark)
        return code, detail, []


RECORD_RETRY_S = 2.0


def record_status(adir: AttemptDir, status: dict) -> None:
    """Write how the attempt ended, however long the disk stays full.

    The ranks have stopped already; the daemon waits for a supervisor that is alive, so
    the end is recorded as it was once there is room, never turned into a lost attempt.
    """
    told = False
    while True:
        try:
            write_json(adir.status, status, sort_keys=True)
            return
        except OSError as exc:
            if not told:
                try:  # stderr is the supervisor's log, on the same disk
                    print(f"fireflyer supervisor: cannot write {adir.status} ({exc.strerror}); retrying every "
                          f"{RECORD_RETRY_S:g} s", file=sys.stderr, flush=True)
                except OSError:
                    pass
                told = True
            time.sleep(RECORD_RETRY_S)


_SIGNALS = {s.value for s in signal.Signals}


def exit_text(code: int) -> str:
    """``was killed by SIGKILL`` or ``exited with code 3``."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in _SIGNALS \
        else f"exited with code {code}"


def _rank_order(label: str) -> int:
    digits = label.removeprefix("rank")
    return int(digits) if digits.isdigit() else -1


def _span(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def read_whole_life_state(adir: AttemptDir) -> int | None:
    try:
        return int(adir.flag("whole_life_state").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def read_spec(adir: AttemptDir) -> dict | None:
    """The attempt's spec, or None: it already ended (a Slurm requeue of a finished attempt: nothing to do), or it
    has no spec (its end is then recorded as such)."""
    if read_json(adir.status) is not None:
        return None
    spec = read_json(adir.spec)
    if spec is None:
        record_status(adir, {"stop_code": int(StopCode.FAILED | StopCode.INIT_FAILED),
                             "detail": f"no spec.json in {adir.root}", "exit_codes": {}, "failed_nodes": [],
                             "whole_life_state": None})
    return spec


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m fireflyer.platform.attempt.supervisor ATTEMPT_DIR [--slurm]", file=sys.stderr)
        return 2
    adir = AttemptDir(Path(args[0]))
    starter: Starter = local_ranks
    if "--slurm" in args[1:]:
        from fireflyer.platform.attempt.starters import srun_ranks

        starter = srun_ranks
    spec = read_spec(adir)
    if spec is None:
        return 0 if read_json(adir.status) is not None else 1
    Supervisor(adir, Launch.from_json(spec), starter).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
