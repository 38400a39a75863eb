"""``fireflyer hfreduce clean``: remove arenas and test namespaces left by processes that no longer exist."""

from __future__ import annotations

from fireflyer.cliutil import ArgumentParser
from fireflyer.hfreduce.arena import sweep_stale


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer hfreduce", description=__doc__)
    p.add_argument("action", choices=["clean", "demo"], help="clean: remove stale /dev/shm arenas and network namespaces; demo: hfreduce vs gloo on emulated nodes")
    p.parse_args(argv)
    removed = sweep_stale()
    from fireflyer.hfreduce.netns import remove_stale_namespaces

    try:
        namespaces = remove_stale_namespaces("ffr")
    except (OSError, RuntimeError):
        namespaces = []
    print(f"removed {len(removed)} stale arena(s) and {len(namespaces or [])} stale namespace(s)")
    return 0
