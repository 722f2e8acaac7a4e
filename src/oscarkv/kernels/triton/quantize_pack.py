"""Triton clip-quantize-pack (2- or 4-bit, one (scale, zero) per row) of rotated rows; its inverse
is in :mod:`.dequantize`.

``_quantize_pack``, bit-exact with the reference: a program takes ``BLOCK_R`` rows, each held as
eight column pieces ``x_i = x[:, i·D/8 : (i+1)·D/8]`` (pieces ``2q``, ``2q+1`` make quarter ``q``
of the packed layout: byte ``j`` holds elements ``j, j+D/4, j+D/2, j+3D/4``).

1. Clip threshold ``tau``: the ``(N_DROP+1)``-th largest ``|x|`` counting ties (the reference's
   ``⌊ratio·D⌋``-th smallest). A round finds a row's ``K`` largest values, sorted (``K = 6`` if
   ``N_DROP < 6``, else ``round_k``: 12), by comparator networks on multisets (so ties need no
   care; in ``quantize_nets``): each column's eight pieces sorted (19 comparators), then merges
   of two sorted lists into their ``K`` largest (``_merge``: ``max(a_i, b_{K-1-i})`` falls, then
   rises; a bitonic sort less its padding sorts it, 7 / 20 comparators for 6 / 12): ``TREE``
   levels of adjacent-column pairs (reshape/split, within a thread), then ``tl.reduce``.
   Larger drop counts take ``⌈(N_DROP+1)/K⌉`` rounds, each masking the values ``>=`` the last
   list's smallest entry and counting them. Packed (``PACKED``; bf16/fp16 rows): the network
   takes the rows' own values, ``|x|`` as int16 bit patterns (ordered like the values, so exact),
   two per register through ``max/min.bf16x2`` (``.f16x2``; Triton's bf16 max/min go through
   fp32): half the comparator instructions. The tree keeps a thread's pairs whole (halves of its
   runs of columns) down to its last level, which with ``tl.reduce`` runs on int16 scalars;
   ``tau`` converts exactly. Under the interpreter the same code runs on int16 through
   ``tl.maximum``/``tl.minimum``.
2. ``lo, hi`` of the clipped row are ``clamp(min x), clamp(max x)``; scale and zero as the
   reference, rounded to the metadata dtype.
3. Codes by three compares: ``q(v) = ⌊fl(fl(v ⊘ s) + z) + 0.5⌋`` is non-decreasing in ``v``, so
   ``clamp(q(clip(x)), 0, 3) = [x >= t1] + [x >= t2] + [x >= t3]``, ``t_k`` the smallest fp32
   ``v`` with ``q(v) >= k``. Computed exactly per row, not searched: rounding to nearest crosses
   a float at the midpoint below it, so ``fl(u + z) >= W_k`` iff ``u >= β_k - z`` and
   ``fl(v ⊘ s) >= U`` iff ``v >= μ·s`` (``β_k``, ``μ``: midpoints below ``W_k``, ``U``; strict
   where that tie rounds down), both exact in fp64 and rounded up to fp32. A ``t_k`` outside
   ``(lo, hi]`` becomes ``-inf`` (all) or NaN (none), so ``x`` itself is never clamped.
   4 bits (``BITS``, the halved layout: byte ``j`` holds elements ``j, j+D/2``, i.e. pieces ``i``
   and ``i+4``) compute each code as the reference does, ``x`` clamped to ``[lo, hi]`` and the
   quotient taken in fp64 (correctly rounded to fp32 as it is), instead of 15 thresholds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...quant import RowFormat
from ...quant.quantizer import META_TORCH_DTYPES, clip_index
from ..ref.quantize_pack import check_into
from .launch import Launcher, device_facts
from .quantize_nets import abs_bits, clip_threshold, pack, pack4, threshold, to_meta

__all__ = ["DEFAULT_TUNING", "QuantizeTuning", "quantize_pack", "quantize_pack_into"]


@dataclass(frozen=True)
class QuantizeTuning:
    """Launch tuning of :func:`quantize_pack` (H200 sweeps; build variants with ``dataclasses.replace``)."""

    # rows per program and warps: 64 rows x 4 warps won the sweep
    block_r: int = 64
    num_warps: int = 4
    # the clip network on packed pairs of the rows' bf16/fp16 values (False: fp32 everywhere):
    # d=128 at clip 0.96, 1272 SASS instructions per thread against 1442
    packed: bool = True
    # ... up to this many clip rounds (2+ rounds: no fewer sm_90 instructions than fp32)
    packed_rounds: int = 1
    # register cap of the packed 2-bit network at d=128 (0: none; uncapped, ptxas takes 115 registers
    # and saves predicates: 1354 instructions)
    packed_maxnreg: int = 128
    # values per clip round where N_DROP >= 6 (6 or 12): d=128 at clip 0.92, one round of 12 packed
    # takes 1416 instructions per thread, two rounds of 6 (fp32) 2480
    round_k: int = 12
    # launch as a programmatic dependent of the previous kernel (compute capability >= 9), so that
    # the launch overlaps its tail: +2-4% at 64K-256K rows, 0 to -2% at 1M
    pdl: bool = True

    def __post_init__(self) -> None:
        for name, least, power in (("block_r", 1, True), ("num_warps", 1, True), ("packed_rounds", 1, False),
                                   ("packed_maxnreg", 0, False)):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least or (power and v & (v - 1)):
                kind = "a power of two" if power else f"an integer >= {least}"
                raise ValueError(f"QuantizeTuning.{name} must be {kind}; got {v!r}")
        if self.round_k not in (6, 12) or isinstance(self.round_k, bool):
            raise ValueError(f"QuantizeTuning.round_k must be 6 or 12; got {self.round_k!r}")
        for name in ("packed", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QuantizeTuning.{name} must be True or False; got {getattr(self, name)!r}")


DEFAULT_TUNING = QuantizeTuning()


# β_k: the midpoint below W_k = the smallest fp32 w with fl(w + 0.5) >= k (k = 1, 2, 3); a tie
# u + z = β_k rounds down for k = 1 only (W_1 = 0.5 - 2^-25 is odd; 1.5 and 2.5 are even)
_BETA1 = tl.constexpr(float.fromhex("0x1.fffffd0000000p-2"))
_BETA2 = tl.constexpr(float.fromhex("0x1.7fffff0000000p+0"))
_BETA3 = tl.constexpr(float.fromhex("0x1.3fffff0000000p+1"))


@triton.jit
def _nmin(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _finish(x0, x1, x2, x3, x4, x5, x6, x7, c_off, rmask, C, M, tiny, m_off, BLOCK_R: tl.constexpr,
            D8: tl.constexpr, CLIP: tl.constexpr, N_DROP: tl.constexpr, ROUNDS: tl.constexpr,
            TOP_K: tl.constexpr, TREE: tl.constexpr, PACKED: tl.constexpr = False,
            ASM: tl.constexpr = 0, BITS: tl.constexpr = 2):  # fmt: skip
    """Clip, quantize and pack a block of rows held as eight fp32 column pieces (``PACKED``: as
    the rows' bf16/fp16 values, the clip network on packed pairs, ``ASM`` its PTX type) into
    ``BITS``-bit codes; store."""
    f0, f1, f2, f3, f4, f5, f6, f7 = x0, x1, x2, x3, x4, x5, x6, x7
    if PACKED:
        f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        f4, f5, f6, f7 = x4.to(tl.float32), x5.to(tl.float32), x6.to(tl.float32), x7.to(tl.float32)
    # min/max that keep NaN (one instruction either way): a row holding NaN gets NaN scale/zero
    mn = _nmin(_nmin(_nmin(f0, f1), _nmin(f2, f3)), _nmin(_nmin(f4, f5), _nmin(f6, f7)))
    mx = _nmax(_nmax(_nmax(f0, f1), _nmax(f2, f3)), _nmax(_nmax(f4, f5), _nmax(f6, f7)))
    lo = tl.reduce(mn, 1, _nmin)
    hi = tl.reduce(mx, 1, _nmax)
    if CLIP:
        if PACKED:
            # |x| as int16 bit patterns (ordered as the values), taken after the fp32 copies above:
            # taken before them, Triton 3.6 lays the codes out like the network's last level (+190
            # SASS ops)
            a0, a1, a2, a3 = abs_bits(x0), abs_bits(x1), abs_bits(x2), abs_bits(x3)
            a4, a5, a6, a7 = abs_bits(x4), abs_bits(x5), abs_bits(x6), abs_bits(x7)
            tau = clip_threshold((a0, a1, a2, a3, a4, a5, a6, a7), N_DROP, ROUNDS, TREE, TOP_K, ASM)
            tau = tau.to(x0.dtype, bitcast=True).to(tl.float32)  # exact
        else:
            a = (tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3), tl.abs(x4), tl.abs(x5), tl.abs(x6), tl.abs(x7))  # fmt: skip
            tau = clip_threshold(a, N_DROP, ROUNDS, TREE, TOP_K)
        lo = _nmin(_nmax(lo, -tau), tau)
        hi = _nmin(_nmax(hi, -tau), tau)
    if BITS == 2:
        s = tl.math.div_rn(_nmax(hi - lo, 1e-8), 3.0)  # NaN for a row of infinities of one sign
    else:
        s = tl.math.div_rn(_nmax(hi - lo, 1e-8), 15.0)
    s = _nmax(s, tl.maximum(tl.abs(lo), tl.abs(hi)) * 0.00006103515625)  # exact: / 2^14
    s = _nmax(s, tiny)
    z = tl.math.div_rn(-lo, s)
    s_m = to_meta(s, M.dtype.element_ty)
    z_m = to_meta(z, M.dtype.element_ty)
    if BITS == 2:
        sd = s_m.to(tl.float64)
        zd = z_m.to(tl.float64)
        # a NaN or infinite scale (rows with NaN or unclipped infinities): every code 0, as the reference
        ok = (s < float("inf"))[:, None]
        t1 = tl.where(ok, threshold(_BETA1, True, sd, zd, lo, hi), float("nan"))
        t2 = tl.where(ok, threshold(_BETA2, False, sd, zd, lo, hi), float("nan"))
        t3 = tl.where(ok, threshold(_BETA3, False, sd, zd, lo, hi), float("nan"))
        m2 = rmask[:, None]
        cp = C.to(tl.pointer_type(tl.int32)) + (c_off // 4)[:, None] + tl.arange(0, D8 // 4)[None, :]
        tl.store(cp, pack(x0, x2, x4, x6, t1, t2, t3, BLOCK_R, D8), mask=m2)
        tl.store(cp + D8 // 4, pack(x1, x3, x5, x7, t1, t2, t3, BLOCK_R, D8), mask=m2)
    else:
        ok = (s < float("inf"))[:, None]
        sd = s_m.to(tl.float64)[:, None]
        zf = z_m.to(tl.float32)[:, None]
        lc, hc = lo[:, None], hi[:, None]
        xs = (x0, x1, x2, x3, x4, x5, x6, x7)  # (16-bit when PACKED: the fp32 copies are dead by now)
        m2 = rmask[:, None]
        cp = C.to(tl.pointer_type(tl.int32)) + (c_off // 4)[:, None] + tl.arange(0, D8 // 4)[None, :]
        for i in tl.static_range(4):  # bytes i·D/8 onwards: pieces i (bits 3:0) and i + 4 (bits 7:4)
            codes = pack4(xs[i], xs[i + 4], lc, hc, sd, zf, ok, CLIP, BLOCK_R, D8)
            tl.store(cp + i * (D8 // 4), codes, mask=m2)
    tl.store(M + m_off, s_m, mask=rmask)
    tl.store(M + m_off + 1, z_m, mask=rmask)


@triton.jit
def _quantize_pack(X, C, M, SRC, DST, n_rows, tiny, s_xt, s_xh, s_ct, s_ch, s_mt, s_mh, D: tl.constexpr,
                   BLOCK_R: tl.constexpr, CLIP: tl.constexpr, N_DROP: tl.constexpr, ROUNDS: tl.constexpr,
                   TOP_K: tl.constexpr, TREE: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr,
                   PDL: tl.constexpr, BITS: tl.constexpr = 2, H: tl.constexpr = 1, GATHER: tl.constexpr = False,
                   SCATTER: tl.constexpr = False):  # fmt: skip
    """Rows ``0 .. n_rows`` = (token ``i``, head ``h``) pairs, ``H`` heads a token, at token/head
    strides ``s_*t``/``s_*h`` (codes in bytes, ``X`` and metadata in elements); ``GATHER``: row
    ``(i, h)`` is read from token ``SRC[i]`` of ``X``; ``SCATTER``: written to token ``DST[i]``."""
    if PDL:  # a programmatic dependent launch: wait for the previous kernel before the first read
        gdc_wait()
        gdc_launch_dependents()
    D8: tl.constexpr = D // 8
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    m2 = rmask[:, None]
    tok, head = (rows // H).to(tl.int64), rows % H
    src = tl.load(SRC + tok, mask=rmask, other=0).to(tl.int64) if GATHER else tok
    dst = tl.load(DST + tok, mask=rmask, other=0).to(tl.int64) if SCATTER else tok
    xp = X + (src * s_xt + head * s_xh)[:, None] + tl.arange(0, D8)[None, :]
    x0, x1 = tl.load(xp, mask=m2, other=0.0), tl.load(xp + D8, mask=m2, other=0.0)
    x2, x3 = tl.load(xp + 2 * D8, mask=m2, other=0.0), tl.load(xp + 3 * D8, mask=m2, other=0.0)
    x4, x5 = tl.load(xp + 4 * D8, mask=m2, other=0.0), tl.load(xp + 5 * D8, mask=m2, other=0.0)
    x6, x7 = tl.load(xp + 6 * D8, mask=m2, other=0.0), tl.load(xp + 7 * D8, mask=m2, other=0.0)
    if not PACKED:
        x0, x1, x2, x3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        x4, x5, x6, x7 = x4.to(tl.float32), x5.to(tl.float32), x6.to(tl.float32), x7.to(tl.float32)
    _finish(x0, x1, x2, x3, x4, x5, x6, x7, dst * s_ct + head * s_ch, rmask, C, M, tiny, dst * s_mt + head * s_mh,
            BLOCK_R, D8, CLIP, N_DROP, ROUNDS, TOP_K, TREE, PACKED, ASM, BITS)  # fmt: skip


_QUANTIZE_PACK = Launcher(_quantize_pack)
_PAIRS = {torch.bfloat16: 1, torch.float16: 2}  # the packed network's PTX type (quantize_nets._PAIR_TYPES)


@functools.cache
def _pair_asm(device: torch.device, dtype: torch.dtype, rounds: int) -> int:
    """The packed network's PTX type on ``device``, 0 where its inline PTX cannot run: ROCm, and
    NVIDIA below sm_80 (``max/min`` on 16-bit pairs), or below sm_90 with more than one round
    (its packed ``set`` compares; not checked on older GPUs)."""
    if torch.version.hip is not None:
        return 0
    return (
        _PAIRS[dtype] if torch.cuda.get_device_capability(device) >= ((9, 0) if rounds > 1 else (8, 0)) else 0
    )


def _check(fmt: RowFormat) -> None:
    if (
        fmt.bits not in (2, 4)
        or fmt.groups != 1
        or fmt.quantizer != "asymmetric"
        or fmt.head_dim not in (64, 128, 256)
    ):
        raise ValueError(
            "the Triton quantize_pack kernel writes 2- or 4-bit asymmetric rows with one (scale, zero) per row "
            f"and head_dim 64/128/256; got {fmt.bits}-bit, {fmt.groups} groups, {fmt.quantizer}, "
            f"d={fmt.head_dim} (use backend='torch')"
        )


def quantize_pack(
    rows: torch.Tensor, fmt: RowFormat, tuning: QuantizeTuning = DEFAULT_TUNING
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.ref.quantize_pack`` (rotated rows ``[N, H, d]`` on CUDA)."""
    _check(fmt)
    n, h, _ = rows.shape
    codes = torch.empty(n, h, fmt.packed_dim, dtype=torch.uint8, device=rows.device)
    meta = torch.empty(n, h, 1, 2, dtype=META_TORCH_DTYPES[fmt.meta_dtype], device=rows.device)
    _launch(rows, fmt, codes, meta, None, None, n, tuning)
    return codes, meta


def quantize_pack_into(
    rows: torch.Tensor,
    fmt: RowFormat,
    codes: torch.Tensor,
    meta: torch.Tensor,
    dst: torch.Tensor,
    src: torch.Tensor | None = None,
    tuning: QuantizeTuning = DEFAULT_TUNING,
) -> None:
    """Same contract as ``kernels.ref.quantize_pack_into``: one launch that reads ``rows[src]``
    and writes ``codes[dst]``/``meta[dst]`` (the gather, quantize and scatter of a demotion)."""
    _check(fmt)
    check_into(rows, fmt, codes, meta, dst, src)
    n = dst.shape[0]
    _launch(rows, fmt, codes, meta, src, dst, n, tuning)


def _launch(rows, fmt, codes, meta, src, dst, n, t):
    """Rows, codes and metadata at any token and head strides (vLLM's pages interleave them)."""
    h, d = rows.shape[1], rows.shape[2]
    x = rows if rows.stride(-1) == 1 else rows.contiguous()
    if n * h == 0:
        return
    n_drop = d - 1 - clip_index(fmt.clip, d) if fmt.clip > 0 else 0
    top_k = 6 if n_drop < 6 else t.round_k  # the six-network where one round of it does
    rounds = -(-(n_drop + 1) // top_k)
    n_blocks = -(-(n * h) // t.block_r)  # not triton.cdiv: a JIT-wrapped call, ~7 us of host time
    # packed pairs only with the rows at 16-byte boundaries: else the loads are narrow and the pairs
    # cost shuffles (offline 4054 SASS instructions against 3468 for the fp32 network at d=128)
    packed = (
        t.packed and fmt.clip > 0 and x.dtype in _PAIRS and rounds <= t.packed_rounds
        and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0
    )  # fmt: skip
    # on a GPU only with its PTX pairs (the int16 fallback is exact but slower than fp32)
    asm = _pair_asm(x.device, x.dtype, rounds) if packed and x.is_cuda else 0
    packed = packed and (asm > 0 or not x.is_cuda)
    # the register cap is tuned for the 2-bit network (4 bits spill under it)
    capped = packed and d == 128 and fmt.bits == 2 and x.is_cuda and t.packed_maxnreg
    opts = {"maxnreg": t.packed_maxnreg} if capped else {}
    # merge levels of column pairs before tl.reduce, within a thread's 16 loaded bytes (fewer if the
    # block is small): a balanced tree instead of tl.reduce's serial chain (6% faster on the H200);
    # all the way under the interpreter (CPU tensors), whose tl.reduce calls the combine per element
    if not x.is_cuda:
        tree = (d // 8).bit_length() - 1
    elif packed:
        tree = min(d // 8, 8, max(1, t.block_r * d // (256 * t.num_warps))).bit_length() - 1
    else:
        tree = min(d // 8, 16 // x.element_size()).bit_length() - 1
    pdl = t.pdl and device_facts(x.device)[1]
    _QUANTIZE_PACK(
        (n_blocks,), x, codes, meta, x if src is None else src, x if dst is None else dst, n * h,
        torch.finfo(meta.dtype).tiny, x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), meta.stride(0),
        meta.stride(1), D=d, BLOCK_R=t.block_r, CLIP=fmt.clip > 0,
        N_DROP=n_drop, ROUNDS=rounds, TOP_K=top_k, TREE=tree, PACKED=packed, ASM=asm, PDL=pdl, BITS=fmt.bits,
        H=h, GATHER=src is not None, SCATTER=dst is not None, num_warps=t.num_warps, **opts,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
