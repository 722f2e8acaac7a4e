"""Quantization-aware perplexity: prefill a context, then score a continuation in chunks.

Every chunk is a forward through the method's cache, so the continuation is predicted from the
*stored* (quantized) history, as in decoding; the chunk's own tokens see each other exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["continuation_nll"]


@torch.inference_mode()
def continuation_nll(
    model: Any, method: Any, seq: torch.Tensor, context: int, chunk: int
) -> tuple[float, int]:
    """Summed negative log-likelihood of ``seq[..., context:]`` and the number of scored tokens.

    ``seq``: LongTensor ``[L]`` or a batch ``[B, L]`` (scored together, no padding); the first
    ``context`` tokens are prefilled in one forward.
    """
    device = next(model.parameters()).device
    seq = (seq[None] if seq.dim() == 1 else seq).to(device)
    cache = method.make_cache(model)
    logits = [model(input_ids=seq[:, :context], past_key_values=cache, use_cache=True).logits[:, -1:]]
    for s in range(context, seq.shape[1] - 1, chunk):
        ids = seq[:, s : min(s + chunk, seq.shape[1] - 1)]
        logits.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
    lp = torch.cat(logits, 1).float().log_softmax(-1)
    target = seq[:, context:]
    nll = -lp.gather(-1, target[..., None]).sum()
    return float(nll), target.numel()


def perplexity(nll: float, n: int) -> float:
    return math.exp(nll / max(n, 1))
