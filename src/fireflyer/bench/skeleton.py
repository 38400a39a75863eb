"""The skeleton every ``fireflyer bench <part>`` fills in: the benchmark's run, and its ranks' runs.

A benchmark is five pieces: its flags read into a config, a measurement (which prints its
progress), a report of it on the terminal, the result document's fields and a chart.
:func:`run_bench` is every benchmark's ``main``: it runs the pieces in that order, writes the
document as JSON (its head, the time, command and machine, from
:func:`~fireflyer.bench.harness.document`) and the chart as PNG, and prints one line that
names both files.

A benchmark whose ranks run a worker module starts them with :func:`run_ranks`: a spec as
JSON, real torchrun on emulated nodes, each rank's result read back. Each worker's
``__main__`` is :func:`worker_main`: read the spec, run the rank, write what it returns where
:func:`run_ranks` reads it. :func:`rank_groups` is the process groups most ranks run in.
No torch at import time: ``fireflyer bench <part> --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from fireflyer.bench.harness import bench_command, document, write_json, write_rank_json
from fireflyer.errors import JobFailed, TimedOut

C = TypeVar("C")
"""A benchmark's config."""
R = TypeVar("R")
"""What a benchmark's measurement returns."""


# -- the benchmark -------------------------------------------------------------------------


def result_paths(out_dir: str, name: str) -> tuple[str, str]:
    """``out_dir/NAME.json`` and ``out_dir/NAME.png``."""
    return os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, f"{name}.png")


def run_bench(argv: Sequence[str], *, part: str, configure: Callable[[list[str]], C], measure: Callable[[C], R],
              fields: Callable[[C, R], dict[str, Any]], report: Callable[[C, R], object] | None = None,
              plot: Callable[[str, C, R], object] | None = None, paths: Callable[[C], tuple[str, str]] | None = None,
              head: Callable[[list[str]], dict[str, Any]] | None = None,
              verdict: Callable[[C, R], int] | None = None, indent: int = 1) -> int:
    """Run one benchmark, ``fireflyer bench PART ARGV``, and return its exit code.

    ``configure`` reads the flags (a bad one raises :class:`~fireflyer.errors.UserError`);
    ``measure(cfg)`` runs the benchmark, printing its progress (and any table it prints as it
    goes); ``report(cfg, result)`` prints the tables after it. ``fields`` are the result document's
    after its head, ``head(argv)`` (default: :func:`~fireflyer.bench.harness.document` of the
    command ``fireflyer bench PART ARGV``); ``plot(path, cfg, result)`` draws the chart, none
    without it. The document goes to the first of ``paths(cfg)``, the chart to the second (default
    :func:`result_paths` of ``cfg.out_dir`` and PART), then one line names what was written.
    ``verdict(cfg, result)``, after that line, may print more and gives the exit code (default 0)."""
    argv = list(argv)
    cfg = configure(argv)
    result = measure(cfg)
    if report:
        report(cfg, result)
    doc = {**(head(argv) if head else document(bench_command(part, argv))), **fields(cfg, result)}
    json_path, png_path = paths(cfg) if paths else result_paths(cfg.out_dir, part)  # type: ignore[attr-defined]
    write_json(json_path, doc, indent=indent)
    if plot is None:
        print(f"wrote {json_path}")
    else:
        plot(png_path, cfg, result)
        print(f"wrote {json_path} and {png_path}")
    return verdict(cfg, result) if verdict else 0


# -- its ranks --------------------------------------------------------------------------------


def rank_result_path(out_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its result for :func:`run_ranks`: ``out_dir/rankRANK.json``."""
    return os.path.join(out_dir, f"rank{rank}.json")


def run_ranks(worker: str, spec: dict[str, Any], layout: tuple[int, int], *, timeout_s: float,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every rank's result, in rank order, of ``python -m WORKER SPEC.json`` on ``layout`` (NODES x RANKS
    emulated nodes, real torchrun through :func:`fireflyer.launch.run_local`), each rank's environment
    with ``env`` added.

    The ranks read ``spec`` with ``out_dir`` added, the folder :func:`worker_main` writes their results
    to. A rank that fails, a job past ``timeout_s`` or a rank that writes nothing is a one-line
    :class:`~fireflyer.errors.JobFailed`, its logs kept and named; otherwise the folder is removed."""
    from fireflyer.launch import LaunchFailed, LocalJob, run_local

    nodes, per_node = layout
    name = f"{nodes}x{per_node}"
    part = worker.rsplit(".", 1)[-1].removesuffix("_worker")
    tmp = Path(tempfile.mkdtemp(prefix=f"ffr-bench-{part}-{name}-"))
    logs = tmp / "logs"
    keep = False
    try:
        (tmp / "spec.json").write_text(json.dumps({**spec, "out_dir": str(tmp)}))
        job = LocalJob(target=["-m", worker, str(tmp / "spec.json")], nodes=nodes, ranks_per_node=per_node,
                       timeout=timeout_s, quiet=True, log_dir=str(logs), env=dict(env or {}))
        try:
            run_local(job)
        except LaunchFailed as exc:
            keep = True
            raise JobFailed(f"layout {name}: {exc}") from None
        except TimedOut as exc:
            keep = True
            raise JobFailed(f"layout {name}: {exc} (logs in {logs})") from None
        paths = [rank_result_path(str(tmp), r) for r in range(nodes * per_node)]
        missing = [r for r, path in enumerate(paths) if not os.path.exists(path)]
        if missing:
            keep = True
            raise JobFailed(f"layout {name}: ranks {missing} wrote no results (logs in {logs})")
        return [json.loads(Path(path).read_text()) for path in paths]
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def read_spec(argv: list[str], usage: str) -> dict[str, Any] | None:
    """The ``SPEC.json`` a worker rank is started with, its one argument; None, after printing
    ``usage: USAGE SPEC.json`` on stderr, when ``argv`` is not one path."""
    if len(argv) != 1:
        print(f"usage: {usage} SPEC.json", file=sys.stderr)
        return None
    with open(argv[0], encoding="utf-8") as f:
        return json.load(f)


def worker_main(argv: list[str], usage: str, run: Callable[[dict[str, Any]], dict[str, Any] | None]) -> int:
    """A worker rank's ``main``: ``run`` the spec of :func:`read_spec`, and write the result it returns, if any,
    where :func:`run_ranks` reads it (``rank{result["rank"]}.json`` in the spec's ``out_dir``). Exit code 0,
    or 2 for a bad command line."""
    spec = read_spec(argv, usage)
    if spec is None:
        return 2
    result = run(spec)
    if result is not None:
        write_rank_json(rank_result_path(spec["out_dir"], result["rank"]), result)
    return 0


@contextlib.contextmanager
def rank_groups(timeout_s: float, backend: str = "hfreduce") -> Iterator[Any]:
    """This rank's default process group on ``backend`` with a gloo group beside it, which it yields; on a
    normal exit, a barrier on the gloo group, then every group destroyed."""
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "hfreduce":
        import fireflyer.hfreduce  # noqa: F401 - registers the backend
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    yield gloo
    dist.barrier(group=gloo)
    dist.destroy_process_group()
