"""Per-row clipping and group quantizers (pure torch, any device, rows of shape ``[..., d]``).

Every quantizer returns ``(codes, meta)``: ``codes`` uint8 ``[..., d]`` (unpacked, values in
``[0, 2**bits)``) and ``meta`` ``[..., d // group, 2]`` holding ``(scale, zero)`` in the metadata
dtype. Scale and zero are rounded to that dtype *before* the codes are computed, so the codes
are the best ones for the metadata a reader actually sees. The affine quantizers reconstruct
``x_hat = (q - zero) * scale`` (:func:`dequantize_affine`); the true-centroid Lloyd-Max variant
stores ``(sigma, mu)`` and reconstructs ``mu + sigma * centroid[q]`` (:func:`dequantize_codebook`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = [
    "META_TORCH_DTYPES",
    "OSCAR_LM_RATIO",
    "clip_index",
    "clip_rows",
    "clip_threshold",
    "dequantize_affine",
    "dequantize_codebook",
    "lloyd_max_gaussian",
    "quantize_asymmetric",
    "quantize_lloyd_max",
    "quantize_symmetric",
]

META_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# OSCAR's INT2 Lloyd-Max hybrid constants (spec §4.3): decision thresholds on the z-score and
# the centroid span; the reconstruction is uniform, stretched by LM_RATIO.
OSCAR_LM_THRESHOLD = 0.98106527
OSCAR_LM_SPAN = 3.01911712
OSCAR_LM_RATIO = 1.16


def clip_index(ratio: float, d: int) -> int:
    """0-based index into the ascending sorted |x| that gives the clip threshold (spec §3)."""
    return min(math.floor(ratio * d), d - 1)


def clip_threshold(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Per-row clip threshold tau ``[..., 1]``: the ``clip_index``-th smallest |x| of the row."""
    c = clip_index(ratio, x.shape[-1])
    return x.abs().kthvalue(c + 1, dim=-1, keepdim=True).values


def clip_rows(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row of ``x`` ``[..., d]`` to ``±tau`` (``ratio <= 0`` returns ``x`` unchanged)."""
    if ratio <= 0:
        return x
    tau = clip_threshold(x, ratio)
    return torch.maximum(torch.minimum(x, tau), -tau)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    d = x.shape[-1]
    if group <= 0 or d % group:
        raise ValueError(f"group size {group} must divide the last dim {d}")
    return x.float().reshape(*x.shape[:-1], d // group, group)


def _meta(scale: torch.Tensor, zero: torch.Tensor, meta_dtype: str) -> torch.Tensor:
    dt = META_TORCH_DTYPES[meta_dtype]
    return torch.stack([scale, zero], dim=-1).to(dt)


def _safe_scale(scale: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, meta_dtype: str):
    # Keep |zero| = |lo| / scale representable in 16-bit metadata for near-constant groups, and
    # keep scale above the dtype's smallest normal so it never rounds to 0.
    bound = torch.maximum(lo.abs(), hi.abs()) / 16384.0
    tiny = torch.finfo(META_TORCH_DTYPES[meta_dtype]).tiny
    return torch.maximum(scale, bound).clamp_min(tiny)


def _finish(xg: torch.Tensor, meta: torch.Tensor, levels: int) -> torch.Tensor:
    s = meta[..., 0:1].float()
    z = meta[..., 1:2].float()
    q = torch.floor(xg / s + z + 0.5).clamp_(0, levels - 1)
    return q.to(torch.uint8).flatten(-2)


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """Correctly rounded ``x / c`` on every device (CUDA turns a division by a Python scalar into a
    multiply by its rounded reciprocal, which differs in the last bit for ~1 row in 3 of fp32
    metadata; dividing by a same-shaped tensor is a true division everywhere)."""
    return x / torch.full_like(x, c)


def quantize_asymmetric(
    x: torch.Tensor, bits: int, group: int, meta_dtype: str = "fp16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """OSCAR's min-max quantizer (spec §4.1): ``s = max(M - m, 1e-8) / (2^b - 1)``, ``z = -m/s``
    (not rounded), ``q = floor(x/s + z + 0.5)`` clamped, i.e. round half up."""
    levels = 1 << bits
    xg = _grouped(x, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    s = _safe_scale(_div(((hi - lo).clamp_min(1e-8)), levels - 1), lo, hi, meta_dtype)
    meta = _meta(s, -lo / s, meta_dtype)
    return _finish(xg, meta, levels), meta


def quantize_symmetric(
    x: torch.Tensor, bits: int, group: int, meta_dtype: str = "fp16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric mid-rise quantizer (the naive baseline): ``zero = (2^b - 1)/2`` fixed and
    ``scale = absmax / zero``, so the levels are ``±absmax, ±absmax/3`` for 2 bits."""
    levels = 1 << bits
    half = (levels - 1) / 2
    xg = _grouped(x, group)
    amax = xg.abs().amax(-1)
    s = _safe_scale(_div(amax.clamp_min(1e-8), half), amax, amax, meta_dtype)
    meta = _meta(s, torch.full_like(s, half), meta_dtype)
    return _finish(xg, meta, levels), meta


@lru_cache(maxsize=8)
def lloyd_max_gaussian(levels: int, iters: int = 2000) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Lloyd-Max quantizer of N(0, 1) with ``levels`` levels: ``(thresholds, centroids)``."""
    inv_sqrt2pi = 1.0 / math.sqrt(2.0 * math.pi)

    def pdf(t: float) -> float:
        return 0.0 if math.isinf(t) else inv_sqrt2pi * math.exp(-0.5 * t * t)

    def cdf(t: float) -> float:
        return 0.5 * (1.0 + math.erf(t / math.sqrt(2.0)))

    c = [-2.0 + 4.0 * (i + 0.5) / levels for i in range(levels)]
    for _ in range(iters):
        t = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(levels - 1)] + [math.inf]
        c = [(pdf(t[i]) - pdf(t[i + 1])) / (cdf(t[i + 1]) - cdf(t[i])) for i in range(levels)]
    t = [(c[i] + c[i + 1]) / 2 for i in range(levels - 1)]
    return tuple(t), tuple(c)


def quantize_lloyd_max(
    x: torch.Tensor,
    bits: int,
    group: int,
    meta_dtype: str = "fp16",
    mode: str = "hybrid",
    lm_ratio: float = OSCAR_LM_RATIO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd-Max bucketing of the per-group z-score (population std + 1e-8, spec §4.3).

    ``mode="hybrid"`` is OSCAR's INT2 variant: Lloyd-Max thresholds, then a *uniform*
    reconstruction stored as affine ``(scale, zero)`` with ``scale = span/3 * lm_ratio * sigma``
    and ``zero = 1.5 - mu/scale`` (read back with :func:`dequantize_affine`). ``mode="centroid"``
    stores ``(sigma, mu)`` and reconstructs at the true centroids (:func:`dequantize_codebook`),
    for any bit width.
    """
    levels = 1 << bits
    xg = _grouped(x, group)
    mu = xg.mean(-1)
    sigma = torch.sqrt(xg.var(-1, unbiased=False) + 1e-8)
    zs = (xg - mu[..., None]) / sigma[..., None]
    if mode == "hybrid":
        if bits != 2:
            raise ValueError("OSCAR's Lloyd-Max hybrid is defined for 2 bits; use mode='centroid'")
        thresholds = torch.tensor([-OSCAR_LM_THRESHOLD, 0.0, OSCAR_LM_THRESHOLD], device=x.device)
        s = OSCAR_LM_SPAN / 3 * lm_ratio * sigma
        meta = _meta(s, 1.5 - mu / s, meta_dtype)
    elif mode == "centroid":
        thresholds = torch.tensor(lloyd_max_gaussian(levels)[0], device=x.device)
        meta = _meta(sigma, mu, meta_dtype)
    else:
        raise ValueError(f"mode must be 'hybrid' or 'centroid'; got {mode!r}")
    codes = (zs[..., None] >= thresholds).sum(-1).to(torch.uint8)
    return codes.flatten(-2), meta


def dequantize_affine(codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``(q - zero) * scale`` per group -> float32 ``[..., d]``."""
    groups = meta.shape[-2]
    qg = codes.float().reshape(*codes.shape[:-1], groups, codes.shape[-1] // groups)
    m = meta.float()
    return ((qg - m[..., 1:2]) * m[..., 0:1]).flatten(-2)


def dequantize_codebook(codes: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """``mu + sigma * centroid[q]`` per group (true-centroid Lloyd-Max) -> float32 ``[..., d]``."""
    groups = meta.shape[-2]
    cb = torch.tensor(lloyd_max_gaussian(1 << bits)[1], device=codes.device)
    qg = cb[codes.long()].reshape(*codes.shape[:-1], groups, codes.shape[-1] // groups)
    m = meta.float()
    return (m[..., 1:2] + m[..., 0:1] * qg).flatten(-2)
