"""Triton split-K decode attention over packed INT2 history (keys 2- or 4-bit) and 16-bit windows:
the launcher.

It checks the pools once per call, takes a :class:`~.planner.DecodePlan` (given, or made from the
lists' lengths and the device) and launches :func:`.stages.stage1` and :func:`.stages.merge`.
Strides are derived from the (validated) contiguous layouts, which keeps the launch short.
"""

from __future__ import annotations

import functools

import torch

from ....quant import RowFormat
from ..launch import Launcher
from .planner import LOOPS, DecodePlan
from .planner import plan as make_plan
from .stages import merge, stage1

__all__ = ["check_windows", "decode_attention"]

LOG2E = 1.4426950408889634
_STAGE1, _MERGE = Launcher(stage1), Launcher(merge)
_POOL_NAMES = ("k_codes", "k_meta", "v_codes", "v_meta", "hp_k", "hp_v")
# metadata dtype -> (the word one (scale, zero) pair is read as, the kernel's META id)
_META_WORDS = {
    torch.float16: (torch.int32, 0),
    torch.bfloat16: (torch.int32, 1),
    torch.float32: (torch.int64, 2),
}


@functools.cache
def _check_format(fmt: RowFormat, kind: str) -> None:
    """``kind`` ``"k"`` (2- or 4-bit) or ``"v"`` (2-bit)."""
    widths = (2, 4) if kind == "k" else (2,)
    if (
        fmt.bits not in widths
        or fmt.groups != 1
        or fmt.quantizer not in ("asymmetric", "symmetric", "lloyd_max")
    ):
        raise ValueError(
            f"the Triton decode kernel reads 2- or 4-bit affine key rows and 2-bit affine value rows with "
            f"one (scale, zero) per row; got {fmt.bits}-bit {'keys' if kind == 'k' else 'values'}, "
            f"{fmt.groups} groups, {fmt.quantizer} (use backend='torch')"
        )


def _check_layout(
    d: int, hkv: int, key_bits: int, meta_word: torch.dtype, pools: tuple[torch.Tensor, ...]
) -> None:
    """Strides are derived from ``d``, ``hkv`` and the contiguous layouts, and the 2-bit codes (head
    dim >= 128, whichever loop the size picks) and the ``(scale, zero)`` pairs are read as words:
    refuse pools that would be read out of bounds or off a word boundary (4-bit keys: bytes)."""
    # per pool: (dtype or None for any, shape after the slot dim, bytes of the word it is read in)
    codes = (torch.uint8, (hkv, d // 4), 2 if d >= 128 else 1)
    k_codes = codes if key_bits == 2 else (torch.uint8, (hkv, d // 2), 1)
    meta = (None, (hkv, 1, 2), meta_word.itemsize)
    hp = (None, (hkv, d), 1)
    for name, t, (dtype, rows, size) in zip(
        _POOL_NAMES, pools, (k_codes, meta, codes, meta, hp, hp), strict=True
    ):
        if not t.is_contiguous():
            raise ValueError(
                f"decode_attention: {name} must be contiguous (shape {tuple(t.shape)}, stride "
                f"{t.stride()}); the kernel derives its strides from the pool layout"
            )
        if (dtype is not None and t.dtype != dtype) or t.shape[1:] != rows:
            raise ValueError(
                f"decode_attention: {name} must be {str(dtype or t.dtype)[6:]} [N, {', '.join(map(str, rows))}]; "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        if t.data_ptr() % size:
            raise ValueError(
                f"decode_attention: {name} must start at a multiple of {size} bytes (it is read as "
                f"{size}-byte words); got a view at byte offset {t.storage_offset() * t.element_size()}"
            )


#: the window pools' dtypes the 16-bit loop reads (fp8: float8_e4m3fn windows, widened exactly)
_HP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def _check_windows(hp_k: torch.Tensor, hp_v: torch.Tensor) -> None:
    """The window pools: one dtype of :data:`_HP_DTYPES` for K and V; fp8 needs compute
    capability 8.9 or newer on CUDA (Triton's float8e4nv)."""
    if hp_k.dtype != hp_v.dtype or hp_k.dtype not in _HP_DTYPES:
        raise ValueError(
            f"decode_attention: hp_k/hp_v must share one dtype of fp16, bf16, fp32 or float8_e4m3fn "
            f"(fp8 windows; no other fp8 format); got {hp_k.dtype} and {hp_v.dtype}"
        )
    if hp_k.dtype == torch.float8_e4m3fn:
        try:
            check_windows("fp8_e4m3", hp_k.device)
        except ValueError as e:
            raise ValueError(f"decode_attention: {e} (use window_dtype 'model')") from None


def check_windows(window_dtype: str, device: torch.device) -> None:
    """``KernelOps.check_windows``: fp8 windows need compute capability 8.9 or newer."""
    if window_dtype == "fp8_e4m3" and device.type == "cuda" and _capability(device) < (8, 9):
        raise ValueError(
            f"fp8 windows need a GPU of compute capability 8.9 or newer; {device} has {_capability(device)}"
        )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _check_plan(
    p: DecodePlan, shape: tuple[int, ...], lens_hint: tuple[int, int] | None, key_bits: int
) -> None:
    if key_bits != 2 and p.lp.loop != "bytes":
        raise ValueError(
            f"decode_attention: {key_bits}-bit keys are read by the byte loop only; the plan takes the "
            f"{p.lp.loop} loop (make it with plan(..., key_bits={key_bits}))"
        )
    if (p.batch, p.q_heads, p.kv_heads, p.head_dim) != shape:
        raise ValueError(
            f"decode_attention: the plan was made for batch, query heads, KV heads, head dim "
            f"{(p.batch, p.q_heads, p.kv_heads, p.head_dim)}; this call has {shape}"
        )
    if lens_hint is not None and (lens_hint[0] > p.max_q or lens_hint[1] > p.max_h):
        raise ValueError(
            f"decode_attention: lists of {tuple(lens_hint)} tokens exceed the plan's {(p.max_q, p.max_h)}; "
            "its splits would drop tokens (make the plan from the longest lists)"
        )


def decode_attention(q_rot, k_codes, k_meta, v_codes, v_meta, hp_k, hp_v, int2_indptr, int2_indices,
                     hp_indptr, hp_indices, sm_scale, k_fmt, v_fmt, lens_hint=None, plan=None):  # fmt: skip
    """Same contract as ``kernels.ref.decode_attention``. ``lens_hint``: optional host-side
    ``(longest quantized list, longest 16-bit list)``, which saves a device sync. ``plan``: a
    :class:`DecodePlan` made for this shape and at least these lengths (one per batch step serves
    every layer; 4-bit keys need one of the byte loop, ``plan(..., key_bits=4)``); by default one is
    made from ``lens_hint``, the key width and the default tuning."""
    _check_format(k_fmt, "k"), _check_format(v_fmt, "v")
    bsz, hq, d = q_rot.shape
    hkv = hp_k.shape[1]
    if d not in (64, 128, 256) or hq % hkv:
        raise ValueError(f"head_dim must be 64, 128 or 256 and Hq a multiple of Hkv; got d={d}, {hq}/{hkv}")
    if k_meta.dtype != v_meta.dtype or k_meta.dtype not in _META_WORDS or k_meta.shape[-2:] != (1, 2):
        raise ValueError(
            f"decode_attention: k_meta/v_meta must both be [N, Hkv, 1, 2] fp16/bf16/fp32 (one scale/zero "
            f"pair per row, as quantize_pack writes); got {k_meta.dtype} {tuple(k_meta.shape)} and "
            f"{v_meta.dtype} {tuple(v_meta.shape)} (use backend='torch' for grouped formats)"
        )
    word, meta_id = _META_WORDS[k_meta.dtype]
    _check_layout(d, hkv, k_fmt.bits, word, (k_codes, k_meta, v_codes, v_meta, hp_k, hp_v))
    _check_windows(hp_k, hp_v)
    if plan is None:
        if lens_hint is None:
            lens = torch.stack(
                [(int2_indptr[1:] - int2_indptr[:-1]).max(), (hp_indptr[1:] - hp_indptr[:-1]).max()]
            )
            lens_hint = tuple(int(x) for x in lens.tolist()) if bsz else (0, 0)
        plan = make_plan(bsz, hq, hkv, d, lens_hint, q_rot.device, key_bits=k_fmt.bits)
    else:
        _check_plan(plan, (bsz, hq, hkv, d), lens_hint, k_fmt.bits)
    return _launch(plan, q_rot, (k_codes, k_meta, v_codes, v_meta, hp_k, hp_v), word, meta_id,
                   (int2_indptr, int2_indices, hp_indptr, hp_indices), sm_scale, k_fmt.bits)  # fmt: skip


def _launch(p: DecodePlan, q_rot, pools, word, meta_id, lists, sm_scale, key_bits):
    lp = p.lp
    k_codes, k_meta, v_codes, v_meta, hp_k, hp_v = pools
    bsz, hq, d = q_rot.shape
    o_part = torch.empty(bsz, hq, p.total, d, device=q_rot.device, dtype=torch.float32)
    lse = torch.empty(bsz, hq, p.total, device=q_rot.device, dtype=torch.float32)
    # 16-bit queries: the model's bf16/fp16 as they are; anything else (fp32 on the CPU) as fp16
    q = q_rot.contiguous() if q_rot.dtype in (torch.bfloat16, torch.float16) else q_rot.half().contiguous()
    words = lp.loop != "bytes"
    kc, vc = (k_codes.view(torch.int16), v_codes.view(torch.int16)) if words else (k_codes, v_codes)
    g = hq // p.kv_heads
    _STAGE1(
        p.grid, q, kc, k_meta.view(word), vc, v_meta.view(word), hp_k, hp_v, *lists, o_part, lse,
        sm_scale * LOG2E, p.splits.split, p.split_h, p.n_q_splits, p.total, p.splits.n_early, p.splits.split_late,
        max(p.max_q, 1), max(p.max_h, 1),
        HKV=p.kv_heads, G=g, HPB=lp.hpb, R_PAD=lp.rows, G_PAD=max(16, 1 << (g - 1).bit_length()), D=d,
        BLOCK_N=lp.block_n, BLOCK_H=lp.hp_block, ASM=q.is_cuda, META=meta_id, LOOP=LOOPS.index(lp.loop),
        HP_STAGES=lp.hp_stages, PDL=p.pdl, KI8=lp.k_int8, KEY_BITS=key_bits, num_warps=lp.warps,
        num_stages=p.num_stages,
    )  # fmt: skip
    out = torch.empty_like(q_rot)
    _MERGE(
        (bsz * hq, d // p.merge_d), o_part, lse, out, p.total, S_BLOCK=p.merge_block, D=d, DB=p.merge_d,
        PDL=p.pdl, num_warps=p.merge_warps, **({"launch_pdl": True} if p.pdl else {}),
    )  # fmt: skip
    return out
