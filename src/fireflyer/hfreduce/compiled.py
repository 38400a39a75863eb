"""hfreduce's compiled core (``_core``, built by pip from the C sources in ``_core/``), loaded in one place.

:data:`CORE` is the extension module, or None where it is missing; :data:`MISSING` then
says why. The engine (the node stage, the trees, the fast door) and the kernels take it
from here, and run the pure-Python reference without it.
"""

from __future__ import annotations

from types import ModuleType


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        import fireflyer.hfreduce._core as core
    except ImportError as e:  # pragma: no cover - a machine without a C compiler
        return None, f"it could not be loaded ({e})"
    if not hasattr(core, "reduce"):  # the _core/ folder of C sources, imported as a namespace package
        return None, "it was not built (no C compiler at install time?)"
    return core, None


CORE, MISSING = _load()
