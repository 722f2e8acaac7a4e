"""Attention over a fake-quantized cache with OSCAR's 16-bit windows, for the held-out passes of
calibration (the clip search by loss, the offsets' and the key widths' held-out NLL).

For the query at position ``i``, key/value ``j`` is exact if ``j < sink`` or ``i - j < recent``,
otherwise clipped, quantized and dequantized in the rotated basis, as the cache stores it. The
scores are computed once against the quantized keys and corrected by ``q · (k - k_q)`` only where
a key is exact (the sink columns, and a band of ``recent`` keys below the diagonal, in blocks of
queries); the values likewise. A dense form (two score matrices and a select) runs about twice as
many passes over the ``[queries, keys]`` matrix, which dominates a held-out pass on a CPU.
"""

from __future__ import annotations

import torch

from ..quant import RowFormat, fake_quantize_rows
from ..quant.window import FP8_WINDOW, through_window
from ..rotation import LayerRotation, rotate_heads

__all__ = ["windowed_fake_quant_attention"]

_BLOCK = 256  # queries per band block: the band then spans at most _BLOCK + recent - 1 keys


def windowed_fake_quant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rot: LayerRotation,
    kf: RowFormat,
    vf: RowFormat,
    sink: int,
    recent: int,
    scale: float,
    window: str = "model",
) -> torch.Tensor:
    """Causal attention of the last ``T_q`` positions over ``T`` keys with OSCAR's windows.

    ``q [B, H_q, T_q, d]`` (positions ``T - T_q .. T - 1``), ``k/v [B, H_kv, T, d]``;
    returns ``[B, T_q, H_q, d]`` in ``q``'s dtype (the math in fp32). ``window``: the spec's
    ``window_dtype``; with ``fp8_e4m3`` every stored row (window or INT2) starts from its fp8
    value, as the cache stores it (``quant.window``).
    """
    b, hq, tq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    rk, rv = rot.k.float(), rot.v.float()
    qr = (rotate_heads(q.float(), rk) * scale).reshape(b, hkv, g, tq, d)  # query heads per KV head
    kr, vr = rotate_heads(k.float(), rk), rotate_heads(v.float(), rv)
    # the quantized tier stores rows minus the layer's channel offsets (read back plus them)
    ck = 0.0 if rot.k_offset is None else rot.k_offset.float().to(q.device)[None, :, None, :]
    cv = 0.0 if rot.v_offset is None else rot.v_offset.float().to(q.device)[None, :, None, :]
    if window == "fp8_e4m3":  # the windows hold the offset rows in fp8, and INT2 rows quantize those
        kr, vr = through_window(kr - ck, FP8_WINDOW) + ck, through_window(vr - cv, FP8_WINDOW) + cv
    kq, vq = fake_quantize_rows(kr - ck, kf) + ck, fake_quantize_rows(vr - cv, vf) + cv
    dk, dv = (kr - kq)[:, :, None], (vr - vq)[:, :, None]  # [B, H_kv, 1, T, d]: exact minus stored

    s = qr @ kq[:, :, None].transpose(-1, -2)  # [B, H_kv, g, T_q, T]
    w = min(sink, t)
    s[..., :w] += qr @ dk[..., :w, :].transpose(-1, -2)
    bands = []
    for p0 in range(0, tq, _BLOCK):
        p1 = min(p0 + _BLOCK, tq)
        i = torch.arange(t - tq + p0, t - tq + p1, device=q.device)[:, None]
        c0, c1 = max(w, t - tq + p0 - recent + 1), t - tq + p1
        if c1 <= c0:
            continue
        j = torch.arange(c0, c1, device=q.device)[None, :]
        band = (i - j < recent) & (j <= i)
        s[..., p0:p1, c0:c1] += (qr[..., p0:p1, :] @ dk[..., c0:c1, :].transpose(-1, -2)) * band
        bands.append((p0, p1, c0, c1, band))
    pos = torch.arange(t - tq, t, device=q.device)[:, None]
    p = s.masked_fill_(torch.arange(t, device=q.device)[None, :] > pos, float("-inf")).softmax(-1)
    o = p @ vq[:, :, None]  # [B, H_kv, g, T_q, d]
    o += p[..., :w] @ dv[..., :w, :]
    for p0, p1, c0, c1, band in bands:
        o[..., p0:p1, :] += (p[..., p0:p1, c0:c1] * band) @ dv[..., c0:c1, :]
    o = rotate_heads(o.reshape(b, hq, tq, d), rv, inverse=True)
    return o.transpose(1, 2).to(q.dtype).contiguous()
