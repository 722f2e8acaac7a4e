"""FP8 block-scaled weights (``quant_method: fp8``, e4m3, 128×128 blocks): :class:`Fp8Block`.

The checkpoint format of DeepSeek-V3, Qwen3-FP8 and MiniMax-M2 (transformers' finegrained FP8):
each linear's ``weight`` is float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` fp32
``[ceil(out/128), ceil(in/128)]``; the weight is ``weight_scale_inv[i // 128, j // 128] ·
weight[i, j]``, each block's scale being its ``amax / 448``.

Where the weights live decides how they run (:meth:`Fp8Block.finish`). On CPU they are
dequantized once into the model dtype (in fp32, then rounded), so the model computes exactly what
its dequantized twin computes. On CUDA with the Triton backend they stay FP8: every projection and
the routed experts run the weight-only FP8 kernels of ``kernels.triton.fp8`` (FP8 tiles widened
in registers, block scales applied per 128-column step). With the torch backend on SM90 (Hopper),
dense projections of whole blocks run one cuBLAS block-scaled GEMM (``torch.nn.functional.scaled_mm``:
activations quantized per token and 128-column group on the fly, ``BlockWise1x128``; weights with
their block scales, ``BlockWise128x128``) where the torch build's cuBLAS runs it; anything else is
dequantized at load, with a warning.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import OscarkvWarning
from ...kernels import KernelOps
from ...kernels.ref.fp8 import dequantize_fp8
from .linear import Linear, LinearMethod

__all__ = [
    "BLOCK",
    "FP8",
    "FP8_MAX",
    "Fp8Block",
    "block_mm",
    "dequantize_blocks",
    "quantize_activations",
    "quantize_blocks",
]

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., n, k]`` -> ``[..., nb, 128, kb, 128]`` (zero-padded to whole blocks)."""
    n, k = w.shape[-2:]
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    if n % BLOCK or k % BLOCK:
        w = nn.functional.pad(w, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    return w.unflatten(-1, (kb, BLOCK)).unflatten(-3, (nb, BLOCK))


def _unblock(b: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return b.flatten(-2).flatten(-3, -2)[..., :n, :k]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., n, k]`` -> ``(float8_e4m3fn [..., n, k], scale_inv fp32 [..., ceil(n/128),
    ceil(k/128)])``, per 128×128 block ``scale_inv = amax / 448`` (1 for an all-zero block)."""
    n, k = w.shape[-2:]
    b = _blocks(w.float())
    amax = b.abs().amax(dim=(-3, -1))
    s = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (b / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return _unblock(q, n, k).contiguous(), s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale_inv · q`` in fp32 (the kernels' reference, :func:`~oscarkv.kernels.ref.fp8.dequantize_fp8`),
    then ``dtype``: ``q`` float8 ``[..., n, k]``, ``s`` fp32 with at least ``[..., ceil(n/128),
    ceil(k/128)]`` (extra trailing columns are ignored)."""
    return dequantize_fp8(q, s).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [m, k]`` -> ``(float8_e4m3fn [m, k], scale fp32 [m, ceil(k/128)])``, one scale per token
    and 128-column group (``amax / 448``), laid out M-major (strides ``(1, m)``) as cuBLAS's
    ``BlockWise1x128`` scaling reads it."""
    m, k = x.shape
    kb = _cdiv(k, BLOCK)
    xf = x.float()
    if k % BLOCK:
        xf = nn.functional.pad(xf, (0, kb * BLOCK - k))
    g = xf.reshape(m, kb, BLOCK)
    amax = g.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, kb * BLOCK)
    if k % BLOCK:
        q = q[:, :k].contiguous()
    # strides exactly (1, m), also for one token (where .t().contiguous().t() keeps (kb, 1))
    return q, torch.empty_strided((m, kb), (1, m), device=x.device).copy_(s)


def block_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x [m, k]`` (CUDA, SM90) times ``wᵀ`` for an FP8 ``w [n, k]`` of whole 128×128 blocks ->
    ``[m, n]`` in ``x``'s dtype.

    ``s`` is the weight's block scales ``[n/128, L4]`` with ``L4 = k/128`` rounded up to a
    multiple of 4 (zero padding): ``s.t()`` is the K-major layout cuBLAS reads.
    """
    from torch.nn.functional import ScalingType, scaled_mm

    if w.shape[0] % BLOCK or w.shape[1] % BLOCK:
        raise ValueError(f"block_mm: weight {list(w.shape)} is not whole {BLOCK}x{BLOCK} blocks")
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[0])
    xq, xs = quantize_activations(x)
    return scaled_mm(xq, w.t(), xs, ScalingType.BlockWise1x128, s.t(), ScalingType.BlockWise128x128,
                     output_dtype=x.dtype)  # fmt: skip


@functools.cache
def _block_gemm_fails(device: int) -> str:
    """Why this torch build's cuBLAS cannot run a 128x128 block-scaled FP8 GEMM on CUDA device
    ``device`` ("": it can). torch 2.11 (cu130) on an H100 answers CUBLAS_STATUS_NOT_SUPPORTED."""
    dev = torch.device("cuda", device)
    w = torch.zeros(BLOCK, BLOCK, dtype=FP8, device=dev)
    s = torch.ones(1, 4, device=dev)
    try:
        block_mm(torch.ones(1, BLOCK, dtype=torch.bfloat16, device=dev), w, s)
        torch.cuda.synchronize(dev)
    except RuntimeError as e:
        return (
            f"this torch build cannot run FP8 block-scaled GEMMs ({(str(e).splitlines() or [''])[0][:120]})"
        )
    return ""


def _no_fp8_gemm(layer: Linear) -> str:
    """Why ``layer``'s CUDA weights cannot run block-scaled GEMMs ("": they can): cuBLAS's 1x128
    by 128x128 scaling is SM90-only, and torch's shape checks disagree on partial blocks (ceil in
    the CUDA kernel's, floor in the meta registration's); every fused or split part is whole
    blocks anyway."""
    if torch.cuda.get_device_capability(layer.weight.device)[0] != 9:
        return "FP8 block-scaled GEMMs need an SM90 GPU"
    why = _block_gemm_fails(torch.device(layer.weight.device).index or 0)
    if why:
        return why
    if layer.in_features % BLOCK or layer.out_features % BLOCK:
        return f"a [{layer.out_features}, {layer.in_features}] projection is not whole 128x128 blocks"
    return ""


@dataclass(frozen=True)
class Fp8Block(LinearMethod):
    """``weight`` float8_e4m3fn ``[*lead, out, in]`` and ``weight_scale_inv`` fp32 ``[*lead,
    ceil(out/128), L4]`` (the checkpoint's ``ceil(in/128)`` columns, zero-padded to a multiple of 4
    for cuBLAS; :meth:`tensors` names the unpadded view).

    Stacked experts (``lead``) need whole blocks (``out`` and ``in`` multiples of 128). Kept FP8 on
    CUDA, they are run by ``KernelOps.fp8_moe_experts`` (the :class:`~.moe.Experts` module calls it).
    """

    name = "fp8-block"
    block = (BLOCK, BLOCK)

    def create(self, layer: Linear, out_features: int, in_features: int, bias: bool) -> None:
        if layer.lead and (out_features % BLOCK or in_features % BLOCK):
            bad = out_features if out_features % BLOCK else in_features
            raise ValueError(
                f"stacked expert weights [{out_features}, {in_features}] (this rank's part): {bad} is "
                f"not a multiple of the weight block {BLOCK}"
            )
        dev = layer.factory["device"]
        kb = _cdiv(in_features, BLOCK)
        layer.weight = nn.Parameter(
            torch.empty(*layer.lead, out_features, in_features, dtype=FP8, device=dev), requires_grad=False
        )
        layer.weight_scale_inv = nn.Parameter(
            torch.zeros(*layer.lead, _cdiv(out_features, BLOCK), _cdiv(kb, 4) * 4, device=dev),
            requires_grad=False,
        )

    def tensors(self, layer: Linear) -> dict[str, tuple[torch.Tensor, int, int]]:
        out = {"weight": (layer.weight, 1, 1)}
        if _quantized(layer):
            out["weight_scale_inv"] = (_scales(layer), BLOCK, BLOCK)
        return out

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight
        if not _quantized(layer):
            return nn.functional.linear(x, w)
        if layer.kernel is not None:  # still FP8 after finish (CUDA): a block-scaled GEMM runs it
            return layer.kernel(x.reshape(-1, x.shape[-1]), w, layer.weight_scale_inv).view(*x.shape[:-1], -1)
        return nn.functional.linear(x, dequantize_blocks(w, layer.weight_scale_inv, x.dtype))

    def finish(self, layer: Linear, ops: KernelOps | None = None) -> None:
        """On CUDA, keep FP8 where a kernel runs it: the backend's Triton kernels (``ops.fp8_linear``
        and, for stacked experts, ``ops.fp8_moe_experts``), else cuBLAS's block-scaled GEMM for
        dense projections where it runs. Otherwise dequantize into the model dtype and free the FP8
        tensors (on CUDA with a one-line warning)."""
        w = layer.weight
        if not _quantized(layer):
            return
        if w.is_cuda:
            if layer.lead:
                if ops is not None and ops.fp8_moe_experts is not None:
                    return  # the Experts module calls ops.fp8_moe_experts on the FP8 tensors
                why = "FP8 experts need the Triton kernels (backend 'triton')"
            elif ops is not None and ops.fp8_linear is not None:
                layer.kernel = ops.fp8_linear
                return
            else:
                why = _no_fp8_gemm(layer)
                if not why:
                    layer.kernel = block_mm
                    return
            msg = f"{why}: such FP8 weights run dequantized to the model dtype (twice their memory)"
            warnings.warn(OscarkvWarning(msg), stacklevel=2)
        dense = _dequantize_matrices(w, layer.weight_scale_inv, layer.factory["dtype"])
        layer.weight = nn.Parameter(dense, requires_grad=False)
        layer.weight_scale_inv = None

    def stacked(self, layer: Linear) -> torch.Tensor:
        if not _quantized(layer):
            return layer.weight
        return _dequantize_matrices(layer.weight, layer.weight_scale_inv, layer.factory["dtype"])

    def dense_weight(self, layer: Linear, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """fp32 rows; on FP8 weights ``rows`` must start and end on 128-row blocks (or the end)."""
        w = layer.weight.detach()
        if not _quantized(layer):
            return (w if rows is None else w[rows[0] : rows[1]]).float()
        r0, r1 = _block_rows(layer, rows)
        return dequantize_blocks(w[r0:r1], _scales(layer)[r0 // BLOCK : _cdiv(r1, BLOCK)], torch.float32)

    def set_dense_weight(self, layer: Linear, w: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Store fp32 rows, requantized per 128×128 block (``scale_inv = amax / 448``) on FP8 weights."""
        dst = layer.weight.detach()
        if not _quantized(layer):
            (dst if rows is None else dst[rows[0] : rows[1]]).copy_(w)
            return
        r0, r1 = _block_rows(layer, rows)
        if tuple(w.shape) != (r1 - r0, dst.shape[-1]):
            raise ValueError(
                f"set_dense_weight: got {list(w.shape)} for rows [{r0}, {r1}) of {list(dst.shape)}"
            )
        q, s = quantize_blocks(w)
        dst[r0:r1].copy_(q)
        _scales(layer)[r0 // BLOCK : _cdiv(r1, BLOCK)].copy_(s)

    def fill_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        """N(0, 0.02) weights quantized per block, one matrix at a time."""
        w, s = layer.weight.detach(), _scales(layer)
        flat_w = w.flatten(0, -3) if layer.lead else w[None]
        flat_s = s.flatten(0, -3) if layer.lead else s[None]
        for i in range(flat_w.shape[0]):
            q, si = quantize_blocks(
                torch.empty(w.shape[-2:], device=w.device).normal_(0.0, 0.02, generator=generator)
            )
            flat_w[i].copy_(q)
            flat_s[i].copy_(si)


_CHUNK = 1 << 26  # fp32 elements dequantized per step


def _dequantize_matrices(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize_blocks` of ``[*lead, n, k]``, a few matrices at a time (bounds the fp32
    temporary to 256 MiB)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    fq, fs, fo = (t.reshape(-1, *t.shape[-2:]) for t in (q, s, out))
    step = max(1, _CHUNK // (q.shape[-2] * q.shape[-1]))
    for i in range(0, fq.shape[0], step):
        fo[i : i + step] = dequantize_blocks(fq[i : i + step], fs[i : i + step], dtype)
    return out


def _quantized(layer: Linear) -> bool:
    return layer.weight.dtype == FP8


def _scales(layer: Linear) -> torch.Tensor:
    """The checkpoint's ``[..., ceil(out/128), ceil(in/128)]`` view of the padded scales."""
    return layer.weight_scale_inv.detach()[..., : _cdiv(layer.in_features, BLOCK)]


def _block_rows(layer: Linear, rows: tuple[int, int] | None) -> tuple[int, int]:
    n = layer.out_features
    r0, r1 = (0, n) if rows is None else rows
    if not 0 <= r0 < r1 <= n or r0 % BLOCK or (r1 % BLOCK and r1 != n):
        raise ValueError(
            f"rows [{r0}, {r1}) of an FP8 weight with {n} rows do not start and end on its {BLOCK}-row blocks"
        )
    return r0, r1
