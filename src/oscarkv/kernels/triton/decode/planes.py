"""Code planes and query parts: the MMA operands of the INT2 tile loops.

An INT2 tile is never dequantized. With codes ``c`` and per-row ``(s, z)``:
``q·k = s·(q·c) − s·z·Σq`` and ``p·V = (p∘s)·c − Σ p∘s∘z``, so the products run on the 2-bit
*planes* of the codes (the quartered byte layout makes plane ``i`` the contiguous quarter ``i`` of
the head dimension).

- **fp16 planes**: the code bits masked in place into the low mantissa bits of an fp16 word, the
  exact subnormal ``c·4^i·2⁻²⁴``: no shift, no int-to-float conversion. Query part ``i`` is
  pre-scaled by ``4^-i`` (exact); the ``2²⁴ / 4^i`` go into the final scaling
  (``common.store_part``). Bytes give four planes (:func:`byte_planes`); int16 words, two bytes
  each, give eight planes ``(i, e)`` (:func:`word_planes`: plane ``i`` of byte ``e`` of word ``m``
  is the code of dim ``D/4·i + 2m + e``) with Triton's native 16-bit operand width, and need
  K = D/8 >= 16 per ``tl.dot`` (head dim >= 128). On CUDA one PTX block builds them (byte
  permutes, then one mask per plane and pair of codes); the CPU interpreter, which cannot run
  PTX, builds the same bit patterns with Triton integer ops. 4-bit keys (halved layout: byte
  ``j`` holds dims ``j`` and ``D/2 + j``) give two byte planes (:func:`nibble_planes`),
  ``c·2⁻²⁴`` and ``c·16·2⁻²⁴``, the second's query part scaled by ``1/16``.
- **int8 key planes** (swap loop, :func:`key_planes_i8`): the code bytes as loaded are an int8
  MMA's operand, four codes per register; planes ``b & 0x03``, ``b & 0x0C``, ``(b >> 4) & 0x03``,
  ``(b >> 4) & 0x0C`` are worth ``c, 4c, c, 4c``. The queries become a per-head scale ``σ`` and
  two int8 parts, ``q_d / (w_d σ) ≈ hi + lo / 256``, so ``q·c = σ (T_hi + T_lo / 256)`` from two
  exact int32 sums; a query element's rounding error is at most ``2^-14`` of its head's largest
  ``|q_d| / w_d``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import store_part

__all__ = ["byte_planes", "dot8", "dot_i8", "key_planes_i8", "nibble_planes", "pv8", "qpart", "qparts8", "qparts_i8",
           "qscale", "scale8", "store8", "vp8", "word_planes", "zeros8"]  # fmt: skip


def _planes_ptx(
    lo: str | None, hi: str, masks: tuple[int, ...] = (0x00030003, 0x000C000C, 0x00300030, 0x00C000C0)
) -> str:
    """PTX that turns one 32-bit register of codes into ``2·len(masks)`` registers of fp16-subnormal
    pairs: byte permutes (selectors ``lo``, ``hi``) spread bytes over 16-bit lanes, then one mask per
    plane (by default the four 2-bit planes: plane ``i`` keeps its bits in place, so it holds
    ``c·4^i``). Outputs ``$2i`` / ``$2i+1`` are plane ``i`` of the ``lo`` / ``hi`` spread. ``lo=None``:
    the register as it is (bytes 0 and 2 already sit at the bottom of the 16-bit lanes), one
    permute fewer."""
    ands = "".join(
        f"and.b32 ${2 * i}, lo, 0x{m:08x};\nand.b32 ${2 * i + 1}, hi, 0x{m:08x};\n"
        for i, m in enumerate(masks)
    )
    src = f"${2 * len(masks)}"
    spread_lo = f"mov.b32 lo, {src};" if lo is None else f"prmt.b32 lo, {src}, 0, {lo};"
    return f"{{\n.reg .b32 lo, hi;\n{spread_lo}\nprmt.b32 hi, {src}, 0, {hi};\n{ands}}}"


# four code bytes in one register -> their four planes, bytes (0, 1) in ``lo`` and (2, 3) in ``hi``
_BYTE_PLANES_PTX = tl.constexpr(_planes_ptx("0x4140", "0x4342"))
# two 16-bit code words in one register -> the eight planes ``(i, e)``: byte 0 of both words is
# already at the bottom of its lane (``lo`` = the register), byte 1 is moved there (``hi``)
_WORD_PLANES_PTX = tl.constexpr(_planes_ptx(None, "0x4341"))
# four bytes of 4-bit codes -> their two nibble planes (bits 3:0 and 7:4 kept in place)
_NIBBLE_PLANES_PTX = tl.constexpr(_planes_ptx("0x4140", "0x4342", (0x000F000F, 0x00F000F0)))
_KEY_PLANES_I8_PTX = tl.constexpr(
    "{\n.reg .b32 t;\n"
    "and.b32 $0, $4, 0x03030303;\nand.b32 $1, $4, 0x0C0C0C0C;\n"
    "shr.u32 t, $4, 4;\n"
    "and.b32 $2, t, 0x03030303;\nand.b32 $3, t, 0x0C0C0C0C;\n}"
)


@triton.jit
def byte_planes(c, ASM: tl.constexpr):
    """uint8 codes -> four fp16 tensors, plane ``i`` holding the exact subnormal ``c_i·4^i·2⁻²⁴``."""
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _BYTE_PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [c],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        c16 = c.to(tl.int16)
        p0 = (c16 & 3).to(tl.float16, bitcast=True)
        p1 = (c16 & 12).to(tl.float16, bitcast=True)
        p2 = (c16 & 48).to(tl.float16, bitcast=True)
        p3 = (c16 & 192).to(tl.float16, bitcast=True)
    return p0, p1, p2, p3


@triton.jit
def nibble_planes(c, ASM: tl.constexpr):
    """uint8 codes of 4-bit keys -> two fp16 tensors holding the exact subnormals ``c_lo·2⁻²⁴`` (bits
    3:0) and ``c_hi·16·2⁻²⁴`` (bits 7:4)."""
    if ASM:
        p0, p1 = tl.inline_asm_elementwise(
            _NIBBLE_PLANES_PTX, "=r,=r,=r,=r,r", [c], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        c16 = c.to(tl.int16)
        p0 = (c16 & 15).to(tl.float16, bitcast=True)
        p1 = (c16 & 240).to(tl.float16, bitcast=True)
    return p0, p1


@triton.jit
def word_planes(c, ASM: tl.constexpr):
    """int16 code words (bytes ``2m``, ``2m + 1`` of a row) -> eight fp16 tensors: plane ``(i, e)``
    holds the exact subnormal ``c·4^i·2⁻²⁴`` of the code of dim ``D/4·i + 2m + e``."""
    if ASM:
        p00, p01, p10, p11, p20, p21, p30, p31 = tl.inline_asm_elementwise(
            _WORD_PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [c],
            dtype=(tl.float16,) * 8, is_pure=True, pack=2,
        )  # fmt: skip
    else:
        b0 = c & 255
        b1 = (c >> 8) & 255
        p00 = (b0 & 3).to(tl.float16, bitcast=True)
        p01 = (b1 & 3).to(tl.float16, bitcast=True)
        p10 = (b0 & 12).to(tl.float16, bitcast=True)
        p11 = (b1 & 12).to(tl.float16, bitcast=True)
        p20 = (b0 & 48).to(tl.float16, bitcast=True)
        p21 = (b1 & 48).to(tl.float16, bitcast=True)
        p30 = (b0 & 192).to(tl.float16, bitcast=True)
        p31 = (b1 & 192).to(tl.float16, bitcast=True)
    return p00, p01, p10, p11, p20, p21, p30, p31


@triton.jit
def qpart(qp, i: tl.constexpr, e: tl.constexpr, mask, D4: tl.constexpr):
    """Query dims ``D4·i + e`` onwards from ``qp`` (the dims of code plane ``i``) as fp32; ``mask``
    broadcasts against ``qp``."""
    return tl.load(qp + D4 * i + e, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def qscale(q, i: tl.constexpr):
    """Query part for code plane ``i`` (worth ``c·4^i``) as an fp16 operand: scaled by ``4^-i`` (exact)."""
    return q.to(tl.float16) if i == 0 else (q * (0.25**i)).to(tl.float16)


@triton.jit
def qparts8(qp, mask, D4: tl.constexpr, AXIS: tl.constexpr = 1):
    """The eight query parts of word planes ``(i, e)`` (dims ``D4·i + 2m + e`` from ``qp``; ``mask``
    broadcasts against ``qp``) as fp16 operands scaled by ``4^-i``, and their sums over the dims'
    axis ``AXIS`` (``Σq`` per head, unscaled, fp32; 0 for the swap loop's transposed parts)."""
    q00 = qpart(qp, 0, 0, mask, D4)
    q01 = qpart(qp, 0, 1, mask, D4)
    q10 = qpart(qp, 1, 0, mask, D4)
    q11 = qpart(qp, 1, 1, mask, D4)
    q20 = qpart(qp, 2, 0, mask, D4)
    q21 = qpart(qp, 2, 1, mask, D4)
    q30 = qpart(qp, 3, 0, mask, D4)
    q31 = qpart(qp, 3, 1, mask, D4)
    qsum = tl.sum(q00 + q01 + q10 + q11 + q20 + q21 + q30 + q31, AXIS)
    q00, q01, q10, q11 = qscale(q00, 0), qscale(q01, 0), qscale(q10, 1), qscale(q11, 1)
    q20, q21, q30, q31 = qscale(q20, 2), qscale(q21, 2), qscale(q30, 3), qscale(q31, 3)
    return q00, q01, q10, q11, q20, q21, q30, q31, qsum


@triton.jit
def zeros8(R_PAD: tl.constexpr, D8: tl.constexpr):
    """Eight fp32 ``[R_PAD, D8]`` accumulators, one per word plane ``(i, e)``."""
    z = tl.zeros([R_PAD, D8], tl.float32)
    return z, z, z, z, z, z, z, z


@triton.jit
def dot8(x00, x01, x10, x11, x20, x21, x30, x31, y00, y01, y10, y11, y20, y21, y30, y31):
    """``Σ_(i,e) x_(i,e) · y_(i,e)``: eight ``tl.dot``s into one fp32 score tile (queries times
    planes in the padded loop, planes times queries in the swap loop)."""
    t = tl.dot(x00, y00)
    t = tl.dot(x01, y01, t)
    t = tl.dot(x10, y10, t)
    t = tl.dot(x11, y11, t)
    t = tl.dot(x20, y20, t)
    t = tl.dot(x21, y21, t)
    t = tl.dot(x30, y30, t)
    return tl.dot(x31, y31, t)


@triton.jit
def scale8(a00, a01, a10, a11, a20, a21, a30, a31, al):
    """The eight accumulators times ``al`` (the rescale factors, broadcast along the heads' axis)."""
    return a00 * al, a01 * al, a10 * al, a11 * al, a20 * al, a21 * al, a30 * al, a31 * al


@triton.jit
def pv8(p, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31):
    """``a_(i,e) += p · plane_(i,e)`` for the eight value planes."""
    return (tl.dot(p, v00, a00), tl.dot(p, v01, a01), tl.dot(p, v10, a10), tl.dot(p, v11, a11),
            tl.dot(p, v20, a20), tl.dot(p, v21, a21), tl.dot(p, v30, a30), tl.dot(p, v31, a31))  # fmt: skip


@triton.jit
def vp8(ps, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31):
    """``a_(i,e) += plane_(i,e)^T · (p∘s_V)`` for the eight transposed value planes ``[HP·D/8, BLOCK_N]``."""
    return (tl.dot(v00, ps, a00), tl.dot(v01, ps, a01), tl.dot(v10, ps, a10), tl.dot(v11, ps, a11),
            tl.dot(v20, ps, a20), tl.dot(v21, ps, a21), tl.dot(v30, ps, a30), tl.dot(v31, ps, a31))  # fmt: skip


@triton.jit
def store8(op, a00, a01, a10, a11, a20, a21, a30, a31, inv, z, mask, D4: tl.constexpr):
    """The eight word planes' output dims (``common.store_part``; ``inv``, ``z`` and ``mask``
    broadcast against the accumulators)."""
    store_part(op, 0, 0, a00, inv, z, mask, D4)
    store_part(op, 0, 1, a01, inv, z, mask, D4)
    store_part(op, 1, 0, a10, inv, z, mask, D4)
    store_part(op, 1, 1, a11, inv, z, mask, D4)
    store_part(op, 2, 0, a20, inv, z, mask, D4)
    store_part(op, 2, 1, a21, inv, z, mask, D4)
    store_part(op, 3, 0, a30, inv, z, mask, D4)
    store_part(op, 3, 1, a31, inv, z, mask, D4)


@triton.jit
def key_planes_i8(b, ASM: tl.constexpr):
    """uint8 code bytes -> four int8 planes ``(c, 4c, c, 4c)`` of dims ``m, D/4 + m, D/2 + m,
    3D/4 + m`` for byte ``m``."""
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _KEY_PLANES_I8_PTX, "=r,=r,=r,=r,r", [b], dtype=(tl.int8,) * 4, is_pure=True, pack=4
        )
    else:
        p0 = (b & 3).to(tl.int8, bitcast=True)
        p1 = (b & 12).to(tl.int8, bitcast=True)
        p2 = ((b >> 4) & 3).to(tl.int8, bitcast=True)
        p3 = ((b >> 4) & 12).to(tl.int8, bitcast=True)
    return p0, p1, p2, p3


@triton.jit
def _split_i8(x):
    """``x`` (|x| <= 127) -> int8 ``hi, lo`` with ``hi + lo / 256 = round(256 x) / 256``, i.e.
    within ``1/512`` of ``x`` (``hi`` in ±127, ``lo`` in -128 … 127, no clamping)."""
    n = tl.floor(x * 256.0 + 0.5)
    hi = tl.floor((n + 128.0) * (1.0 / 256.0))
    return hi.to(tl.int8), (n - hi * 256.0).to(tl.int8)


@triton.jit
def qparts_i8(qp, mask, D4: tl.constexpr):
    """Query parts of the four int8 key planes (dims ``D4·i`` onwards from ``qp``; ``mask``
    broadcasts against ``qp``, rows are bytes and columns query heads) as int8 ``hi`` and ``lo``
    operands, the per-column scale ``σ`` and the true sums ``Σq`` (fp32)."""
    x0, x1 = qpart(qp, 0, 0, mask, D4), qpart(qp, 1, 0, mask, D4)
    x2, x3 = qpart(qp, 2, 0, mask, D4), qpart(qp, 3, 0, mask, D4)
    qsum = tl.sum(x0 + x1 + x2 + x3, 0)
    big = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x2)), tl.maximum(tl.abs(x1), tl.abs(x3)) * 0.25)
    top = tl.max(big, 0)
    sig = tl.where(top > 1e-30, top / 127.0, 1.0)  # 1/σ stays finite (zero or padding columns)
    inv = 1.0 / sig[None, :]
    h0, l0 = _split_i8(x0 * inv)
    h1, l1 = _split_i8(x1 * (inv * 0.25))
    h2, l2 = _split_i8(x2 * inv)
    h3, l3 = _split_i8(x3 * (inv * 0.25))
    return h0, h1, h2, h3, l0, l1, l2, l3, sig, qsum


@triton.jit
def dot_i8(p0, p1, p2, p3, h0, h1, h2, h3, l0, l1, l2, l3):
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
