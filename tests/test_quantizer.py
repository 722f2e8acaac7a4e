"""Clipping (spec §3), asymmetric / symmetric / Lloyd-Max quantizers (spec §4.1, §4.3), RowFormat."""

from __future__ import annotations

import math

import pytest
import torch

from oscarkv import QuantSpec
from oscarkv.quant import (
    RowFormat,
    clip_index,
    clip_rows,
    clip_threshold,
    dequantize_affine,
    dequantize_codebook,
    dequantize_rows,
    lloyd_max_gaussian,
    quantize_asymmetric,
    quantize_lloyd_max,
    quantize_rows,
    quantize_symmetric,
)

LM_T = 0.98106527
LM_SPAN = 3.01911712


# ---- clipping ------------------------------------------------------------------------------
def test_clip_index_rule() -> None:
    assert clip_index(0.96, 128) == 122
    assert clip_index(0.92, 128) == 117
    assert clip_index(1.0, 128) == 127
    assert clip_index(0.5, 64) == 32


def _permuted_row(d: int = 128) -> torch.Tensor:
    mags = torch.randperm(d).float() + 1.0  # a permutation of 1..d
    signs = torch.where(torch.rand(d) < 0.5, -1.0, 1.0)
    return mags * signs


def test_clip_threshold_is_kth_smallest_magnitude() -> None:
    x = torch.stack([_permuted_row(), _permuted_row()])
    tau = clip_threshold(x, 0.96)
    assert tau.shape == (2, 1)
    assert tau.flatten().tolist() == [123.0, 123.0]
    assert clip_threshold(x, 0.92).flatten().tolist() == [118.0, 118.0]


def test_clip_rows_ratio_zero_is_identity() -> None:
    x = torch.randn(4, 128) * 5
    assert torch.equal(clip_rows(x, 0.0), x)


@pytest.mark.parametrize(("ratio", "clamped"), [(0.96, 5), (0.92, 10)])
def test_clip_rows_clamps_the_largest(ratio: float, clamped: int) -> None:
    x = torch.randn(16, 128, dtype=torch.float64)  # distinct magnitudes almost surely
    tau = clip_threshold(x, ratio)
    y = clip_rows(x, ratio)
    changed = (y != x).sum(-1)
    assert changed.tolist() == [clamped] * 16
    # the clamped elements plus the element that defines tau sit exactly at |tau|
    assert ((y.abs() == tau).sum(-1) == clamped + 1).all()
    assert (y.abs() <= tau).all()
    assert torch.equal(torch.sign(y), torch.sign(x))
    # tau is the 6th largest (|x| sorted descending) for ratio .96
    assert torch.equal(tau.squeeze(-1), x.abs().sort(-1, descending=True).values[:, clamped])


# ---- asymmetric ----------------------------------------------------------------------------
def _half_step_ok(x: torch.Tensor, xh: torch.Tensor, scale: torch.Tensor, slack: torch.Tensor | float = 0.0):
    """|x - xh| <= scale/2 per group (scale [..., G, 1] broadcast over the group)."""
    g = scale.shape[-2]
    err = (x - xh).reshape(*x.shape[:-1], g, -1).abs()
    bound = scale.float() / 2 * (1 + 1e-5) + slack
    return bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [128, 32])
def test_asymmetric_within_half_step_fp32(bits: int, group: int) -> None:
    x = clip_rows(torch.randn(64, 128) * 3, 0.96)
    codes, meta = quantize_asymmetric(x, bits, group, "fp32")
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert int(codes.min()) >= 0 and int(codes.max()) <= (1 << bits) - 1
    assert meta.dtype == torch.float32 and meta.shape == (64, 128 // group, 2)
    xh = dequantize_affine(codes, meta)
    ok, worst = _half_step_ok(x, xh, meta[..., 0:1])
    assert ok, worst


def test_asymmetric_codes_use_all_levels() -> None:
    x = torch.randn(64, 128)
    codes, _ = quantize_asymmetric(x, 2, 128, "fp32")
    assert sorted(codes.unique().tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("lead", [(32,), (2, 3, 5)])
def test_asymmetric_matches_spec_formula(lead: tuple[int, ...]) -> None:
    x = torch.randn(*lead, 128) * 2 + 0.3
    codes, meta = quantize_asymmetric(x, 2, 128, "fp32")
    m = x.amin(-1, keepdim=True)
    big_m = x.amax(-1, keepdim=True)
    s = torch.clamp(big_m - m, min=1e-8) / 3
    z = -m / s
    q = torch.floor(x / s + z + 0.5).clamp(0, 3)
    assert torch.equal(meta[..., 0, 0:1], s)
    assert torch.equal(meta[..., 0, 1:2], z)
    assert torch.equal(codes, q.to(torch.uint8))


def test_asymmetric_rounds_half_up() -> None:
    # m = 0, M = 3 -> s = 1, z = 0: x = 0.5, 1.5, 2.5 sit exactly on ties and must round up
    # (floor(x/s + z + 0.5)); round-half-to-even would give 0, 2, 2.
    x = torch.zeros(128)
    x[:6] = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0])
    codes, meta = quantize_asymmetric(x, 2, 128, "fp32")
    assert meta.flatten().tolist() == [1.0, 0.0]
    assert codes[:6].tolist() == [0, 3, 1, 2, 3, 1]


def test_asymmetric_min_and_max_reconstruct() -> None:
    x = torch.randn(16, 128) * 4 - 1
    codes, meta = quantize_asymmetric(x, 2, 128, "fp32")
    xh = dequantize_affine(codes, meta)
    lo, hi = x.argmin(-1, keepdim=True), x.argmax(-1, keepdim=True)
    assert torch.allclose(xh.gather(-1, lo), x.gather(-1, lo), atol=1e-5, rtol=1e-5)
    assert torch.allclose(xh.gather(-1, hi), x.gather(-1, hi), atol=1e-5, rtol=1e-5)
    assert (codes.gather(-1, lo) == 0).all() and (codes.gather(-1, hi) == 3).all()


def test_asymmetric_fp16_meta() -> None:
    x = clip_rows(torch.randn(64, 128) * 2 + 0.5, 0.96)
    codes, meta = quantize_asymmetric(x, 2, 128, "fp16")
    assert meta.dtype == torch.float16
    xh = dequantize_affine(codes, meta)
    m = x.amin(-1, keepdim=True)[..., None]  # [..., 1, 1] to broadcast over groups
    ok, worst = _half_step_ok(x, xh, meta[..., 0:1], 1e-2 * m.abs())
    assert ok, worst


def test_asymmetric_constant_row_is_finite() -> None:
    x = torch.full((2, 128), 3.0)
    codes, meta = quantize_asymmetric(x, 2, 128, "fp16")
    assert torch.isfinite(meta.float()).all()
    assert torch.allclose(dequantize_affine(codes, meta), x, atol=1e-2)


def test_asymmetric_group_meta_shape() -> None:
    x = torch.randn(3, 5, 128)
    codes, meta = quantize_asymmetric(x, 2, 32, "fp16")
    assert codes.shape == (3, 5, 128)
    assert meta.shape == (3, 5, 4, 2)
    # group 1 covers elements 32..63: its scale is its own min-max
    g1 = x[..., 32:64]
    s1 = (g1.amax(-1) - g1.amin(-1)) / 3
    assert torch.allclose(meta[..., 1, 0].float(), s1, rtol=1e-3)


def test_group_must_divide_dim() -> None:
    with pytest.raises(ValueError, match="group size 48 must divide the last dim 128"):
        quantize_asymmetric(torch.randn(2, 128), 2, 48)


# ---- symmetric -----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_symmetric_zero_and_extremes(bits: int) -> None:
    x = torch.randn(8, 128)
    codes, meta = quantize_symmetric(x, bits, 128, "fp32")
    half = ((1 << bits) - 1) / 2
    assert (meta[..., 1] == half).all()
    xh = dequantize_affine(codes, meta)
    amax = x.abs().amax(-1)
    i = x.abs().argmax(-1, keepdim=True)
    rec = xh.gather(-1, i).squeeze(-1)
    assert torch.allclose(rec, torch.sign(x.gather(-1, i).squeeze(-1)) * amax, rtol=1e-5)
    ok, worst = _half_step_ok(x, xh, meta[..., 0:1])
    assert ok, worst


# ---- Lloyd-Max -----------------------------------------------------------------------------
def test_lloyd_max_gaussian_4_levels() -> None:
    t, c = lloyd_max_gaussian(4)
    assert t == pytest.approx((-0.9816, 0.0, 0.9816), abs=1e-3)
    assert c == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=1e-3)


def test_lloyd_max_gaussian_2_levels() -> None:
    t, c = lloyd_max_gaussian(2)
    assert t == pytest.approx((0.0,), abs=1e-9)
    assert c == pytest.approx((-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)), abs=1e-9)


def test_lloyd_max_hybrid_matches_spec() -> None:
    x = torch.randn(32, 128) * 1.7 + 0.4
    codes, meta = quantize_lloyd_max(x, 2, 128, "fp32", mode="hybrid")
    x64 = x.double()
    mu = x64.mean(-1, keepdim=True)
    sigma = torch.sqrt(((x64 - mu) ** 2).mean(-1, keepdim=True) + 1e-8)
    z = (x64 - mu) / sigma
    thresholds = torch.tensor([-LM_T, 0.0, LM_T], dtype=torch.float64)
    expected = (z[..., None] >= thresholds).sum(-1)
    far = ((z[..., None] - thresholds).abs().amin(-1)) > 1e-5  # skip float32-vs-64 ties
    assert far.float().mean() > 0.99
    assert torch.equal(codes.long()[far], expected[far])
    scale = LM_SPAN / 3 * 1.16 * sigma
    assert torch.allclose(meta[..., 0, 0:1].double(), scale, rtol=1e-5)
    assert torch.allclose(meta[..., 0, 1:2].double(), 1.5 - mu / scale, atol=1e-5)
    # reconstruction levels are mu + sigma * {±0.5837, ±1.7511}
    xh = dequantize_affine(codes, meta).double()
    levels = torch.tensor([-1.7511, -0.5837, 0.5837, 1.7511], dtype=torch.float64)
    assert torch.allclose(xh, mu + sigma * levels[codes.long()], atol=1e-3)


def test_lloyd_max_centroid_mode() -> None:
    x = torch.randn(16, 128) * 0.8 - 0.2
    codes, meta = quantize_lloyd_max(x, 2, 128, "fp32", mode="centroid")
    mu = x.mean(-1, keepdim=True)
    sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-8)
    assert torch.allclose(meta[..., 0, 0:1], sigma, rtol=1e-5)
    assert torch.allclose(meta[..., 0, 1:2], mu, atol=1e-6)
    centroids = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
    xh = dequantize_codebook(codes, meta, 2)
    assert torch.allclose(xh, mu + sigma * centroids[codes.long()], atol=1e-3)
    z = (x - mu) / sigma
    # each value is bucketed by the ±0.9816 / 0 thresholds
    expected = (z[..., None] >= torch.tensor([-0.9816, 0.0, 0.9816])).sum(-1)
    far = ((z[..., None] - torch.tensor([-0.9816, 0.0, 0.9816])).abs().amin(-1)) > 1e-3
    assert torch.equal(codes.long()[far], expected[far])


def test_lloyd_max_centroid_3_bits() -> None:
    x = torch.randn(8, 128)
    codes, meta = quantize_lloyd_max(x, 3, 128, "fp32", mode="centroid")
    assert int(codes.max()) <= 7 and len(codes.unique()) == 8
    err = (dequantize_codebook(codes, meta, 3) - x).pow(2).mean()
    assert float(err) < 0.05  # 8-level Lloyd-Max MSE on N(0,1) is ~0.0345


def test_lloyd_max_hybrid_rejects_3_bits() -> None:
    with pytest.raises(ValueError, match="hybrid is defined for 2 bits; use mode='centroid'"):
        quantize_lloyd_max(torch.randn(2, 128), 3, 128, mode="hybrid")


def test_lloyd_max_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        quantize_lloyd_max(torch.randn(2, 128), 2, 128, mode="nf2")


# ---- RowFormat -----------------------------------------------------------------------------
def _mse(fmt: RowFormat, x: torch.Tensor) -> float:
    codes, meta = quantize_rows(x, fmt)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == fmt.packed_dim
    assert meta.shape == (*x.shape[:-1], fmt.groups, 2)
    return float((dequantize_rows(codes, meta, fmt) - x).pow(2).mean())


@pytest.mark.parametrize("quantizer", ["asymmetric", "symmetric"])
def test_row_format_error_decreases_with_bits(quantizer: str) -> None:
    x = torch.randn(256, 128)
    mse = [_mse(RowFormat(128, bits=b, quantizer=quantizer), x) for b in (2, 3, 4)]
    assert mse[0] > mse[1] > mse[2]
    assert mse[2] < 0.02


def test_row_format_lloyd_max_round_trip() -> None:
    x = torch.randn(128, 128)
    hyb = _mse(RowFormat(128, quantizer="lloyd_max", clip=0.96), x)
    cen = _mse(RowFormat(128, quantizer="lloyd_max_centroid"), x)
    assert hyb < 0.3 and cen < 0.15  # N(0,1) 4-level Lloyd-Max MSE is ~0.1175


def test_row_format_from_spec() -> None:
    k = RowFormat.from_spec(QuantSpec(), 128, "k")
    v = RowFormat.from_spec(QuantSpec(), 128, "v")
    assert k.clip == 0.96 and v.clip == 0.92
    assert (k.bits, k.group, k.quantizer, k.meta_dtype) == (2, 128, "asymmetric", "fp16")
    assert k.packed_dim == 32 and k.groups == 1
    s = QuantSpec(key_bits=4, value_bits=3, group_size=32, codebook="uniform")
    assert RowFormat.from_spec(s, 128, "k").bits == 4
    assert RowFormat.from_spec(s, 128, "v").groups == 4
    assert RowFormat.from_spec(QuantSpec(codebook="lloyd_max"), 128, "k").quantizer == "lloyd_max"
    assert RowFormat.from_spec(QuantSpec(), 128, "k", clip=0.5).clip == 0.5
    with pytest.raises(ValueError, match="kind must be 'k' or 'v'; got 'q'"):
        RowFormat.from_spec(QuantSpec(), 128, "q")


def test_quantize_rows_clips_first() -> None:
    x = torch.randn(4, 128)
    x[:, 0] = 100.0  # one huge outlier per row
    fmt = RowFormat(128, clip=0.96, meta_dtype="fp32")
    codes, meta = quantize_rows(x, fmt)
    xh = dequantize_rows(codes, meta, fmt)
    assert float(xh.abs().max()) < 10.0


def test_quantize_rows_wrong_last_dim() -> None:
    with pytest.raises(ValueError, match="128"):
        quantize_rows(torch.randn(2, 64), RowFormat(128))


def test_row_format_validation() -> None:
    with pytest.raises(ValueError, match=r"quantizer must be one of \[.*\]; got 'nf4'"):
        RowFormat(128, quantizer="nf4")
    with pytest.raises(ValueError, match="group 48 must divide head_dim 128"):
        RowFormat(128, group=48)
    with pytest.raises(ValueError, match="3-bit packing needs the last dim to be a multiple of 8; got 12"):
        RowFormat(12, bits=3)


def test_asymmetric_scale_is_the_correctly_rounded_division():
    """``s = (hi − lo) / 3`` rounded once (fp32 metadata keeps it exactly), not ``(hi − lo)·fl(1/3)``
    as CUDA computes a division by a Python scalar; the GPU kernels divide correctly too."""
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(5))
    _, meta = quantize_asymmetric(x, 2, 128, "fp32")
    span = (x.amax(-1) - x.amin(-1)).double()
    want = (span / 3).float()
    assert torch.equal(meta[..., 0].reshape(-1), want)
    assert not torch.equal(want, (span.float() * (1 / 3)).float())  # the data tells the two apart
