"""Device names checked against this torch build (shared by the HF front ends and the engine)."""

from __future__ import annotations

from ..errors import InputError

__all__ = ["resolve_device"]


def resolve_device(device: str) -> str:
    """``device`` checked against this torch build ("auto": cuda when present, else cpu)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(
            f"--device {device}: not a device name; expected cpu, cuda or cuda:N", "or leave it at auto"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(
                f"--device {device}: this torch build ({torch.__version__}) sees no CUDA device",
                "pass --device cpu, or install a CUDA build of torch on a machine with a GPU",
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise InputError(f"--device {device}: only {n} CUDA device(s) (cuda:0 .. cuda:{n - 1})")
    elif dev.type != "cpu":
        backend = getattr(torch.backends, dev.type, None)
        if backend is None or not backend.is_available():
            raise InputError(f"--device {device}: not available in this torch build; use cpu or cuda")
    return device
