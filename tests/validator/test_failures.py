"""Kernel-log parsing and failure analysis: each line format, noise, malformed lines, IB incidents, MTBF."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest

from fireflyer.validator.failures import (
    ParseOptions,
    analyse,
    daly_interval,
    link_incidents,
    mtbf_hours,
    parse_log,
    xid_class_totals,
    xid_table,
    young_daly_interval,
)

BOOT = datetime(2023, 10, 2, 8, 0, 0, tzinfo=timezone.utc)


def one(line: str, **kw):
    return parse_log(line + "\n", source="t", options=ParseOptions(**kw))


def test_dmesg_boot_relative_stays_on_the_boot_clock_without_a_boot_time():
    log = one("[12345.678901] NVRM: Xid (PCI:0000:65:00): 74, pid=4242, name=python3, NVLink: fatal error", node="gpu1")
    (e,) = log.xids
    assert (e.node, e.code, e.pci, e.pid, e.process, e.clock) == ("gpu1", 74, "0000:65:00", 4242, "python3", "boot")
    assert e.time == pytest.approx(12345.678901)


def test_dmesg_boot_relative_with_a_boot_time_is_wall_clock():
    (e,) = one("[   60.000000] NVRM: Xid (PCI:0000:65:00): 31, pid=1, name=x, Ch 00000010", boot_time=BOOT).xids
    assert e.clock == "wall" and e.time == BOOT.timestamp() + 60


def test_dmesg_T_carries_its_year():
    (e,) = one("[Mon Oct  2 10:11:12 2023] NVRM: Xid (PCI:0000:65:00): 43, pid=1, name=x, Ch 00000008").xids
    assert e.time == datetime(2023, 10, 2, 10, 11, 12, tzinfo=timezone.utc).timestamp() and e.code == 43


def test_journalctl_names_the_node_and_takes_the_year_from_options():
    (e,) = one("Oct 02 10:11:12 gpu-node-7 kernel: NVRM: Xid (PCI:0000:65:00): 79, pid=<unknown>, GPU has fallen off the bus.",
               year=2022, node="fallback").xids
    assert e.node == "gpu-node-7" and e.pid is None
    assert e.time == datetime(2022, 10, 2, 10, 11, 12, tzinfo=timezone.utc).timestamp()


def test_kern_log_inner_boot_stamp_and_iso_journal():
    kern = one("Oct  2 10:11:12 n1 kernel: [ 1234.5] NVRM: Xid (PCI:0000:65:00): 13, pid=1, name=x, oops", year=2023)
    iso = one("2023-10-02T10:11:12+02:00 n2 kernel: NVRM: Xid (PCI:0000:65:00): 13, pid=1, name=x, oops")
    assert kern.xids[0].code == 13 and kern.xids[0].node == "n1"
    assert iso.xids[0].time == datetime(2023, 10, 2, 8, 11, 12, tzinfo=timezone.utc).timestamp()


def test_year_rolls_over_and_mtime_year_is_the_last_lines_year():
    text = "Dec 31 23:59:00 n kernel: NVRM: Xid (PCI:0:1:0): 74, x\nJan 01 00:01:00 n kernel: NVRM: Xid (PCI:0:1:0): 74, x\n"
    first = parse_log(text, source="t", options=ParseOptions(year=2023))
    last = parse_log(text, source="t", options=ParseOptions(year=2024, year_is_last=True))
    for log in (first, last):
        a, b = (e.time for e in log.xids)
        assert b - a == 120  # two minutes across New Year
        assert datetime.fromtimestamp(b, timezone.utc).year == 2024


def test_noise_malformed_and_unknown_codes_are_counted_not_fatal():
    text = "\n".join([
        "[    1.000000] Linux version 6.1.0 (gcc 12)",                              # noise
        "Oct 02 10:00:00 n systemd[1]: Started Session 3 of User root.",            # noise
        "-- Boot 0123456789abcdef --",                                             # noise (journal marker)
        "[    2.000000] NVRM: GPU at PCI:0000:65:00: GPU-1234",                      # noise
        "[    3.000000] NVRM: Xid (PCI:0000:65:00): 999, pid=1, name=x, new thing",  # unknown code
        "[    4.000000] NVRM: Xid (PCI:0000:65:00): seventy-four",                  # malformed Xid
        "this line has no time stamp",                                             # malformed
        "[12x.5] NVRM: Xid (PCI:0000:65:00): 74, x",                                # malformed stamp
        "Feb 30 10:00:00 n kernel: NVRM: Xid (PCI:0000:65:00): 74, x",              # not a date
        "",                                                                        # blank: not counted
    ])
    log = parse_log(text, source="t", options=ParseOptions(year=2023))
    assert (log.lines, log.noise, log.malformed) == (9, 4, 4)
    assert [e.code for e in log.xids] == [999]
    a = analyse([log])
    assert a.xids == {999: 1}
    (row,) = xid_table(a.xids)
    assert row.xid_class == "Unknown" and row.action == "unknown" and row.percent == 100.0
    assert xid_class_totals(a.xids) == {"Unknown": 1}


@pytest.mark.parametrize("down,up", [
    ("mlx5_core 0000:e1:00.0 ib0: Link down", "mlx5_core 0000:e1:00.0 ib0: Link up"),
    ("ib0: lost carrier", "IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready"),
    ("ib1: Lost Carrier", "ib1: Link is Up"),
    ("mlx5_ib: mlx5_0: port 1 state changed: ACTIVE -> DOWN", "mlx5_ib: mlx5_0: port 1 state changed: DOWN -> ACTIVE"),
    ("ib_core: mlx5_1 port 1 event: PORT_ERR", "ib_core: mlx5_1 port 1 event: PORT_ACTIVE"),
])
def test_ib_link_messages_pair_into_flash_cuts_and_outages(down, up):
    text = "\n".join([
        f"[  100.000000] {down}", f"[  110.000000] {up}",     # back in 10 s: flash cut
        f"[ 1000.000000] {down}", f"[ 2000.000000] {up}",     # back in 1000 s: outage
        f"[ 5000.000000] {down}",                             # never back: outage
    ])
    log = parse_log(text, source="t", options=ParseOptions(node="n"))
    assert len(log.links) == 5 and log.noise == 0
    incs = link_incidents(log.links, window_s=60)
    assert [(i.flash, i.up is not None) for i in incs] == [(True, True), (False, True), (False, False)]
    s = analyse([log]).nodes["n"]
    assert (s.flash_cuts, s.outages, s.interruptions) == (1, 2, 3)


def test_ethernet_and_unrelated_link_messages_are_noise():
    log = one("[ 5.0] e1000e 0000:00:1f.6 eno1: NIC Link is Down", node="n")
    assert log.links == [] and log.noise == 1


def test_node_hours_and_interruptions_per_node():
    text = "\n".join([
        "Oct 02 00:00:00 a kernel: boot",
        "Oct 02 01:00:00 a kernel: NVRM: Xid (PCI:0:1:0): 74, x",   # interrupts
        "Oct 02 02:00:00 a kernel: NVRM: Xid (PCI:0:1:0): 43, x",   # follows an app fault: does not
        "Oct 02 03:00:00 a kernel: NVRM: Xid (PCI:0:1:0): 63, x",   # row remap event: does not
        "Oct 02 10:00:00 a kernel: done",
        "Oct 02 00:00:00 b kernel: boot",
        "Oct 02 05:00:00 b kernel: done",
    ])
    a = analyse([parse_log(text, source="t", options=ParseOptions(year=2023))])
    assert a.nodes["a"].hours == 10 and a.nodes["b"].hours == 5 and a.node_hours == 15
    assert a.nodes["a"].interruptions == 1 and a.interruptions == 1
    assert analyse([parse_log(text, source="t", options=ParseOptions(year=2023))], hours_per_node=24).node_hours == 48


def test_mtbf_and_young_daly_by_hand():
    assert mtbf_hours(1000.0, 4) == 250.0
    assert mtbf_hours(1000.0, 0) is None
    # C = 10 s, M = 5 h = 18,000 s: sqrt(2 * 10 * 18000) = 600 s
    assert young_daly_interval(10.0, 18000.0) == pytest.approx(600.0)
    # Daly: 600 * (1 + sqrt(r)/3 + r/9) - 10 with r = 10/36000
    r = 10 / 36000
    assert daly_interval(10.0, 18000.0) == pytest.approx(600 * (1 + math.sqrt(r) / 3 + r / 9) - 10)
    assert daly_interval(50.0, 20.0) == 20.0  # C >= 2M: checkpoint every MTBF
    with pytest.raises(ValueError):
        young_daly_interval(1.0, 0.0)
    with pytest.raises(ValueError):
        mtbf_hours(-1.0, 1)


def test_the_xid_check_and_the_analysis_read_a_line_alike_zone_less_as_utc():
    from fireflyer.validator.checks.xid_log import parse_xids

    line = "[Mon Oct  2 10:11:12 2023] NVRM: Xid (PCI:0000:65:00): 79, pid=1, name=x, GPU has fallen off the bus."
    (check,) = parse_xids(line)
    (analysis,) = one(line).xids
    assert check == analysis
    assert check.when == datetime(2023, 10, 2, 10, 11, 12, tzinfo=timezone.utc)
    assert (check.code, check.pci, check.pid, check.process) == (79, "0000:65:00", 1, "x")
