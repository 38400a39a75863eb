"""Rank 0's live view of training: a rich progress bar on a terminal, plain lines otherwise.

Each step reports the global loss (the mean over all ranks), global tokens per second
over the last ten steps (step time only; evaluation and saving are left out), and the
allreduce bandwidth DDP saw so far: bytes each rank reduced / seconds from a step's
first bucket launch to its last bucket's completion. That span includes waiting for
the slowest rank to finish its backward, so on an oversubscribed host it reads low.
Other ranks get :class:`Silent`.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Protocol, TextIO


@dataclass(frozen=True)
class StepStats:
    """What the bar shows after one step."""

    step: int
    loss: float
    lr: float
    tokens_per_s: float
    allreduce_gbps: float
    imbalance: float | None = None
    """MoE: the busiest expert's tokens over the mean, worst layer (None for a dense model)."""


class Progress(Protocol):
    def update(self, stats: StepStats) -> None: ...
    def note(self, text: str) -> None: ...
    def close(self) -> None: ...


class Silent:
    """Progress for ranks other than 0: reports nothing."""

    def update(self, stats: StepStats) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class PlainLines:
    """One line every ``every`` steps (and on the last one), for logs and pipes."""

    def __init__(self, *, first: int, total: int, every: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.every = max(1, every)
        self.first = first
        self.stream = stream or sys.stdout

    def update(self, s: StepStats) -> None:
        if s.step % self.every == 0 or s.step in (self.first, self.total):
            print(f"step {s.step:>{len(str(self.total))}}/{self.total}  loss {s.loss:.4f}  lr {s.lr:.2e}  "
                  f"{_rate(s.tokens_per_s)} tok/s  allreduce {s.allreduce_gbps:.2f} GB/s{_experts(s)}",
                  file=self.stream, flush=True)

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class RichBar:
    """A rich progress bar with loss, tokens/s and allreduce GB/s; notes print above it."""

    def __init__(self, *, first: int, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=None),
            MofNCompleteColumn(),
            TextColumn("loss [bold cyan]{task.fields[loss]}"),
            TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("allreduce {task.fields[gbps]} GB/s{task.fields[experts]}"),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=sys.stdout),
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total, completed=first - 1, loss="-", rate="-", gbps="-",
                                            experts="")
        self._progress.start()

    def update(self, s: StepStats) -> None:
        self._progress.update(self._task, completed=s.step, loss=f"{s.loss:.3f}", rate=_rate(s.tokens_per_s),
                              gbps=f"{s.allreduce_gbps:.2f}", experts=_experts(s))

    def note(self, text: str) -> None:
        self._progress.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        self._progress.stop()


class Throughput:
    """Tokens per second over the last ``window`` steps, counting step time only (not evaluation or saving)."""

    def __init__(self, window: int = 10) -> None:
        self._seconds: deque[float] = deque(maxlen=window)
        self._tokens: deque[int] = deque(maxlen=window)

    def add(self, seconds: float, tokens: int) -> float:
        """Record one step; return the rate over the window."""
        self._seconds.append(seconds)
        self._tokens.append(tokens)
        total = sum(self._seconds)
        return sum(self._tokens) / total if total > 0 else 0.0


def make_progress(*, rank: int, first: int, total: int) -> Progress:
    """The right progress for this rank: a bar on rank 0 at a terminal, plain lines on rank 0 otherwise."""
    if rank != 0:
        return Silent()
    if sys.stdout.isatty():
        return RichBar(first=first, total=total)
    return PlainLines(first=first, total=total, every=max(1, total // 20))


def _experts(s: StepStats) -> str:
    return "" if s.imbalance is None else f"  experts imbalance {s.imbalance:.2f}"


def _rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"
