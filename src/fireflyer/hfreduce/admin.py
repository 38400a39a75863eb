"""``fireflyer hfreduce clean|trace``: remove what dead processes left behind; diagnose a hang from its dumps."""

from __future__ import annotations

from fireflyer.cliutil import ArgumentParser


def main(argv: list[str]) -> int:
    if argv and argv[0] == "trace":
        from fireflyer.hfreduce import trace_report

        return trace_report.main(argv[1:])
    p = ArgumentParser(prog="fireflyer hfreduce", description=__doc__)
    p.add_argument("action", choices=["clean", "demo", "trace"],
                   help="clean: remove stale /dev/shm arenas and network namespaces; demo: hfreduce vs gloo on "
                        "emulated nodes; trace DIR: which rank a failed or hung job waited for, from its "
                        "flight recorder dumps")
    p.parse_args(argv)
    from fireflyer.hfreduce.arena import sweep_stale
    from fireflyer.hfreduce.netns import remove_stale_namespaces

    removed = sweep_stale()
    try:
        namespaces = remove_stale_namespaces("ffr")
    except (OSError, RuntimeError):
        namespaces = []
    print(f"removed {len(removed)} stale arena(s) and {len(namespaces or [])} stale namespace(s)")
    return 0
