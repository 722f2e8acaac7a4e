"""The swap loop's key product on 8-bit integer MMAs (``CONFIG['swap_k_int8']``).

With fp16 planes (:mod:`.decode_words`) a 32-bit register holds two codes, so building the key
planes costs one AND per two codes plus a byte permute per register. An int8 MMA operand register
holds four: the code bytes as loaded are the MMA's A fragment (four consecutive bytes, i.e. four
consecutive K elements of one token), and one AND per register keeps one plane of four codes in
place. Byte ``m`` of a head's row holds the codes of dims ``m, D/4 + m, D/2 + m, 3D/4 + m`` in bits
``0-1, 2-3, 4-5, 6-7``; the planes are ``b & 0x03``, ``b & 0x0C``, ``(b >> 4) & 0x03`` and
``(b >> 4) & 0x0C``, worth ``c, 4c, c, 4c`` (one shift for the upper two keeps every plane's
weight within 4).

The queries become integers: per query head a scale ``σ`` (the largest ``|q_d| / w_d`` over 127,
``w`` the plane weight) and two int8 parts, ``q_d / (w_d σ) ≈ hi + lo / 256``, so ``q·c = σ (T_hi
+ T_lo / 256)`` with both int32 MMA sums exact. The rounding error of a query element is at most
``w_d σ / 512``, i.e. ``2^-14`` of the head's largest ``|q_d| / w_d`` for the ``4c`` planes: far
below the bf16 queries' own rounding, about that of the fp16 planes' path on fp32 queries (an
interpreter test with scores in the hundreds: 6.5e-3 against 4.8e-3). Planes all worth ``c``
(three shifts more per register; 2^-16) measured no faster than the fp16 planes on the H200, the
planes above 0.3-3% faster than them in the same run (one round, ``results/dv_s15_kint8_w1.md``),
so these stay. The value product is unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_tiles import _qpart

__all__ = ["_dot_i8", "_kplanes_i8", "_qparts_i8"]

_KPLANES_PTX = tl.constexpr(
    "{\n.reg .b32 t;\n"
    "and.b32 $0, $4, 0x03030303;\nand.b32 $1, $4, 0x0C0C0C0C;\n"
    "shr.u32 t, $4, 4;\n"
    "and.b32 $2, t, 0x03030303;\nand.b32 $3, t, 0x0C0C0C0C;\n}"
)


@triton.jit
def _kplanes_i8(b, ASM: tl.constexpr):
    """uint8 code bytes -> four int8 planes ``(c, 4c, c, 4c)`` of dims ``m, D/4 + m, D/2 + m,
    3D/4 + m`` for byte ``m``."""
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _KPLANES_PTX, "=r,=r,=r,=r,r", [b], dtype=(tl.int8,) * 4, is_pure=True, pack=4
        )
    else:
        p0 = (b & 3).to(tl.int8, bitcast=True)
        p1 = (b & 12).to(tl.int8, bitcast=True)
        p2 = ((b >> 4) & 3).to(tl.int8, bitcast=True)
        p3 = ((b >> 4) & 12).to(tl.int8, bitcast=True)
    return p0, p1, p2, p3


@triton.jit
def _split(x):
    """``x`` (|x| <= 127) -> int8 ``hi, lo`` with ``hi + lo / 256 = round(256 x) / 256``, i.e.
    within ``1/512`` of ``x`` (``hi`` in ±127, ``lo`` in -128 … 127, no clamping)."""
    n = tl.floor(x * 256.0 + 0.5)
    hi = tl.floor((n + 128.0) * (1.0 / 256.0))
    return hi.to(tl.int8), (n - hi * 256.0).to(tl.int8)


@triton.jit
def _qparts_i8(qp, mask, D4: tl.constexpr):
    """Query parts of the four planes (dims ``D4·i`` onwards from ``qp``; ``mask`` broadcasts
    against ``qp``, rows are bytes and columns query heads) as int8 ``hi`` and ``lo`` operands,
    the per-column scale ``σ`` and the true sums ``Σq`` (fp32)."""
    x0, x1 = _qpart(qp, 0, 0, mask, D4), _qpart(qp, 1, 0, mask, D4)
    x2, x3 = _qpart(qp, 2, 0, mask, D4), _qpart(qp, 3, 0, mask, D4)
    qsum = tl.sum(x0 + x1 + x2 + x3, 0)
    big = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x2)), tl.maximum(tl.abs(x1), tl.abs(x3)) * 0.25)
    top = tl.max(big, 0)
    sig = tl.where(top > 1e-30, top / 127.0, 1.0)  # 1/σ stays finite (zero or padding columns)
    inv = 1.0 / sig[None, :]
    h0, l0 = _split(x0 * inv)
    h1, l1 = _split(x1 * (inv * 0.25))
    h2, l2 = _split(x2 * inv)
    h3, l3 = _split(x3 * (inv * 0.25))
    return h0, h1, h2, h3, l0, l1, l2, l3, sig, qsum


@triton.jit
def _dot_i8(p0, p1, p2, p3, h0, h1, h2, h3, l0, l1, l2, l3):
    """``Σ_i plane_i · (hi_i + lo_i / 256)`` as fp32, from two exact int32 MMA sums."""
    th = tl.dot(p0, h0, out_dtype=tl.int32)
    th = tl.dot(p1, h1, th, out_dtype=tl.int32)
    th = tl.dot(p2, h2, th, out_dtype=tl.int32)
    th = tl.dot(p3, h3, th, out_dtype=tl.int32)
    tw = tl.dot(p0, l0, out_dtype=tl.int32)
    tw = tl.dot(p1, l1, tw, out_dtype=tl.int32)
    tw = tl.dot(p2, l2, tw, out_dtype=tl.int32)
    tw = tl.dot(p3, l3, tw, out_dtype=tl.int32)
    return th.to(tl.float32) + tw.to(tl.float32) * (1.0 / 256.0)
