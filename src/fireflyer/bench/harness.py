"""The one harness every ``fireflyer bench <part>`` shares.

The machine a benchmark ran on, the result document's head (when, the command, the
machine), JSON and PNG written atomically through :mod:`fireflyer.fsutil`, a figure to draw
on, a rich console wide enough for the tables and a line of progress, sizes as people write
them, and the rounds' arithmetic (each op's time is its slowest rank's; figures are medians).
The run every benchmark shares is :mod:`fireflyer.bench.skeleton`'s. No torch at import time:
``fireflyer bench <part> --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform as _platform
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from fireflyer import fsutil, lifetime
from fireflyer.errors import UserError

MiB = 1 << 20


# -- the machine and the result document ---------------------------------------------


def machine_info(*, torch: bool = True) -> dict[str, Any]:
    """Host, OS, Python, core count, CPU model and memory; torch's version too unless ``torch=False``
    (benchmarks that never import torch leave it out)."""
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": _platform.platform(),
                            "python": _platform.python_version()}
    if torch:
        import torch as _torch

        info["torch"] = _torch.__version__
    info["cpu_count"] = os.cpu_count()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        if torch:
            with open("/proc/meminfo", encoding="utf-8") as f:
                info["mem_total_kib"] = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    return info


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where /proc/loadavg cannot be read."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def timestamp() -> str:
    """Now, UTC, to the second (ISO 8601): when a result was measured."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def bench_command(part: str, argv: Iterable[str]) -> list[str]:
    """The command line of ``fireflyer bench PART ARGV...``, as a result document records it."""
    return ["fireflyer", "bench", part, *argv]


def document(command: list[str], *, torch: bool = True, **fields: Any) -> dict[str, Any]:
    """A result document: ``timestamp``, ``command`` and ``machine`` first, then ``fields`` in order."""
    return {"timestamp": timestamp(), "command": command, "machine": machine_info(torch=torch), **fields}


# -- writing results ----------------------------------------------------------------------


def atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Write via a temporary file, fsync, rename: readers never see a half-written file."""
    fsutil.atomic_write(path, write)


def clean_json(x: Any) -> Any:
    """``x`` with every NaN float as None (NaN is not JSON)."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    return x


def write_json(path: str, doc: dict[str, Any], indent: int = 1) -> None:
    """``doc`` as indented JSON at ``path``, atomically, NaN written as null."""
    fsutil.write_json(path, clean_json(doc), indent=indent)


def write_rank_json(path: str, doc: dict[str, Any]) -> None:
    """What one worker rank reports to its benchmark's parent: ``doc`` as one line of JSON, atomically."""
    atomic_write(path, lambda f: f.write(json.dumps(doc).encode()))


def save_png(path: str, fig: Any, dpi: int = 110) -> None:
    """A matplotlib figure as PNG at ``path``, atomically."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def save_figure(path: str, fig: Any, dpi: int = 110) -> None:
    """Lay ``fig`` out tightly, write it as PNG at ``path`` (atomically) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    save_png(path, fig, dpi=dpi)
    plt.close(fig)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(path: str, nrows: int = 1, ncols: int = 1, *, dpi: int = 110, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure and its axes (``plt.subplots(nrows, ncols, **subplots)``) to draw on; on a normal exit
    it is written as PNG at ``path`` (:func:`save_figure`), and closed either way."""
    plt = pyplot()
    fig, axes = plt.subplots(nrows, ncols, **subplots)
    try:
        yield fig, axes
        save_figure(path, fig, dpi=dpi)
    finally:
        plt.close(fig)


def make_console(stderr: bool = False, width: int = 132) -> Any:
    """A rich console at least ``width`` columns wide (the terminal's width where wider)."""
    from rich.console import Console

    return Console(width=max(width, Console().width), highlight=False, stderr=stderr)


def progress() -> Callable[[str], None]:
    """A function that prints one line of progress, dim and indented, on stderr."""
    err = make_console(stderr=True)
    return lambda message: err.print(f"[dim]  {message}[/dim]")


# -- a busy host -------------------------------------------------------------------------------

MAX_BUSY = 64
"""The most CPU-bound processes ``--busy`` starts."""


def check_busy(n: int) -> int:
    """``--busy N``: 0 to :data:`MAX_BUSY` processes, or a one-line :class:`UserError`."""
    if not 0 <= n <= MAX_BUSY:
        raise UserError(f"--busy must be 0 to {MAX_BUSY} CPU-bound processes, got {n}")
    return n


def busy_path(path: str, busy: int | str) -> str:
    """Where a result goes by default when ``busy`` processes ran beside it: ``name-busyN.ext`` (``path`` at 0),
    so a quiet and a busy run of the same benchmark sit side by side."""
    if not busy:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-busy{busy}{ext}"


@contextlib.contextmanager
def busy_host(n: int) -> Iterator[list[int]]:
    """``n`` CPU-bound processes (a Python loop each, never sleeping) running beside the block, as a training
    node's data loaders and Python loop keep its cores busy; their pids. They end with the block, and with this
    process whatever ends it (the parent-death signal), so none outlives a benchmark."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(check_busy(n)):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          preexec_fn=lifetime.tied_to_me(signal.SIGKILL)))
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=30)


# -- sizes (parse_size: fireflyer.cliutil's) -------------------------------------------


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", MiB), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


# -- rounds and medians -----------------------------------------------------------------


def median(xs: Iterable[float]) -> float:
    """The median, NaN for no samples."""
    s = sorted(xs)
    if not s:
        return float("nan")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def spread(xs: Iterable[float]) -> dict[str, float]:
    """``median``, ``min`` and ``max`` of some samples (at least one)."""
    s = list(xs)
    return {"median": median(s), "min": min(s), "max": max(s)}


def slowest_per_op(per_rank: list[list[float]]) -> list[float]:
    """Each op's time is its slowest rank's: the element-wise max over ranks' per-op seconds."""
    if not per_rank:
        return []
    n = len(per_rank[0])
    if any(len(t) != n for t in per_rank):
        raise UserError(f"ranks timed different numbers of ops: {[len(t) for t in per_rank]}")
    return [max(col) for col in zip(*per_rank)]


# -- charts -------------------------------------------------------------------------------


def plot_loglog(path: str, panels: list[dict[str, Any]], title: str, ylabel: str, ncols: int = 1) -> None:
    """Time (ms) against bytes per rank, log-log, ``ncols`` panels a row, written to ``path`` as PNG.

    Each panel: ``title``; ``lines``, a list of (label, [(bytes, seconds)], matplotlib style);
    ``sizes``, the x ticks; ``hlines``, (label, seconds) drawn dotted across."""
    import matplotlib.ticker

    nrows = max(1, -(-len(panels) // ncols))
    with figure(path, nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False) as (fig, axes):
        for k, panel in enumerate(panels):
            ax = axes[k // ncols][k % ncols]
            for label, pts, style in panel["lines"]:
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], label=label, **{"ls": "-", **style})
            for label, seconds in panel.get("hlines", []):
                ax.axhline(seconds * 1e3, color="gray", ls=":", lw=1, label=label)
            ax.set_xscale("log", base=2)
            if panel.get("sizes"):
                ax.set_xticks(panel["sizes"], [format_size(b) for b in panel["sizes"]])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_yscale("log")
            ax.set_title(panel["title"])
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(title)
