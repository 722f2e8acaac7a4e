"""The windows' storage dtype (``QuantSpec.window_dtype``): the model's dtype, or float8_e4m3fn.

FP8 windows carry no scale (a per-tensor scale of 1): a write rounds to nearest even and
saturates at ``±FP8_MAX`` (torch's cast of a larger value to float8_e4m3fn may give NaN, so every
write clamps first). Every read upcasts exactly: each e4m3 value is a bf16, fp16 and fp32 value.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "FP8_WINDOW", "is_fp8", "through_window", "to_window", "window_torch_dtype"]

FP8_WINDOW = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest float8_e4m3fn


def window_torch_dtype(window_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the window pools for ``QuantSpec.window_dtype`` and the model's dtype."""
    if window_dtype == "model":
        return model_dtype
    if window_dtype == "fp8_e4m3":
        return FP8_WINDOW
    raise ValueError(f"window_dtype must be 'model' or 'fp8_e4m3'; got {window_dtype!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_WINDOW


def to_window(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` stored as ``dtype``: fp8 rounds ``x.float()`` to nearest even after clamping it to
    ``±FP8_MAX`` (NaN stays NaN); any other dtype is a plain cast."""
    if dtype == FP8_WINDOW:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_WINDOW)
    return x.to(dtype)


def through_window(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the windows give it back: stored as ``dtype`` (:func:`to_window`) and read in
    ``x.dtype``; ``x`` itself where ``dtype`` is ``x.dtype``."""
    if dtype == x.dtype:
        return x
    return to_window(x, dtype).to(x.dtype)
