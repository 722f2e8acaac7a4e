"""Triton kernels against their torch twins on a CUDA device (skipped where there is none).

The grid of issue #5: batch 1-64, lengths 1-131072, GQA 32/8, 64/8, 8/8, head dims 64/128,
empty tiers, single tokens, lengths that are not multiples of the block, shuffled slot lists.
Tolerances: codes and metadata bit-exact; attention within a relative 1e-2 of
the fp32 oracle (bf16 queries, fp16 probabilities for the value dot; measured ≤ 2.1e-3).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

from oscarkv.kernels import ref
from oscarkv.kernels.triton.decode import planes
from oscarkv.kernels.triton.rotate import fp8_e4m3
from oscarkv.quant import RowFormat
from oscarkv.quant.quantizer import clip_index
from token_cases import coverage_case, drop_effects, prefill_case, rel, rows_rel, split_edges

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _lists(lens: list[int], device: str, shuffle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    n = sum(lens)
    idx = torch.randperm(n, device=device) if shuffle else torch.arange(n, device=device)
    return indptr, idx.to(torch.int32)


def _forced_taper(p):
    """``p`` with a taper on any launch of two INT2 splits or more (``planner.taper``'s contract:
    whole tiles, the late splits no longer, the list covered): splits ``< n_q // 2`` a tile longer."""
    from oscarkv.kernels.triton.decode.planner import Taper

    n_q, split, tile = p.n_q_splits, p.splits.split, p.lp.block_n
    if n_q < 2:
        return p
    early, n_early = split + tile, n_q // 2
    late = max(tile, math.ceil(max(max(p.max_q, 1) - n_early * early, 0) / (n_q - n_early) / tile) * tile)
    return dataclasses.replace(p, splits=Taper(n_early, early, late))


# tunings that force each loop and split rule at any size; the loop the plan must then take
PLANES = {
    "auto": ({}, None),
    "bytes": ({"small_tokens": 1 << 40}, "bytes"),
    "bytes-grouped": ({"small_tokens": 1 << 40, "group_tokens": 0}, "bytes"),
    "words": ({"small_tokens": 0, "swap_max_tokens": 0, "swap_heads": 1, "group_tokens": 0}, "words"),
    "swap": ({"small_tokens": 0, "swap_pair_tokens": 0}, "swap"),
    "swap-one-head": ({"small_tokens": 0, "swap_heads": 1, "swap_max_tokens": 1 << 40}, "swap"),
    "swap-fp16-keys": ({"small_tokens": 0, "swap_pair_tokens": 0, "int8_key_bytes": 1 << 20}, "swap"),
    "hp-short": ({"small_tokens": 0, "sms": 1, "hp_programs": 100000}, None),  # 16-bit splits of one tile
    "taper": ({}, None),  # whatever loop the size picks: half its splits longer, the rest shorter
}


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d"),
    [
        ([1], [1], 32, 8, 128),
        ([0, 5, 129], [320, 0, 7], 32, 8, 128),
        ([4097] * 8, [320] * 8, 64, 8, 128),
        ([1000, 999], [50, 51], 8, 8, 64),
        ([513] * 64, [0] * 64, 32, 8, 128),
        ([0] * 4, [100] * 4, 32, 8, 128),
        ([131072 - 320], [320], 32, 8, 128),
        ([3000, 70], [40, 320], 16, 4, 256),
        ([1000, 999], [50, 51], 8, 8, 128),  # g = 1: the swap loop's N side is one column
        ([5000, 70], [30, 320], 12, 4, 128),  # g = 3: a padding head
        ([2000, 33], [10, 320], 16, 8, 128),  # g = 2: two KV heads per swap program
    ],
)
@pytest.mark.parametrize("meta", ["fp16", "bf16"])
@pytest.mark.parametrize("planes", list(PLANES))
def test_decode_attention_matches_the_oracle(lens_q, lens_h, hq, hkv, d, meta, planes):
    from oscarkv.kernels.triton import decode as dec

    changes, loop = PLANES[planes]
    p = dec.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cuda",
                 dataclasses.replace(dec.DEFAULT_TUNING, **changes))  # fmt: skip
    if loop is not None and p.lp.loop != loop:
        pytest.skip(
            f"{planes}: this shape takes the {p.lp.loop} loop (head dim 64: bytes; words: groupable heads)"
        )
    if planes == "taper":
        p = _forced_taper(p)
    dev = "cuda"
    fmt = RowFormat(d, 2, d, meta_dtype=meta)
    nq, nh = max(sum(lens_q), 1), max(sum(lens_h), 1)
    kc, km = ref.quantize_pack(torch.randn(nq, hkv, d, device=dev), fmt)
    vc, vm = ref.quantize_pack(torch.randn(nq, hkv, d, device=dev), fmt)
    hk = torch.randn(nh, hkv, d, device=dev, dtype=torch.bfloat16)
    hv = torch.randn(nh, hkv, d, device=dev, dtype=torch.bfloat16)
    qi, qx = _lists(lens_q, dev, shuffle=True)
    hi, hx = _lists(lens_h, dev, shuffle=True)
    q = torch.randn(len(lens_q), hq, d, device=dev, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(d)
    got = dec.decode_attention(q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, fmt, fmt, plan=p)
    want = ref.decode_attention(
        q.float(), kc, km, vc, vm, hk.float(), hv.float(), qi, qx, hi, hx, scale, fmt, fmt
    )
    for b in range(len(lens_q)):
        if lens_q[b] + lens_h[b] == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))
        else:
            assert _rel(got[b], want[b]) < 1e-2


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d"),
    [
        ([131072 - 320], [320], 32, 8, 128),
        ([32768 - 320 - 37 * i for i in range(8)], [320] * 7 + [0], 32, 8, 128),
        ([8192 - 320 - 11 * i for i in range(32)], [320 - i for i in range(32)], 32, 8, 128),
        ([4096 - 320 - 5 * i for i in range(8)], [320] * 8, 32, 8, 128),
        ([32768 - 320] * 4, [320] * 4, 16, 4, 256),
        ([8192 - 320] * 8, [320] * 8, 9, 3, 64),
    ],
)
@pytest.mark.parametrize("planes", ["auto", "words", "swap-one-head", "swap-fp16-keys", "taper"])
def test_decode_attention_sees_every_token(lens_q, lens_h, hq, hkv, d, planes):
    """Real lengths, zero queries: the output is the exact mean of both lists' values
    (``token_cases``), and the kernel must be closer to it than a third of what losing or repeating
    the first or last token of any INT2 split would change (the plan's own splits)."""
    from oscarkv.kernels.triton import decode as dec

    changes, loop = PLANES[planes]
    p = dec.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cuda",
                 dataclasses.replace(dec.DEFAULT_TUNING, **changes))  # fmt: skip
    if loop is not None and p.lp.loop != loop:
        pytest.skip(f"{planes}: this shape takes the {p.lp.loop} loop")
    if planes == "taper":
        p = _forced_taper(p)
    args, want, _ = coverage_case(lens_q, lens_h, hq, hkv, d, "cuda")
    got = dec.decode_attention(*args, plan=p)
    edges = split_edges(p, lens_q)
    for (s, pos), effect in zip(edges, drop_effects(args, want, edges), strict=True):
        assert rel(got[s], want[s]) < effect / 3, (s, pos, rel(got[s], want[s]), effect)


@pytest.mark.parametrize(("p", "t", "hq", "hkv", "d"), [(0, 500, 32, 8, 128), (1500, 500, 32, 8, 128),
                                                         (3000, 1, 16, 4, 256), (700, 300, 9, 3, 64)])  # fmt: skip
def test_prefill_attention_sees_every_key(p, t, hq, hkv, d):
    """The Triton backend's prefill (SDPA, bottom-right causal mask) in bf16 on the GPU: each new row
    within a third of what one key too many or too few would change (zero queries: exact means)."""
    from oscarkv.kernels.triton.ops import prefill_attention

    args, want, effect = prefill_case(p, t, hq, hkv, d, "cuda", torch.bfloat16)
    err = rows_rel(prefill_attention(*args), want)
    assert (err < effect / 3).all(), (err.max(), effect.min())


@triton.jit
def _plane_probe(C, OUT, N: tl.constexpr, KIND: tl.constexpr, ASM: tl.constexpr):
    """The plane builders of 256 codes per program, each plane's bits as int32 ``OUT[plane, i]``."""
    offs = tl.program_id(0) * 256 + tl.arange(0, 256)
    c = tl.load(C + offs)
    if KIND == 0:
        a, b, e, f = planes.byte_planes(c, ASM)
        outs = (a, b, e, f)
    elif KIND == 1:
        a, b, e, f = planes.key_planes_i8(c, ASM)
        outs = (a, b, e, f)
    else:
        a, b, e, f, g, h, i, j = planes.word_planes(c, ASM)
        outs = (a, b, e, f, g, h, i, j)
    for k in tl.static_range(len(outs)):
        bits = outs[k].to(tl.int32) if KIND == 1 else outs[k].to(tl.int16, bitcast=True).to(tl.int32)
        tl.store(OUT + k * N + offs, bits)


def test_plane_builders_ptx_equals_their_integer_twins():
    """The inline-PTX plane builders (what the GPU runs) against the integer-op versions (what the
    interpreter runs), bit for bit, over every code byte and every code word."""
    byte = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8)
    word = torch.arange(-32768, 32768, device="cuda", dtype=torch.int32).to(torch.int16)
    for kind, codes, n_out in ((0, byte, 4), (1, byte, 4), (2, word, 8)):
        got = {}
        for asm in (True, False):
            out = torch.full((n_out, codes.numel()), -7, device="cuda", dtype=torch.int32)
            _plane_probe[(codes.numel() // 256,)](codes, out, N=codes.numel(), KIND=kind, ASM=asm)
            got[asm] = out
        assert torch.equal(got[True], got[False]), kind
        assert (got[True] != -7).any(0).all(), kind  # every element written


@pytest.mark.parametrize(("batch", "n"), [(1, 3000), (8, 40000)])
@pytest.mark.parametrize("loop", ["swap", "swap-one-head", "words", "bytes"])
def test_decode_attention_rescales_past_the_first_tile(batch, n, loop):
    """Scores that grow along the list (queries x30, the later half of the keys x4): the lazy
    rescale must fire after a split's first tile too, or fp16 probabilities overflow."""
    from oscarkv.kernels.triton import decode as dec

    p = dec.plan(
        batch, 32, 8, 128, (n, 16), "cuda", dataclasses.replace(dec.DEFAULT_TUNING, **PLANES[loop][0])
    )
    if p.lp.loop != PLANES[loop][1]:
        pytest.skip(f"{loop}: this shape takes the {p.lp.loop} loop")
    fmt = RowFormat(128, 2, 128)
    k = torch.randn(batch, n, 8, 128, device="cuda")
    k[:, n // 2 :] *= 4.0
    kc, km = ref.quantize_pack(k.flatten(0, 1), fmt)
    vc, vm = ref.quantize_pack(torch.randn(batch * n, 8, 128, device="cuda"), fmt)
    hk = torch.randn(batch * 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    hv = torch.randn_like(hk)
    qi, qx = _lists([n] * batch, "cuda", shuffle=False)  # list order = token order: the scores grow
    hi, hx = _lists([16] * batch, "cuda", shuffle=True)
    q = (torch.randn(batch, 32, 128, device="cuda") * 30.0).bfloat16()
    args = (q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, 1 / math.sqrt(128), fmt, fmt)
    got = dec.decode_attention(*args, plan=p)
    want = ref.decode_attention(q.float(), kc, km, vc, vm, hk.float(), hv.float(), *args[7:])
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2


@pytest.mark.parametrize(("batch", "lq", "lh"), [(1, 5000, 320), (8, 40000, 320), (4, 0, 100), (32, 2000, 0)])
def test_decode_with_the_merge_as_a_dependent_launch_is_exact(batch, lq, lh):
    """``DecodeTuning.pdl``: the merge waits on stage 1 through griddepcontrol, eagerly and replayed from
    a CUDA graph (where the dependency becomes a programmatic edge); the result must be the
    ordinary launch's, bit for bit, every replay."""
    from oscarkv.kernels.triton import decode as dec
    from oscarkv.kernels.triton.decode import attention as da

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    fmt = RowFormat(128, 2, 128)
    kc, km = ref.quantize_pack(torch.randn(max(batch * lq, 1), 8, 128, device="cuda"), fmt)
    vc, vm = ref.quantize_pack(torch.randn(max(batch * lq, 1), 8, 128, device="cuda"), fmt)
    hk = torch.randn(max(batch * lh, 1), 8, 128, device="cuda", dtype=torch.bfloat16)
    hv = torch.randn_like(hk)
    qi, qx = _lists([lq] * batch, "cuda", shuffle=True)
    hi, hx = _lists([lh] * batch, "cuda", shuffle=True)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, 1 / math.sqrt(128), fmt, fmt)
    hint = (lq, lh)  # no device sync inside the graph capture
    ordinary = dec.plan(batch, 32, 8, 128, hint, "cuda", dataclasses.replace(dec.DEFAULT_TUNING, pdl=False))
    assert not ordinary.pdl and dec.plan(batch, 32, 8, 128, hint, "cuda").pdl
    want = dec.decode_attention(*args, plan=ordinary)
    assert torch.equal(dec.decode_attention(*args, lens_hint=hint), want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = dec.decode_attention(*args, lens_hint=hint)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    # the merge really was compiled for (and so launched as) a programmatic dependent launch
    assert any(c.metadata.launch_pdl for c, _ in da._MERGE._cache.values())


def test_quantize_pack_as_a_dependent_launch_waits_for_its_producer():
    """quantize_pack is launched as a programmatic dependent of the kernel
    before it and lets its successor launch once all its programs have started, so a
    quantize_pack that consumes the previous one's output must wait on griddepcontrol. Here it
    reads the codes of K's last rows, read as bf16 rows: the producer's last programs write them
    while its first ones have already freed slots (without the wait this read stale codes). In a
    CUDA graph (programmatic edges) the chain quantize K -> quantize K's codes -> quantize V ->
    decode must give the ordinary launches' codes, metadata and output, bit for bit, on every
    replay with new rows, and eagerly."""
    from oscarkv.kernels.triton import decode as dec
    from oscarkv.kernels.triton import quantize_pack as tqp

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    batch, lq, lh, d = 8, 6000, 64, 128
    tail = 4096  # K tokens whose codes the second call reads: the last 512 of its producer's 6000 programs
    fmt = RowFormat(d, 2, d, clip=0.96)
    rk = torch.empty(batch * lq, 8, d, device="cuda", dtype=torch.bfloat16)
    rv = torch.empty_like(rk)
    hk = torch.randn(batch * lh, 8, d, device="cuda", dtype=torch.bfloat16)
    hv = torch.randn_like(hk)
    qi, qx = _lists([lq] * batch, "cuda", shuffle=True)
    hi, hx = _lists([lh] * batch, "cuda", shuffle=True)
    q = torch.randn(batch, 32, d, device="cuda", dtype=torch.bfloat16)

    def step(pdl=True):
        qt = dataclasses.replace(tqp.DEFAULT_TUNING, pdl=pdl)
        plan = dec.plan(batch, 32, 8, d, (lq, lh), "cuda", dataclasses.replace(dec.DEFAULT_TUNING, pdl=pdl))
        kc, km = tqp.quantize_pack(rk, fmt, qt)
        cc, cm = tqp.quantize_pack(kc[-tail:].view(torch.bfloat16).view(-1, 8, d), fmt, qt)
        vc, vm = tqp.quantize_pack(rv, fmt, qt)
        out = dec.decode_attention(q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, 0.088, fmt, fmt, plan=plan)
        return kc, km, cc, cm, vc, vm, out

    def ordinary():
        return step(pdl=False)

    def same(got, want):  # bit patterns: the codes read as rows hold NaN, and so may the metadata
        return all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True)
        )

    def refill():
        rk.normal_().mul_(2.0)
        rv.normal_()
        q.normal_()

    refill()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = step()
    for _ in range(3):
        refill()
        want = ordinary()
        for t in got:
            t.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert same(got, want)
    refill()
    assert same(step(), ordinary())  # eagerly too
    # the kernel really was compiled for (and so launched as) a programmatic dependent launch
    assert any(c.metadata.launch_pdl for c, _ in tqp._QUANTIZE_PACK._cache.values())


def _non_finite_rows(d: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rows [6, 2, d]: one finite, then a NaN, all +inf, one +inf, one -inf, three +inf."""
    x = torch.randn(6, 2, d, device=device)
    x[1, :, 5] = float("nan")
    x[2] = float("inf")
    x[3, :, 7] = float("inf")
    x[4, :, 9] = -float("inf")
    x[5, :, :3] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("meta", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("d", "clip"), [(128, 0.0), (128, 0.96), (128, 0.92), (256, 0.96), (64, 0.8)])
def test_quantize_pack_non_finite_rows_match_the_oracle(d, clip, dtype, meta):
    """NaN and infinities: the reference's scale/zero (NaN for a row holding NaN or a row of
    infinities, inf for an unclipped infinity) and codes, bit for bit, NaN in the same places
    (bf16 metadata: the GPU's NaN, 0x7FFFFFFF, must not round to -0.0)."""
    from oscarkv.kernels.triton import quantize_pack as tqp

    fmt = RowFormat(d, 2, d, clip=clip, meta_dtype=meta)
    x = _non_finite_rows(d, dtype, "cuda")
    c1, m1 = tqp.quantize_pack(x, fmt)
    c2, m2 = ref.quantize_pack(x, fmt)
    assert torch.equal(c1, c2) and torch.equal(m1.isnan(), m2.isnan())
    assert torch.equal(m1.nan_to_num(0.0), m2.nan_to_num(0.0)) and m1[1:3].isnan().all()


@pytest.mark.parametrize(
    ("d", "clip"), [(64, 0.92), (128, 0.96), (128, 0.92), (128, 0.8), (256, 0.96), (256, 0.0)]
)
@pytest.mark.parametrize("meta", ["fp16", "bf16", "fp32"])
def test_quantize_pack_is_bit_exact(d, clip, meta):
    from oscarkv.kernels.triton import quantize_pack as tqp
    from oscarkv.kernels.triton.dequantize import dequantize

    fmt = RowFormat(d, 2, d, clip=clip, meta_dtype=meta)
    gen = torch.Generator(device="cuda").manual_seed(d)
    x = (torch.randn(3000, 8, d, device="cuda", generator=gen) * 2 + 0.2).bfloat16()
    x[0, 0, :7] = 5.0  # ties at the clip threshold
    x[1] = torch.randint(-3, 4, (8, d), device="cuda", generator=gen).bfloat16() * 0.5  # ties everywhere
    x[2] = x[2].abs() + 1.0  # all positive (lo > 0)
    x[3, 0] = 0.0  # an all-zero row
    x[3, 1] = 1.25  # a constant row
    x[4, :, 3] = 300.0  # one huge outlier per row
    c1, m1 = tqp.quantize_pack(x, fmt)
    c2, m2 = ref.quantize_pack(x, fmt)
    assert torch.equal(c1, c2) and torch.equal(m1, m2)
    assert torch.equal(dequantize(c1, m1, fmt), ref.dequantize(c1, m1, fmt))


@pytest.mark.parametrize(("d", "meta"), [(128, "bf16"), (64, "fp32"), (128, "fp16")])
@pytest.mark.parametrize("interleaved", [False, True])
def test_quantize_pack_into_is_bit_exact(d, meta, interleaved):
    """A demotion's gather + quantize + scatter, into contiguous pools or into vLLM-style pages
    (one byte row per token holding ``[meta | codes]`` and padding): the twin's bytes, every
    other slot untouched."""
    from oscarkv.kernels.triton import quantize_pack as tqp

    fmt = RowFormat(d, 2, d, clip=0.92, meta_dtype=meta)
    mt = ref.quantize_pack(torch.zeros(1, 1, d, device="cuda"), fmt)[1].dtype
    gen = torch.Generator(device="cuda").manual_seed(d)
    h, s, n = 8, 4096, 1500
    hp = (torch.randn(5000, 2, h, d, device="cuda", generator=gen) * 2).bfloat16()[:, 0]
    src = torch.randperm(5000, device="cuda", generator=gen)[:n]
    dst = torch.randperm(s, device="cuda", generator=gen)[:n]
    if interleaved:
        mb = h * 2 * mt.itemsize
        base = torch.randint(0, 256, (s, mb + h * fmt.packed_dim + 4), dtype=torch.uint8, device="cuda")

        def views(p):
            return p[:, mb : mb + h * fmt.packed_dim].view(s, h, fmt.packed_dim), p[:, :mb].view(mt).view(
                s, h, 1, 2
            )
    else:
        base = torch.randint(
            0, 256, (s, h * (fmt.packed_dim + 2 * mt.itemsize)), dtype=torch.uint8, device="cuda"
        )

        def views(p):
            c, m = p.split([h * fmt.packed_dim, 2 * h * mt.itemsize], dim=1)
            return c.contiguous().view(s, h, fmt.packed_dim), m.contiguous().view(mt).view(s, h, 1, 2)

    def same(a, b):  # bytes: an untouched slot's random metadata bytes may read as NaN
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    got, want = views(base.clone()), views(base.clone())
    tqp.quantize_pack_into(hp, fmt, *got, dst, src)
    ref.quantize_pack_into(hp, fmt, *want, dst, src)
    assert same(got[0], want[0]) and same(got[1], want[1])
    c, m = ref.quantize_pack(hp[src], fmt)
    assert same(got[0][dst], c) and same(got[1][dst], m)
    rest = torch.ones(s, dtype=torch.bool, device="cuda")
    rest[dst] = False
    assert same(got[0][rest], views(base)[0][rest]) and same(got[1][rest], views(base)[1][rest])


@pytest.mark.parametrize(
    ("d", "clip"), [(64, 0.96), (64, 0.8), (128, 0.96), (128, 0.92), (128, 0.8), (256, 0.96), (256, 0.92)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rounds", "round_k"),
    [(1, 12), (99, 12), (99, 6)],
    ids=["default-rounds", "all-rounds", "all-rounds-of-6"],
)
def test_quantize_pack_packed_network_is_bit_exact(d, clip, dtype, rounds, round_k, monkeypatch):
    """The clip network on packed pairs (``packed``; ``packed_rounds`` 99 forces it at every round
    count, of 12 or of 6 values): the reference's and the fp32 network's codes and metadata, bit
    for bit, on ties at the threshold, zero, constant, integer, all-positive, huge-outlier and
    subnormal rows."""
    from oscarkv.kernels.triton import quantize_pack as tqp

    tuning = dataclasses.replace(tqp.DEFAULT_TUNING, packed_rounds=rounds, round_k=round_k)
    fmt = RowFormat(d, 2, d, clip=clip, meta_dtype="bf16")
    gen = torch.Generator(device="cuda").manual_seed(d + rounds)
    x = torch.randn(3000, 8, d, device="cuda", generator=gen) * 2 + 0.2
    x[0, 0, :7] = 5.0  # ties at the clip threshold
    x[0, 1, : d // 4] = -5.0  # ties across rounds
    x[1] = torch.randint(-3, 4, (8, d), device="cuda", generator=gen) * 0.5  # ties everywhere
    x[2] = x[2].abs() + 1.0  # all positive (lo > 0)
    x[3, 0], x[3, 1] = 0.0, 1.25  # all-zero and constant rows
    x[4, :, 3] = 1e30 if dtype == torch.bfloat16 else 6e4  # one huge outlier per row
    x[5] *= 1e-39 if dtype == torch.bfloat16 else 1e-6  # subnormal rows
    x = x.to(dtype)
    seen, launch = [], tqp._QUANTIZE_PACK

    def spy(grid, *args, **kwargs):
        seen.append((kwargs["PACKED"], kwargs["ASM"]))
        return launch(grid, *args, **kwargs)

    monkeypatch.setattr(tqp, "_QUANTIZE_PACK", spy)
    c1, m1 = tqp.quantize_pack(x, fmt, tuning)
    n_drop = d - 1 - clip_index(clip, d)
    n_rounds = -(-(n_drop + 1) // (6 if n_drop < 6 else round_k))
    packed = clip > 0 and n_rounds <= rounds
    assert seen == [(packed, {torch.bfloat16: 1, torch.float16: 2}[dtype] if packed else 0)]  # the PTX pairs
    c2, m2 = ref.quantize_pack(x, fmt)
    bad = ((c1 != c2).any(-1) | (m1 != m2).flatten(2).any(-1)).nonzero()[:8].tolist()
    assert not bad, f"rows (token, head) differing from the reference: {bad}"
    c3, m3 = tqp.quantize_pack(x, fmt, dataclasses.replace(tuning, packed=False))
    assert torch.equal(c1, c3) and torch.equal(m1, m3)


@pytest.mark.parametrize("meta", ["fp16", "fp32"])
def test_reference_quantizer_is_the_same_on_cpu_and_gpu(meta):
    fmt = RowFormat(128, 2, 128, clip=0.96, meta_dtype=meta)
    x = torch.randn(20000, 1, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    c_gpu, m_gpu = ref.quantize_pack(x.cuda(), fmt)
    c_cpu, m_cpu = ref.quantize_pack(x, fmt)
    assert torch.equal(c_gpu.cpu(), c_cpu) and torch.equal(m_gpu.cpu(), m_cpu)


def test_cached_launches_repeat_the_first_launch():
    """The second and later calls of a specialization go through ``Launcher``'s cached compiled
    kernel: they must give what the ordinary (first) launch gave, also after the arguments change
    between calls of one key (other pools, list lengths, scale) and for a new key (a misaligned
    row view)."""
    from oscarkv.kernels.triton import quantize_pack as tqp
    from oscarkv.kernels.triton.decode import attention as tda

    dev, d, hkv = "cuda", 128, 8
    fmt = RowFormat(d, 2, d, clip=0.96)
    for launcher in (tda._STAGE1, tda._MERGE, tqp._QUANTIZE_PACK):  # so the first call is an ordinary launch
        launcher._cache.clear()
    outs = []
    for seed, lens in ((1, [3000, 40000]), (2, [3000, 40000]), (3, [123, 50000])):
        torch.manual_seed(seed)
        x = torch.randn(sum(lens), 2 * hkv, d, device=dev, dtype=torch.bfloat16)
        kc, km = tqp.quantize_pack(x[:, :hkv], fmt)
        vc, vm = tqp.quantize_pack(x[:, hkv:], fmt)
        assert torch.equal(kc, ref.quantize_pack(x[:, :hkv], fmt)[0])
        hk, hv = x[:64, :hkv].contiguous(), x[:64, hkv:].contiguous()
        qi, qx = _lists(lens, dev, shuffle=True)
        hi, hx = _lists([32, 32], dev, shuffle=False)
        q = torch.randn(2, 32, d, device=dev, dtype=torch.bfloat16)
        args = (q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, d**-0.5 * seed, fmt, fmt)
        n_keys = tda._STAGE1.cache_size()
        first = tda.decode_attention(*args)
        assert seed > 1 or tda._STAGE1.cache_size() == n_keys + 1  # the first call compiled and cached
        again = tda.decode_attention(*args)
        assert torch.equal(first, again)
        want = ref.decode_attention(q.float(), *args[1:5], hk.float(), hv.float(), *args[7:])
        assert _rel(again, want) < 1e-2
        outs.append(again)
    assert not torch.equal(outs[0], outs[1])  # new arguments reached the cached kernel
    # rows at a 2-byte offset: another specialization (no 16-byte alignment), same codes
    buf = torch.randn(4097 * d + 1, device=dev, dtype=torch.bfloat16)
    rows = buf[1:].view(4097, 1, d)
    assert rows.data_ptr() % 16
    for _ in range(2):
        c, m = tqp.quantize_pack(rows, fmt)
        c_ref, m_ref = ref.quantize_pack(rows, fmt)
        assert torch.equal(c, c_ref) and torch.equal(m, m_ref)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_heads_matches_the_oracle(d, per_head, dtype, close_rotations):
    from oscarkv.kernels.triton.rotate import rotate_heads

    gen = torch.Generator(device="cuda").manual_seed(4)
    r = torch.linalg.qr(torch.randn(d, d, device="cuda", dtype=torch.float64, generator=gen))[0].float()
    if per_head:
        r = torch.stack([r, r.T, -r, r.flip(0), r, r.T, -r, r.flip(0)])
    x = torch.randn(33, 32, d, device="cuda", generator=gen).to(dtype)
    for inverse in (False, True):
        close_rotations(rotate_heads(x, r, inverse), ref.rotate_heads(x, r, inverse))
    dst = torch.tensor([5 * i if i % 3 else -1 for i in range(33)], device="cuda", dtype=torch.int32)
    pool = torch.randn(200, 32, d, device="cuda", generator=gen).to(dtype)
    got = rotate_heads(x, r, False, pool.clone(), dst)
    close_rotations(got, ref.rotate_heads(x, r, False, pool.clone(), dst.long()))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotate_rows_matches_the_oracle_and_ignores_the_row_count(d, per_head, dtype, close_rotations):
    """A prefill's rows: the torch twin's fp32 result within one rounding step of the output dtype
    (bf16 rows run three exact bf16 pieces of R on the tensor cores), and each row's result the
    same whatever rows come with it, bit for bit (a chunked prefill rotates the rows it would
    rotate unchunked)."""
    from oscarkv.kernels.triton.rotate import rotate_rows

    gen = torch.Generator(device="cuda").manual_seed(5)
    r = torch.linalg.qr(torch.randn(d, d, device="cuda", dtype=torch.float64, generator=gen))[0].float()
    if per_head:
        r = torch.stack([r, r.T, -r, r.flip(0)])
    x = (4 * torch.randn(3000, 32, d, device="cuda", generator=gen)).to(dtype)
    for inverse in (False, True):
        got, want = rotate_rows(x, r, inverse), ref.rotate_rows(x, r, inverse)
        if dtype == torch.float16:
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-10, atol=1e-5)
        else:
            close_rotations(got, want)
        assert torch.equal(rotate_rows(x[1000:1777], r, inverse), got[1000:1777])


@pytest.mark.parametrize(("granularity", "window"), [("layer", "model"), ("kv_head", "model"),
                                                   ("layer", "fp8_e4m3")])  # fmt: skip
def test_oscar_cache_decodes_on_the_gpu_like_the_reference_backend(granularity, window):
    """Prefill then 30 decode steps (demotions every 8) with the Triton decode ops and with the
    torch reference on the same GPU, fed the same tokens: logits agree at every step. Both caches
    prefill with the reference attention (fp32), so the difference is the decode path's own
    (bf16 queries, fp16 probabilities for the V dot, rotations summed in another order); a wrong
    slot, rotation or tier gives errors near 1. ``window``: the windows' dtype (fp8: the rotation
    into fp8 pools, the demotion from them and the 16-bit loop's widening)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oscarkv import QuantSpec
    from oscarkv.hf import OscarCache
    from oscarkv.rotation import LayerRotation, RotationSet

    d, hkv, layers = 128, 2, 2
    cfg = Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=hkv, head_dim=d, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(1)

    def rot():
        q = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen))[0].float()
        return q if granularity == "layer" else torch.stack([q, q.T])

    spec = QuantSpec(sink_tokens=4, recent_tokens=16, demote_block=8, window_dtype=window)
    lrs = {}
    for i in range(layers):
        rk, rv = rot(), rot()
        lrs[i] = LayerRotation(rk, rv, torch.ones(rk.shape[:-1]), torch.ones(rv.shape[:-1]))
    rots = RotationSet(lrs, spec, "layer" if granularity == "layer" else "kv_head")
    ids = torch.randint(
        0, 256, (2, 90), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)
    )
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # a left-padded sequence
    steps = torch.randint(0, 256, (30, 2), device="cuda")
    logits = {}
    for backend in ("triton", "torch"):
        cache = OscarCache.from_rotations(model, rots, backend=backend)
        cache.ops = dataclasses.replace(cache.ops, prefill_attention=ref.prefill_attention)
        out = []
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            m = mask
            for tok in steps:
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                out.append(
                    model(input_ids=tok[:, None], attention_mask=m, past_key_values=cache).logits[:, -1]
                )
        logits[backend] = torch.stack(out).float()
    assert _rel(logits["triton"], logits["torch"]) < 2e-2


@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotate_new_rows_matches_the_oracle(d, close_rotations):
    from oscarkv.kernels.triton.rotate import rotate_new_rows

    gen = torch.Generator(device="cuda").manual_seed(5)

    def orth():
        return torch.linalg.qr(torch.randn(d, d, device="cuda", dtype=torch.float64, generator=gen))[
            0
        ].float()

    q = torch.randn(40, 32, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(40, 8, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(40, 8, d, device="cuda", generator=gen).bfloat16()
    dst = torch.tensor([7 * i if i % 5 else -1 for i in range(40)], device="cuda")
    per_head = torch.stack([orth() for _ in range(8)])
    for r_k, r_v in ((orth(), orth()), (per_head, None), (orth(), per_head[:2])):
        pools = [torch.randn(300, 8, d, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        pools += [p.clone() for p in pools]
        got = rotate_new_rows(q, k, v, r_k, r_v, pools[0], pools[1], dst)
        want = ref.rotate_new_rows(q, k, v, r_k, r_v, pools[2], pools[3], dst)
        for a, b in ((got, want), (pools[0], pools[2]), (pools[1], pools[3])):
            close_rotations(a, b)


# ---- fp8 windows (QuantSpec.window_dtype="fp8_e4m3") -------------------------------------------
F8 = torch.float8_e4m3fn


@triton.jit
def _fp8_round(X, Y, N: tl.constexpr):
    o = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(Y + o, fp8_e4m3(tl.load(X + o)))


def test_fp8_rounding_equals_torchs_saturating_cast_on_the_gpu():
    """``rotate.fp8_e4m3`` (integer ops) against ``x.clamp(-448, 448).to(float8_e4m3fn)`` on the
    device: random magnitudes 2^-14..2^10, every fp8 value, every midpoint and its neighbours."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.exp2(torch.rand(1 << 20, device="cuda", generator=gen) * 24 - 14)
    x = torch.where(torch.rand(x.shape, device="cuda", generator=gen) < 0.5, -x, x)
    fin = torch.arange(256, dtype=torch.uint8, device="cuda").view(F8).float()
    fin = fin[torch.isfinite(fin)].unique().sort().values
    mids = (fin[1:] + fin[:-1]) / 2
    big = torch.tensor([448.0, 449.0, 464.0, 465.0, 1e6, math.inf, -math.inf], device="cuda")
    x = torch.cat([x, fin, mids, -mids, big, torch.nextafter(mids, torch.zeros_like(mids)),
                   torch.nextafter(mids, torch.full_like(mids, 1e9))])  # fmt: skip
    x = torch.cat([x, torch.zeros(-x.numel() % 256, device="cuda")])
    y = torch.empty(x.shape, dtype=F8, device="cuda")
    _fp8_round[(x.numel() // 256,)](x, y, N=256)
    assert torch.equal(y.view(torch.uint8), x.clamp(-448, 448).to(F8).view(torch.uint8))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotate_new_rows_into_fp8_pools(d):
    """bf16 rows (|x| up to ~1500) rotated into fp8 pools: the kernel's bf16 result rounded to fp8
    saturating at ±448, bit for bit; within one fp8 step of the twin."""
    from oscarkv.kernels.triton.rotate import rotate_new_rows
    from oscarkv.quant.window import to_window

    gen = torch.Generator(device="cuda").manual_seed(6)
    r = torch.linalg.qr(torch.randn(d, d, device="cuda", dtype=torch.float64, generator=gen))[0].float()
    q = torch.randn(40, 32, d, device="cuda", generator=gen).bfloat16()
    k = (torch.randn(40, 8, d, device="cuda", generator=gen) * 300).bfloat16()
    v = (torch.randn(40, 8, d, device="cuda", generator=gen) * 300).bfloat16()
    dst = torch.tensor([7 * i if i % 5 else -1 for i in range(40)], device="cuda")
    f8 = [torch.zeros(300, 8, d, device="cuda", dtype=F8) for _ in range(4)]
    wide = [torch.zeros(300, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    rotate_new_rows(q, k, v, r, r, f8[0], f8[1], dst)
    rotate_new_rows(q, k, v, r, r, wide[0], wide[1], dst)
    ref.rotate_new_rows(q, k, v, r, r, f8[2], f8[3], dst)
    rows = dst[dst >= 0]
    for got, w, want in ((f8[0], wide[0], f8[2]), (f8[1], wide[1], f8[3])):
        assert torch.equal(got[rows].view(torch.uint8), to_window(w[rows], F8).view(torch.uint8))
        assert (got[rows].float().abs() == 448).any() and got.float().isfinite().all()
        step = (want[rows].float().abs() / 8).clamp_min(2**-9)
        assert ((got[rows].float() - want[rows].float()).abs() <= step).all()


@pytest.mark.parametrize(("d", "meta", "bits"), [(128, "bf16", 2), (64, "fp32", 2), (128, "fp16", 4)])
def test_quantize_pack_into_from_an_fp8_ring_is_bit_exact(d, meta, bits):
    """A demotion from fp8 windows: the twin's codes and metadata, those of the upcast rows."""
    from oscarkv.kernels.triton import quantize_pack as tqp
    from oscarkv.quant.window import to_window

    fmt = RowFormat(d, bits, d, clip=0.92 if bits == 2 else 0.0, meta_dtype=meta)
    gen = torch.Generator(device="cuda").manual_seed(d)
    hp = to_window(torch.randn(5000, 8, d, device="cuda", generator=gen) * 40, F8)
    src = torch.randperm(5000, device="cuda", generator=gen)[:1500]
    dst = torch.randperm(4096, device="cuda", generator=gen)[:1500]
    mt = ref.quantize_pack(torch.zeros(1, 1, d, device="cuda"), fmt)[1].dtype
    got = (torch.zeros(4096, 8, fmt.packed_dim, dtype=torch.uint8, device="cuda"),
           torch.zeros(4096, 8, 1, 2, dtype=mt, device="cuda"))  # fmt: skip
    want = (got[0].clone(), got[1].clone())
    tqp.quantize_pack_into(hp, fmt, *got, dst, src)
    ref.quantize_pack_into(hp, fmt, *want, dst, src)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    c, m = ref.quantize_pack(hp[src].float(), fmt)
    assert torch.equal(got[0][dst], c) and torch.equal(got[1][dst], m)


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d"),
    [([0, 5, 129], [320, 0, 7], 32, 8, 128), ([4097] * 8, [320] * 8, 64, 8, 128), ([0] * 4, [100] * 4, 32, 8, 128),
     ([3000, 70], [40, 320], 16, 4, 256), ([1000, 999], [50, 51], 8, 8, 64)],
)  # fmt: skip
@pytest.mark.parametrize("planes", ["auto", "bytes", "words", "swap", "swap-one-head", "hp-short"])
def test_decode_attention_reads_fp8_windows(lens_q, lens_h, hq, hkv, d, planes):
    """fp8 window pools, widened to the bf16 queries' dtype in the 16-bit loop: within a relative
    1e-2 of the fp32 oracle on the same fp8 rows, as for bf16 windows."""
    from oscarkv.kernels.triton import decode as dec
    from oscarkv.quant.window import to_window

    changes, loop = PLANES[planes]
    p = dec.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cuda",
                 dataclasses.replace(dec.DEFAULT_TUNING, **changes))  # fmt: skip
    if loop is not None and p.lp.loop != loop:
        pytest.skip(f"{planes}: this shape takes the {p.lp.loop} loop")
    dev, fmt = "cuda", RowFormat(d, 2, d, meta_dtype="bf16")
    nq, nh = max(sum(lens_q), 1), max(sum(lens_h), 1)
    kc, km = ref.quantize_pack(torch.randn(nq, hkv, d, device=dev), fmt)
    vc, vm = ref.quantize_pack(torch.randn(nq, hkv, d, device=dev), fmt)
    hk = to_window(torch.randn(nh, hkv, d, device=dev) * torch.logspace(-4, 2, d, device=dev), F8)
    hv = to_window(torch.randn(nh, hkv, d, device=dev), F8)
    qi, qx = _lists(lens_q, dev, shuffle=True)
    hi, hx = _lists(lens_h, dev, shuffle=True)
    q = torch.randn(len(lens_q), hq, d, device=dev, dtype=torch.bfloat16) * 0.2
    scale = 1 / math.sqrt(d)
    got = dec.decode_attention(q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, fmt, fmt, plan=p)
    want = ref.decode_attention(q.float(), kc, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, fmt, fmt)
    for b in range(len(lens_q)):
        if lens_q[b] + lens_h[b] == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))
        else:
            assert _rel(got[b], want[b]) < 1e-2, (b, _rel(got[b], want[b]))
