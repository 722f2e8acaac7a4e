"""FP8 block-scaled twins of the tiny mixture-of-experts checkpoints (``moe_models.py``).

:func:`write_fp8_pair` writes a random ``kind`` model whose linear sizes are whole 128-row blocks,
then (a) its FP8 checkpoint: every attention, dense MLP, expert and shared-expert weight quantized
per 128×128 block (``weight_scale_inv = amax / 448``) with ``quantization_config`` in config.json,
the router gate, norms, correction bias, embeddings and LM head untouched; and (b) its dequantized
twin: the same tensors dequantized by transformers' own FP8 dequantization, no quantization_config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from moe_models import moe_config, write_moe_model
from safetensors.torch import load_file, save_file

from oscarkv.engine.models.fp8 import quantize_blocks

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def block_config(kind: str):
    """``moe_config(kind)`` with every linear size a multiple of 128."""
    cfg = moe_config(kind)
    if kind == "minimax_m2":
        cfg.intermediate_size = 128
    else:
        cfg.intermediate_size, cfg.moe_intermediate_size = 256, 128
    return cfg


def is_fp8_weight(key: str) -> bool:
    """The projections an FP8 checkpoint stores in FP8 (never the router ``gate``)."""
    module, _, leaf = key.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in PROJECTIONS


def dequantize_hf(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' FP8 dequantization (``scale_inv`` broadcast over its 128×128 block), fp32;
    transformers before 5.23 has no such function: the same broadcast written out."""
    try:
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    except ImportError:
        r, c = q.shape[-2:]
        full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :r, :c]
        return q.float() * full
    return _dequantize_fp8_weight(q, s, [128, 128], torch.float32)


def write_fp8_pair(kind: str, root: Path, seed: int = 1, config=None) -> tuple[Path, Path]:
    """``(fp8 dir, dequantized twin dir)`` of a tiny random ``kind`` model (``config``: default
    :func:`block_config`), under ``root``."""
    src = write_moe_model(kind, root / f"{kind}-src", seed=seed, config=config or block_config(kind))
    fp8_dir, twin_dir = root / f"{kind}-fp8", root / f"{kind}-twin"
    fp8, twin = {}, {}
    for key, t in load_file(src / "model.safetensors").items():
        if is_fp8_weight(key):
            q, s = quantize_blocks(t)
            fp8[key], fp8[f"{key}_scale_inv"] = q, s
            twin[key] = dequantize_hf(q, s)
        else:
            fp8[key] = twin[key] = t
    for out, tensors in ((fp8_dir, fp8), (twin_dir, twin)):
        out.mkdir()
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, out / f.name)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    set_quantization_config(fp8_dir, FP8_CONFIG)
    return fp8_dir, twin_dir


def set_quantization_config(model_dir: Path, qc: dict | None) -> None:
    """Write ``qc`` as config.json's ``quantization_config`` (``None``: remove it)."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    if qc is not None:
        cfg["quantization_config"] = qc
    path.write_text(json.dumps(cfg, indent=2))
