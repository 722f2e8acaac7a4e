"""Triton twin of ``kernels.ref.qk_norm_rope``: a layer's new queries and keys normalized per head
(optional) and rotated in one launch, where the eager ops launch about 20 kernels per layer.

Program ``(t, j)`` takes ``HB`` heads of token ``t`` (query heads first, then key heads) straight
out of the fused ``qkv`` projection's strided views: the rotary pairs as two ``HALF``-wide blocks
(dims ``i`` and ``i + ROT/2``) and, for partial rotary (``ROT < D``), dims ``[ROT, D)`` as a third
block that the norm covers and the rotation passes through. The arithmetic keeps the twin's
rounding points: fp32 statistics, the normalized row rounded to the model dtype before the weight,
and each RoPE product and sum rounded to the model dtype as the eager ops do; the results differ
from the twin only by the fp32 summation order of the norm (none without the norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ref.rope import check_norm_weights, check_rotary
from .launch import Launcher

__all__ = ["qk_norm_rope"]

ROWS_ELEMS = 2048  # head rows per program: about this many elements


@triton.jit
def _rows(X, t, h, s_t, s_h, offs, mask):
    return tl.load(X + t * s_t + h.to(tl.int64)[:, None] * s_h + offs[None, :], mask=mask, other=0.0)


@triton.jit
def _qk_norm_rope(Q, K, COS, SIN, WQ, WK, QO, KO, s_qt, s_qh, s_kt, s_kh, s_ct, eps, HQ: tl.constexpr,
                  HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr,
                  PASS: tl.constexpr, HB: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    is_q, is_k = heads < HQ, (heads >= HQ) & (heads < HQ + HKV)
    hk = tl.where(is_k, heads - HQ, 0)
    hq = tl.where(is_q, heads, 0)
    offs = tl.arange(0, HALF)  # the rotary pairs: dims offs and offs + ROT/2
    cm = offs < ROT // 2
    qm, km = is_q[:, None] & cm[None, :], is_k[:, None] & cm[None, :]
    # every row is a query row or a key row (or padding): one of the two masked loads reads it
    x1 = _rows(Q, t, hq, s_qt, s_qh, offs, qm) + _rows(K, t, hk, s_kt, s_kh, offs, km)
    x2 = _rows(Q, t, hq, s_qt, s_qh, offs + ROT // 2, qm) + _rows(K, t, hk, s_kt, s_kh, offs + ROT // 2, km)
    dt = x1.dtype
    if PASS > 0:  # partial rotary: dims [ROT, D) are normalized (with the norm) but not rotated
        po = ROT + tl.arange(0, PASS)
        pm = po < D
        pqm, pkm = is_q[:, None] & pm[None, :], is_k[:, None] & pm[None, :]
        xp = _rows(Q, t, hq, s_qt, s_qh, po, pqm) + _rows(K, t, hk, s_kt, s_kh, po, pkm)
    if NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        ss = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
        if PASS > 0:
            fp = xp.to(tl.float32)
            ss += tl.sum(fp * fp, axis=1)
        rstd = tl.math.rsqrt(ss / D + eps)[:, None]
        wq1 = tl.load(WQ + offs, mask=cm, other=0.0).to(tl.float32)[None, :]
        wq2 = tl.load(WQ + ROT // 2 + offs, mask=cm, other=0.0).to(tl.float32)[None, :]
        wk1 = tl.load(WK + offs, mask=cm, other=0.0).to(tl.float32)[None, :]
        wk2 = tl.load(WK + ROT // 2 + offs, mask=cm, other=0.0).to(tl.float32)[None, :]
        w1 = tl.where(is_q[:, None], wq1, wk1)
        w2 = tl.where(is_q[:, None], wq2, wk2)
        x1 = ((f1 * rstd).to(dt).to(tl.float32) * w1).to(dt)
        x2 = ((f2 * rstd).to(dt).to(tl.float32) * w2).to(dt)
        if PASS > 0:
            wqp = tl.load(WQ + po, mask=pm, other=0.0).to(tl.float32)[None, :]
            wkp = tl.load(WK + po, mask=pm, other=0.0).to(tl.float32)[None, :]
            xp = ((fp * rstd).to(dt).to(tl.float32) * tl.where(is_q[:, None], wqp, wkp)).to(dt)
    c = tl.load(COS + t * s_ct + offs, mask=cm, other=0.0).to(dt).to(tl.float32)[None, :]
    s = tl.load(SIN + t * s_ct + offs, mask=cm, other=0.0).to(dt).to(tl.float32)[None, :]
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)).to(dt)
    qo = QO + (t * HQ + hq)[:, None] * D
    ko = KO + (t * HKV + hk)[:, None] * D
    tl.store(qo + offs[None, :], o1, mask=qm)
    tl.store(qo + ROT // 2 + offs[None, :], o2, mask=qm)
    tl.store(ko + offs[None, :], o1, mask=km)
    tl.store(ko + ROT // 2 + offs[None, :], o2, mask=km)
    if PASS > 0:
        tl.store(qo + po[None, :], xp, mask=pqm)
        tl.store(ko + po[None, :], xp, mask=pkm)


_KERNEL = Launcher(_qk_norm_rope)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.ref.qk_norm_rope``: ``q``/``k`` with unit stride in the head dim
    (any token and head strides), ``cos``/``sin`` sharing one row stride; outputs are contiguous."""
    check_norm_weights(q_weight, k_weight)
    t, hq, d = q.shape
    hkv = k.shape[1]
    r = check_rotary(d, cos, sin)
    if k.shape != (t, hkv, d) or cos.shape[0] != t:
        raise ValueError(
            f"qk_norm_rope: q [T, Hq, d], k [T, Hkv, d] and cos/sin [T, r/2]; got q {list(q.shape)}, "
            f"k {list(k.shape)}, cos {list(cos.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(
            "qk_norm_rope: q, k, cos and sin need unit stride in their last dim, cos and sin one row stride"
        )
    norm = q_weight is not None
    if norm and (q_weight.shape != (d,) or k_weight.shape != (d,)):  # type: ignore[union-attr]
        raise ValueError(f"qk_norm_rope: the norm weights must be [{d}]")
    qo = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, hkv, d, dtype=k.dtype, device=k.device)
    if t:
        half = triton.next_power_of_2(r // 2)
        rest = triton.next_power_of_2(d - r) if d > r else 0
        fit = max(1, ROWS_ELEMS // (2 * half + rest))
        hb = min(triton.next_power_of_2(hq + hkv), 1 << (fit.bit_length() - 1))  # a power of two
        wq = q_weight if norm else q  # unread without the norm
        wk = k_weight if norm else k
        _KERNEL(
            (t, triton.cdiv(hq + hkv, hb)), q, k, cos, sin, wq, wk, qo, ko, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), cos.stride(0), float(eps), HQ=hq, HKV=hkv, D=d, ROT=r, HALF=half, PASS=rest, HB=hb,
            NORM=norm, num_warps=4,
        )  # fmt: skip
    return qo, ko
