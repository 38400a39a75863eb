"""The ``fireflyer`` command. Thin: each subcommand imports its part lazily so ``--help`` starts fast."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

from fireflyer.errors import FireflyerError, UserError
from fireflyer.lifetime import Stopped, owning


BENCHES = {
    "allreduce": "fireflyer.bench.allreduce",
    "alltoall": "fireflyer.bench.exchange",
    "ddp": "fireflyer.bench.ddp",
    "fsdp": "fireflyer.bench.fsdp",
    "pp": "fireflyer.bench.pp",
    "moe": "fireflyer.bench.moe",
    "checkpoint": "fireflyer.bench.checkpoint",
    "recovery": "fireflyer.bench.recovery",
    "platform": "fireflyer.bench.platform",
    "fabric": "fireflyer.bench.fabric",
    "storage": "fireflyer.bench.storage",
    "parallel": "fireflyer.bench.parallel",
}


def _bench(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: fireflyer bench PART [options]; PART is one of: " + ", ".join(BENCHES))
        return 0 if rest else 2
    if rest[0] not in BENCHES:
        raise UserError(f"unknown benchmark part {rest[0]!r}; choose one of: {', '.join(BENCHES)}")
    with owning():  # the peers, workers and torchrun agents a benchmark starts end with it
        return importlib.import_module(BENCHES[rest[0]]).main(rest[1:])


def _train(rest: list[str]) -> int:
    from fireflyer.train import cli

    return cli.main(rest)


def _demo(rest: list[str]) -> int:
    from fireflyer.train import cli

    return cli.main(rest, prog="fireflyer demo")


def _simulate(rest: list[str]) -> int:
    if rest and rest[0] == "goodput":  # the failure model lives with the failure data, in the validator
        from fireflyer.validator import goodput_cli

        return goodput_cli.main(rest[1:])
    from fireflyer.fabric import cli

    return cli.main(["simulate", *rest])


def _validate(rest: list[str]) -> int:
    from fireflyer.validator import cli

    return cli.main(rest)


def _failures(rest: list[str]) -> int:
    from fireflyer.validator import failures_cli

    def synthesize(**config: object) -> object:  # --synthesize: the testing wing's log generator
        from fireflyer.testing.synthlog import SynthConfig, generate

        return generate(SynthConfig(**config))  # type: ignore[arg-type]

    return failures_cli.main(rest, synthesize=synthesize)


def _hfreduce(rest: list[str]) -> int:
    if rest and rest[0] == "demo":
        from fireflyer.hfreduce.commands import demo

        with owning():
            return demo.main(rest[1:])
    from fireflyer.hfreduce.commands import admin

    def namespaces() -> list[str]:  # clean: the emulated nodes' stale namespaces (testing wing)
        from fireflyer.testing.netns import remove_stale_namespaces

        return remove_stale_namespaces("ffr")

    return admin.main(rest, namespaces=namespaces)


def _lazy(module: str, *lead: str) -> Callable[[list[str]], int]:
    """A command whose ``main(argv)`` lives in ``module``; ``lead`` is put before the user's arguments."""

    def run(rest: list[str]) -> int:
        return importlib.import_module(module).main([*lead, *rest])

    return run


_PLATFORM = "fireflyer.platform.commands.dispatch"

COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "train": ("train a small GPT with haiscale DDP on emulated nodes: fireflyer train [CONFIG] [--help]", _train),
    "demo": ("the main job on its default config (same as 'fireflyer train')", _demo),
    "bench": ("measure a part against its baseline: fireflyer bench " + "|".join(BENCHES), _bench),
    "validate": ("check this node's health against a hardware profile (Slurm HealthCheckProgram)", _validate),
    "failures": ("analyse kernel logs: Xid and InfiniBand failures, MTBF, checkpoint interval", _failures),
    "hfreduce": ("hfreduce tools: fireflyer hfreduce demo | clean | trace DIR (diagnose a hang)", _hfreduce),
    "platform": ("the HAI scheduler: fireflyer platform start|stop|status", _lazy(_PLATFORM, "platform")),
    "submit": ("queue a task: fireflyer submit -n NODES [-p PRIORITY] -- CMD...", _lazy(_PLATFORM, "submit")),
    "queue": ("list the platform's tasks", _lazy(_PLATFORM, "queue")),
    "describe": ("one task and its chain of attempts: fireflyer describe ID", _lazy(_PLATFORM, "describe")),
    "logs": ("a task's logs: fireflyer logs ID [-f] [--rank R]", _lazy(_PLATFORM, "logs")),
    "suspend": ("checkpoint and hold a running task: fireflyer suspend ID", _lazy(_PLATFORM, "suspend")),
    "resume": ("queue a held task again: fireflyer resume ID", _lazy(_PLATFORM, "resume")),
    "stop": ("stop a task for good: fireflyer stop ID", _lazy(_PLATFORM, "stop")),
    "nodes": ("the platform's nodes, zones and health", _lazy(_PLATFORM, "nodes")),
    "drain": ("take a node out of scheduling: fireflyer drain NODE", _lazy(_PLATFORM, "drain")),
    "undrain": ("return a drained node: fireflyer undrain NODE", _lazy(_PLATFORM, "undrain")),
    "plan": ("plan a cluster's fabric, cost and power: fireflyer plan --gpus N", _lazy("fireflyer.fabric.cli", "plan")),
    "simulate": ("simulate collectives at scale: fireflyer simulate allreduce --gpus ...", _simulate),
    "cache": ("the tiered shard cache: fireflyer cache simulate", _lazy("fireflyer.storage.cli", "cache")),
}


def usage() -> str:
    lines = ["usage: fireflyer COMMAND [options]", "", "The Fire-Flyer AI-HPC software stack.", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (text, _) in COMMANDS.items()]
    lines += ["", "Run 'fireflyer COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    try:
        if command not in COMMANDS:
            raise UserError(f"invalid choice: {command!r} (choose from {', '.join(COMMANDS)})")
        return COMMANDS[command][1](rest)
    except UserError as exc:
        print(f"fireflyer {command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `fireflyer describe 1 | head`: the reader is gone, which is no error
        sys.stderr.close()
        return 141
    except KeyboardInterrupt:
        print(f"fireflyer {command}: interrupted", file=sys.stderr)
        return 130
    except Stopped as exc:  # SIGINT, SIGTERM or SIGHUP to a command that stops what it started first
        print(f"fireflyer {command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except FireflyerError as exc:  # the root of every error a user can cause; anything else is a bug
        print(f"fireflyer {command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
