"""The ``fireflyer`` command. Thin: each subcommand imports its part lazily so ``--help`` starts fast."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from fireflyer.errors import UserError


def _bench(args: argparse.Namespace) -> int:
    if args.part == "allreduce":
        from fireflyer.hfreduce import bench

        return bench.main(args.rest)
    raise UserError(f"unknown benchmark part {args.part!r}; choose one of: allreduce")


def _demo(args: argparse.Namespace) -> int:
    from fireflyer.hfreduce import demo

    return demo.main(args.rest)


def _hfreduce(args: argparse.Namespace) -> int:
    from fireflyer.hfreduce import admin

    return admin.main(args.rest)


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "demo": ("run the main demo job (today: an allreduce across emulated nodes)", _demo),
    "bench": ("measure a part against its baseline: fireflyer bench allreduce [--help]", _bench),
    "hfreduce": ("hfreduce housekeeping: fireflyer hfreduce clean", _hfreduce),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fireflyer", description="The Fire-Flyer AI-HPC software stack.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=name != "bench" and name != "demo" and name != "hfreduce")
        if name == "bench":
            p.add_argument("part", help="which part to benchmark: allreduce")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command][1](args)
    except UserError as exc:
        print(f"fireflyer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fireflyer {args.command}: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, ValueError, TypeError) as exc:
        print(f"fireflyer {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
