"""The step-time model's physical constants: one set, in this one place, for every figure.

The hardware (PCIe, root port, host memory, NIC, GPU<->NIC P2P, NVLink) is the parts
catalogue's (``catalog.toml``, each number with its source). What the catalogue cannot hold
is here: how fast a GPU runs a training step's arithmetic, and how each system overlaps its
communication. The paper states none of these, so two are *read off one figure each* (said
below) and then used unchanged for every other figure and every forecast; the rest are
structural choices with their reason. ``tests/fabric/test_fabric_steptime.py`` checks that no
figure's code builds its own :class:`StepConstants` or replaces a field of :data:`CONSTANTS`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fireflyer.errors import UserError


@dataclass(frozen=True, kw_only=True)
class StepConstants:
    """Constants of :mod:`fireflyer.fabric.steptime`. Rates are sustained training rates per GPU."""

    tf32_train_tflops: float = 31.8
    """FP32 (TF32) training arithmetic per GPU, TFLOP/s. Read off Fig. 8b: GPT-2 medium at 32
    sequences of 256 tokens per GPU is 18.1 TFLOP a step (6 x 355M parameters + attention, per
    token), and HaiScale FSDP's 0.57 s at 16 GPUs is all compute (its allgathers and
    reduce-scatter hide behind it). 30% of Table II's TF32 GEMM. (Read off Fig. 8a's VGG16
    instead, it would be 35.7: 9 of the 12 Fig. 8 rows land within 10% with 31.8, 5 with 35.7.)"""
    bf16_train_tflops: float = 172.0
    """BF16 training arithmetic per GPU, TFLOP/s. Read off Fig. 9a: the rate at which the model's
    LLaMA-13B step at 64 GPUs (PP=4) is the paper's 64.118 s. 78% of Table II's FP16 GEMM."""
    nccl_overlap: float = 0.0
    """Fraction of an NCCL collective that hides behind compute in Torch DDP/FSDP on these nodes.
    0: NCCL's kernels take SMs and the PCIe links the compute needs (paper IV-B), and Fig. 8a's
    Torch DDP step (0.27 s) is HaiScale's compute plus the whole ring allreduce. Read off Fig. 8a."""
    haiscale_overlap: float = 1.0
    """Fraction of HaiScale's DDP allreduce / FSDP allgather and reduce-scatter that can hide behind
    the backward pass (forward, for FSDP's first allgather): 1, as the paper says HFReduce runs on
    the copy engines and CPUs with no SMs ("complete asynchrony with no overhead", IV-B, V-A)."""
    backward_share: float = 2.0 / 3.0
    """Share of a step's arithmetic in the backward pass (backward = 2 x forward)."""
    micro_batch: int = 1
    """Sequences per pipeline micro-batch (the paper gives none; 1 keeps activations of 2k-4k
    tokens within 40 GB)."""
    grad_bytes: int = 4
    """Bytes per gradient element in the data-parallel allreduce: FP32 (Megatron-style BF16
    training accumulates and reduces gradients in FP32; DDP/FSDP on FP32 models do too)."""
    activation_bytes: int = 2
    """Bytes per activation element sent between pipeline stages and in EP's all-to-all (BF16)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not v >= 0:
                raise UserError(f"step constant {f.name} must not be negative, got {v}")
        for name in ("tf32_train_tflops", "bf16_train_tflops", "micro_batch", "grad_bytes", "activation_bytes"):
            if not getattr(self, name) > 0:
                raise UserError(f"step constant {name} must be positive")
        if self.nccl_overlap > 1 or self.haiscale_overlap > 1 or not 0 < self.backward_share < 1:
            raise UserError("overlaps must be within 0..1 and backward_share strictly between 0 and 1")

    def rate_flops(self, precision: str) -> float:
        """Sustained FLOP/s per GPU for ``precision`` ("tf32" or "bf16")."""
        if precision == "tf32":
            return self.tf32_train_tflops * 1e12
        if precision == "bf16":
            return self.bf16_train_tflops * 1e12
        raise UserError(f"precision must be 'tf32' or 'bf16', got {precision!r}")


#: The one set every figure and forecast uses.
CONSTANTS = StepConstants()
