"""Quantization-aware perplexity: prefill a context, then score a continuation in chunks.

Every chunk is a forward through the method's cache, so the continuation is predicted from the
*stored* (quantized) history, as in decoding; the chunk's own tokens see each other exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["batched_nll", "batched_sequence_nlls", "continuation_nll", "perplexity", "sequence_nlls"]


@torch.inference_mode()
def sequence_nlls(
    model: Any, method: Any, seq: torch.Tensor, context: int, chunk: int
) -> tuple[list[float], int]:
    """Summed negative log-likelihood of ``seq[..., context:]``, one sum per sequence, and the
    number of scored tokens per sequence.

    ``seq``: LongTensor ``[L]`` or a batch ``[B, L]`` (scored together, no padding); the first
    ``context`` tokens are prefilled in one forward.
    """
    device = next(model.parameters()).device
    seq = (seq[None] if seq.dim() == 1 else seq).to(device)
    cache = method.make_cache(model)
    nll = torch.zeros(seq.shape[0], dtype=torch.float64, device=device)

    def score(logits: torch.Tensor, targets: torch.Tensor) -> None:
        lp = logits.float().log_softmax(-1)
        nll.sub_(lp.gather(-1, targets[..., None])[..., 0].double().sum(-1))

    # the prefill keeps only its last position's logits: [B, context, vocab] in fp32 is gigabytes
    out = model(input_ids=seq[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
    score(out.logits[:, -1:], seq[:, context : context + 1])
    for s in range(context, seq.shape[1] - 1, chunk):
        e = min(s + chunk, seq.shape[1] - 1)
        score(
            model(input_ids=seq[:, s:e], past_key_values=cache, use_cache=True).logits, seq[:, s + 1 : e + 1]
        )
    return [float(x) for x in nll], seq.shape[1] - context


def continuation_nll(
    model: Any, method: Any, seq: torch.Tensor, context: int, chunk: int
) -> tuple[float, int]:
    """Summed negative log-likelihood of ``seq[..., context:]`` and the number of scored tokens
    (over the whole batch; see :func:`sequence_nlls`)."""
    nll, n = sequence_nlls(model, method, seq, context, chunk)
    return sum(nll), n * len(nll)


def batched_sequence_nlls(
    model: Any, method: Any, seqs: torch.Tensor, context: int, chunk: int, batch_size: int
) -> tuple[list[float], list[int]]:
    """:func:`sequence_nlls` over ``seqs [N, L]``, ``batch_size`` sequences at a time: the summed
    NLL and the scored-token count of each sequence, in order (for paired per-sequence statistics)."""
    nll: list[float] = []
    n: list[int] = []
    for j in range(0, len(seqs), batch_size):
        a, b = sequence_nlls(model, method, seqs[j : j + batch_size], context, chunk)
        nll, n = nll + a, n + [b] * len(a)
    return nll, n


def batched_nll(
    model: Any, method: Any, seqs: torch.Tensor, context: int, chunk: int, batch_size: int
) -> tuple[float, int]:
    """:func:`continuation_nll` summed over ``seqs [N, L]``, ``batch_size`` sequences at a time."""
    nll, n = batched_sequence_nlls(model, method, seqs, context, chunk, batch_size)
    return sum(nll), sum(n)


def perplexity(nll: float, n: int) -> float:
    return math.exp(nll / max(n, 1))
