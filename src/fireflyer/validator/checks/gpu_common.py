"""What the GPU checks share: whether CUDA is usable here, and the devices to test."""

from __future__ import annotations


def cuda_skip_reason() -> str | None:
    """Why GPU checks cannot run here, or None when at least one CUDA device is usable."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return f"torch is not importable: {exc}"
    if not torch.backends.cuda.is_built():
        return "no CUDA: this torch is a CPU-only build"
    try:
        if not torch.cuda.is_available():
            return "no CUDA device visible (no GPU, no driver, no permission, or CUDA_VISIBLE_DEVICES is empty)"
        if torch.cuda.device_count() < 1:
            return "no CUDA device visible"
    except RuntimeError as exc:
        return f"CUDA is not usable: {exc}"
    return None


def gpu_count() -> int:
    """Usable CUDA devices (0 where CUDA is absent)."""
    if cuda_skip_reason() is not None:
        return 0
    import torch

    return torch.cuda.device_count()


def gpu_names() -> list[str]:
    """``torch.cuda.get_device_name`` of every usable device."""
    import torch

    return [torch.cuda.get_device_name(i) for i in range(gpu_count())]
