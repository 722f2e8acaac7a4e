"""The fused small-batch experts kernel (``kernels.triton.moe``) and the fused router
(``kernels.triton.router``) against their torch twins, and the experts' twin against the engine's
grouped and looped experts. Routes compare as expert sets per token with equal weights per expert.

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
    tuning = MoeTuning(
        up_bn=16, down_bn=16, bk=32, down_bk=16
    )  # several tiles and reduction steps at these sizes
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


# (tokens, experts, hidden, top-k): odd sizes cross the router's tiles
ROUTER_GRID = [(1, 8, 64, 2), (3, 40, 96, 4), (2, 128, 160, 8)]
ROUTINGS = {
    "softmax": dict(kind="softmax", renormalize=False),
    "softmax-renorm": dict(kind="softmax", renormalize=True),
    "sigmoid-bias-scaled": dict(kind="sigmoid", renormalize=True, scale=2.5, renorm_eps=1e-20, bias=True),
    "sigmoid-fp32-logits": dict(kind="sigmoid", renormalize=True, fp32_logits=True),
    "sigmoid-plain": dict(kind="sigmoid", renormalize=False),
}


def router_case(t: int, e: int, h: int, k: int, dtype: torch.dtype, routing: dict, device: str = "cpu"):
    g = torch.Generator().manual_seed(t * 1000 + e)
    x, w = (
        torch.randn(t, h, generator=g).to(device, dtype),
        (0.1 * torch.randn(e, h, generator=g)).to(device, dtype),
    )
    bias = (0.5 * torch.randn(e, generator=g)).to(device) if routing.get("bias") else None
    kw = {n: v for n, v in routing.items() if n != "bias"}
    return (x, w, bias), dict(top_k=k, **kw)


def same_routes(got: tuple, want: tuple, dtype: torch.dtype) -> None:
    """Equal expert sets per token (the sigmoid reference's order is unset) and equal weights by expert."""
    (gw, gi), (ww, wi) = got, want
    assert gw.dtype == ww.dtype and gi.dtype == wi.dtype == torch.int64
    go, wo = gi.sort(dim=-1), wi.sort(dim=-1)
    assert torch.equal(go.values, wo.values)
    gw, ww = gw.gather(1, go.indices).float(), ww.gather(1, wo.indices).float()
    tol = 1e-5 if gw.dtype == torch.float32 and dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert (gw - ww).abs().max().item() <= tol * max(ww.abs().max().item(), 1.0)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("shape", ROUTER_GRID)
def test_triton_vs_twin_route_topk(shape, routing: str, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton.router import RouterTuning, route_topk

    args, kw = router_case(*shape, dtype, ROUTINGS[routing])
    got = route_topk(*args, **kw, tuning=RouterTuning(be=4, bk=32))  # several tiles and steps
    same_routes(got, ref.route_topk(*args, **kw), dtype)
    if kw["kind"] == "softmax":  # the fused router orders by weight, as torch.topk does
        assert torch.equal(got[1], ref.route_topk(*args, **kw)[1])


def test_router_refuses_groups_and_bad_shapes() -> None:
    from oscarkv.kernels.triton.router import route_topk

    (x, w, _), kw = router_case(1, 8, 64, 2, torch.float32, ROUTINGS["sigmoid-plain"])
    with pytest.raises(ValueError, match="n_group=2"):
        route_topk(x, w, None, **kw, n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(x, w[:, :32], None, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("shape", [*ROUTER_GRID, (8, 128, 2048, 8), (4, 256, 3072, 8)])
def test_gpu_route_topk(shape, routing: str, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton.router import route_topk

    args, kw = router_case(*shape, dtype, ROUTINGS[routing], "cuda")
    same_routes(route_topk(*args, **kw), ref.route_topk(*args, **kw), dtype)
