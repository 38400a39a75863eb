"""``fireflyer hfreduce clean|trace``: remove what dead processes left behind; diagnose a hang from its dumps.

``clean`` sweeps the stale /dev/shm arenas itself; the stale network namespaces of emulated
nodes belong to the testing wing (its ``netns`` module), so the ``fireflyer``
command passes their sweep in as ``namespaces`` (hfreduce never imports the testing wing).
"""

from __future__ import annotations

from collections.abc import Callable

from fireflyer.cliutil import ArgumentParser, doc_summary, plural


def main(argv: list[str], *, namespaces: Callable[[], list[str]] | None = None) -> int:
    """Run ``fireflyer hfreduce clean|trace``; ``namespaces`` removes stale namespaces and names them."""
    if argv and argv[0] == "trace":
        from fireflyer.hfreduce.diagnosis import trace_report

        return trace_report.main(argv[1:])
    p = ArgumentParser(prog="fireflyer hfreduce", description=doc_summary(__doc__))
    p.add_argument("action", choices=["clean", "demo", "trace"],
                   help="clean: remove stale /dev/shm arenas and network namespaces; demo: hfreduce vs gloo on "
                        "emulated nodes; trace DIR: which rank a failed or hung job waited for, from its "
                        "flight recorder dumps")
    p.parse_args(argv)
    from fireflyer.hfreduce.transport.arena import sweep_stale

    removed = sweep_stale()
    names: list[str] = []
    if namespaces is not None:
        try:
            names = namespaces() or []
        except (OSError, RuntimeError):
            names = []
    print(f"removed {plural(len(removed), 'stale arena')} and {plural(len(names), 'stale namespace')}")
    return 0
