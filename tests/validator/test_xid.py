"""The Xid catalogue agrees with reliability.md's table (§3.3) and the paper's Tables V and VI."""

from __future__ import annotations

import pytest

from fireflyer.validator.xid import (
    CATALOGUE,
    TABLE_VI,
    Action,
    XidClass,
    lookup,
    recovery_action,
)

# reliability.md §3.3: Xid -> (NVIDIA mnemonic, NVIDIA action, fatal)
NVIDIA = {
    13: ("ROBUST_CHANNEL_GR_EXCEPTION", "RESTART_APP", False),
    31: ("ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP", False),
    43: ("ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE", False),
    45: ("ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45", False),
    44: ("ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "IGNORE", False),
    46: ("ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "RESET_GPU", True),
    48: ("ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48", True),
    61: ("PMU_BREAKPOINT", "UNEXPECTED_ERR_REPORT_ISSUE", True),
    62: ("PMU_HALT_ERROR", "RESET_GPU", True),
    63: ("INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE", False),
    64: ("INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU", True),
    69: ("ROBUST_CHANNEL_GR_CLASS_ERROR", "RESTART_APP", False),
    74: ("NVLINK_ERROR", "WORKFLOW_NVLINK_ERR", True),
    79: ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM", True),
    92: ("EXCESSIVE_SBE_INTERRUPTS", "IGNORE", False),
    94: ("ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP", False),
    95: ("ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU", True),
    109: ("ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "RESET_GPU", True),
    119: ("GSP_RPC_TIMEOUT", "RESET_GPU", True),
    120: ("GSP_ERROR", "RESET_GPU", True),
}

# reliability.md's policy sets: drain (hardware fault), reset when idle, app errors (no drain)
DRAIN = {46, 48, 61, 62, 64, 74, 79, 95, 119, 120}
RESET_WHEN_IDLE = {63, 94}
APP_ERRORS = {13, 31, 43, 45}

# paper Table V
CLASSES = {
    XidClass.SOFTWARE: {13, 31, 43, 45},
    XidClass.NVLINK: {74},
    XidClass.GPU_ECC: {63, 64, 94, 95},
    XidClass.UNCORRECTABLE: {44, 48, 61, 62, 69, 79},
    XidClass.GSP: {119},
}


@pytest.mark.parametrize("code", sorted(NVIDIA))
def test_nvidia_mnemonic_action_and_fatal_match_reliability_md(code):
    x = CATALOGUE[code]
    assert (x.mnemonic, x.nvidia_action, x.fatal) == NVIDIA[code]


def test_operator_actions_follow_the_drain_reset_and_app_sets():
    for code in DRAIN:
        assert CATALOGUE[code].action is Action.DRAIN, code
    for code in RESET_WHEN_IDLE:
        assert CATALOGUE[code].action is Action.RESET_GPU, code
    for code in APP_ERRORS:
        assert CATALOGUE[code].action in (Action.RESTART_APP, Action.IGNORE), code
    assert CATALOGUE[13].action is CATALOGUE[31].action is Action.RESTART_APP
    # the paper's uncorrectable 44 and 69 need a GPU reset even though NVIDIA does not drain for them
    assert CATALOGUE[44].action is CATALOGUE[69].action is Action.RESET_GPU


def test_classes_are_the_papers_table_v():
    for cls, codes in CLASSES.items():
        assert {c for c, x in CATALOGUE.items() if x.xid_class is cls} == codes


def test_table_vi_counts_sum_to_the_papers_total_and_are_all_catalogued():
    assert sum(TABLE_VI.values()) == 12970
    assert TABLE_VI[74] == 5521 and TABLE_VI[43] == 4342 and TABLE_VI[31] == 2487
    assert set(TABLE_VI) <= set(CATALOGUE)


def test_unknown_codes_are_an_entry_not_an_error():
    x = lookup(999)
    assert x.xid_class is XidClass.UNKNOWN and x.action is Action.UNKNOWN and x.code == 999


def test_xid_154_takes_its_action_from_the_message():
    assert recovery_action(154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)") is Action.RESET_GPU
    assert recovery_action(154, "... to 0x2 (Node Reboot Required)") is Action.DRAIN
    assert recovery_action(154, "") is Action.UNKNOWN
    assert recovery_action(74, "anything") is Action.DRAIN


def test_the_xid_checks_drain_list_is_the_catalogues_drain_action():
    from fireflyer.validator.checks.xid_log import DRAIN_XIDS

    assert DRAIN_XIDS == sorted(c for c, x in CATALOGUE.items() if x.action is Action.DRAIN)
    # reliability.md's drain set (the check's hand list before it was derived), every code now catalogued
    assert DRAIN_XIDS == [46, 48, 61, 62, 64, 74, 79, 95, 119, 120, 140, 143, 144, 145, 146, 147, 148, 149, 150,
                          155, 158]
    assert all(CATALOGUE[c].fatal for c in DRAIN_XIDS)
