"""FP8 windows (``QuantSpec.window_dtype="fp8_e4m3"``) in the Triton kernels against their torch
twins, on the CPU through Triton's interpreter (tiny shapes): the fp32 -> fp8 rounding, rotations
into fp8 pools, quantize_pack_into reading fp8 rows (a demotion), decode over fp8 windows.

Run by ``tests/test_kernels_triton.py`` in a fresh interpreter with ``TRITON_INTERPRET=1``.
Tolerances: the rounding, the copies and the codes bit-exact; rotations into fp8 bit-exact with
the kernel's own rotation rounded by the twin's rule (the products' order differs from the twin's);
decode within a relative 5e-3 of the fp32 oracle, as for 16-bit windows.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run through tests/test_kernels_triton.py (needs TRITON_INTERPRET=1)", allow_module_level=True
    )

import triton
import triton.language as tl

from oscarkv.kernels import ref
from oscarkv.kernels.triton import decode, quantize_pack
from oscarkv.kernels.triton.rotate import fp8_e4m3, rotate_heads, rotate_new_rows
from oscarkv.quant import RowFormat
from oscarkv.quant.window import to_window

torch.set_num_threads(1)
F8 = torch.float8_e4m3fn


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


@triton.jit
def _round(X, Y, N: tl.constexpr):
    o = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(Y + o, fp8_e4m3(tl.load(X + o)))


def test_fp8_rounding_is_the_twins_bit_for_bit():
    """``rotate.fp8_e4m3`` against ``x.clamp(-448, 448).to(float8_e4m3fn)``: random magnitudes
    from 2^-14 to 2^10, every fp8 value, every midpoint between neighbours and its fp32 neighbours
    (ties to even), signed zeros, saturation past 448, infinities, fp32 subnormals."""
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.rand(1 << 14, generator=g) * 24 - 14)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x)
    values = torch.arange(256, dtype=torch.uint8).view(F8).float()
    fin = values[torch.isfinite(values)].unique().sort().values
    mids = (fin[1:] + fin[:-1]) / 2
    extra = [0.0, -0.0, 448.0, 449.0, 463.9, 464.0, 465.0, 1e6, math.inf, -math.inf, 2**-10, 1e-40]
    x = torch.cat([x, fin, mids, -mids, torch.tensor(extra), torch.nextafter(mids, torch.tensor(0.0)),
                   torch.nextafter(mids, torch.tensor(1e9))])  # fmt: skip
    x = torch.cat([x, torch.zeros(-x.numel() % 64)])
    y = torch.empty(x.shape, dtype=F8)
    _round[(x.numel() // 64,)](x, y, N=64)
    assert torch.equal(_bits(y), _bits(to_window(x, F8)))
    nan = torch.full((64,), math.nan)
    _round[(1,)](nan, y[:64], N=64)
    assert y[:64].float().isnan().all()


def _rotation(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_rotate_new_rows_into_fp8_pools(dtype, d):
    """Key and value rows rotated into fp8 pools are the kernel's rotation rounded to the rows'
    dtype, then to fp8 saturating at ±448 (rows of |x| up to ~1000, so some saturate); within one
    fp8 step of the twin; the returned queries and untouched slots as with 16-bit pools."""
    r_k, r_v = _rotation(d, 5), torch.stack([_rotation(d, 6), _rotation(d, 7)])
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(17, 8, d, generator=gen).to(dtype)
    k = (torch.randn(17, 2, d, generator=gen) * 300).to(dtype)
    v = (torch.randn(17, 2, d, generator=gen) * 300).to(dtype)
    dst = torch.tensor([3 * i if i % 4 else -1 for i in range(17)], dtype=torch.int32)
    pool = to_window(torch.randn(60, 2, d, generator=gen), F8)
    got_k, got_v, want_k, want_v = pool.clone(), pool.clone(), pool.clone(), pool.clone()
    wide_k, wide_v = torch.zeros(60, 2, d, dtype=dtype), torch.zeros(60, 2, d, dtype=dtype)
    got_q = rotate_new_rows(q, k, v, r_k, r_v, got_k, got_v, dst)
    rotate_new_rows(q, k, v, r_k, r_v, wide_k, wide_v, dst)
    want_q = ref.rotate_new_rows(q, k, v, r_k, r_v, want_k, want_v, dst.long())
    rows = dst[dst >= 0].long()
    for got, wide, want in ((got_k, wide_k, want_k), (got_v, wide_v, want_v)):
        assert torch.equal(_bits(got[rows]), _bits(to_window(wide[rows], F8)))
        assert (got[rows].float().abs() == 448).any()  # saturated
        step = (want[rows].float().abs() / 8).clamp_min(2**-9)  # one e4m3 step at most
        assert ((got[rows].float() - want[rows].float()).abs() <= step).all()
        keep = torch.ones(60, dtype=torch.bool)
        keep[rows] = False
        assert torch.equal(_bits(got[keep]), _bits(pool[keep]))
    assert _rel(got_q, want_q) < 1e-3 and got_q.dtype == dtype


def test_rotate_heads_copies_into_fp8_pools_bit_exact():
    """Without a rotation (the engine's BF16-mode write) rows go to fp8 as the twin rounds them."""
    x = torch.randn(5, 4, 64) * 200
    dst = torch.tensor([7, -1, 0, 3, -1])
    pool = torch.zeros(9, 4, 64, dtype=F8)
    got = rotate_heads(x, None, False, pool.clone(), dst)
    want = ref.rotate_heads(x, None, False, pool.clone(), dst)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(want[torch.tensor([7, 0, 3])]), _bits(to_window(x[torch.tensor([0, 2, 3])], F8)))


@pytest.mark.parametrize(("d", "bits", "clip", "meta"), [(64, 2, 0.92, "fp16"), (128, 2, 0.96, "bf16"),
                                                       (128, 4, 0.0, "fp32")])  # fmt: skip
@pytest.mark.parametrize("gather", [False, True])
def test_quantize_pack_into_from_fp8_rows_bit_exact(d, bits, clip, meta, gather):
    """A demotion from an fp8 ring (``src``) or fp8 rows given directly: the twin's codes and
    metadata, which are those of the upcast rows."""
    fmt = RowFormat(d, bits, d, clip=clip, meta_dtype=meta)
    g = torch.Generator().manual_seed(d + bits)
    pool = to_window(torch.randn(40, 3, d, generator=g) * 50, F8)
    n = 9
    src = torch.randperm(40, generator=g)[:n] if gather else None
    rows = pool if gather else pool[:n]
    dst = torch.randperm(30, generator=g)[:n]
    c0 = torch.zeros(30, 3, fmt.packed_dim, dtype=torch.uint8)
    m0 = torch.zeros(30, 3, 1, 2, dtype=ref.quantize_pack(pool[:1].float(), fmt)[1].dtype)
    got, want = (c0.clone(), m0.clone()), (c0.clone(), m0.clone())
    quantize_pack.quantize_pack_into(rows, fmt, *got, dst, src)
    ref.quantize_pack_into(rows, fmt, *want, dst, src)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    c, m = ref.quantize_pack((rows[src] if gather else rows).float(), fmt)
    assert torch.equal(want[0][dst], c) and torch.equal(want[1][dst], m)


LOOPS = {
    "bytes": {"small_tokens": 1 << 40, "group_tokens": 1 << 40},
    "words": {"small_tokens": 0, "swap_max_tokens": 0, "swap_heads": 1, "group_tokens": 0},
    "swap": {"small_tokens": 0, "swap_pair_tokens": 0},
}


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "loop"),
    [
        ([70, 0, 129], [5, 40, 0], 8, 2, 64, "bytes"),  # empty tiers, partial tiles
        ([90, 0], [37, 20], 8, 2, 128, "words"),
        ([90, 0], [37, 20], 32, 8, 128, "swap"),  # two KV heads per program, each its own 16-bit loop
    ],
)
def test_decode_attention_reads_fp8_windows(lens_q, lens_h, hq, hkv, d, loop):
    """fp8 window pools (values up to ~±100, subnormals included) against the twin on the same
    pools, which equals the twin on the pools upcast to fp32. Each case has a sequence of window
    rows alone, where a V tile not widened to 16 bits (``p`` rounded to fp8) is off by ~6%."""
    fmt = RowFormat(d, 2, d)
    nq, nh = sum(lens_q), sum(lens_h)
    g = torch.Generator().manual_seed(nq + nh)
    kc, km = ref.quantize_pack(torch.randn(max(nq, 1), hkv, d, generator=g), fmt)
    vc, vm = ref.quantize_pack(torch.randn(max(nq, 1), hkv, d, generator=g), fmt)
    hk = to_window(torch.randn(max(nh, 1), hkv, d, generator=g) * torch.logspace(-4, 2, d), F8)
    hv = to_window(torch.randn(max(nh, 1), hkv, d, generator=g) * 0.5, F8)
    qi = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    hi = torch.tensor([0, *torch.tensor(lens_h).cumsum(0).tolist()], dtype=torch.int32)
    qx = torch.randperm(max(nq, 1), generator=g)[:nq].to(torch.int32)
    hx = torch.randperm(max(nh, 1), generator=g)[:nh].to(torch.int32)
    q = torch.randn(len(lens_q), hq, d, generator=g) * 0.2
    args = (kc, km, vc, vm, hk, hv, qi, qx, hi, hx, 1 / math.sqrt(d), fmt, fmt)
    want = ref.decode_attention(q, *args)
    wide = ref.decode_attention(q, kc, km, vc, vm, hk.float(), hv.float(), *args[6:])
    assert torch.equal(want, wide)
    t = dataclasses.replace(decode.DEFAULT_TUNING, **LOOPS[loop])
    p = decode.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cpu", t)
    assert p.lp.loop == loop
    got = decode.decode_attention(q, *args, plan=p)
    for b in range(len(lens_q)):
        assert _rel(got[b], want[b]) < 5e-3, (b, _rel(got[b], want[b]))


def test_decode_attention_refuses_other_window_dtypes():
    """Only float8_e4m3fn among the fp8 formats, and K and V windows of one dtype."""
    fmt = RowFormat(64, 2, 64)
    kc, km = ref.quantize_pack(torch.randn(8, 2, 64), fmt)
    hk = torch.randn(2, 2, 64)
    lists = (torch.tensor([0, 8], dtype=torch.int32), torch.arange(8, dtype=torch.int32),
             torch.tensor([0, 2], dtype=torch.int32), torch.arange(2, dtype=torch.int32))  # fmt: skip
    q = torch.randn(1, 4, 64)
    for a, b in ((hk.to(torch.float8_e5m2), hk.to(torch.float8_e5m2)), (to_window(hk, F8), hk)):
        with pytest.raises(ValueError, match="hp_k/hp_v must share one dtype"):
            decode.decode_attention(q, kc, km, kc, km, a, b, *lists, 0.1, fmt, fmt)
