"""Load a transformers causal LM and its tokenizer: shared by the CLI, the demo and benchmarks."""

from __future__ import annotations

from typing import Any

from ..errors import ModelError
from ..kernels.devices import resolve_device
from ..utils.models import quiet_length_warning
from .validate import ModelInfo, check_model_source

__all__ = ["DTYPES", "load_model", "resolve_device"]

#: ``--dtype`` names -> torch dtype attribute names ("auto": bf16 on CUDA, fp32 elsewhere)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}


def load_model(path: str, device: str, dtype: str, info: ModelInfo | None = None) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer (a local path or a hub id) onto ``device``.

    The source is checked first (:func:`~oscarkv.hf.validate.check_model_source`, skipped when
    ``info`` is that check's result), so a wrong directory fails before any weight loads.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if info is None:
        info = check_model_source(path)
    device = resolve_device(device)
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPES[dtype]))
    except (OSError, ValueError, RuntimeError) as e:  # corrupt files, mismatched shapes, bad JSON
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelError(
            f"model {path}: cannot load its weights or tokenizer ({type(e).__name__}: {first})",
            "the files are truncated, corrupt or do not match config.json; copy the model again",
        ) from None
    if getattr(tok, "vocab_size", 1) in (0, None) or len(tok) == 0:
        raise ModelError(f"model {path}: its tokenizer is empty; the tokenizer files are incomplete")
    return model.to(device).eval(), quiet_length_warning(tok)
