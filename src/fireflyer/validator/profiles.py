"""Hardware profiles: what a healthy node of one kind measures, in TOML.

A profile names the hardware, sets default thresholds, and per check gives expected values
(``expect``, keyed by the check's metric names), thresholds, a budget for a full run and the
check's own parameters::

    name = "a100-pcie"
    description = "..."
    [hardware]
    gpus = 8
    gpu_name = "A100"
    [defaults]
    warn_below = 0.8          # WARN below 80% of expected
    fail_below = 0.5          # FAIL below 50%
    [checks.gpu_bandwidth]
    expect = { h2d = 27.0, d2h = 27.0 }
    [checks.storage]
    enabled = false

Built-in profiles live next to this module in ``profiles/NAME.toml``; ``--profile PATH.toml``
loads any file. Every key is checked: an unknown check, metric or parameter is an error that
lists the valid ones, so a typo never silently loosens a node's checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from fireflyer.errors import UserError
from fireflyer.validator.checks import ALL_CHECKS
from fireflyer.validator.checks.base import CheckSettings
from fireflyer.validator.grading import Thresholds

PROFILE_DIR = Path(__file__).with_name("profiles")
HARDWARE_KEYS = {"gpus": int, "gpu_name": str, "gpu_memory_gb": (int, float), "cpu_model": str,
                 "cpu_sockets": int, "cpu_cores": int, "memory_gb": (int, float), "nics": str}
CHECK_KEYS = {"enabled", "warn_below", "fail_below", "budget_s", "expect"}


class ProfileError(UserError):
    """A profile that cannot be used: unreadable, not TOML, or with a wrong key or value."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Expectations for one kind of node."""

    name: str
    description: str = ""
    source: str = ""
    hardware: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, CheckSettings] = field(default_factory=dict)
    defaults: Thresholds = field(default_factory=Thresholds)

    def settings(self, check: str) -> CheckSettings:
        """This profile's settings for ``check`` (the defaults when it says nothing)."""
        return self.checks.get(check) or CheckSettings(thresholds=self.defaults)


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with fireflyer."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name, or a TOML file by path (anything ending in ``.toml``)."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ProfileError(f"profile file {name_or_path} does not exist")
    else:
        path = PROFILE_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise ProfileError(f"unknown profile {name_or_path!r}; choose one of: "
                               f"{', '.join(builtin_profiles())}, or give a path to a .toml file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {path} is not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    return parse_profile(data, source=str(path))


def _type_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, list):
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, type(default))


def _type_name(default: Any) -> str:
    return "a list of integers" if isinstance(default, list) else f"a {type(default).__name__}"


def _unknown(where: str, keys: set[str], valid: set[str] | list[str]) -> None:
    bad = sorted(set(keys) - set(valid))
    if bad:
        raise ProfileError(f"{where}: unknown key {bad[0]!r}; valid keys: {', '.join(sorted(valid))}")


def _thresholds(where: str, table: dict[str, Any], base: Thresholds) -> Thresholds:
    try:
        return Thresholds(warn_below=table.get("warn_below", base.warn_below),
                          fail_below=table.get("fail_below", base.fail_below))
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from exc


def parse_profile(data: dict[str, Any], *, source: str = "<dict>") -> Profile:
    """Validate a profile's parsed TOML and build the :class:`Profile`; raise ProfileError."""
    _unknown(source, set(data), {"name", "description", "hardware", "defaults", "checks"})
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{source}: 'name' must be a non-empty string")
    hardware = data.get("hardware", {})
    _unknown(f"{source} [hardware]", set(hardware), set(HARDWARE_KEYS))
    for key, value in hardware.items():
        if not isinstance(value, HARDWARE_KEYS[key]) or isinstance(value, bool):
            raise ProfileError(f"{source} [hardware] {key} has the wrong type: {value!r}")
    defaults_table = data.get("defaults", {})
    _unknown(f"{source} [defaults]", set(defaults_table), {"warn_below", "fail_below"})
    defaults = _thresholds(f"{source} [defaults]", defaults_table, Thresholds())
    checks: dict[str, CheckSettings] = {}
    for check_name, table in data.get("checks", {}).items():
        where = f"{source} [checks.{check_name}]"
        if check_name not in ALL_CHECKS:
            raise ProfileError(f"{where}: unknown check {check_name!r}; valid checks: {', '.join(ALL_CHECKS)}")
        if not isinstance(table, dict):
            raise ProfileError(f"{where}: must be a table")
        check = ALL_CHECKS[check_name]
        _unknown(where, set(table), CHECK_KEYS | set(check.params))
        expect = table.get("expect", {})
        if not isinstance(expect, dict):
            raise ProfileError(f"{where}: 'expect' must be a table of metric = value")
        _unknown(f"{where} expect", set(expect), set(check.metrics))
        for metric, value in expect.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ProfileError(f"{where}: expect.{metric} must be a non-negative number, got {value!r}")
        params = {k: v for k, v in table.items() if k in check.params}
        for key, value in params.items():
            if not _type_ok(value, check.params[key]):
                raise ProfileError(f"{where}: {key} must be {_type_name(check.params[key])}, got {value!r}")
        enabled = table.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ProfileError(f"{where}: enabled must be true or false")
        budget = table.get("budget_s")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
            raise ProfileError(f"{where}: budget_s must be positive seconds, got {budget!r}")
        checks[check_name] = CheckSettings(
            enabled=enabled, thresholds=_thresholds(where, table, defaults),
            expect={k: float(v) for k, v in expect.items()},
            budget_s=float(budget) if budget is not None else None, params=params)
    return Profile(name=name, description=str(data.get("description", "")), source=source,
                   hardware=dict(hardware), checks=checks, defaults=defaults)


def default_profile_name(gpu_names: list[str]) -> str:
    """The built-in profile for this node: ``generic-cpu`` without GPUs; with GPUs the built-in
    whose ``gpu_name`` and ``gpus`` match, else ``generic-gpu``."""
    if not gpu_names:
        return "generic-cpu"
    for name in builtin_profiles():
        hw = load_profile(name).hardware
        want = hw.get("gpu_name")
        if want and all(want.lower() in g.lower() for g in gpu_names) and hw.get("gpus", len(gpu_names)) == len(gpu_names):
            return name
    return "generic-gpu"
