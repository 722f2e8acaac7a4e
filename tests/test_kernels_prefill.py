"""Prefill attention on the CPU: both backends' ``prefill_attention`` against the prefix-plus-causal
rule written out, with inputs in which every key is visible.

Zero queries make every visible key's weight exactly equal, so new row ``i`` of a prefill over a
``P``-token prefix is the plain mean of the first ``P + i + 1`` values. A mask that is off by one
(a row seeing one token too many or too few) moves that mean by ~``(P + i)^-1/2`` with values of
mean 0, far above fp32 rounding. The Triton backend's prefill is PyTorch SDPA with a bottom-right
causal mask, so it runs on the CPU too; its GPU run is in the GPU lane.
"""

from __future__ import annotations

import pytest
import torch

from oscarkv.kernels import ref
from token_cases import prefill_case, rows_rel


def _backends():
    from oscarkv.kernels.triton.ops import prefill_attention as sdpa_prefill

    return {"torch": ref.prefill_attention, "triton": sdpa_prefill}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("p", "t", "hq", "hkv", "d"), [(0, 37, 4, 2, 64), (300, 64, 8, 2, 64), (1, 1, 2, 2, 128),
                                                         (1000, 300, 4, 4, 128)])  # fmt: skip
def test_prefill_attention_sees_every_key(backend, p, t, hq, hkv, d):
    """Each row within 1/100 of what one key too many or too few would change (fp32)."""
    args, want, effect = prefill_case(p, t, hq, hkv, d, "cpu", torch.float32)
    err = rows_rel(_backends()[backend](*args), want)
    assert (err < effect / 100).all(), (err.max(), effect.min())


def test_a_mask_one_token_off_fails_the_check():
    """The check above against a mask that lets each new row see the next new token too."""
    args, want, effect = prefill_case(300, 64, 8, 2, 64, "cpu", torch.float32)
    q, pk, pv, nk, nv, scale = args
    t = q.shape[0]
    k = torch.cat([pk, nk]).transpose(0, 1)[None]
    v = torch.cat([pv, nv]).transpose(0, 1)[None]
    off = torch.arange(300 + t)[None, :] <= (300 + torch.arange(t) + 1)[:, None]
    got = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=off, scale=scale, enable_gqa=True
    )[0].transpose(0, 1)
    assert (rows_rel(got, want)[:-1] > effect[:-1] / 100).all()
