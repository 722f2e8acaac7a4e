"""The FP8 block-scaled weight kernels (``kernels.triton.fp8``) against their torch twins
(``kernels.ref.fp8``), and the twins against plain dequantized arithmetic.

The ``triton_vs_twin`` tests run under Triton's CPU interpreter in a fresh process
(``test_fp8_kernels_under_the_interpreter``; fp32 and fp16 activations there, since the interpreter
truncates fp32 to bf16), the ``gpu`` ones on a CUDA device in bf16 and fp16. Tolerances: fp32
within 1e-5 of the output's scale (summation order); 16-bit outputs within 2 units in the last
place of the largest output (a product rounded on the other side of a tie).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import run_under_the_interpreter
from oscarkv.engine.models.fp8 import dequantize_blocks, quantize_blocks
from oscarkv.kernels import ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="run by test_fp8_kernels_under_the_interpreter")
# (rows, out, in): partial 128-blocks on both sides, one row to a tile and past it
LINEAR_GRID = [(1, 128, 128), (3, 256, 384), (17, 320, 200), (70, 192, 640)]
# (tokens, experts, hidden, expert width, top-k)
MOE_GRID = [(1, 8, 256, 128, 2), (5, 6, 384, 128, 3), (40, 16, 256, 256, 8)]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    tol = 1e-5 * max(scale, 1.0) if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * scale
    assert (got.float() - want.float()).abs().max().item() <= tol


def linear_case(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w, s = quantize_blocks(0.02 * torch.randn(n, k, generator=g))
    s = torch.nn.functional.pad(s, (0, -s.shape[1] % 4))  # the engine's padded scale columns
    return torch.randn(m, k, generator=g).to(device, dtype), w.to(device), s.to(device)


def moe_case(t: int, e: int, h: int, i: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = quantize_blocks(0.05 * torch.randn(e, 2 * i, h, generator=g))
    w2, s2 = quantize_blocks(0.05 * torch.randn(e, h, i, generator=g))
    x = torch.randn(t, h, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    wts = torch.rand(t, k, generator=g).to(device)
    return [x, w13.to(device), s13.to(device), w2.to(device), s2.to(device), wts, ids]


@pytest.mark.parametrize("shape", LINEAR_GRID)
def test_linear_twin_is_the_dequantized_matmul(shape) -> None:
    x, w, s = linear_case(*shape, torch.float32)
    want = x @ dequantize_blocks(w, s, torch.float32).T
    close(ref.fp8_linear(x, w, s), want, torch.float32)


@pytest.mark.parametrize("shape", MOE_GRID)
def test_moe_twin_is_the_bf16_experts_on_dequantized_weights(shape) -> None:
    x, w13, s13, w2, s2, wts, ids = moe_case(*shape, torch.float32)
    d13, d2 = dequantize_blocks(w13, s13, torch.float32), dequantize_blocks(w2, s2, torch.float32)
    close(
        ref.fp8_moe_experts(x, w13, s13, w2, s2, wts, ids),
        ref.moe_experts(x, d13, d2, wts, ids),
        torch.float32,
    )


@pytest.mark.parametrize(
    "tokens,experts,k,bm", [(1, 8, 2, 16), (7, 5, 3, 4), (40, 16, 8, 16), (3, 64, 8, 16)]
)
def test_align_pairs_groups_every_pair_once_by_expert(tokens: int, experts: int, k: int, bm: int) -> None:
    from oscarkv.kernels.triton.fp8 import align_pairs

    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    p = tokens * k
    rows, owner = align_pairs(ids, experts, bm)
    assert rows.shape == (owner.shape[0] * bm,) and owner.shape[0] == -(-p // bm) + min(experts, p)
    real = rows[rows < p].long()
    assert sorted(real.tolist()) == list(range(p))  # every pair exactly once
    for b in range(owner.shape[0]):
        blk = rows[b * bm : (b + 1) * bm].long()
        if owner[b] < 0:
            assert (blk == p).all()  # blocks past the last used one hold padding only
        else:
            assert (ids.reshape(-1)[blk[blk < p]] == owner[b]).all() and (blk < p).any()
    used = owner[owner >= 0]
    assert (used[1:] >= used[:-1]).all()  # experts in order, blocks in front


# several tiles and steps, both tile heights; the second splits every small launch's reduction
TUNINGS = {
    "tiles": dict(bn_small=32, bn_large=64, bm_large=32, bk=64, small_rows=16, small_pairs_per_expert=0),
    "split": dict(bn_small=32, bn_large=64, bm_large=32, bk=64, small_rows=16, programs_per_sm=1 << 20,
                  min_split_steps=1, max_split=4, small_pairs_per_expert=0),
    "thin": dict(bn_small=32, bk=64, small_rows=4, small_pairs_per_expert=64),  # experts: small tiles
}  # fmt: skip


@interpreted
@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", LINEAR_GRID)
def test_triton_vs_twin_fp8_linear(shape, dtype: torch.dtype, tuning: str) -> None:
    from oscarkv.kernels.triton.fp8 import Fp8Tuning, fp8_linear

    args = linear_case(*shape, dtype)
    close(fp8_linear(*args, tuning=Fp8Tuning(**TUNINGS[tuning])), ref.fp8_linear(*args), dtype)


@interpreted
@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", MOE_GRID)
def test_triton_vs_twin_fp8_moe_experts(shape, dtype: torch.dtype, tuning: str) -> None:
    from oscarkv.kernels.triton.fp8 import Fp8Tuning, fp8_moe_experts

    args = moe_case(*shape, dtype)
    close(fp8_moe_experts(*args, tuning=Fp8Tuning(**TUNINGS[tuning])), ref.fp8_moe_experts(*args), dtype)


def test_fp8_kernels_under_the_interpreter() -> None:
    run_under_the_interpreter(__file__, "-k", "triton_vs_twin", timeout=600)


def test_bad_inputs_are_refused() -> None:
    from oscarkv.kernels.triton.fp8 import Fp8Tuning, fp8_linear, fp8_moe_experts

    x, w, s = linear_case(2, 256, 256, torch.float32)
    with pytest.raises(ValueError, match="at least \\[2, 2\\] blocks"):
        fp8_linear(x, w, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w.float(), s)
    args = moe_case(1, 4, 256, 128, 2, torch.float32)
    with pytest.raises(ValueError, match="fp8_moe_experts: x \\[T, H\\]"):
        fp8_moe_experts(args[0][:, :128], *args[1:])
    with pytest.raises(ValueError, match="must divide 128"):
        Fp8Tuning(bn_small=96)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [*LINEAR_GRID, (1, 4096, 4096), (9, 2816, 4096), (300, 4096, 1408)])
def test_gpu_fp8_linear(shape, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton.fp8 import fp8_linear

    args = linear_case(*shape, dtype, device="cuda")
    close(fp8_linear(*args), ref.fp8_linear(*args), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape", [*MOE_GRID, (1, 128, 4096, 1408, 8), (64, 128, 4096, 1408, 8), (300, 32, 1024, 256, 4)]
)
def test_gpu_fp8_moe_experts(shape, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton.fp8 import fp8_moe_experts

    args = moe_case(*shape, dtype, device="cuda")
    close(fp8_moe_experts(*args), ref.fp8_moe_experts(*args), dtype)
