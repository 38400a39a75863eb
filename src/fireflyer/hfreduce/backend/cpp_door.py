"""The C++ door (``door.cpp``): built against the installed torch, loaded, and chosen per group.

torch calls a C++ backend without the interpreter; a Python backend costs every call
torch's plugin boundary, the options' conversion and a Python ``Work``. The door is a
``c10d::Backend`` that an :class:`~fireflyer.hfreduce.backend.process_group.HFReduceProcessGroup`
registers as its CPU backend: its small synchronous allreduces on one node run the compiled
core from C++, everything else goes to the Python door behind it (see ``door.cpp``).

It is compiled with :func:`torch.utils.cpp_extension.load` against the **installed** torch's
headers, never a torch fetched into an isolated build: ``make`` builds it once at install
(:func:`main`), and a process that finds it missing builds
it on first use, under a lock, so the ranks of a node build it once. It lives beside this file
in ``_door/<name>/``, the name keyed by the sources and torch's and Python's versions, so a
changed source or another torch builds afresh and never loads a stale one.

A group's :attr:`~fireflyer.hfreduce.config.HFReduceConfig.door` (``FIREFLYER_HFREDUCE_DOOR``) chooses:
``cpp`` (the default) uses the door where it builds and loads, and otherwise the Python door
with a one-line warning; ``python`` always the Python door.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("fireflyer.hfreduce")

SOURCE = Path(__file__).with_name("door.cpp")
CORE_HEADERS = Path(__file__).resolve().parents[1] / "_core"
ROOT = Path(__file__).with_name("_door")
"""Where the built doors lie (one folder per :func:`name`)."""
BUILD_TIMEOUT = 900.0
"""Seconds a process waits for the build lock (another process building) before it takes the Python door."""

_loaded: dict[str, ModuleType | None] = {}
_warned: set[str] = set()


def name() -> str:
    """The door's module name: its sources, the installed torch's version and this Python's, hashed."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), (CORE_HEADERS / "node.h").read_bytes(), torch.__version__.encode(),
                 sys.version.encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()):
        h.update(part)
        h.update(b"\0")
    return f"hfreduce_door_{h.hexdigest()[:16]}"


def built(folder: Path | None = None) -> Path | None:
    """The built door's shared object, where there is one."""
    folder = ROOT / name() if folder is None else folder
    path = folder / f"{folder.name}.so"
    return path if path.is_file() else None


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(*, timeout: float = BUILD_TIMEOUT, verbose: bool = False) -> ModuleType:
    """Build the door (if no process has) and load it; raises what stopped it (no compiler, a compile error,
    the lock not free within ``timeout`` seconds: TimeoutError)."""
    import torch.distributed  # noqa: F401 - the door's base class, c10d::Backend, is registered with pybind there
    from torch.utils import cpp_extension

    module_name = name()
    folder = ROOT / module_name
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(ROOT / f"{module_name}.lock", "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held the build lock of {folder} for {timeout:.0f} s") from None
                time.sleep(0.2)
        try:
            path = built(folder)
            if path is not None:
                return _import(path)
            try:
                import ninja  # the build tool cpp_extension drives, from PyPI
                os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
            except ImportError:
                pass  # a system ninja, if any
            module = cpp_extension.load(name=module_name, sources=[str(SOURCE)],
                                        extra_include_paths=[str(CORE_HEADERS)], extra_cflags=["-O2"],
                                        build_directory=str(folder), verbose=verbose)
            _forget_others(module_name)
            return module
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _forget_others(keep: str) -> None:
    """Remove the doors built from other sources or for another torch (a process still using one keeps its
    mapping)."""
    import shutil
    for old in ROOT.glob("hfreduce_door_*"):
        if old.name != keep and old.name != f"{keep}.lock":
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


def load() -> ModuleType | None:
    """The door's module for this process, or None where it could not be built or loaded (then one warning
    line says why, once per process)."""
    module_name = name()
    if module_name in _loaded:
        return _loaded[module_name]
    module = None
    try:
        import torch.distributed  # noqa: F401 - see build()
        path = built()
        module = _import(path) if path is not None else build()
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: the Python door stands in
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if module_name not in _warned:
            _warned.add(module_name)
            log.warning("hfreduce: the C++ door is unavailable (%s); using the Python door", reason[:300])
    _loaded[module_name] = module
    return module


def main(argv: list[str] | None = None) -> int:
    """Build the door now, saying where it lies or, in one line, why not (``make`` runs it at install)."""
    try:
        build(verbose="-v" in (argv if argv is not None else sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001 - a CLI: one line, non-zero
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        print(f"hfreduce: the C++ door did not build ({last[:300]}); the Python door will stand in", file=sys.stderr)
        return 1
    print(f"hfreduce: the C++ door is built ({ROOT / name()})")
    return 0


