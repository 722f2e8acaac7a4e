"""Triton twins of ``kernels.ref.rotate_heads`` / ``rotate_new_rows`` / ``rotate_rows``: the rotations
of a decode step's rows and of a prefill's.

Program ``(head, row block, column block)`` loads a block of one head's rows, multiplies them by a
block of columns of the head's fp32 matrix, rounds once to the output dtype and stores the rows
densely or to their slots ``dst[b]`` (skipping negative ones). The product is fp32 math (R·Rᵀ must
stay I to fp32 rounding): bf16 rows take three bf16 ``tl.dot``s against ``R = R1 + R2 + R3``, R's
exact split into bf16 pieces (8 significant bits each; bf16 × bf16 products are exact in fp32), so
the tensor cores run it with fp32 accumulation; other dtypes take an IEEE fp32 ``tl.dot`` (no TF32).
``rotate_new_rows`` does a decode step's query, key and value rows in one launch (program axis 0
runs over the query heads, then the key heads, then the value heads). ``rotate_rows`` takes a
prefill's thousands of rows in 64-row blocks and 128 columns at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ref.rotate import check_new_rows_args, check_rotate_args
from .launch import Launcher

__all__ = ["fp8_e4m3", "rotate_heads", "rotate_new_rows", "rotate_rows"]

BLOCK_B = 16  # tl.dot needs M >= 16; smaller batches are masked
BLOCK_C = 32
BLOCK_K = 16
ROWS_B, ROWS_C = 64, 128  # rotate_rows' blocks: a prefill's rows


@triton.jit
def fp8_e4m3(y):
    """fp32 ``y`` as float8_e4m3fn, rounded to nearest even and saturated at ±448 (NaN stays NaN),
    by integer ops on the fp32 bits: the interpreter's own fp32 -> fp8 cast drops the mantissa
    carry and rounds ties up, so a cast could not be checked against the twin on the CPU."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = tl.minimum(tl.abs(y), 448.0)
    ua = a.to(tl.int32, bitcast=True)
    # normal (|y| >= 2^-6): drop 20 mantissa bits to nearest even, rebias the exponent (127 -> 7)
    normal = ((ua + 0x7FFFF + ((ua >> 20) & 1)) >> 20) - 960
    # subnormal: the integer nearest |y|·2^9 (< 8; 8 is 2^-6's code), ties to even
    us = (a * 512.0).to(tl.int32, bitcast=True)
    sh = tl.minimum(150 - (us >> 23), 30)
    m = (us & 0x7FFFFF) | 0x800000
    q = m >> sh
    rem = m - (q << sh)
    half = 1 << (sh - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    bits = tl.where(a < 0.015625, q, normal)
    bits = tl.where(y != y, 0x7F, bits) | sign
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _rotate_rows(X, R, Y, DST, h, n_b, s_xb, s_xh, s_rh, s_yb, s_yh, D: tl.constexpr, GROUP: tl.constexpr,
                 ROTATE: tl.constexpr, INVERSE: tl.constexpr, SCATTER: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BF16_DOT: tl.constexpr):  # fmt: skip
    """Rows ``b`` of this program's batch block, head ``h``, output columns ``BLOCK_C·program_id(2)``
    onwards: ``Y[b or DST[b], h] = X[b, h] @ R_(h // GROUP)`` (a copy, by the first column block).
    A float8_e4m3fn ``Y`` (fp8 windows) gets the product rounded to ``X``'s dtype, then to fp8."""
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = offs_b < n_b
    offs_d = tl.arange(0, D)
    if SCATTER:
        rows = tl.load(DST + offs_b, mask=bmask, other=-1).to(tl.int64)
        keep = bmask & (rows >= 0)
    else:
        rows = offs_b.to(tl.int64)
        keep = bmask
    yp = Y + rows[:, None] * s_yb + h * s_yh
    if ROTATE:
        rh = R + (h // GROUP) * s_rh
        xp = X + offs_b[:, None] * s_xb + h * s_xh
        c0 = (
            tl.program_id(2) * BLOCK_C
        )  # column blocks are programs: a decode step's few rows are latency-bound
        offs_c = tl.arange(0, BLOCK_C)
        offs_k = tl.arange(0, BLOCK_K)
        y = tl.zeros([BLOCK_B, BLOCK_C], tl.float32)
        # K in chunks, the rows re-read per chunk: a whole [16, d] x [d, BLOCK_C] IEEE fp32 dot
        # (FMA path) spilled kilobytes per thread. A runtime loop (pipelined): unrolled, the three
        # bodies of _rotate_new took 34 s to compile at d = 256 (1.7 MB of cubin, Triton 3.6)
        for k0 in tl.range(0, D, BLOCK_K, num_stages=2):
            xk = tl.load(xp + (k0 + offs_k)[None, :], mask=bmask[:, None], other=0.0)
            if INVERSE:  # (Rᵀ)[k, c] = R[c, k]
                m = tl.load(rh + (c0 + offs_c)[None, :] * D + (k0 + offs_k)[:, None])
            else:
                m = tl.load(rh + (k0 + offs_k)[:, None] * D + (c0 + offs_c)[None, :])
            if X.dtype.element_ty == tl.bfloat16:
                # m's 24 significant bits in three bf16 pieces, exactly (each remainder fits the next)
                m1 = m.to(tl.bfloat16)
                rest = m - m1.to(tl.float32)
                m2 = rest.to(tl.bfloat16)
                m3 = (rest - m2.to(tl.float32)).to(tl.bfloat16)
                if BF16_DOT:
                    y = tl.dot(xk, m1, y)
                    y = tl.dot(xk, m2, y)
                    y = tl.dot(xk, m3, y)
                else:  # the interpreter's bf16 tl.dot is wrong; the same exact products in fp32
                    xf = xk.to(tl.float32)
                    y = tl.dot(xf, m1.to(tl.float32), y, input_precision="ieee")
                    y = tl.dot(xf, m2.to(tl.float32), y, input_precision="ieee")
                    y = tl.dot(xf, m3.to(tl.float32), y, input_precision="ieee")
            else:
                y = tl.dot(xk.to(tl.float32), m, y, input_precision="ieee")
        if Y.dtype.element_ty == tl.float8e4nv:  # fp8 windows: as a prefill stores the row
            y = fp8_e4m3(y.to(X.dtype.element_ty).to(tl.float32))
        tl.store(yp + (c0 + offs_c)[None, :], y.to(Y.dtype.element_ty), mask=keep[:, None])
    elif tl.program_id(2) == 0:
        x = tl.load(X + offs_b[:, None] * s_xb + h * s_xh + offs_d[None, :], mask=bmask[:, None], other=0.0)
        if Y.dtype.element_ty == tl.float8e4nv:
            x = fp8_e4m3(x.to(tl.float32))
        tl.store(yp + offs_d[None, :], x.to(Y.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _rotate(X, R, Y, DST, n_b, s_xb, s_xh, s_rh, s_yb, s_yh, D: tl.constexpr, GROUP: tl.constexpr,
            ROTATE: tl.constexpr, INVERSE: tl.constexpr, SCATTER: tl.constexpr, BLOCK_B: tl.constexpr,
            BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BF16_DOT: tl.constexpr):  # fmt: skip
    _rotate_rows(X, R, Y, DST, tl.program_id(0), n_b, s_xb, s_xh, s_rh, s_yb, s_yh, D, GROUP, ROTATE, INVERSE,
                 SCATTER, BLOCK_B, BLOCK_C, BLOCK_K, BF16_DOT)  # fmt: skip


@triton.jit
def _rotate_new(Q, K, V, RK, RV, QO, KO, VO, DST, n_b, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_rkh, s_rvh, s_ob,
                s_pb, s_ph, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GQ: tl.constexpr,
                GK: tl.constexpr, GV: tl.constexpr, ROT_V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_K: tl.constexpr, BF16_DOT: tl.constexpr):  # fmt: skip
    # program_id(0) runs over the query heads, then the key heads, then the value heads
    h = tl.program_id(0)
    if h < HQ:
        _rotate_rows(Q, RK, QO, DST, h, n_b, s_qb, s_qh, s_rkh, s_ob, D, D, GQ, True, False, False, BLOCK_B,
                     BLOCK_C, BLOCK_K, BF16_DOT)  # fmt: skip
    elif h < HQ + HKV:
        _rotate_rows(K, RK, KO, DST, h - HQ, n_b, s_kb, s_kh, s_rkh, s_pb, s_ph, D, GK, True, False, True,
                     BLOCK_B, BLOCK_C, BLOCK_K, BF16_DOT)  # fmt: skip
    else:
        _rotate_rows(V, RV, VO, DST, h - HQ - HKV, n_b, s_vb, s_vh, s_rvh, s_pb, s_ph, D, GV, ROT_V, False, True,
                     BLOCK_B, BLOCK_C, BLOCK_K, BF16_DOT)  # fmt: skip


_ROTATE, _ROTATE_NEW = Launcher(_rotate), Launcher(_rotate_new)


def _check_dim(d: int) -> None:
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"the Triton rotate kernels take head dims 16-256, powers of two; got {d}")


def _matrix(r: torch.Tensor | None, heads: int, d: int, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(R or a placeholder pointer, heads per matrix, stride between matrices)``."""
    if r is None:
        return like, 1, 0
    r = r.contiguous()
    return (r, heads // r.shape[0], d * d) if r.dim() == 3 else (r, 1, 0)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rotate_heads(
    x: torch.Tensor,
    r: torch.Tensor | None,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    dst: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.ref.rotate_heads`` (tensors on one CUDA device)."""
    check_rotate_args(x, r, out, dst)
    x = _unit_stride(x)
    y = out if out is not None else torch.empty_like(x)
    if y.stride(-1) != 1:
        raise ValueError("rotate_heads: out must have unit stride in its last dim")
    return _launch(x, r, inverse, y, dst, BLOCK_B, BLOCK_C)


def rotate_rows(x: torch.Tensor, r: torch.Tensor | None, inverse: bool = False) -> torch.Tensor:
    """Same contract as ``kernels.ref.rotate_rows``: a prefill's rows ``x [T, H, d]`` rotated, in new
    memory laid out like ``x`` (``x`` itself when ``r`` is ``None``)."""
    if r is None:
        return x
    check_rotate_args(x, r, None, None)
    x = _unit_stride(x)
    return _launch(x, r, inverse, torch.empty_like(x), None, ROWS_B, ROWS_C)


def _launch(x: torch.Tensor, r: torch.Tensor | None, inverse: bool, y: torch.Tensor, dst: torch.Tensor | None,
            block_b: int, block_c: int) -> torch.Tensor:  # fmt: skip
    """``_rotate`` over ``x [B, H, d]`` (unit last stride) into ``y`` (rows ``dst[b]`` if given) in
    ``block_b``-row, ``block_c``-column programs; returns ``y``."""
    b, h, d = x.shape
    _check_dim(d)
    if b == 0:
        return y
    scatter = dst is not None
    rotate = r is not None
    r, group, s_rh = _matrix(r, h, d, x)
    cols = min(d, block_c)
    _ROTATE(
        (h, -(-b // block_b), d // cols), x, r, y, dst if scatter else x, b, x.stride(0), x.stride(1), s_rh,
        y.stride(0), y.stride(1), D=d, GROUP=group, ROTATE=rotate, INVERSE=inverse, SCATTER=scatter,
        BLOCK_B=block_b, BLOCK_C=cols, BLOCK_K=BLOCK_K, BF16_DOT=x.is_cuda, num_warps=4,
    )  # fmt: skip
    return y


def rotate_new_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    r_k: torch.Tensor,
    r_v: torch.Tensor | None,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    dst: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``kernels.ref.rotate_new_rows``: the three rotations in one launch."""
    check_new_rows_args(query, key, value, r_k, r_v, k_out, v_out, dst)
    b, hq, d = query.shape
    hkv = key.shape[1]
    _check_dim(d)
    ps = k_out.stride()
    if v_out.stride() != ps or ps[2] != 1:
        raise ValueError(
            "rotate_new_rows: k_out and v_out must share one layout with unit stride in the last dim"
        )
    q_out = torch.empty(b, hq, d, dtype=query.dtype, device=query.device)
    if b == 0:
        return q_out
    query, key, value = _unit_stride(query), _unit_stride(key), _unit_stride(value)
    qs, ks, vs = query.stride(), key.stride(), value.stride()
    rot_v = r_v is not None
    r_k, gq, s_rk = _matrix(r_k, hq, d, query)
    gk = hkv // r_k.shape[0] if r_k.dim() == 3 else 1
    r_v, gv, s_rv = _matrix(r_v, hkv, d, query)
    _ROTATE_NEW(
        (hq + 2 * hkv, -(-b // BLOCK_B), d // min(d, BLOCK_C)), query, key, value, r_k, r_v, q_out, k_out, v_out, dst, b, qs[0], qs[1],
        ks[0], ks[1], vs[0], vs[1], s_rk, s_rv, hq * d, ps[0], ps[1], HQ=hq, HKV=hkv, D=d, GQ=gq, GK=gk, GV=gv,
        ROT_V=rot_v, BLOCK_B=BLOCK_B, BLOCK_C=min(d, BLOCK_C), BLOCK_K=BLOCK_K, BF16_DOT=query.is_cuda, num_warps=4,
    )  # fmt: skip
    return q_out
