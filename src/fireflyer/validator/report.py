"""The validator's report: a JSON document for machines, a table for people."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any

from fireflyer.validator.drain import DrainOutcome
from fireflyer.validator.grading import CheckResult, Status, exit_code

STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


@dataclass(kw_only=True)
class Report:
    """One validator run on one node."""

    profile: str
    profile_source: str
    quick: bool
    started: datetime
    results: list[CheckResult]
    status: Status
    seconds: float
    node: str = field(default_factory=socket.gethostname)
    drain: DrainOutcome | None = None

    @property
    def exit_code(self) -> int:
        return exit_code(self.status)

    def failure_reason(self) -> str:
        """One line naming the failed checks and why: the drain reason."""
        bad = [r for r in self.results if r.status == self.status and r.status in (Status.FAIL, Status.WARN)]
        return "fireflyer validate: " + "; ".join(f"{r.name}: {r.reason}" for r in bad)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "node": self.node, "profile": self.profile, "profile_source": self.profile_source,
            "quick": self.quick, "started": self.started.isoformat(timespec="seconds"),
            "seconds": round(self.seconds, 3), "status": str(self.status), "exit_code": self.exit_code,
            "counts": {str(s): sum(1 for r in self.results if r.status == s) for s in Status},
            "checks": [r.to_json() for r in self.results],
        }
        if self.drain is not None:
            doc["drain"] = {"argv": self.drain.argv, "returncode": self.drain.returncode, "output": self.drain.output}
        return doc

    def write_json(self, stream: IO[str]) -> None:
        json.dump(self.to_json(), stream, indent=2)
        stream.write("\n")

    def print_table(self, stream: IO[str] | None = None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = Console(file=stream, highlight=False)
        table = Table(title=f"fireflyer validate on {self.node} (profile {self.profile}"
                            + (", quick" if self.quick else "") + ")", title_justify="left")
        for col, kw in (("check", {}), ("status", {}), ("measured", {"justify": "right"}),
                        ("expected", {"justify": "right"}), ("reason", {"ratio": 1}), ("time", {"justify": "right"})):
            table.add_column(col, **kw)
        for r in self.results:
            measured = "\n".join(f"{m.name} {m.value:.4g} {m.unit}" for m in r.metrics)
            expected = "\n".join(f"{m.expected:.4g}" if m.expected is not None else "-" for m in r.metrics)
            table.add_row(r.name, f"[{STYLE[r.status]}]{r.status}[/]", measured, expected, r.reason,
                          f"{r.seconds:.1f}s", end_section=False)
        console.print(table)
        console.print(f"node status: [{STYLE[self.status]}]{self.status}[/] (exit {self.exit_code}) "
                      f"in {self.seconds:.1f}s")
        if self.drain is not None:
            console.print(f"drain hook {self.drain.argv[0]}: exit {self.drain.returncode} {self.drain.output}")
