"""`oscarkv demo`: the main job on an embedded default, with no downloads.

Until the calibration and evaluation layers land, the demo runs the full store path (rotate,
clip, INT2-quantize, pack, unpack, dequantize) on synthetic attention data whose statistics
mimic real models (a decaying query spectrum, key outlier channels, values with a few strong
directions), fits OSCAR's rotations from the query second moment and the score-energy value
target (spec §2.2-2.3), and compares attention-output error against identity and Hadamard
rotations at the same bits per element.
"""

from __future__ import annotations

import math

import torch

from .config import QuantSpec
from .quant import RowFormat, dequantize_rows, quantize_rows
from .rotation import compose, hadamard

__all__ = ["run_demo", "synthetic_layer"]


def synthetic_layer(n: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values ``[n, d]`` (float32) with model-like structure: decaying
    spectra in unrelated random bases, plus four RoPE-like low-frequency channel pairs that are
    large in both queries and keys (the outliers that make identity-basis INT2 fail)."""

    def basis() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()

    spec = torch.arange(1, d + 1, dtype=torch.float32) ** -1.0
    q = (torch.randn(n, d, generator=gen) * spec.sqrt() * 4) @ basis().T
    k = (torch.randn(n, d, generator=gen) * spec.sqrt() * 2) @ basis().T
    v = (torch.randn(n, d, generator=gen) * spec.sqrt() * 3) @ basis().T
    pos = torch.arange(n, dtype=torch.float32)
    half = d // 2
    for j, (amp_k, amp_q) in enumerate([(8.0, 3.0), (6.0, 2.5), (5.0, 2.0), (4.0, 2.0)]):
        c = half - 4 + j
        for x, amp in ((k, amp_k), (q, amp_q)):
            theta = pos * 1e-3 * (j + 1) + torch.rand(n, generator=gen) * 0.3
            x[:, c] += amp * torch.cos(theta)
            x[:, c + half] += amp * torch.sin(theta)
    return q, k, v


def _oscar_rotations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    q64, k64, v64 = q.double(), k.double(), v.double()
    cq = q64.T @ q64 / len(q64)
    w = ((k64 @ cq) * k64).sum(-1)
    w = w * len(w) / w.sum().clamp_min(1e-12)
    cv = (v64 * w[:, None]).T @ v64 / len(v64)
    rk = compose(*torch.linalg.eigh((cq + cq.T) / 2)).float()
    rv = compose(*torch.linalg.eigh((cv + cv.T) / 2)).float()
    return rk, rv


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n, d = k.shape
    s = (q @ k.T) / math.sqrt(d)
    s = s.masked_fill(torch.ones(len(q), n, dtype=torch.bool).triu(n - len(q) + 1), float("-inf"))
    p = s.softmax(-1)
    return p, p @ v


def _fake_quant(x: torch.Tensor, r: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    codes, meta = quantize_rows(x @ r, fmt)
    return dequantize_rows(codes, meta, fmt) @ r.T


def run_demo(seed: int = 0, tokens: int = 4096, layers: int = 4) -> int:
    """Print the rotation comparison table; returns a process exit code."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    d, spec = 128, QuantSpec()
    gen = torch.Generator().manual_seed(seed)
    methods = {
        "identity + clip": "identity",
        "Hadamard + clip (QuaRot-style)": "hadamard",
        "OSCAR U·H·P + clip": "oscar",
    }
    kf, vf = RowFormat.from_spec(spec, d, "k"), RowFormat.from_spec(spec, d, "v")
    errs: dict[str, list[tuple[float, float]]] = {m: [] for m in methods.values()}
    con.print(
        f"[bold]oscarkv demo[/]: {layers} synthetic layers x {tokens} tokens, head_dim {d}, "
        f"INT2 K/V (clip {spec.k_clip}/{spec.v_clip}, fp16 scale/zero)"
    )
    for _ in range(layers):
        q, k, v = synthetic_layer(tokens, d, gen)
        calib, test = slice(0, tokens // 2), slice(tokens // 2, tokens)
        rk, rv = _oscar_rotations(q[calib], k[calib], v[calib])
        qt, kt, vt = q[test], k[test], v[test]
        p_ref, o_ref = _attention(qt[-256:], kt, vt)
        for name in methods.values():
            if name == "oscar":
                a, b = rk, rv
            else:
                a = b = torch.eye(d) if name == "identity" else hadamard(d, torch.float32)
            p_q, o_q = _attention(qt[-256:], _fake_quant(kt, a, kf), _fake_quant(vt, b, vf))
            kl = (p_ref * (p_ref.clamp_min(1e-30).log() - p_q.clamp_min(1e-30).log())).sum(-1)
            rel = (o_q - o_ref).norm() / o_ref.norm()
            errs[name].append((float(kl.mean()), float(rel)))
    t = Table(title="INT2 attention error on held-out tokens (lower is better)")
    for col in ("rotation", "attention KL", "output rel. error", "bits/element"):
        t.add_column(col)
    bpe = spec.bits_per_element(None, d)
    for label, name in methods.items():
        kl = sum(e[0] for e in errs[name]) / layers
        rel = sum(e[1] for e in errs[name]) / layers
        t.add_row(label, f"{kl:.4f}", f"{rel:.4f}", f"{bpe:.3f}")
    con.print(t)
    con.print(
        "Every token is quantized here (no BF16 windows), so the numbers isolate the "
        "rotation; BF16 costs 16 bits/element."
    )
    return 0
