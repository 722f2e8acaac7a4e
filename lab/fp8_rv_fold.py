"""R_V folding with FP8 weights (CPU): fold then requantize per 128x128 block, against keeping the
rotation out of the weight (at runtime, ``absorb_v=False``) or folding into a bf16 copy.

A 1024x1024 bf16 matrix ``W0`` is quantized to FP8 (``W``: the checkpoint); a random orthogonal
128x128 ``R_V`` per head is folded into it as ``v_proj`` rows (``R_Vᵀ W_h``) or ``o_proj`` input
columns (``W[:, h] R_V``). Errors are relative (Frobenius) on ``x W'ᵀ`` for Gaussian ``x [256, 1024]``:

- plain: the FP8 weight's own error, ``x Wᵀ`` against ``x W0ᵀ`` (one FP8 quantization step);
- (a) fold + requant: ``W' = requant(fold(W))`` against the exact fp32 ``fold(W)``;
- (b) fold in fp32, keep bf16: ``W' = bf16(fold(W))`` against the same;
- runtime: the rotation applied outside the weight is exact (0 against ``fold(W)``);
and "total" columns against the folded original ``fold(W0)``.

    python lab/fp8_rv_fold.py
"""

from __future__ import annotations

import torch

from oscarkv.engine.models.fp8 import dequantize_blocks, quantize_blocks
from oscarkv.rotation import absorb_output_weight, absorb_value_weight


def orthogonal(d: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=g))
    return q * torch.sign(torch.diagonal(r))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def fold(w: torch.Tensor, r: torch.Tensor, role: str) -> torch.Tensor:
    return absorb_value_weight(w, None, r, 128)[0] if role == "v_proj" else absorb_output_weight(w, r, 128)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    n, d = 1024, 128
    print(
        f"{'trial':>5} {'role':>6} | {'plain':>7} {'(a)':>7} {'(b)':>7} | {'total (a)':>9} {'total (b)':>9} {'runtime':>9}"
    )
    for trial in range(3):
        w0 = (0.02 * torch.randn(n, n, generator=g)).bfloat16().double()
        w = dequantize_blocks(*quantize_blocks(w0), torch.float64)
        r = torch.stack([orthogonal(d, g) for _ in range(n // d)])
        x = torch.randn(256, n, generator=g, dtype=torch.float64)
        plain = rel(x @ w.T, x @ w0.T)
        for role in ("v_proj", "o_proj"):
            exact, exact0 = fold(w, r, role), fold(w0, r, role)
            wa = dequantize_blocks(*quantize_blocks(exact), torch.float64)
            wb = exact.bfloat16().double()
            y, y0 = x @ exact.T, x @ exact0.T
            print(f"{trial:>5} {role:>6} | {plain:7.2%} {rel(x @ wa.T, y):7.2%} {rel(x @ wb.T, y):7.2%} | "
                  f"{rel(x @ wa.T, y0):9.2%} {rel(x @ wb.T, y0):9.2%} {rel(y, y0):9.2%}")  # fmt: skip


if __name__ == "__main__":
    main()
