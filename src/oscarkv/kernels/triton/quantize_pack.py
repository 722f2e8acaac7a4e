"""Triton rotate-clip-quantize-pack (2-bit, one (scale, zero) per row); its inverse is in :mod:`.dequantize`.

``_quantize_pack``, bit-exact with the reference: a program takes ``BLOCK_R`` rows, each held as
eight column pieces ``x_i = x[:, i·D/8 : (i+1)·D/8]`` (pieces ``2q``, ``2q+1`` make quarter ``q``
of the packed layout: byte ``j`` holds elements ``j, j+D/4, j+D/2, j+3D/4``).

1. Rotation (optional): ``tl.dot`` of the rows with ``R`` in the rows' dtype, fp32 accumulation,
   split into the pieces by reshape/split (register relabelling). A program then loops over row
   blocks (a grid of ``ROT_PER_SM`` programs per SM): ``R`` is read once and stays in shared
   memory, the next block's rows are prefetched. (d=256: one block per program, ``R`` in chunks.)
2. Clip threshold ``tau``: the ``(N_DROP+1)``-th largest ``|x|`` counting ties (the reference's
   ``⌊ratio·D⌋``-th smallest). A round finds a row's ``K`` largest values, sorted (``K = 6`` if
   ``N_DROP < 6``, else ``ROUND_K``: 12), by comparator networks on multisets (so ties need no
   care; in ``quantize_nets``): each column's eight pieces sorted (19 comparators), then merges
   of two sorted lists into their ``K`` largest (``_merge``: ``max(a_i, b_{K-1-i})`` falls, then
   rises; a bitonic sort less its padding sorts it, 7 / 20 comparators for 6 / 12): ``TREE``
   levels of adjacent-column pairs (reshape/split, within a thread), then ``tl.reduce``
   (``TREE = 0``: of eight-lists padded to twelve). Larger drop counts take ``⌈(N_DROP+1)/K⌉``
   rounds, each masking the values ``>=`` the last list's smallest entry and counting them.
   Packed (``PACKED``; bf16/fp16 rows, no rotation): the network takes the rows' own values,
   ``|x|`` as int16 bit patterns (ordered like the values, so exact), two per register through
   ``max/min.bf16x2`` (``.f16x2``; Triton's bf16 max/min go through fp32): half the comparator
   instructions. The tree keeps a thread's pairs whole (halves of its runs of columns) down to
   its last level, which with ``tl.reduce`` runs on int16 scalars; ``tau`` converts exactly.
   Under the interpreter the same code runs on int16 through ``tl.maximum``/``tl.minimum``.
3. ``lo, hi`` of the clipped row are ``clamp(min x), clamp(max x)``; scale and zero as the
   reference, rounded to the metadata dtype.
4. Codes by three compares: ``q(v) = ⌊fl(fl(v ⊘ s) + z) + 0.5⌋`` is non-decreasing in ``v``, so
   ``clamp(q(clip(x)), 0, 3) = [x >= t1] + [x >= t2] + [x >= t3]``, ``t_k`` the smallest fp32
   ``v`` with ``q(v) >= k``. Computed exactly per row, not searched: rounding to nearest crosses
   a float at the midpoint below it, so ``fl(u + z) >= W_k`` iff ``u >= β_k - z`` and
   ``fl(v ⊘ s) >= U`` iff ``v >= μ·s`` (``β_k``, ``μ``: midpoints below ``W_k``, ``U``; strict
   where that tie rounds down), both exact in fp64 and rounded up to fp32. A ``t_k`` outside
   ``(lo, hi]`` becomes ``-inf`` (all) or NaN (none), so ``x`` itself is never clamped.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...quant import RowFormat
from ...quant.quantizer import META_TORCH_DTYPES, clip_index
from .launch import Launcher, pdl_ok
from .quantize_nets import _abs_bits, _clip_threshold, _pack, _split8, _threshold, _to_meta

__all__ = ["quantize_pack"]

# Tuning (set by benchmarks/gpu_check.py's sweep; see its saved results). With rotation a program
# can loop over row blocks (R stays in shared memory, the next block's rows are prefetched):
# ROT_PER_SM programs per SM (0: one block per program), ROT_STAGES-deep prefetch, ROT_MAXNREG
# registers per thread (0: no cap). On the H200 the loop measured slower than one block per
# program (0.87-0.94x, benchmarks/results/quantize_pack_ab_h200.md), so the defaults keep one
# block per program, no prefetch and the 128-register cap (1.20 vs 1.16 TB/s at 1M rows). The loop
# stays, run once per program: the same block without it, like the d=256 path, compiled 3-4%
# slower at 256K-1M rows (results/quantize_pack_noloop_ab_h200.md)
BLOCK_R = 64
NUM_WARPS = 4
MAXNREG = 0  # without rotation (0: no cap)
BLOCK_R_ROT = 64
ROT_STAGES = 1
ROT_PER_SM = 0
ROT_MAXNREG = 128
ROT_TREE = 0  # in-thread merge levels of the clip network in the MMA layout (0: tl.reduce alone)
# The packed clip network (False: fp32) up to PACKED_ROUNDS rounds (2+: no fewer sm_90 SASS ops),
# PACKED_MAXNREG registers at d=128 (0: no cap; d=256 spills under 128). d=128, clip 0.96: 1272
# SASS ops per thread against 1442 (uncapped, ptxas takes 115 registers, saves predicates: 1354)
PACKED = True
PACKED_ROUNDS = 1
PACKED_MAXNREG = 128
# Clip rounds of ROUND_K (6 or 12) values where N_DROP >= 6. d=128 at clip 0.92, sm_90 SASS per
# thread: one round of 12, packed, 1416; two of 6 (fp32: the packed one spills) 2480
ROUND_K = 12
# Without rotation, launch as a programmatic dependent of the previous kernel (compute capability
# >= 9; the kernel waits on griddepcontrol.wait before it reads anything), so that its launch
# overlaps that kernel's tail, and let the next kernel launch the same way. H200, back-to-back
# calls in a CUDA graph, two runs (results/quantize_pack_pdl_s14_h200.md): +2-4% at 64K-256K
# rows (clip 0.92, 64K: 1.45-1.46 -> 1.50 TB/s), 0 to -2% at 1M; with rotation 0.99x at every
# size, so the rotation path keeps the ordinary launch
PDL = True

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
def _finish(x0, x1, x2, x3, x4, x5, x6, x7, rows, rmask, C, M, tiny, s_cr, s_mr, BLOCK_R: tl.constexpr,
            D8: tl.constexpr, CLIP: tl.constexpr, N_DROP: tl.constexpr, ROUNDS: tl.constexpr,
            TOP_K: tl.constexpr, TREE: tl.constexpr, PACKED: tl.constexpr = False,
            ASM: tl.constexpr = 0):  # fmt: skip
    """Clip, quantize and pack a block of rows held as eight fp32 column pieces (``PACKED``: as
    the rows' bf16/fp16 values, the clip network on packed pairs, ``ASM`` its PTX type); store."""
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
            a0, a1, a2, a3 = _abs_bits(x0), _abs_bits(x1), _abs_bits(x2), _abs_bits(x3)
            a4, a5, a6, a7 = _abs_bits(x4), _abs_bits(x5), _abs_bits(x6), _abs_bits(x7)
            tau = _clip_threshold((a0, a1, a2, a3, a4, a5, a6, a7), N_DROP, ROUNDS, TREE, TOP_K, ASM)
            tau = tau.to(x0.dtype, bitcast=True).to(tl.float32)  # exact
        else:
            a = (tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3), tl.abs(x4), tl.abs(x5), tl.abs(x6), tl.abs(x7))  # fmt: skip
            tau = _clip_threshold(a, N_DROP, ROUNDS, TREE, TOP_K)
        lo = _nmin(_nmax(lo, -tau), tau)
        hi = _nmin(_nmax(hi, -tau), tau)
    s = tl.math.div_rn(_nmax(hi - lo, 1e-8), 3.0)  # NaN for a row of infinities of one sign
    s = _nmax(s, tl.maximum(tl.abs(lo), tl.abs(hi)) * 0.00006103515625)  # exact: / 2^14
    s = _nmax(s, tiny)
    z = tl.math.div_rn(-lo, s)
    s_m = _to_meta(s, M.dtype.element_ty)
    z_m = _to_meta(z, M.dtype.element_ty)
    sd = s_m.to(tl.float64)
    zd = z_m.to(tl.float64)
    # a NaN or infinite scale (rows with NaN or unclipped infinities): every code 0, as the reference
    ok = (s < float("inf"))[:, None]
    t1 = tl.where(ok, _threshold(_BETA1, True, sd, zd, lo, hi), float("nan"))
    t2 = tl.where(ok, _threshold(_BETA2, False, sd, zd, lo, hi), float("nan"))
    t3 = tl.where(ok, _threshold(_BETA3, False, sd, zd, lo, hi), float("nan"))
    m2 = rmask[:, None]
    cp = C.to(tl.pointer_type(tl.int32)) + rows[:, None] * (s_cr // 4) + tl.arange(0, D8 // 4)[None, :]
    tl.store(cp, _pack(x0, x2, x4, x6, t1, t2, t3, BLOCK_R, D8), mask=m2)
    tl.store(cp + D8 // 4, _pack(x1, x3, x5, x7, t1, t2, t3, BLOCK_R, D8), mask=m2)
    tl.store(M + rows * s_mr, s_m, mask=rmask)
    tl.store(M + rows * s_mr + 1, z_m, mask=rmask)


@triton.jit
def _block_rows(blk, n_rows, BLOCK_R: tl.constexpr, HEADS: tl.constexpr):
    """Row ids ``r·HEADS + program_id(1)`` of block ``blk`` and their mask."""
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows * HEADS + tl.program_id(1), rows < n_rows


@triton.jit
def _quantize_pack(X, R, C, M, n_rows, tiny, s_xr, s_rh, s_cr, s_mr,
                   D: tl.constexpr, BLOCK_R: tl.constexpr, ROTATE: tl.constexpr, HEADS: tl.constexpr,
                   CLIP: tl.constexpr, N_DROP: tl.constexpr, ROUNDS: tl.constexpr, TOP_K: tl.constexpr,
                   TREE: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr, PACKED: tl.constexpr = False,
                   ASM: tl.constexpr = 0, PDL: tl.constexpr = False):  # fmt: skip
    tl.static_assert(not (PACKED and ROTATE), "the packed clip network takes the rows' own values")
    if PDL:  # a programmatic dependent launch: wait for the previous kernel before the first read
        gdc_wait()
        gdc_launch_dependents()
    # blocks of rows of head program_id(1) (HEADS = 1 unless R is per head). With rotation and
    # KC == D a program loops over blocks program_id(0) + i·num_programs(0): R is loaded once and
    # stays in shared memory, the next block's rows are prefetched (STAGES); otherwise one block
    D8: tl.constexpr = D // 8
    Rh = R + tl.program_id(1) * s_rh
    if ROTATE and KC == D:
        rk = tl.load(Rh + tl.arange(0, D)[:, None] * D + tl.arange(0, D)[None, :])
        n_blocks = tl.cdiv(n_rows, BLOCK_R)
        for blk in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
            rows, rmask = _block_rows(blk, n_rows, BLOCK_R, HEADS)
            xp = X + rows[:, None] * s_xr + tl.arange(0, D)[None, :]
            acc = tl.dot(tl.load(xp, mask=rmask[:, None], other=0.0).to(rk.dtype), rk)
            x0, x1, x2, x3, x4, x5, x6, x7 = _split8(acc, BLOCK_R, D8)
            _finish(x0, x1, x2, x3, x4, x5, x6, x7, rows, rmask, C, M, tiny, s_cr, s_mr, BLOCK_R, D8,
                    CLIP, N_DROP, ROUNDS, TOP_K, TREE)  # fmt: skip
    else:
        rows, rmask = _block_rows(tl.program_id(0), n_rows, BLOCK_R, HEADS)
        m2 = rmask[:, None]
        if ROTATE:  # d=256: R (128 KB) in KC-row chunks
            acc = tl.zeros([BLOCK_R, D], tl.float32)
            kc = tl.arange(0, KC)
            for k0 in tl.static_range(0, D, KC):
                xk = tl.load(X + rows[:, None] * s_xr + (k0 + kc)[None, :], mask=m2, other=0.0)
                rc = tl.load(Rh + (k0 + kc)[:, None] * D + tl.arange(0, D)[None, :])
                acc += tl.dot(xk.to(rc.dtype), rc)
            x0, x1, x2, x3, x4, x5, x6, x7 = _split8(acc, BLOCK_R, D8)
        else:
            xp = X + rows[:, None] * s_xr + tl.arange(0, D8)[None, :]
            x0, x1 = tl.load(xp, mask=m2, other=0.0), tl.load(xp + D8, mask=m2, other=0.0)
            x2, x3 = tl.load(xp + 2 * D8, mask=m2, other=0.0), tl.load(xp + 3 * D8, mask=m2, other=0.0)
            x4, x5 = tl.load(xp + 4 * D8, mask=m2, other=0.0), tl.load(xp + 5 * D8, mask=m2, other=0.0)
            x6, x7 = tl.load(xp + 6 * D8, mask=m2, other=0.0), tl.load(xp + 7 * D8, mask=m2, other=0.0)
            if not PACKED:
                x0, x1, x2, x3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
                x4, x5, x6, x7 = x4.to(tl.float32), x5.to(tl.float32), x6.to(tl.float32), x7.to(tl.float32)
        _finish(x0, x1, x2, x3, x4, x5, x6, x7, rows, rmask, C, M, tiny, s_cr, s_mr, BLOCK_R, D8,
                CLIP, N_DROP, ROUNDS, TOP_K, TREE, PACKED, ASM)  # fmt: skip


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
        fmt.bits != 2
        or fmt.groups != 1
        or fmt.quantizer != "asymmetric"
        or fmt.head_dim not in (64, 128, 256)
    ):
        raise ValueError(
            "the Triton quantize_pack kernel writes 2-bit asymmetric rows with one (scale, zero) per row "
            f"and head_dim 64/128/256; got {fmt.bits}-bit, {fmt.groups} groups, {fmt.quantizer}, "
            f"d={fmt.head_dim} (use backend='torch')"
        )


def quantize_pack(rows: torch.Tensor, rotation: torch.Tensor | None, fmt: RowFormat):
    """Same contract as ``kernels.ref.quantize_pack`` (rows ``[N, H, d]`` on CUDA)."""
    _check(fmt)
    n, h, d = rows.shape
    x = rows.reshape(n * h, d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty(n, h, d // 4, dtype=torch.uint8, device=rows.device)
    meta = torch.empty(n, h, 1, 2, dtype=META_TORCH_DTYPES[fmt.meta_dtype], device=rows.device)
    if n * h == 0:
        return codes, meta
    per_head = rotation is not None and rotation.dim() == 3
    block_r = BLOCK_R_ROT if rotation is not None else BLOCK_R
    n_drop = d - 1 - clip_index(fmt.clip, d) if fmt.clip > 0 else 0
    top_k = 6 if n_drop < 6 else ROUND_K  # the six-network where one round of it does
    rounds = -(-(n_drop + 1) // top_k)
    # the rotation GEMM runs in the rows' dtype (bf16 tensor cores for bf16 models), fp32 accumulation
    r = rotation.to(device=rows.device, dtype=rows.dtype).contiguous() if rotation is not None else x
    tiny = torch.finfo(meta.dtype).tiny
    heads = h if per_head else 1
    n_blocks = -(-(n * h // heads) // block_r)  # not triton.cdiv: a JIT-wrapped call, ~7 us of host time
    # merge column pairs by splits before tl.reduce, within a thread's 16 loaded bytes: a balanced
    # tree instead of tl.reduce's serial chain (measured 6% faster on the H200); the MMA
    # accumulator by tl.reduce alone (a level of pairs adds shuffles at clip 0.92 in its layout);
    # all the way under the interpreter (CPU tensors), whose tl.reduce calls the combine once per
    # element
    tree = ROT_TREE if rotation is not None else min(d // 8, 16 // x.element_size()).bit_length() - 1
    opts, kc, stages = {}, d if d <= 128 else 64, ROT_STAGES
    # (rows at 16-byte boundaries: else the loads are narrow and the pairs cost shuffles, measured
    # offline 4054 SASS instructions against 3468 for the fp32 network at d=128)
    packed = (
        PACKED and rotation is None and fmt.clip > 0 and x.dtype in _PAIRS and rounds <= PACKED_ROUNDS
        and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0
    )  # fmt: skip
    # on a GPU only with its PTX pairs (the int16 fallback is exact but slower than fp32)
    asm = _pair_asm(x.device, x.dtype, rounds) if packed and x.is_cuda else 0
    packed = packed and (asm > 0 or not x.is_cuda)
    if rotation is None:
        warps, programs = NUM_WARPS, n_blocks
        cap = (PACKED_MAXNREG if d == 128 else 0) if packed else MAXNREG
        if x.is_cuda and cap:
            opts["maxnreg"] = cap
        if packed:  # in-thread levels: the columns a thread loads (16 bytes, fewer if the block is small)
            tree = min(d // 8, 8, max(1, block_r * d // (256 * warps))).bit_length() - 1
    else:
        # one warp group (4 warps) per 64 rows: at 64 rows, 2 or 8 warps took 1.7x / 2.2x as long
        warps = 8 if d > 128 else max(4, block_r // 16)
        sms = torch.cuda.get_device_properties(rows.device).multi_processor_count if x.is_cuda else 1
        programs = min(n_blocks, max(1, sms * ROT_PER_SM // heads)) if ROT_PER_SM else n_blocks
        if d > 128:  # R in 64-row chunks per block, one block per program (as before the loop)
            programs, stages = n_blocks, 1
        elif x.is_cuda and ROT_MAXNREG:
            opts["maxnreg"] = ROT_MAXNREG
    if not x.is_cuda:
        tree = (d // 8).bit_length() - 1
    pdl = PDL and rotation is None and pdl_ok(x.device)
    _QUANTIZE_PACK(
        (programs, heads), x, r, codes, meta, n * h // heads, tiny, x.stride(0), r.stride(0) if per_head else 0, d // 4, 2,
        D=d, BLOCK_R=block_r, ROTATE=rotation is not None, HEADS=heads, CLIP=fmt.clip > 0, N_DROP=n_drop,
        ROUNDS=rounds, TOP_K=top_k, TREE=tree, KC=kc, STAGES=stages, PACKED=packed, ASM=asm, PDL=pdl,
        num_warps=warps, **opts, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return codes, meta
