"""The fused small-batch experts kernel (``kernels.triton.moe``) against its torch twin, and the
twin against the engine's grouped and looped experts.

The ``triton_vs_twin`` test runs under Triton's CPU interpreter in a fresh process
(``test_moe_kernel_under_the_interpreter`` sets ``TRITON_INTERPRET=1`` before any kernel is
defined; fp32 and fp16 there, since the interpreter casts fp32 to bf16 by truncation, not rounding);
the ``gpu`` one on a CUDA device, bf16 and fp16. Tolerances: fp32 within 1e-5 (summation order); bf16
and fp16 within 2 units in the last place of the output's scale (a product rounded on the other side
of a tie), measured against the largest output.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import run_under_the_interpreter
from oscarkv.engine.models.moe import grouped_experts, looped_experts
from oscarkv.kernels import ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="run by test_moe_kernel_under_the_interpreter")
# (tokens, experts, hidden, expert width, top-k): odd sizes cross the tiles' edges
GRID = [(1, 8, 64, 32, 2), (3, 6, 96, 48, 3), (5, 4, 40, 24, 4), (8, 16, 128, 64, 8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def case(t: int, e: int, h: int, i: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13, w2 = 0.1 * torch.randn(e, 2 * i, h, generator=g), 0.1 * torch.randn(e, h, i, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return [a.to(device) if a is ids or a is w else a.to(device, dtype) for a in (x, w13, w2, w, ids)]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.float().abs().max().item()
    tol = 1e-5 * max(scale, 1.0) if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * scale
    assert (got.float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GRID)
def test_twin_equals_the_grouped_and_looped_experts(shape, dtype: torch.dtype) -> None:
    args = case(*shape, dtype)
    want = ref.moe_experts(*args)
    close(grouped_experts(*args), want, dtype)
    if dtype == torch.float32:  # the loop adds each expert's rounded output: exact only in fp32
        close(looped_experts(*args), want, dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter truncates to bf16
@pytest.mark.parametrize("shape", GRID)
def test_triton_vs_twin_moe_experts(shape, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton.moe import MoeTuning, moe_experts

    args = case(*shape, dtype)
    tuning = MoeTuning(up_bn=16, down_bn=16, bk=32)  # several tiles and reduction steps at these sizes
    close(moe_experts(*args, tuning=tuning), ref.moe_experts(*args), dtype)


def test_moe_kernel_under_the_interpreter() -> None:
    run_under_the_interpreter(__file__, "-k", "triton_vs_twin", timeout=600)


def test_bad_shapes_are_refused() -> None:
    from oscarkv.kernels.triton.moe import moe_experts

    x, w13, w2, w, ids = case(1, 8, 64, 32, 2, torch.float32)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_experts(x, w13, w2[:, :, :16], w, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [*GRID, (4, 128, 2048, 768, 8), (1, 256, 3072, 1536, 8)])
def test_gpu_moe_experts(shape, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton.moe import moe_experts

    args = case(*shape, dtype, device="cuda")
    close(moe_experts(*args), ref.moe_experts(*args), dtype)
