"""Per-layer error versus BF16 (spec §6.1): attention KL, attention-output error, hidden states.

Attention metrics use the queries, keys and values of a BF16 forward and each method's
``fake_kv`` (what it would store, read back): for the last ``n_queries`` positions,
``KL(p_bf16 ‖ p_method)`` of the causal attention distribution and the relative squared error of
the attention output. Hidden-state error runs the method's real cache: the sequence minus a
probe is prefilled, then the probe's per-layer hidden states are compared with BF16's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...calibration.capture import capture_attention

__all__ = ["attention_metrics", "hidden_state_errors"]


def _attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nq: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, t, d = q.shape
    g = hq // k.shape[1]
    qs = q[:, :, t - nq :].float().reshape(b, k.shape[1], g * nq, d)
    s = qs @ k.float().transpose(-1, -2) / math.sqrt(d)
    pos = torch.arange(t - nq, t, device=q.device).repeat(g)[:, None]
    s = s.masked_fill(torch.arange(t, device=q.device)[None] > pos, float("-inf"))
    logp = s.log_softmax(-1)
    return logp, logp.exp() @ v.float()


@torch.inference_mode()
def attention_metrics(
    model: Any, methods: dict[str, Any], sequences: torch.Tensor, n_queries: int = 256
) -> dict[str, dict[int, dict[str, float]]]:
    """``{method: {layer: {"attn_kl": ..., "attn_out_err": ...}}}`` averaged over sequences."""
    acc: dict[str, dict[int, list[float]]] = {m: {} for m in methods}
    device = next(model.parameters()).device

    def cb(layer: int, q, k, v, o) -> None:
        nq = min(n_queries, q.shape[2])
        logp_ref, o_ref = _attn(q, k, v, nq)
        for name, method in methods.items():
            kq, vq = method.fake_kv(layer, k, v)
            logp, o_q = _attn(q, kq, vq, nq)
            p_ref = logp_ref.exp()
            kl = (p_ref * (logp_ref - logp.clamp_min(-1e4))).nan_to_num().sum(-1).mean()
            err = (o_q - o_ref).square().sum() / o_ref.square().sum().clamp_min(1e-30)
            a = acc[name].setdefault(layer, [0.0, 0.0, 0])
            a[0], a[1], a[2] = a[0] + float(kl), a[1] + float(err), a[2] + 1

    with capture_attention(model, cb):
        for s in sequences:
            model(input_ids=s[None].to(device), use_cache=False)
    return {
        m: {i: {"attn_kl": a[0] / a[2], "attn_out_err": a[1] / a[2]} for i, a in sorted(d.items())}
        for m, d in acc.items()
    }


@torch.inference_mode()
def hidden_state_errors(
    model: Any, methods: dict[str, Any], sequences: torch.Tensor, probe: int = 256
) -> dict[str, dict[int, float]]:
    """``{method: {layer: ‖h − h_bf16‖ / ‖h_bf16‖}}`` on the last ``probe`` tokens of each sequence."""
    from transformers import DynamicCache

    device = next(model.parameters()).device

    def hidden(cache: Any, seq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model(input_ids=seq[None, :-probe], past_key_values=cache, use_cache=True)
        out = model(
            input_ids=seq[None, -probe:], past_key_values=cache, use_cache=True, output_hidden_states=True
        )
        return out.hidden_states[1:]

    num: dict[str, dict[int, float]] = {m: {} for m in methods}
    den: dict[int, float] = {}
    for s in sequences:
        s = s.to(device)
        ref = hidden(DynamicCache(), s)
        for i, h in enumerate(ref):
            den[i] = den.get(i, 0.0) + float(h.float().square().sum())
        for name, method in methods.items():
            for i, h in enumerate(hidden(method.make_cache(model), s)):
                num[name][i] = num[name].get(i, 0.0) + float((h.float() - ref[i].float()).square().sum())
    return {m: {i: math.sqrt(v / max(den[i], 1e-30)) for i, v in d.items()} for m, d in num.items()}
