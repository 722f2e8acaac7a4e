"""Torch twins of the rotations: rows of a head rotated in fp32, rounded once.

A decode step rotates the new query, key and value rows into the cache's basis and the attention
output back (spec §5.6); the key and value rows go straight to their 16-bit slots. A prefill
rotates its query and key rows (``rotate_rows``), and its value rows unless ``v_proj`` carries
``R_V``.
"""

from __future__ import annotations

import torch

from ...quant.window import to_window
from ...rotation import rotate_heads as rotate_rows_fp32

__all__ = ["check_new_rows_args", "check_rotate_args", "rotate_heads", "rotate_new_rows", "rotate_rows"]


def check_rotate_args(
    x: torch.Tensor, r: torch.Tensor | None, out: torch.Tensor | None, dst: torch.Tensor | None
) -> None:
    """Shapes and dtypes both backends accept; raises ``ValueError`` naming the problem."""
    shape = x.shape
    if len(shape) != 3:
        raise ValueError(f"rotate_heads: x must be [B, H, d]; got {tuple(shape)}")
    b, h, d = shape
    if r is not None:
        rs = r.shape
        if r.dtype != torch.float32 or rs[-2:] != (d, d) or len(rs) not in (2, 3):
            raise ValueError(
                f"rotate_heads: r must be float32 [{d}, {d}] or [H_r, {d}, {d}]; got {r.dtype} {tuple(rs)}"
            )
        if len(rs) == 3 and h % rs[0]:
            raise ValueError(f"rotate_heads: {h} heads cannot share {rs[0]} per-head rotations")
    if (out is None) != (dst is None):
        raise ValueError("rotate_heads: out and dst go together (rows are written to out[dst[b]])")
    if out is not None and dst is not None:
        if out.shape[1:] != (h, d) or len(out.shape) != 3:
            raise ValueError(f"rotate_heads: out must be [N, {h}, {d}]; got {tuple(out.shape)}")
        if dst.shape != (b,) or dst.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"rotate_heads: dst must be int32/int64 [{b}]; got {dst.dtype} {tuple(dst.shape)}"
            )


def rotate_heads(
    x: torch.Tensor,
    r: torch.Tensor | None,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    dst: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``x [B, H, d]`` (16-bit or fp32) times ``r`` (``rᵀ`` if ``inverse``) in fp32.

    ``r``: float32 ``[d, d]`` for every head, ``[H_r, d, d]`` shared by groups of ``H / H_r``
    consecutive heads, or ``None`` (no rotation: a copy). Without ``out``: returns the rotated rows
    in ``x.dtype``. With ``out [N, H, d]`` and ``dst`` int ``[B]``: writes row ``b`` to
    ``out[dst[b]]`` in ``out.dtype`` where ``dst[b] >= 0`` (skipped where negative); returns ``out``.
    A float8_e4m3fn ``out`` (fp8 windows) gets the rows rounded to ``x.dtype`` first, then to fp8
    saturating at ±448 (``quant.window.to_window``): what a prefill stores for the same row.
    """
    check_rotate_args(x, r, out, dst)
    y = x.float()
    if r is not None:  # the prefill's rotation, of one token
        y = rotate_rows_fp32(y.unsqueeze(2), r.to(y.device), inverse=inverse).squeeze(2)
    if out is None or dst is None:
        return y.to(x.dtype, copy=True)  # a new tensor also without rotation (fp32 x)
    keep = dst >= 0
    rows = y[keep]
    if out.dtype == torch.float8_e4m3fn:
        rows = to_window(rows.to(x.dtype), out.dtype)
    out[dst[keep].long()] = rows.to(out.dtype)
    return out


def check_new_rows_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    r_k: torch.Tensor,
    r_v: torch.Tensor | None,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """``rotate_new_rows``' shapes: the three row sets share batch and head dim, K and V their heads;
    ``r_k`` is required (``r_v`` may be ``None``: values stored as they are)."""
    if r_k is None:
        raise ValueError("rotate_new_rows: r_k is required (queries and keys are always rotated)")
    check_rotate_args(query, r_k, None, None)
    check_rotate_args(key, r_k, k_out, dst)
    check_rotate_args(value, r_v, v_out, dst)
    if query.shape[0] != key.shape[0] or key.shape != value.shape or query.shape[2] != key.shape[2]:
        raise ValueError(
            "rotate_new_rows: query [B, Hq, d] and key/value [B, Hkv, d] must share B and d; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"rotate_new_rows: {query.shape[1]} query heads are not a multiple of {key.shape[1]}"
        )


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
    """A decode step's new rows: returns ``query [B, Hq, d]`` rotated by ``r_k``; writes ``key`` rotated
    by ``r_k`` to ``k_out[dst[b]]`` and ``value`` rotated by ``r_v`` (``None``: as it is) to
    ``v_out[dst[b]]`` (``[B, Hkv, d]`` rows, negative slots skipped). Same math as three
    :func:`rotate_heads` calls."""
    check_new_rows_args(query, key, value, r_k, r_v, k_out, v_out, dst)
    rotate_heads(key, r_k, False, k_out, dst)
    rotate_heads(value, r_v, False, v_out, dst)
    return rotate_heads(query, r_k)


def rotate_rows(x: torch.Tensor, r: torch.Tensor | None, inverse: bool = False) -> torch.Tensor:
    """A prefill's rows ``x [T, H, d]`` (16-bit or fp32) times ``r`` (``rᵀ`` if ``inverse``; float32
    ``[d, d]`` or ``[H_r, d, d]``, as in :func:`rotate_heads`) in fp32, rounded once to ``x.dtype``;
    ``x`` itself when ``r`` is ``None``. Computed per head over all ``T`` rows at once, as
    ``hf/cache.py`` rotates a prompt, so the engine's prefill matches ``OscarCache`` bit for bit."""
    if r is None:
        return x
    check_rotate_args(x, r, None, None)
    y = rotate_rows_fp32(x.float().transpose(0, 1).unsqueeze(0), r.to(x.device), inverse=inverse)
    return y.squeeze(0).transpose(0, 1).to(x.dtype)
