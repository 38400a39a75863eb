"""The Xid catalogue: what each NVIDIA Xid code means and what an operator should do about it.

An *Xid* is an error report the NVIDIA kernel driver writes to the kernel log as
``NVRM: Xid (PCI:0000:65:00): 74, pid=..., <message>``. The number names the kind of fault.
Fire-Flyer's year of logs from ~10,000 PCIe A100s (paper §VII-C, Tables V and VI) groups the
codes it saw into classes: *software* faults triggered by applications (13, 31, 43, 45), the
*NVLink* bridge error (74), GPU memory *ECC* events (63, 64, 94, 95), *uncorrectable* GPU
failures (44, 48, 61, 62, 69, 79) and the *GSP* firmware processor (119).

For each code the catalogue keeps NVIDIA's own recommended action mnemonic (``RESET_GPU``,
``RESTART_APP``, ``IGNORE``, ``WORKFLOW_*``...) and whether NVIDIA calls it fatal, and reduces them
to one of four operator actions (:class:`Action`): drain the node, reset the GPU when it is
idle, restart the application, or ignore. ``interrupts`` says whether the event stops the running
job; it is what counts as a failure for the MTBF. Codes missing from the catalogue are *unknown*:
they are counted, never rejected.

Codes 140-158 (newer GPUs: Hopper, Blackwell's NVLink5) are not in the paper's tables; their
mnemonics, meanings and actions are NVIDIA's Xid catalogue
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), their FATAL flags NVSentinel's
``xiderrorsmapping.csv``. NVIDIA acts on each, so the operator action is to drain.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class XidClass(str, Enum):
    """The paper's Table V/VI classes, plus two of our own for codes the paper does not class."""

    NVLINK = "NVLink Error"
    SOFTWARE = "Software"
    GPU_ECC = "GPU ECC"
    UNCORRECTABLE = "Uncorrectable"
    GSP = "GSP"
    UNCLASSIFIED = "Unclassified"  # in the catalogue but not in the paper's tables
    UNKNOWN = "Unknown"  # not in the catalogue at all


class Action(str, Enum):
    """What an operator does about an Xid, from most to least severe."""

    DRAIN = "drain"  # take the node out of scheduling, then reset/reboot/test; RMA if it repeats
    RESET_GPU = "reset GPU"  # reset the GPU (when idle) to recover, e.g. to activate a row remap
    RESTART_APP = "restart app"  # the application died; the hardware is fine
    IGNORE = "ignore"  # a consequence of another error, or a trend to monitor
    UNKNOWN = "unknown"  # not in the catalogue: look it up


@dataclass(frozen=True, kw_only=True)
class Xid:
    """One catalogue entry."""

    code: int
    mnemonic: str
    meaning: str
    xid_class: XidClass
    nvidia_action: str
    """NVIDIA's recommended-action mnemonic, as in its Xid catalogue."""
    fatal: bool | None
    """NVIDIA's FATAL/NONFATAL flag; ``None`` where NVIDIA gives none."""
    action: Action
    interrupts: bool
    """Whether the event stops the job running on the GPU (a failure for MTBF purposes)."""
    note: str = ""


def _x(code, mnemonic, meaning, cls, nv, fatal, action, interrupts, note=""):
    return Xid(
        code=code, mnemonic=mnemonic, meaning=meaning, xid_class=cls, nvidia_action=nv,
        fatal=fatal, action=action, interrupts=interrupts, note=note,
    )


_S, _N, _E, _U, _G, _O = (
    XidClass.SOFTWARE, XidClass.NVLINK, XidClass.GPU_ECC, XidClass.UNCORRECTABLE, XidClass.GSP, XidClass.UNCLASSIFIED,
)
_D, _R, _A, _I = Action.DRAIN, Action.RESET_GPU, Action.RESTART_APP, Action.IGNORE

CATALOGUE: dict[int, Xid] = {
    x.code: x
    for x in (
        _x(13, "ROBUST_CHANNEL_GR_EXCEPTION", "graphics engine exception (illegal instruction or address in a kernel)",
           _S, "RESTART_APP", False, _A, True, "escalate if it repeats across different jobs"),
        _x(31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault (MMU fault)",
           _S, "RESTART_APP", False, _A, True, "escalate if it repeats across different jobs"),
        _x(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing (channel reset after an app fault)",
           _S, "IGNORE", False, _I, False, "follows the app's own fault"),
        _x(44, "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "graphics fault during a context switch",
           _U, "IGNORE", False, _R, True, "the paper needs a GPU reset or node reboot"),
        _x(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "preemptive cleanup after earlier errors",
           _S, "WORKFLOW_XID_45", False, _I, False, "look at the Xid before it"),
        _x(46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing (timeout)",
           _O, "RESET_GPU", True, _D, True),
        _x(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "double-bit (uncorrectable) ECC error",
           _U, "WORKFLOW_XID_48", True, _D, True, "reset, check row remap; RMA if it recurs"),
        _x(61, "PMU_BREAKPOINT", "internal micro-controller breakpoint or warning",
           _U, "UNEXPECTED_ERR_REPORT_ISSUE", True, _D, True, "reset or reboot"),
        _x(62, "PMU_HALT_ERROR", "internal micro-controller halt",
           _U, "RESET_GPU", True, _D, True),
        _x(63, "INFOROM_DRAM_RETIREMENT_EVENT", "ECC page retirement or row-remap recording event",
           _E, "IGNORE", False, _R, False, "reset when idle to activate the remap; track counts"),
        _x(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "ECC page retirement or row-remap failure",
           _E, "RESET_GPU", True, _D, True, "RMA if it repeats after a reset"),
        _x(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "graphics engine class error",
           _U, "RESTART_APP", False, _R, True, "the paper needs a GPU reset or node reboot"),
        _x(74, "NVLINK_ERROR", "NVLink error (on PCIe A100 mostly the NVLink bridge)",
           _N, "WORKFLOW_NVLINK_ERR", True, _D, True, "stress-test the link; remove repeat offenders"),
        _x(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus",
           _U, "RESTART_BM", True, _D, True, "reboot the node; reseat, then RMA"),
        _x(92, "EXCESSIVE_SBE_INTERRUPTS", "high single-bit ECC error rate",
           _O, "IGNORE", False, _I, False, "monitor the trend: it predicts failures"),
        _x(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "contained ECC error (only the affected app is killed)",
           _E, "RESTART_APP", False, _R, True, "restart the app; reset the GPU when idle"),
        _x(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "uncontained ECC error (every app on the GPU affected)",
           _E, "RESET_GPU", True, _D, True),
        _x(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "context-switch timeout",
           _O, "RESET_GPU", True, _R, True),
        _x(119, "GSP_RPC_TIMEOUT", "GSP (GPU System Processor) RPC timeout",
           _G, "RESET_GPU", True, _D, True, "run fieldiag; most need RMA"),
        _x(120, "GSP_ERROR", "GSP error", _O, "RESET_GPU", True, _D, True),
        _x(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "unrecovered ECC error: uncorrectable GPU memory errors the driver "
           "could not mark for page offlining or row remapping", _O, "RESET_GPU", True, _D, True,
           "reset the GPU; contact the vendor if it persists"),
        _x(143, "GPU_INIT_ERROR", "GPU initialization error", _O, "RESET_GPU", True, _D, True),
        *(_x(code, f"NVLINK_{unit}_ERROR", f"NVLink5 {unit} error", _O, "WORKFLOW_NVLINK5_ERR", True, _D, True,
             "decode the message's intrInfo and errorStatus with NVIDIA's 'Xid 144-150 Decode' table; "
             "some sub-errors are non-fatal")
          for code, unit in ((144, "SAW"), (145, "RLW"), (146, "TLW"), (147, "TREX"), (148, "NVLPW_CTRL"),
                             (149, "NETIR"), (150, "MSE"))),
        _x(154, "GPU_RECOVERY_ACTION_CHANGED", "the driver states the recovery action the GPU needs",
           _O, "FOLLOW_LINKED_XID", None, Action.UNKNOWN, False, "the action is in the message text"),
        _x(155, "NVLINK_SW_DEFINED_ERROR", "NVLink software-defined error (a link-down flagged as intentional, "
           "including a transition to sleep)", _O, "RESET_GPU", True, _D, True),
        _x(158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", _O, "RESET_GPU", True, _D, True),
    )
}

TABLE_VI: dict[int, int] = {
    74: 5521, 13: 45, 31: 2487, 43: 4342, 45: 240, 63: 245, 64: 2, 94: 13, 95: 17,
    44: 1, 48: 2, 61: 13, 62: 3, 69: 1, 79: 37, 119: 1,
}
"""Fire-Flyer's raw Xid counts over one year on ~10,000 PCIe A100s (paper Table VI; 12,970 in all)."""

CLASS_ORDER: tuple[XidClass, ...] = tuple(XidClass)
"""Row order of Table VI-style reports."""


def lookup(code: int) -> Xid:
    """The catalogue entry for ``code``, or an *unknown* entry (never an error) if it is not catalogued."""
    entry = CATALOGUE.get(code)
    if entry is not None:
        return entry
    return Xid(
        code=code, mnemonic="UNKNOWN", meaning="not in fireflyer's Xid catalogue", xid_class=XidClass.UNKNOWN,
        nvidia_action="UNKNOWN", fatal=None, action=Action.UNKNOWN, interrupts=True,
        note="counted as a failure to stay on the safe side; look it up in NVIDIA's Xid catalogue",
    )


def recovery_action(code: int, message: str = "") -> Action:
    """The operator action for one Xid line.

    Xid 154 carries its action in the message ("... to 0x2 (Node Reboot Required)"), so it is read
    from there: a reboot or drain means :attr:`Action.DRAIN`, a GPU reset :attr:`Action.RESET_GPU`.
    """
    if code == 154:
        text = message.lower()
        if "reboot" in text or "drain" in text:
            return Action.DRAIN
        if "reset" in text:
            return Action.RESET_GPU
        return Action.UNKNOWN
    return lookup(code).action
