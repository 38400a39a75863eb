"""Validator pieces without running real measurements: profiles, grading, exit codes, drain
hook, sysfs link parsing, Xid filtering, and the guarantee that a check never crashes the run."""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from fireflyer.errors import UserError
from fireflyer.validator.checks import (
    ALL_CHECKS,
    Check,
    CheckContext,
    CheckSettings,
    RunOptions,
)
from fireflyer.validator.checks.cpu import cpu_share, read_cpu_frequencies
from fireflyer.validator.checks.links import ib_ports, net_links, parse_ib_rate
from fireflyer.validator.checks.xid_log import parse_xids, since_filter
from fireflyer.validator.drain import (
    REASON_ENV,
    one_line,
    parse_drain_command,
    run_drain,
)
from fireflyer.validator.grading import (
    CheckResult,
    Status,
    Thresholds,
    exit_code,
    grade,
    node_status,
)
from fireflyer.validator.profiles import (
    ProfileError,
    builtin_profiles,
    default_profile_name,
    load_profile,
)
from fireflyer.validator.runner import run_checks, run_one, select_checks


def ctx_for(check: type[Check], *, settings: CheckSettings | None = None, **options) -> CheckContext:
    return CheckContext(options=RunOptions(**options), settings=settings or CheckSettings(),
                        defaults=dict(check.params), budget_s=1.0)


# -- grading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("measured,status", [(100, Status.PASS), (80, Status.PASS), (79.9, Status.WARN),
                                             (50, Status.WARN), (49.9, Status.FAIL), (0, Status.FAIL)])
def test_grade_against_thresholds(measured, status):
    got, reason = grade(measured, 100.0, Thresholds(warn_below=0.8, fail_below=0.5))
    assert got == status and "%" in reason


def test_grade_without_expectation_passes():
    assert grade(1e-9, None, Thresholds())[0] == Status.PASS


@pytest.mark.parametrize("kw", [{"warn_below": 1.5}, {"fail_below": -0.1}, {"warn_below": 0.4, "fail_below": 0.5},
                                {"warn_below": True}])
def test_bad_thresholds_are_rejected(kw):
    with pytest.raises(ValueError):
        Thresholds(**kw)


def _result(status: Status) -> CheckResult:
    return CheckResult(name="x", status=status, reason="")


@pytest.mark.parametrize("statuses,strict,code", [
    ([Status.PASS, Status.SKIP], False, 0),
    ([Status.PASS, Status.WARN], False, 0),
    ([Status.PASS, Status.WARN], True, 1),
    ([Status.WARN, Status.FAIL], False, 1),
    ([Status.SKIP], False, 0),
    ([], False, 0),
])
def test_exit_code_follows_the_worst_status(statuses, strict, code):
    assert exit_code(node_status([_result(s) for s in statuses], warn_is_failure=strict)) == code


# -- profiles --------------------------------------------------------------------------------

def test_builtin_profiles_load_and_name_only_real_checks():
    names = builtin_profiles()
    assert {"generic-cpu", "generic-gpu", "a100-pcie"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.name == name
        for check, settings in profile.checks.items():
            assert set(settings.expect) <= set(ALL_CHECKS[check].metrics)
    a100 = load_profile("a100-pcie")
    assert a100.hardware["gpus"] == 8
    assert a100.settings("gpu_gemm").expect["tflops"] == 312.0
    assert a100.settings("gpu_bandwidth").expect == {"h2d": 27.0, "d2h": 27.0}


def test_default_profile_follows_the_gpus():
    assert default_profile_name([]) == "generic-cpu"
    assert default_profile_name(["NVIDIA A100-PCIE-40GB"] * 8) == "a100-pcie"
    assert default_profile_name(["NVIDIA A100-PCIE-40GB"] * 2) == "generic-gpu"
    assert default_profile_name(["NVIDIA H200"]) == "generic-gpu"


def test_profile_from_a_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\n[defaults]\nwarn_below = 0.9\n[checks.storage]\nexpect = { write = 5 }\n'
                    'path = "/data"\n[checks.gpu_gemm]\nenabled = false\n')
    profile = load_profile(str(path))
    assert profile.settings("storage").thresholds.warn_below == 0.9
    assert profile.settings("storage").params == {"path": "/data"}
    assert profile.settings("cpu_gemm").thresholds.warn_below == 0.9  # defaults reach unnamed checks
    assert not profile.settings("gpu_gemm").enabled


@pytest.mark.parametrize("text,needle", [
    ('name = "x"\n[checks.storage\n', "not valid TOML"),
    ('name = "x"\ncolour = "red"\n', "unknown key 'colour'"),
    ('name = "x"\n[checks.warp_drive]\n', "unknown check 'warp_drive'"),
    ('name = "x"\n[checks.storage]\nexpect = { writes = 5 }\n', "unknown key 'writes'; valid keys: read, write"),
    ('name = "x"\n[checks.storage]\nsize = 5\n', "unknown key 'size'"),
    ('name = "x"\n[checks.storage]\nsize_mb = "big"\n', "size_mb must be a int"),
    ('name = "x"\n[checks.storage]\nexpect = { write = -1 }\n', "non-negative"),
    ('name = "x"\n[checks.storage]\nwarn_below = 0.3\nfail_below = 0.6\n', "must not exceed"),
    ('name = "x"\n[checks.xid]\nfail_xids = [79, "x"]\n', "list of integers"),
    ('name = "x"\n[hardware]\ngpus = "eight"\n', "gpus has the wrong type"),
    ('description = "no name"\n', "'name' must be"),
])
def test_bad_profiles_give_clear_errors(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    assert needle in str(info.value)
    assert isinstance(info.value, UserError)


def test_unknown_profile_name_lists_the_builtins():
    with pytest.raises(UserError, match="unknown profile 'nope'.*generic-cpu"):
        load_profile("nope")
    with pytest.raises(UserError, match="does not exist"):
        load_profile("/no/such/profile.toml")


def test_unknown_check_name_is_a_user_error():
    with pytest.raises(UserError, match="unknown check 'gpu_magic'"):
        select_checks(["cpu_gemm", "gpu_magic"])
    assert select_checks(["storage", "cpu_gemm"]) == ["cpu_gemm", "storage"]
    assert "storage" not in select_checks(None, skip=["storage"])


# -- the drain hook --------------------------------------------------------------------------

def test_drain_hook_gets_the_reason_without_a_shell(tmp_path):
    out = tmp_path / "reason.txt"
    marker = tmp_path / "injected"
    script = f"import os, sys; open(sys.argv[1], 'w').write(os.environ['{REASON_ENV}'] + '|' + sys.argv[2])"
    argv = [sys.executable, "-c", script, str(out), "reason={reason}"]
    evil = f'Xid 79 on 0000:65:00"; touch {marker}; echo "$(touch {marker})`touch {marker}`\nsecond line'
    outcome = run_drain(argv, evil)
    assert outcome.returncode == 0, outcome.output
    env_reason, arg_reason = out.read_text().split("|", 1)
    assert env_reason == one_line(evil) and "\n" not in env_reason
    assert arg_reason == "reason=" + one_line(evil)  # one argument, whatever the reason holds
    assert not marker.exists()


def test_drain_command_parsing_and_missing_command():
    assert parse_drain_command("scontrol update nodename={hostname} 'reason={reason}'") == [
        "scontrol", "update", "nodename={hostname}", "reason={reason}"]
    with pytest.raises(UserError):
        parse_drain_command("  ")
    with pytest.raises(UserError):
        parse_drain_command("echo 'unbalanced")
    outcome = run_drain(["/no/such/drain-tool"], "x")
    assert outcome.returncode is None and "not found" in outcome.output


def test_one_line_truncates():
    assert len(one_line("x" * 1000)) == 200


# -- sysfs -----------------------------------------------------------------------------------

def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_sysfs(root: Path, *, ib_state: str = "4: ACTIVE", rate: str = "200 Gb/sec (4X HDR)") -> Path:
    port = root / "class/infiniband/mlx5_0/ports/1"
    _write(port / "state", ib_state)
    _write(port / "phys_state", "5: LinkUp" if "ACTIVE" in ib_state else "3: Disabled")
    _write(port / "rate", rate)
    _write(port / "link_layer", "InfiniBand")
    for name, state, speed, physical in (("eth0", "up", "25000", True), ("eth1", "down", None, True),
                                         ("docker0", "up", None, False), ("lo", "unknown", None, False)):
        dev = root / "class/net" / name
        _write(dev / "operstate", state)
        if speed:
            _write(dev / "speed", speed)
        if physical:
            (dev / "device").mkdir(parents=True)
    return root


def test_link_parsing_on_a_fake_sysfs(tmp_path):
    root = str(fake_sysfs(tmp_path))
    (port,) = ib_ports(root)
    assert (port.device, port.port, port.state, port.phys_state, port.rate_gbps) == ("mlx5_0", 1, "ACTIVE", "LinkUp", 200.0)
    assert port.up
    links = {ln.name: ln for ln in net_links(root)}
    assert set(links) == {"eth0", "eth1", "docker0"}
    assert links["eth0"].up and links["eth0"].speed_mbps == 25000 and links["eth0"].physical
    assert not links["eth1"].up and links["eth1"].speed_mbps is None
    assert not links["docker0"].physical
    assert parse_ib_rate("100 Gb/sec (2X HDR)") == 100.0 and parse_ib_rate("garbage") is None


def _nic(root: Path, **params) -> CheckResult:
    settings = CheckSettings(expect={"ib_rate": 200.0}, thresholds=Thresholds(warn_below=1.0, fail_below=0.99),
                             params={"ib_ports": 1, **params})
    return ALL_CHECKS["nic"]().run(ctx_for(ALL_CHECKS["nic"], settings=settings, sysfs_root=str(root)))


def test_nic_check_grades_state_and_rate(tmp_path):
    assert _nic(fake_sysfs(tmp_path / "ok")).status == Status.PASS
    down = _nic(fake_sysfs(tmp_path / "down", ib_state="1: DOWN"))
    assert down.status == Status.FAIL and "mlx5_0/1 is DOWN" in down.reason
    slow = _nic(fake_sysfs(tmp_path / "slow", rate="100 Gb/sec (2X HDR)"))
    assert slow.status == Status.FAIL and "ib_rate@mlx5_0/1 100" in slow.reason
    missing = _nic(fake_sysfs(tmp_path / "eth"), eth_links=2)
    assert missing.status == Status.FAIL and "1 physical Ethernet links up" in missing.reason


def test_cpu_frequency_from_fake_cpufreq(tmp_path):
    for i, (cap, cur) in enumerate([(3400000, 2000000), (2000000, 1500000)]):
        d = tmp_path / f"devices/system/cpu/cpu{i}/cpufreq"
        _write(d / "scaling_max_freq", str(cap))
        _write(d / "scaling_cur_freq", str(cur))
        _write(d / "scaling_governor", "powersave")
    info = read_cpu_frequencies(str(tmp_path), str(tmp_path))
    assert info["source"] == "cpufreq" and info["cores"] == 2 and min(info["max_mhz"]) == 2000.0
    settings = CheckSettings(expect={"min_max_mhz": 3400.0}, params={"min_cores": 4, "governor": "performance"})
    result = ALL_CHECKS["cpu_freq"]().run(ctx_for(ALL_CHECKS["cpu_freq"], settings=settings, sysfs_root=str(tmp_path)))
    assert result.status == Status.FAIL
    assert "2 cores online" in result.reason
    (cap,) = [m for m in result.metrics if m.name == "min_max_mhz"]
    assert cap.value == 2000.0 and cap.status == Status.WARN  # 59% of 3400


# -- Xid -------------------------------------------------------------------------------------

XID_LOG = """\
2024-05-06T09:59:00+0000 node7 kernel: NVRM: Xid (PCI:0000:65:00): 13, pid=4242, Graphics Exception
2024-05-06T10:00:01+0000 node7 kernel: NVRM: Xid (PCI:0000:65:00): 31, pid=4242, MMU Fault
2024-05-06T10:05:00+0000 node7 kernel: mlx5_core 0000:b1:00.0: Port module event: module 0, Cable plugged
2024-05-06T11:30:00.123456+00:00 node7 kernel: NVRM: Xid (PCI:0000:ca:00): 79, pid=0, GPU has fallen off the bus.
NVRM: Xid (PCI:0000:ca:00): 48, undated line
"""


def test_xid_parsing_and_since_filter():
    events = parse_xids(XID_LOG)
    assert [(e.code, e.pci) for e in events] == [(13, "0000:65:00"), (31, "0000:65:00"), (79, "0000:ca:00"),
                                                 (48, "0000:ca:00")]
    since = datetime(2024, 5, 6, 10, 0, 0, tzinfo=timezone.utc)
    kept, undated = since_filter(events, since)
    assert [e.code for e in kept] == [31, 79] and undated == 1
    assert len(since_filter(events, None)[0]) == 4


def test_xid_timestamp_formats():
    boot = datetime(2024, 5, 6, 0, 0, tzinfo=timezone.utc)
    mono = parse_xids("[ 3600.500000] NVRM: Xid (PCI:0000:01:00): 74, NVLink", boot_time=boot)[0]
    assert mono.when == boot + timedelta(seconds=3600.5)
    ctime = parse_xids("[Mon May  6 10:00:00 2024] NVRM: Xid (PCI:0000:01:00): 63, row remap")[0]
    assert (ctime.when.month, ctime.when.day, ctime.when.hour) == (5, 6, 10)
    now = datetime(2024, 5, 7, tzinfo=timezone.utc).astimezone()
    syslog = parse_xids("May  6 10:00:00 node7 kernel: NVRM: Xid (PCI:0000:01:00): 94, contained", now=now)[0]
    assert syslog.when.year == 2024 and syslog.code == 94


def _xid(tmp_path, text: str, since: datetime | None = None) -> CheckResult:
    log = tmp_path / "kern.log"
    log.write_text(text)
    return ALL_CHECKS["xid"]().run(ctx_for(ALL_CHECKS["xid"], xid_log=str(log), since=since))


def test_xid_check_fails_on_hardware_xids_and_warns_on_app_xids(tmp_path):
    hw = _xid(tmp_path, XID_LOG, datetime(2024, 5, 6, 10, 0, tzinfo=timezone.utc))
    assert hw.status == Status.FAIL and "Xid 79 x1 on 0000:ca:00 (hardware: drain)" in hw.reason
    assert hw.details["undated_skipped"] == 1
    app = _xid(tmp_path, XID_LOG, datetime(2024, 5, 6, 9, 0, tzinfo=timezone.utc))
    assert app.status == Status.FAIL and "Xid 13" not in app.reason  # the FAIL reasons only
    only_app = _xid(tmp_path, XID_LOG.splitlines()[0] + "\n")
    assert only_app.status == Status.WARN and "Xid 13" in only_app.reason
    clean = _xid(tmp_path, XID_LOG, datetime(2024, 6, 1, tzinfo=timezone.utc))
    assert clean.status == Status.PASS


def test_xid_check_skips_an_unreadable_log(tmp_path):
    result = ALL_CHECKS["xid"]().run(ctx_for(ALL_CHECKS["xid"], xid_log=str(tmp_path / "missing.log")))
    assert result.status == Status.SKIP and "cannot read" in result.reason


# -- robustness ------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
@pytest.mark.parametrize("name", [n for n, c in ALL_CHECKS.items() if c.needs_gpu])
def test_gpu_checks_skip_without_cuda(name):
    result = ALL_CHECKS[name]().run(ctx_for(ALL_CHECKS[name]))
    assert result.status == Status.SKIP and "CUDA" in result.reason


class Exploding(Check):
    name = "exploding"
    title = "raises"

    def _measure(self, ctx, out):
        out.metric  # noqa: B018
        raise ZeroDivisionError("division by zero in the sensor")


class Hanging(Check):
    name = "hanging"
    title = "never returns"

    def _measure(self, ctx, out):
        import threading

        threading.Event().wait(30)


def test_a_raising_check_is_a_fail_not_a_crash():
    result = Exploding().run(ctx_for(Exploding))
    assert result.status == Status.FAIL
    assert "ZeroDivisionError: division by zero in the sensor" in result.reason


def test_a_hanging_check_is_abandoned_as_fail():
    result = run_one(Hanging(), ctx_for(Hanging), limit_s=0.3)
    assert result.status == Status.FAIL and "did not finish within" in result.reason


def test_disabled_checks_skip_unless_named(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('name = "p"\n[checks.cpu_freq]\nenabled = false\n')
    profile = load_profile(str(path))
    (skipped,) = run_checks(profile, RunOptions(quick=True), ["cpu_freq"])
    assert skipped.status == Status.SKIP and "disabled in profile p" in skipped.reason
    (ran,) = run_checks(profile, RunOptions(quick=True), ["cpu_freq"], explicit=True)
    assert ran.status != Status.SKIP


def test_storage_check_writes_verifies_and_cleans_up(tmp_path):
    settings = CheckSettings(expect={"write": 1.0, "read": 1.0})
    result = ALL_CHECKS["storage"]().run(ctx_for(ALL_CHECKS["storage"], settings=settings, quick=True,
                                                 storage_path=str(tmp_path), storage_mb=8))
    assert result.status == Status.PASS, result.reason
    assert result.details["bytes"] == 8 << 20 and result.details["wrong_chunks"] == 0
    assert {m.name for m in result.metrics} == {"write", "read"}
    assert os.listdir(tmp_path) == []


def test_storage_check_skips_a_missing_path(tmp_path):
    result = ALL_CHECKS["storage"]().run(ctx_for(ALL_CHECKS["storage"], storage_path=str(tmp_path / "nope")))
    assert result.status == Status.SKIP and "not a directory" in result.reason


def test_cpu_stress_verifies_its_products():
    result = ALL_CHECKS["cpu_stress"]().run(ctx_for(ALL_CHECKS["cpu_stress"], quick=True))
    assert result.status == Status.PASS, result.reason
    assert result.details["wrong_elements"] == 0 and result.details["iterations"] >= 4


def test_cpu_share_is_the_cpu_time_a_measurement_got_over_its_wall_time_and_threads():
    assert cpu_share(2.0, 1.0, 2) == 1.0  # two threads busy for the whole second: a quiet node
    assert cpu_share(1.0, 1.0, 2) == 0.5
    assert cpu_share(0.333, 1.0, 1) == 0.333  # a third of one core: two other processes shared it
    assert cpu_share(1.0, 1.0, 0) == 1.0 and cpu_share(0.0, 0.0, 1) == 0.0  # no thread count, no time: no error
