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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_prefill_is_each_sequence_on_its_own(backend):
    """Sequences side by side in the varlen layout (one without a prefix, one of a single token):
    each one's rows pass the every-key check of its own case."""
    from oscarkv.kernels.triton.ops import prefill_attention_varlen as sdpa_varlen

    fn = {"torch": ref.prefill_attention_varlen, "triton": sdpa_varlen}[backend]
    cases = [prefill_case(p, t, 4, 2, 64, "cpu", torch.float32) for p, t in ((0, 37), (300, 64), (9, 1))]
    q = torch.cat([c[0][0] for c in cases])
    k = torch.cat([x for c in cases for x in (c[0][1], c[0][3])])
    v = torch.cat([x for c in cases for x in (c[0][2], c[0][4])])
    lens_q = [c[0][0].shape[0] for c in cases]
    lens_k = [c[0][1].shape[0] + c[0][3].shape[0] for c in cases]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    out = fn(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), cases[0][0][5])
    for i, (_, want, effect) in enumerate(cases):
        err = rows_rel(out[cu_q[i] : cu_q[i + 1]], want)
        assert (err < effect / 100).all(), (i, err.max(), effect.min())
