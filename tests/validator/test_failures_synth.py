"""The synthetic log generator reproduces Table VI's mix, and the analysis recovers exactly what it generated."""

from __future__ import annotations

import pytest

from fireflyer.validator.failures import ParseOptions, analyse, parse_log
from fireflyer.testing.synthlog import SynthConfig, generate
from fireflyer.validator.xid import TABLE_VI


def analyse_synth(log):
    parsed = [
        parse_log(text, source=name, options=ParseOptions(boot_time=log.boot_time, year=log.year, node=name.split(".")[0]))
        for name, text in log.files.items()
    ]
    return analyse(parsed)


def test_mix_matches_table_vi_at_large_n():
    log = generate(SynthConfig(xids=100_000, nodes=3, seed=11, noise_per_event=0, ib_incidents=0))
    total = sum(TABLE_VI.values())
    got = log.xids
    assert sum(got.values()) == 100_000
    for code, count in TABLE_VI.items():
        # binomial standard deviation at n = 1e5 is at most 0.16 percentage points
        assert 100 * got.get(code, 0) / 100_000 == pytest.approx(100 * count / total, abs=0.5), code
    assert set(got) <= set(TABLE_VI)


def test_analysis_recovers_the_generated_counts_exactly():
    log = generate(SynthConfig(xids=3000, nodes=5, seed=3, malformed=9, ib_incidents=40, outage_fraction=0.3))
    a = analyse_synth(log)
    assert sorted(a.nodes) == sorted(log.nodes)
    for name, truth in log.nodes.items():
        got = a.nodes[name]
        assert got.xids == truth.xids, name
        assert (got.flash_cuts, got.outages) == (truth.flash_cuts, truth.outages), name
    assert a.xids == log.xids
    assert a.noise == sum(t.noise for t in log.nodes.values())
    assert a.malformed == sum(t.malformed for t in log.nodes.values()) == 9
    assert sum(t.flash_cuts + t.outages for t in log.nodes.values()) == 40
    assert {t.format for t in log.nodes.values()} == {"dmesg", "dmesg-T", "journal"}


def test_without_a_boot_time_dmesg_nodes_stay_on_the_boot_clock_but_counts_hold():
    log = generate(SynthConfig(xids=500, nodes=3, seed=5))
    parsed = [parse_log(t, source=n, options=ParseOptions(year=log.year, node=n.split(".")[0])) for n, t in log.files.items()]
    a = analyse(parsed)
    assert a.clocks == {"boot", "wall"} and a.nodes["node00"].clock == "boot"
    assert a.xids == log.xids


def test_same_seed_same_logs_and_config_checks_itself():
    assert generate(SynthConfig(xids=200, seed=1)).files == generate(SynthConfig(xids=200, seed=1)).files
    assert generate(SynthConfig(xids=200, seed=1)).files != generate(SynthConfig(xids=200, seed=2)).files
    with pytest.raises(ValueError, match="nodes"):
        SynthConfig(xids=10, nodes=0)
