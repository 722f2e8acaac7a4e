"""Load a transformers causal LM and its tokenizer: shared by the CLI, the demo and benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import SpecError

__all__ = ["DTYPES", "load_model"]

#: ``--dtype`` names -> torch dtype attribute names ("auto": bf16 on CUDA, fp32 elsewhere)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}


def load_model(path: str, device: str, dtype: str) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer (a local path or a hub id) onto ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPES[dtype]))
    except OSError as e:
        where = "a local directory" if Path(path).exists() else "not a local directory"
        raise SpecError(
            f"cannot load model {path!r} ({where}): {str(e).splitlines()[0]} — pass a directory with "
            "config.json, weights and tokenizer files"
        ) from e
    return model.to(device).eval(), tok
