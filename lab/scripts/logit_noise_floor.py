"""Is the Triton engine's logit gap to the torch engine a bug or the noise floor of 2-bit codes?

Teacher-forced runs on the demo model (random rotations, as tests/engine/test_engine_gpu.py) give
the test's measure (per step: max |Δlogit| / std over the vocab; median and max over steps) for:
  triton vs torch (int2), triton vs torch (bf16 KV, no codes), and torch vs torch with every row
  that is quantized perturbed by ~1 bf16 ulp before quantization (the noise floor of code flips).
usage: python lab/scripts/logit_noise_floor.py  (CUDA)
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import random_rotation_set
from oscarkv import LLM, SamplingParams
from oscarkv.demo import demo_model_path
from oscarkv.engine import model_runner
from oscarkv.rotation import save_rotations

LENS, VOCAB = (7, 60, 300, 700, 1500), 2048
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENS]


def perturbed_resolve(real_resolve, eps: float):
    """``kernels.resolve`` whose ``quantize_pack`` sees rows times ``1 + eps·u``, u in {-1, 0, 1}."""

    def resolve(backend, device):
        ops = real_resolve(backend, device)
        qp = ops.quantize_pack
        gen = torch.Generator(device=device).manual_seed(1)

        def noisy(rows, fmt, *a, **k):
            u = torch.randint(-1, 2, rows.shape, generator=gen, device=rows.device).to(torch.float32)
            return qp(rows.float() * (1 + eps * u), fmt, *a, **k)  # fp32: sub-ulp steps survive

        return dataclasses.replace(ops, quantize_pack=noisy)

    return resolve


def run(kv: str, rot: Path, backend: str, forced: list | None, eps: float = 0.0) -> tuple[list, list]:
    logs, picks = [], []
    real_sample, real_resolve = model_runner.sample, model_runner.resolve

    def fn(logits, params, gens):
        logs.append(logits.float().cpu())
        if forced is None:
            out = real_sample(logits, params, gens)
            picks.append(out.cpu())
            return out
        return forced[len(logs) - 1].to(logits.device)

    model_runner.sample = fn
    if eps:
        model_runner.resolve = perturbed_resolve(real_resolve, eps)
    try:
        llm = LLM(str(demo_model_path()), rotations=str(rot) if kv == "int2" else None, kv_dtype=kv,
                  device="cuda", dtype="bf16", kv_budget_gb=1, max_running=16, backend=backend)  # fmt: skip
        llm.generate(prompts(), GREEDY)
    finally:
        model_runner.sample, model_runner.resolve = real_sample, real_resolve
    return logs, picks


def measure(a: list, b: list) -> str:
    errs = torch.tensor(
        [((x - y).abs().amax(-1) / x.std(-1)).max().item() for x, y in zip(a, b, strict=True)]
    )
    agree = sum(
        (x.argmax(-1) == y.argmax(-1)).float().mean().item() for x, y in zip(a, b, strict=True)
    ) / len(a)
    return f"median {errs.median():.4f}  max {errs.max():.4f}  argmax agreement {agree:.4f}"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rot = Path(tmp) / "rot"
        save_rotations(random_rotation_set(4, 128), rot)
        for kv in ("int2", "bf16"):
            ref_logs, picks = run(kv, rot, "torch", None)
            tri, _ = run(kv, rot, "triton", picks)
            print(f"{kv:5s} triton vs torch            : {measure(ref_logs, tri)}")
            if kv == "int2":
                for eps in (2**-8, 2**-10):
                    pert, _ = run(kv, rot, "torch", picks, eps)
                    print(f"{kv:5s} torch vs torch, rows·(1±{eps:.1e}): {measure(ref_logs, pert)}")


if __name__ == "__main__":
    main()
