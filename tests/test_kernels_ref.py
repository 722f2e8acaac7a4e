"""The torch reference kernels (``oscarkv.kernels.ref``) against independent float64 oracles.

The reference kernels are themselves the oracle of the Triton kernels, so every check here
recomputes the expected result from first principles (gather, dequantize, plain softmax) rather
than reusing the kernels' own building blocks.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from oscarkv.kernels import Backend, BackendError, resolve
from oscarkv.kernels.ref import (
    decode_attention,
    dequantize,
    merge_states,
    partial_attention,
    prefill_attention,
    quantize_pack,
)
from oscarkv.quant import RowFormat

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- helpers ----------------------------------------------------------------------------------
def _attend64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None) -> torch.Tensor:
    """Plain softmax attention in float64. ``q [T, Hq, d]``, ``k, v [N, Hkv, d]``, contiguous GQA
    groups (query head h reads KV head h // (Hq / Hkv)); ``mask [T, N]`` bool (True = visible)."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("thd,nhd->htn", q.double(), k) * scale
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htn,nhd->thd", s.softmax(-1), v)


def _csr(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0, *itertools.accumulate(len(x) for x in lists)], dtype=torch.int32)
    idx = torch.tensor([i for x in lists for i in x], dtype=torch.int32)
    return indptr, idx


def _pick(n_pool: int, n: int, gen: torch.Generator) -> list[int]:
    """``n`` distinct slot ids of a pool of ``n_pool``, in shuffled (non-monotonic) order."""
    return torch.randperm(n_pool, generator=gen)[:n].tolist()


# ---- the stored format written out from docs/kv_format.md (never the package's own helpers) ------
_META = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _spec_clip(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row to ±tau, tau = the element at 0-based index min(floor(ratio·d), d−1) of the
    row's |x| sorted ascending (``ratio = 0``: no clip)."""
    if ratio <= 0:
        return x
    d = x.shape[-1]
    c = min(math.floor(ratio * d), d - 1)
    tau = x.abs().sort(-1).values[..., c : c + 1]
    return torch.where(x > tau, tau, torch.where(x < -tau, -tau, x))


def _spec_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """2 bit: byte j = q[j] | q[j+d/4]<<2 | q[j+d/2]<<4 | q[j+3d/4]<<6; 4 bit: byte j = q[j] |
    q[j+d/2]<<4; 3 bit: the low two bits in the 2-bit layout (d/4 bytes), then byte j of the high
    plane (d/8 bytes) holds bit 2 of q[j + i·d/8] at bit i."""
    q = q.long()
    d = q.shape[-1]

    def plane(vals: torch.Tensor, parts: int, width: int) -> torch.Tensor:
        n = d // parts  # byte j (all j at once) collects element j + i·n at bits [i·width, (i+1)·width)
        return sum(vals[..., i * n : (i + 1) * n] << (i * width) for i in range(parts))

    if bits == 2:
        out = plane(q, 4, 2)
    elif bits == 4:
        out = plane(q, 2, 4)
    else:
        out = torch.cat([plane(q & 3, 4, 2), plane((q >> 2) & 1, 8, 1)], -1)
    return out.to(torch.uint8)


def _spec_unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of :func:`_spec_pack`: int64 codes ``[..., d]``."""
    p = packed.long()
    q = torch.zeros(*p.shape[:-1], d, dtype=torch.long)

    def read(plane: torch.Tensor, parts: int, width: int, at: int = 0) -> None:
        n = d // parts  # element j + i·n sits in byte j, bits [i·width, (i+1)·width), as code bits at..
        for i in range(parts):
            q[..., i * n : (i + 1) * n] |= ((plane >> (i * width)) & ((1 << width) - 1)) << at

    if bits in (2, 4):
        read(p, 8 // bits, bits)
    else:
        read(p[..., : d // 4], 4, 2)
        read(p[..., d // 4 :], 8, 1, at=2)  # the high plane holds bit 2 of each code
    return q


def _spec_quantize_pack(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniform (min-max) quantizer: per group s = max(M − m, 1e−8)/(2^b − 1) (raised to
    max(|m|, |M|)/16384 and the metadata dtype's smallest normal), z = −m/s; both rounded to the
    metadata dtype, then q = floor(x/s + z + 0.5) clamped to [0, 2^b − 1] with the rounded s, z."""
    assert fmt.quantizer == "asymmetric"
    x = _spec_clip(rows.float(), fmt.clip)
    top = (1 << fmt.bits) - 1
    xg = x.reshape(*x.shape[:-1], fmt.groups, fmt.group)
    lo, hi = xg.min(-1).values, xg.max(-1).values
    s = torch.clamp(hi - lo, min=1e-8) / torch.full_like(lo, top)  # correctly rounded
    s = torch.maximum(s, torch.maximum(lo.abs(), hi.abs()) / 16384).clamp_min(
        torch.finfo(_META[fmt.meta_dtype]).tiny
    )
    meta = torch.stack([s, -lo / s], -1).to(_META[fmt.meta_dtype])
    q = torch.floor(xg / meta[..., :1].float() + meta[..., 1:].float() + 0.5).clamp(0, top)
    return _spec_pack(q.flatten(-2), fmt.bits), meta


def _spec_dequantize(packed: torch.Tensor, meta: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """x̂ = (q − z)·s per group (float32), from the spec's byte layout."""
    q = _spec_unpack(packed, fmt.bits, fmt.head_dim).float()
    qg = q.reshape(*q.shape[:-1], fmt.groups, fmt.group)
    m = meta.float()
    return ((qg - m[..., 1:]) * m[..., :1]).flatten(-2)


def _pools(n_q, n_h, hkv, d, k_fmt, v_fmt, gen, hp_dtype=torch.float32):
    rows_k = torch.randn(n_q, hkv, d, generator=gen) * 1.5 + 0.3
    rows_v = torch.randn(n_q, hkv, d, generator=gen)
    k_codes, k_meta = quantize_pack(rows_k, k_fmt)
    v_codes, v_meta = quantize_pack(rows_v, v_fmt)
    hp_k = torch.randn(n_h, hkv, d, generator=gen).to(hp_dtype)
    hp_v = torch.randn(n_h, hkv, d, generator=gen).to(hp_dtype)
    return k_codes, k_meta, v_codes, v_meta, hp_k, hp_v


def _decode_oracle(q, pools, q_lists, h_lists, scale, k_fmt, v_fmt) -> torch.Tensor:
    k_codes, k_meta, v_codes, v_meta, hp_k, hp_v = pools
    outs = []
    for b in range(q.shape[0]):
        qi, hi = torch.tensor(q_lists[b], dtype=torch.long), torch.tensor(h_lists[b], dtype=torch.long)
        k = torch.cat([_spec_dequantize(k_codes[qi], k_meta[qi], k_fmt).double(), hp_k[hi].double()])
        v = torch.cat([_spec_dequantize(v_codes[qi], v_meta[qi], v_fmt).double(), hp_v[hi].double()])
        if k.shape[0] == 0:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float64))
        else:
            outs.append(_attend64(q[b : b + 1], k, v, scale)[0])
    return torch.stack(outs)


# ---- 1. decode attention ------------------------------------------------------------------------
DECODE_GRID = list(
    itertools.product(
        (1, 3),  # batch
        ((4, 4), (8, 2)),  # (Hq, Hkv)
        (64, 128),  # head dim
        (2, 4),  # bits
        (1, 4),  # groups per row (group = d, d/4)
    )
)


@pytest.mark.parametrize(("bsz", "heads", "d", "bits", "groups"), DECODE_GRID)
def test_decode_attention_matches_softmax_over_dequantized_tiers(bsz, heads, d, bits, groups):
    hq, hkv = heads
    gen = torch.Generator().manual_seed(1000 * bsz + 100 * hq + d + 10 * bits + groups)
    k_fmt = RowFormat(head_dim=d, bits=bits, group=d // groups, clip=0.9)
    v_fmt = RowFormat(head_dim=d, bits=bits, group=d // groups)
    n_q, n_h = 64, 40
    pools = _pools(n_q, n_h, hkv, d, k_fmt, v_fmt, gen)
    if bsz == 1:
        q_lists, h_lists = [_pick(n_q, 37, gen)], [_pick(n_h, 11, gen)]
    else:
        # seq 0: no quantized rows, seq 1: no 16-bit rows, seq 2: both tiers (shuffled slot orders)
        q_lists = [[], _pick(n_q, 50, gen), _pick(n_q, 23, gen)]
        h_lists = [_pick(n_h, 17, gen), [], _pick(n_h, 29, gen)]
    ip, ix = _csr(q_lists)
    hp, hx = _csr(h_lists)
    q = torch.randn(bsz, hq, d, generator=gen)
    scale = 1.0 / math.sqrt(d)

    out = decode_attention(q, *pools, ip, ix, hp, hx, scale, k_fmt, v_fmt)

    assert out.shape == (bsz, hq, d) and out.dtype == torch.float32
    expected = _decode_oracle(q, pools, q_lists, h_lists, scale, k_fmt, v_fmt)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_is_independent_of_slot_order_and_tier_split():
    gen = torch.Generator().manual_seed(3)
    d, hq, hkv = 64, 8, 2
    fmt = RowFormat(head_dim=d, bits=2, group=16)
    pools = _pools(32, 32, hkv, d, fmt, fmt, gen)
    q = torch.randn(1, hq, d, generator=gen)
    ql, hl = _pick(32, 20, gen), _pick(32, 12, gen)
    a = decode_attention(q, *pools, *_csr([ql]), *_csr([hl]), 0.125, fmt, fmt)
    b = decode_attention(q, *pools, *_csr([ql[::-1]]), *_csr([hl[::-1]]), 0.125, fmt, fmt)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_decode_attention_empty_sequences_give_zeros():
    gen = torch.Generator().manual_seed(4)
    d, hq, hkv = 64, 4, 2
    fmt = RowFormat(head_dim=d, bits=2, group=d)
    pools = _pools(16, 16, hkv, d, fmt, fmt, gen)
    q_lists = [[], _pick(16, 5, gen), []]
    h_lists = [[], _pick(16, 3, gen), []]
    q = torch.randn(3, hq, d, generator=gen)
    out = decode_attention(q, *pools, *_csr(q_lists), *_csr(h_lists), 0.125, fmt, fmt)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(hq, d)) and torch.equal(out[2], torch.zeros(hq, d))
    expected = _decode_oracle(q, pools, q_lists, h_lists, 0.125, fmt, fmt)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_16bit_inputs_keep_dtype_and_accuracy():
    gen = torch.Generator().manual_seed(5)
    d, hq, hkv = 64, 4, 2
    fmt = RowFormat(head_dim=d, bits=2, group=d // 2)
    pools = _pools(24, 24, hkv, d, fmt, fmt, gen, hp_dtype=torch.bfloat16)
    q = torch.randn(3, hq, d, generator=gen).bfloat16()
    # (an empty tier in the last two sequences: fp32 and bf16 partial states are merged)
    q_lists = [_pick(24, 10, gen), [], _pick(24, 3, gen)]
    h_lists = [_pick(24, 7, gen), _pick(24, 20, gen), []]
    out = decode_attention(q, *pools, *_csr(q_lists), *_csr(h_lists), 0.125, fmt, fmt)
    assert out.dtype == torch.bfloat16
    expected = _decode_oracle(q, pools, q_lists, h_lists, 0.125, fmt, fmt)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


# ---- 2. partial attention + LSE merge --------------------------------------------------------------
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
# chunk boundaries: an empty first / middle / last chunk, two empty chunks, and no empty chunk
@pytest.mark.parametrize("cuts", [(0, 13), (7, 7), (29, 40), (0, 0), (10, 31)])
def test_merge_states_of_chunks_equals_attention_over_concatenation(hq, hkv, cuts):
    gen = torch.Generator().manual_seed(11)
    n, d = 40, 32
    q = torch.randn(hq, d, generator=gen)
    k = torch.randn(n, hkv, d, generator=gen) * 2
    v = torch.randn(n, hkv, d, generator=gen)
    scale = 1.0 / math.sqrt(d)
    full_o, full_lse = partial_attention(q, k, v, scale)

    a, b = cuts
    chunks = [(k[:a], v[:a]), (k[a:b], v[a:b]), (k[b:], v[b:])]
    states = [partial_attention(q, ck, cv, scale) for ck, cv in chunks]
    for (ck, _), (o, lse) in zip(chunks, states, strict=True):
        if ck.shape[0] == 0:
            assert torch.equal(o, torch.zeros(hq, d)) and torch.isneginf(lse).all()
    outs, lses = [s[0] for s in states], [s[1] for s in states]

    merged = merge_states(outs, lses)
    torch.testing.assert_close(merged, full_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, merge_states(outs[::-1], lses[::-1]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.logsumexp(torch.stack(lses), 0), full_lse, atol=1e-5, rtol=1e-5)

    # and the full state against float64 first principles
    expected = _attend64(q[None], k, v, scale)[0]
    torch.testing.assert_close(full_o.double(), expected, atol=1e-5, rtol=1e-5)
    s = torch.einsum("hd,nhd->hn", q.double(), k.double().repeat_interleave(hq // hkv, dim=1)) * scale
    torch.testing.assert_close(full_lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_merge_states_all_empty_is_zero():
    q = torch.randn(4, 16)
    empty = torch.zeros(0, 2, 16)
    states = [partial_attention(q, empty, empty, 0.25) for _ in range(3)]
    out = merge_states([s[0] for s in states], [s[1] for s in states])
    assert torch.equal(out, torch.zeros(4, 16))


def test_merge_states_is_stable_for_large_logits():
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 16, generator=gen) * 100
    k = torch.randn(30, 2, 16, generator=gen) * 100
    v = torch.randn(30, 2, 16, generator=gen)
    full_o, _ = partial_attention(q, k, v, 1.0)
    parts = [partial_attention(q, k[i : i + 10], v[i : i + 10], 1.0) for i in (0, 10, 20)]
    merged = merge_states([p[0] for p in parts], [p[1] for p in parts])
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged, full_o, atol=1e-4, rtol=1e-4)


# ---- 3. prefill attention -----------------------------------------------------------------------
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
@pytest.mark.parametrize(("p", "t"), [(0, 9), (13, 9), (5, 1), (0, 1)])
def test_prefill_attention_matches_bottom_right_causal_attention(hq, hkv, p, t):
    gen = torch.Generator().manual_seed(21 + p + t)
    d = 32
    q = torch.randn(t, hq, d, generator=gen)
    pk, pv = torch.randn(p, hkv, d, generator=gen), torch.randn(p, hkv, d, generator=gen)
    nk, nv = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    scale = 1.0 / math.sqrt(d)

    out = prefill_attention(q, pk, pv, nk, nv, scale)

    assert out.shape == (t, hq, d) and out.dtype == q.dtype
    # independent oracle: new token i attends to every prefix row and to new tokens 0..i
    expected = torch.stack(
        [
            _attend64(q[i : i + 1], torch.cat([pk, nk[: i + 1]]), torch.cat([pv, nv[: i + 1]]), scale)[0]
            for i in range(t)
        ]
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_attention_last_token_equals_decode_over_everything():
    gen = torch.Generator().manual_seed(22)
    d, hq, hkv, p, t = 32, 4, 2, 6, 5
    q = torch.randn(t, hq, d, generator=gen)
    pk, pv = torch.randn(p, hkv, d, generator=gen), torch.randn(p, hkv, d, generator=gen)
    nk, nv = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    out = prefill_attention(q, pk, pv, nk, nv, 0.2)
    o, _ = partial_attention(q[-1], torch.cat([pk, nk]), torch.cat([pv, nv]), 0.2)
    torch.testing.assert_close(out[-1], o, atol=1e-5, rtol=1e-5)
    # the first new token does not see later ones
    o0, _ = partial_attention(q[0], torch.cat([pk, nk[:1]]), torch.cat([pv, nv[:1]]), 0.2)
    torch.testing.assert_close(out[0], o0, atol=1e-5, rtol=1e-5)


# ---- 4. quantize_pack / dequantize -----------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("clip", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_pack_matches_the_format_written_out(bits, clip, dtype):
    gen = torch.Generator().manual_seed(31)
    fmt = RowFormat(head_dim=64, bits=bits, group=16, clip=clip)
    rows = (torch.randn(10, 3, 64, generator=gen) * 2 + torch.randn(10, 3, 1, generator=gen)).to(dtype)
    codes, meta = quantize_pack(rows, fmt)
    assert codes.dtype == torch.uint8 and codes.shape == (10, 3, fmt.packed_dim)
    assert meta.dtype == torch.float16 and meta.shape == (10, 3, fmt.groups, 2)
    want_codes, want_meta = _spec_quantize_pack(rows, fmt)
    assert torch.equal(meta, want_meta)
    assert torch.equal(codes, want_codes), int((codes != want_codes).sum())
    assert codes.unique().numel() > 16  # the bytes mix codes: a layout error shows


def test_quantize_pack_hand_computed_rows():
    fmt = RowFormat(head_dim=8, bits=2, group=8, clip=0.75)  # clip index min(floor(0.75·8), 7) = 6
    rows = torch.tensor(
        [
            # |x| ascending 0,1,1,2,2,3,4,10: tau = 4, so 10 -> 4; m = -2, M = 4: s = 2, z = 1;
            # q = floor(x/2 + 1 + 0.5) = 1, 3, 2, 1, 3, 0, 2, 3 (x = -1, 3, 1 are ties: rounded up)
            [-1.0, 4.0, 2.0, 0.0, 3.0, -2.0, 1.0, 10.0],
            # |x| ascending 0,.5,1,1.5,2,2.5,3,3: tau = 3 clamps nothing; m = 0, M = 3: s = 1,
            # z = 0; q = 0, 3, 1, 2, 3, 1, 2, 3 (0.5, 1.5, 2.5 are ties: rounded up)
            [0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 3.0],
        ]
    )[:, None]
    codes, meta = quantize_pack(rows, fmt)
    assert meta.float().flatten().tolist() == [2.0, 1.0, 1.0, 0.0]
    # byte 0 = q0 | q2<<2 | q4<<4 | q6<<6, byte 1 = q1 | q3<<2 | q5<<4 | q7<<6
    #   row 0: 1 + 8 + 48 + 128 = 185 and 3 + 4 + 0 + 192 = 199
    #   row 1: 0 + 4 + 48 + 128 = 180 and 3 + 8 + 16 + 192 = 219
    assert codes.flatten().tolist() == [185, 199, 180, 219]
    back = dequantize(codes, meta, fmt)  # (q - z)·s
    assert back[0, 0].tolist() == [0.0, 4.0, 2.0, 0.0, 4.0, -2.0, 2.0, 4.0]
    assert back[1, 0].tolist() == [0.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [64, 16])
@pytest.mark.parametrize("clip", [0.0, 0.92])
def test_dequantize_round_trip_within_half_a_step(bits, group, clip):
    gen = torch.Generator().manual_seed(34)
    d = 64
    fmt = RowFormat(head_dim=d, bits=bits, group=group, clip=clip)
    rows = torch.randn(50, 2, d, generator=gen) * 3 + torch.randn(50, 2, 1, generator=gen)
    codes, meta = quantize_pack(rows, fmt)
    back = dequantize(codes, meta, fmt)
    assert back.dtype == torch.float32 and back.shape == rows.shape
    assert torch.equal(back, _spec_dequantize(codes, meta, fmt))
    target = _spec_clip(rows, clip)  # quantization is of the clipped rows
    step = meta[..., 0].float().repeat_interleave(group, dim=-1)
    err = (back - target).abs()
    assert (err <= 0.5 * step * 1.01 + 1e-6).all(), float((err / step).max())
    # the grid is used: with 2 bits some values land on every level
    assert back.unique().numel() > 4
    # out_dtype is honoured and is a plain cast
    half = dequantize(codes, meta, fmt, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, back.to(torch.bfloat16))


def test_dequantize_is_lossless_on_grid_values():
    fmt = RowFormat(head_dim=32, bits=2, group=8)
    # every group holds exactly the 4 grid levels lo + i·s: quantization is exact
    lo = torch.tensor([-1.0, 0.5, -2.0, 0.0])
    levels = torch.arange(4.0) * 0.25
    row = (lo[:, None] + levels.repeat(1, 2)).flatten()  # 4 groups of 8
    rows = row.expand(3, 2, 32).clone()
    codes, meta = quantize_pack(rows, fmt)
    back = dequantize(codes, meta, fmt)
    torch.testing.assert_close(back, rows, atol=2e-3, rtol=0)
    assert torch.equal(back, _spec_dequantize(codes, meta, fmt))


# ---- 5. backend resolution ------------------------------------------------------------------------
def test_resolve_torch_on_cpu():
    ops = resolve("torch", "cpu")
    assert ops.backend is Backend.TORCH
    assert ops.decode_attention is decode_attention
    assert ops.prefill_attention is prefill_attention
    assert ops.quantize_pack is quantize_pack and ops.dequantize is dequantize
    assert resolve(Backend.TORCH, torch.device("cpu")).backend is Backend.TORCH


def test_resolve_auto_on_cpu_falls_back_to_torch():
    assert resolve("auto", "cpu").backend is Backend.TORCH
    assert resolve(Backend.AUTO, torch.device("cpu")).backend is Backend.TORCH


def test_resolve_triton_on_cpu_raises_with_reason():
    with pytest.raises(BackendError, match="CUDA"):
        resolve("triton", "cpu")


@pytest.mark.parametrize("name", ["foo", "TORCH ", "cuda", ""])
def test_resolve_unknown_backend_raises(name):
    with pytest.raises(BackendError, match="auto, torch, triton"):
        resolve(name, "cpu")
