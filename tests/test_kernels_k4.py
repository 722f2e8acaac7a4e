"""4-bit keys (values stay 2-bit): the Triton quantize_pack, dequantize and decode attention against
their torch twins.

The kernel tests run on a CUDA device (marked ``gpu``), or on the CPU under Triton's interpreter,
which must be switched on before Triton creates any kernel: on a machine without CUDA,
:func:`test_4bit_kernels_under_the_interpreter` reruns this file in a fresh process with
``TRITON_INTERPRET=1`` (tiny shapes; the GPU-only tests deselected by their mark). Tolerances as
the 2-bit tests': codes, metadata and dequantized rows bit-exact; attention within a relative 5e-3
(interpreter, fp32 queries) or 1e-2 (GPU, bf16 queries) of the fp32 oracle.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import triton
import triton.language as tl

from conftest import run_under_the_interpreter
from oscarkv.kernels import ref
from oscarkv.kernels.triton.decode import planes
from oscarkv.quant import RowFormat
from token_cases import coverage_case, drop_effects, rel, split_edges

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
DEV = "cuda" if CUDA else "cpu"
TOL = 1e-2 if CUDA else 5e-3
if INTERPRET:
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add overhead


def gpu_only(f):
    """A test for the GPU alone (long lists, the inline PTX): deselected by the interpreter run."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(f))


def kernel_test(f):
    """A test that launches Triton kernels: on CUDA (a ``gpu`` test) or under the interpreter."""
    f = pytest.mark.skipif(
        not (CUDA or INTERPRET), reason="runs on CUDA, or through test_4bit_kernels_under_the_interpreter"
    )(f)
    return pytest.mark.gpu(f) if CUDA else f


@pytest.mark.skipif(INTERPRET or torch.cuda.is_available(), reason="the kernel tests run directly here")
def test_4bit_kernels_under_the_interpreter() -> None:
    run_under_the_interpreter(__file__, "-m", "not gpu", "-k", "not under_the_interpreter", timeout=1800)


# -- quantize_pack and dequantize ---------------------------------------------------------------


def _rows(d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[30, 2, d]`` rows, three of each kind: random, the clip threshold tied with many values,
    constant, zero, all-negative, one huge outlier, tiny (the scale at its floor), +-max ties, and
    permuted integer ramps of range ``15·2^j`` (scaled by powers of two), whose values land
    exactly on the 4-bit rounding boundaries."""
    g = torch.Generator().manual_seed(seed)
    shape = (3, 2, d)
    tied = torch.randn(shape, generator=g) * 3 + 0.5
    tied[:, :, : d // 8] = 7.0
    outlier = torch.randn(shape, generator=g)
    outlier[:, :, 3] = 1e4
    both = torch.randn(shape, generator=g)
    both[:, 0, :12], both[:, 1, :12] = both[:, 0].abs().amax(-1, keepdim=True), -5.0
    m = 15 * 2 ** ((d // 15).bit_length() - 1)  # range 15·2^j: scale 2^j, boundaries on integers
    ramp = (torch.arange(d) % (m + 1) - m // 2)[torch.argsort(torch.rand(shape, generator=g), -1)].float()
    ramp = ramp * torch.tensor([1.0, 2.0**-3, 2.0**-20])[:, None, None] + torch.tensor([0.0, 0.5])[:, None]
    parts = [torch.randn(shape, generator=g) * 2 + 0.3, tied, torch.full(shape, 0.75), torch.zeros(shape),
             -(torch.rand(shape, generator=g) + 1), outlier, torch.randn(shape, generator=g) * 1e-6, both, ramp,
             ramp.abs()]  # fmt: skip
    return torch.cat(parts).to(dtype).to(DEV)


@kernel_test
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("clip", [0.0, 0.8, 0.96])
@pytest.mark.parametrize(
    ("dtype", "meta"), [(torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")]
)
def test_quantize_pack_4bit_is_bit_exact(d, clip, dtype, meta):
    """Codes ``[N, H, d/2]`` and metadata equal to the reference's, for bf16/fp16 rows (with a clip:
    the packed clip network) and fp32 rows, one clip round (0.96) and several (0.8); the codes
    dequantize as the reference does them."""
    from oscarkv.kernels.triton.dequantize import dequantize
    from oscarkv.kernels.triton.quantize_pack import quantize_pack

    fmt = RowFormat(d, 4, d, clip=clip, meta_dtype=meta)
    x = _rows(d, dtype, d + int(clip * 100))
    c1, m1 = quantize_pack(x, fmt)
    c2, m2 = ref.quantize_pack(x, fmt)
    assert c1.shape == (x.shape[0], 2, d // 2) and torch.equal(c1, c2) and torch.equal(m1, m2)
    assert int(c1.max()) >= 0xF0  # the high nibbles are written (15 in the top half)
    assert torch.equal(dequantize(c1, m1, fmt), ref.dequantize(c1, m1, fmt))


@kernel_test
@pytest.mark.parametrize(("d", "clip", "dtype"), [(128, 0.0, torch.float32), (64, 0.92, torch.bfloat16)])
def test_quantize_pack_4bit_non_finite_rows_match_reference(d, clip, dtype):
    """A NaN, all +inf, one +inf, one -inf, three +inf per row: the reference's codes (all 0 where
    the scale is not finite) and NaN metadata in the same places."""
    from oscarkv.kernels.triton.quantize_pack import quantize_pack

    fmt = RowFormat(d, 4, d, clip=clip)
    x = torch.randn(6, 1, d)
    x[2], x[3, :, 7], x[4, :, 9], x[5, :, :3] = math.inf, math.inf, -math.inf, math.inf
    x[1, :, 5] = math.nan
    x = x.to(dtype).to(DEV)
    c1, m1 = quantize_pack(x, fmt)
    c2, m2 = ref.quantize_pack(x, fmt)
    assert torch.equal(c1, c2) and torch.equal(m1.isnan(), m2.isnan())
    assert torch.equal(m1.nan_to_num(0.0), m2.nan_to_num(0.0)) and m1[1:3].isnan().all()


@kernel_test
@pytest.mark.parametrize("d", [64, 256])
# bf16 on the GPU only: the interpreter truncates fp32 to bf16 where the GPU rounds
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16] + [torch.bfloat16] * CUDA)
def test_dequantize_4bit_matches_reference(d, out_dtype):
    """Every code byte, random (scale, zero) pairs: exactly the reference's rows."""
    from oscarkv.kernels.triton.dequantize import dequantize

    fmt = RowFormat(d, 4, d)
    g = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 256, (70, 3, d // 2), dtype=torch.uint8, generator=g)
    codes[0, 0] = torch.arange(d // 2, dtype=torch.uint8) * (512 // d)
    meta = torch.stack([torch.rand(70, 3, 1, generator=g) + 0.01, torch.rand(70, 3, 1, generator=g) * 15], -1)
    codes, meta = codes.to(DEV), meta.half().to(DEV)
    got = dequantize(codes, meta, fmt, out_dtype)
    assert got.shape == (70, 3, d) and torch.equal(got, ref.dequantize(codes, meta, fmt, out_dtype))


@kernel_test
def test_quantize_and_dequantize_refuse_what_they_do_not_implement():
    from oscarkv.kernels.triton.dequantize import dequantize
    from oscarkv.kernels.triton.quantize_pack import quantize_pack

    x = torch.randn(4, 1, 64, device=DEV)
    for fmt in (RowFormat(64, 3, 64), RowFormat(64, 4, 32), RowFormat(64, 4, 64, quantizer="symmetric")):
        with pytest.raises(ValueError, match="backend='torch'"):
            quantize_pack(x, fmt)
    with pytest.raises(ValueError, match="backend='torch'"):
        dequantize(
            torch.zeros(4, 1, 32, dtype=torch.uint8, device=DEV), torch.ones(4, 1, 2, 2), RowFormat(64, 4, 32)
        )


# -- decode attention -----------------------------------------------------------------------------


def _tuned(**changes):
    from oscarkv.kernels.triton.decode import DEFAULT_TUNING

    return dataclasses.replace(DEFAULT_TUNING, **changes)


def _lists(lens: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = sum(lens)
    return indptr.to(DEV), torch.randperm(max(n, 1), generator=g)[:n].to(torch.int32).to(DEV)


def _case(lens_q, lens_h, hq, hkv, d, meta="fp16", q_scale=1.0, k_grow=1.0, seed=0):
    """``decode_attention``'s arguments with 4-bit keys and 2-bit values: random pools, shuffled
    slot lists (``k_grow``: the later half of the list's keys that much larger, in list order)."""
    g = torch.Generator().manual_seed(seed)
    kf, vf = RowFormat(d, 4, d, meta_dtype=meta), RowFormat(d, 2, d, meta_dtype=meta)
    nq, nh = max(sum(lens_q), 1), max(sum(lens_h), 1)
    k = torch.randn(nq, hkv, d, generator=g)
    k[nq // 2 :] *= k_grow
    kc, km = ref.quantize_pack(k.to(DEV), kf)
    vc, vm = ref.quantize_pack(torch.randn(nq, hkv, d, generator=g).to(DEV), vf)
    hp = torch.bfloat16 if CUDA else torch.float32
    hk = torch.randn(nh, hkv, d, generator=g).to(DEV, hp)
    hv = torch.randn(nh, hkv, d, generator=g).to(DEV, hp)
    qi, qx = _lists(lens_q, g)
    if k_grow != 1.0:  # list order = slot order, so that the scores grow along each list
        qx = torch.arange(sum(lens_q), dtype=torch.int32, device=DEV)
    hi, hx = _lists(lens_h, g)
    q = (torch.randn(len(lens_q), hq, d, generator=g) * q_scale).to(DEV, hp)
    return (q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, 1 / math.sqrt(d), kf, vf)


def _check(args, lens_q, lens_h, tol=TOL, **plan_kw):
    """The kernel against the reference per sequence; returns the plan it ran (key_bits=4: bytes)."""
    from oscarkv.kernels.triton import decode as dec

    q, hq, d = args[0], args[0].shape[1], args[0].shape[2]
    p = dec.plan(len(lens_q), hq, args[5].shape[1], d, (max(lens_q), max(lens_h)), DEV, key_bits=4, **plan_kw)
    assert p.lp.loop == "bytes" and p.key_bits == 4
    got = dec.decode_attention(*args, plan=p)
    want = ref.decode_attention(q.float(), *args[1:5], args[5].float(), args[6].float(), *args[7:])
    assert torch.isfinite(got).all()
    for b in range(len(lens_q)):
        if lens_q[b] + lens_h[b] == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))
        else:
            assert rel(got[b], want[b]) < tol, (b, rel(got[b], want[b]))
    return p


@kernel_test
@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "meta"),
    [
        ([1], [1], 4, 4, 64, "fp16"),  # a single token per tier, MHA
        ([70, 0, 129], [5, 9, 0], 4, 1, 64, "fp16"),  # empty tiers, lengths not multiples of the block
        ([0, 0], [0, 3], 4, 1, 64, "fp16"),  # a sequence with no tokens at all
        ([90, 40], [7, 2], 8, 8, 128, "bf16"),  # metadata as int32 words, bf16 halves
        ([60, 33], [4, 0], 32, 8, 128, "fp32"),  # metadata as int64 words; Qwen3-8B's GQA
        ([300], [20], 8, 2, 128, "fp16"),  # several splits
        ([50], [3], 4, 4, 256, "fp16"),  # head dim 256
    ],
)
@pytest.mark.parametrize("tuning", ["auto", "grouped", "big"])
def test_decode_attention_4bit_keys_matches_reference(lens_q, lens_h, hq, hkv, d, meta, tuning):
    """``grouped``: several KV heads per program at any size; ``big``: sizes at which 2-bit keys take
    the word or swap loop, which 4-bit keys never do."""
    t = {"auto": {}, "grouped": {"group_tokens": 0}, "big": {"small_tokens": 0, "swap_max_tokens": 0}}[tuning]
    p = _check(_case(lens_q, lens_h, hq, hkv, d, meta), lens_q, lens_h, tuning=_tuned(**t))
    if tuning == "grouped" and hq // hkv in (1, 4) and hkv > 1:
        assert p.lp.hpb > 1


@kernel_test
def test_decode_attention_4bit_keys_rescales_past_the_first_tile():
    """Scores that grow along the list (queries x30, the later half of the keys x4), one split: the
    lazy rescale must fire after the first tile, or fp16 probabilities overflow. Scores in the
    hundreds magnify the fp16 query rounding (as for 2-bit keys)."""
    lens_q = [600]
    args = _case(lens_q, [4], 32, 8, 128, q_scale=30.0, k_grow=4.0)
    p = _check(args, lens_q, [4], tuning=_tuned(programs=1, programs_few=1))
    assert p.n_q_splits == 1


@kernel_test
def test_decode_attention_4bit_keys_plans_and_refusals():
    """Without a plan one is made for the key width (the same result as a 4-bit plan); a plan that
    takes another loop, 4-bit values, 3-bit keys and key pools of the 2-bit width are refused."""
    from oscarkv.kernels.triton import decode as dec

    lens = [40, 7]
    args = _case(lens, [3, 2], 8, 2, 128)
    q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, kf, vf = args
    p4 = dec.plan(2, 8, 2, 128, (40, 3), DEV, key_bits=4)
    assert torch.equal(dec.decode_attention(*args), dec.decode_attention(*args, plan=p4))
    assert torch.equal(dec.decode_attention(*args, lens_hint=(40, 3)), dec.decode_attention(*args, plan=p4))
    swap = dec.plan(2, 8, 2, 128, (40, 3), DEV, _tuned(small_tokens=0))
    assert swap.lp.loop != "bytes"
    with pytest.raises(ValueError, match="4-bit keys are read by the byte loop only"):
        dec.decode_attention(*args, plan=swap)
    with pytest.raises(ValueError, match="2-bit affine value rows"):
        dec.decode_attention(*args[:-1], RowFormat(128, 4, 128))
    with pytest.raises(ValueError, match="got 3-bit keys"):
        dec.decode_attention(*args[:-2], RowFormat(128, 3, 128), vf)
    narrow = torch.zeros(kc.shape[0], 2, 32, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match=r"k_codes must be uint8 \[N, 2, 64\]"):
        dec.decode_attention(q, narrow, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, kf, vf)
    with pytest.raises(ValueError, match=r"v_codes must be uint8 \[N, 2, 32\]"):
        dec.decode_attention(q, kc, km, kc, vm, hk, hv, qi, qx, hi, hx, scale, kf, vf)


def test_plan_for_4bit_keys_takes_the_byte_loop():
    """No kernel: ``plan(..., key_bits=4)`` takes the byte loop at every size (grouping heads as the
    byte loop does), records the width, and refuses other widths; 2 stays the default."""
    from oscarkv.kernels.triton import decode as dec
    from oscarkv.kernels.triton.decode import planner

    for b, n, d in ((1, 100, 64), (8, 40000, 128), (32, 131072, 128), (4, 5000, 256)):
        p2 = dec.plan(b, 32, 8, d, (n, 320), "cpu", _tuned(sms=132))
        p4 = dec.plan(b, 32, 8, d, (n, 320), "cpu", _tuned(sms=132), key_bits=4)
        assert p2.key_bits == 2 and p4.key_bits == 4 and p4.lp.loop == "bytes" and not p4.hp_first
        assert p4.lp == planner.int2_loop(d, 4, 8, b * n, _tuned(small_tokens=1 << 40))
        if p2.lp.loop == "bytes":
            assert p4 == dataclasses.replace(p2, key_bits=4)
    with pytest.raises(ValueError, match="key_bits must be 2 or 4"):
        dec.plan(1, 4, 4, 64, (10, 10), key_bits=3)


# -- GPU only ------------------------------------------------------------------------------------


@triton.jit
def _nibble_probe(C, OUT, N: tl.constexpr, ASM: tl.constexpr):
    offs = tl.program_id(0) * 256 + tl.arange(0, 256)
    a, b = planes.nibble_planes(tl.load(C + offs), ASM)
    tl.store(OUT + offs, a.to(tl.int16, bitcast=True).to(tl.int32))
    tl.store(OUT + N + offs, b.to(tl.int16, bitcast=True).to(tl.int32))


@gpu_only
def test_nibble_planes_ptx_equals_the_integer_twin():
    """The inline-PTX nibble planes (what the GPU runs) against the integer ops (what the
    interpreter runs), bit for bit, over every code byte: ``c & 0x0F`` and ``c & 0xF0``."""
    byte = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8)
    got = {}
    for asm in (True, False):
        out = torch.full((2, 256), -7, device="cuda", dtype=torch.int32)
        _nibble_probe[(1,)](byte, out, N=256, ASM=asm)
        got[asm] = out
    assert torch.equal(got[True], got[False])
    assert torch.equal(got[True].cpu(), torch.stack([torch.arange(256) & 15, torch.arange(256) & 240]).int())


@gpu_only
@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d"),
    [
        ([0, 5, 129], [320, 0, 7], 32, 8, 128),
        ([4097] * 8, [320] * 8, 64, 8, 128),
        ([1000, 999], [50, 51], 8, 8, 64),
        ([513] * 64, [0] * 64, 32, 8, 128),
        ([131072 - 320], [320], 32, 8, 128),
        ([3000, 70], [40, 320], 16, 4, 256),
        ([5000, 70], [30, 320], 12, 4, 128),  # g = 3: a padding head
        ([32768 - 320] * 8, [320] * 8, 32, 8, 128),  # grouped heads (from group_tokens)
    ],
)
@pytest.mark.parametrize("meta", ["fp16", "bf16"])
def test_decode_attention_4bit_keys_matches_reference_on_the_gpu(lens_q, lens_h, hq, hkv, d, meta):
    _check(_case(lens_q, lens_h, hq, hkv, d, meta), lens_q, lens_h)


@gpu_only
@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d"),
    [([131072 - 320], [320], 32, 8, 128), ([8192 - 320 - 11 * i for i in range(32)], [320] * 32, 32, 8, 128),
     ([32768 - 320] * 4, [320] * 4, 16, 4, 256)],
)  # fmt: skip
def test_decode_attention_4bit_keys_sees_every_token(lens_q, lens_h, hq, hkv, d):
    """Zero queries (``token_cases``): the exact mean of both lists' values, closer than a third of
    what losing or repeating the first or last token of any INT2 split would change."""
    from oscarkv.kernels.triton import decode as dec

    args, want, _ = coverage_case(lens_q, lens_h, hq, hkv, d, "cuda")
    p = dec.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cuda", key_bits=4)
    edges = split_edges(p, lens_q)
    effects = drop_effects(args, want, edges)  # with the 2-bit value format in args
    k4 = torch.randint(0, 256, (*args[1].shape[:2], d // 2), dtype=torch.uint8, device="cuda")
    got = dec.decode_attention(*args[:1], k4, *args[2:12], RowFormat(d, 4, d), args[13], plan=p)
    for (s, pos), effect in zip(edges, effects, strict=True):
        assert rel(got[s], want[s]) < effect / 3, (s, pos, rel(got[s], want[s]), effect)


@gpu_only
@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantize_pack_4bit_is_bit_exact_on_many_rows(d):
    """Many random rows at every clip round count, packed (PTX pairs) and fp32 clip networks."""
    from oscarkv.kernels.triton.quantize_pack import quantize_pack

    g = torch.Generator().manual_seed(d)
    for clip in (0.0, 0.8, 0.92, 0.96):
        for dtype, meta in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
            fmt = RowFormat(d, 4, d, clip=clip, meta_dtype=meta)
            x = torch.cat([(torch.randn(4000, 8, d, generator=g) * 2 + 0.2).to(DEV, dtype), _rows(d, dtype, d)[:, :1]
                           .expand(-1, 8, -1)])  # fmt: skip
            c1, m1 = quantize_pack(x, fmt)
            c2, m2 = ref.quantize_pack(x, fmt)
            assert torch.equal(c1, c2) and torch.equal(m1, m2), (clip, dtype)
