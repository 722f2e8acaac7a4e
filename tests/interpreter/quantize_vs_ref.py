"""Triton quantize_pack, dequantize and rotations against their torch twins, on the CPU through
Triton's interpreter (tiny shapes).

Run by ``tests/test_kernels_triton.py`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (the
switch must be set before Triton creates any kernel, which other tests' imports could do first).
Tolerances: codes and metadata bit-exact; dequantized rows exact; rotated rows one rounding step.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run through tests/test_kernels_triton.py (needs TRITON_INTERPRET=1)", allow_module_level=True
    )

import triton
import triton.language as tl

from oscarkv.kernels import ref
from oscarkv.kernels.triton.dequantize import dequantize
from oscarkv.kernels.triton.quantize_nets import clip_threshold
from oscarkv.quant import RowFormat

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tk():
    from oscarkv.kernels.triton import quantize_pack

    return quantize_pack, None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize(("d", "clip"), [(64, 0.92), (64, 0.0), (128, 0.96)])
def test_quantize_pack_is_bit_exact(tk, d, clip):
    qp, _ = tk
    fmt = RowFormat(d, 2, d, clip=clip)
    x = torch.randn(37, 2, d) * 3 + 0.5
    x[0, 0, :5] = 7.0  # ties at the clip threshold
    c1, m1 = qp.quantize_pack(x, fmt)
    c2, m2 = ref.quantize_pack(x, fmt)
    assert torch.equal(c1, c2) and torch.equal(m1, m2)
    assert torch.equal(dequantize(c1, m1, fmt), ref.dequantize(c1, m1, fmt))


@pytest.mark.parametrize(("d", "clip", "dtype"), [(128, 0.0, torch.float32), (128, 0.96, torch.bfloat16),
                                              (128, 0.92, torch.bfloat16), (64, 0.8, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("meta", ["fp16", "bf16", "fp32"])
def test_quantize_pack_non_finite_rows_match_reference(tk, d, clip, dtype, meta):
    """NaN and infinities (a NaN, all +inf, one +inf, one -inf, three +inf per row): the
    reference's codes and scale/zero, NaN in the same places (a row holding NaN: NaN, not a
    finite scale that would hide it). The NaN is the GPU's, 0x7FFFFFFF (numpy's is 0x7FC00000),
    whose bf16 rounding must not carry into the sign bit."""
    qp, _ = tk
    fmt = RowFormat(d, 2, d, clip=clip, meta_dtype=meta)
    x = torch.randn(6, 1, d)
    x[2], x[3, :, 7], x[4, :, 9], x[5, :, :3] = math.inf, math.inf, -math.inf, math.inf
    x.view(torch.int32)[1, :, 5] = 0x7FFFFFFF
    c1, m1 = qp.quantize_pack(x.to(dtype), fmt)
    c2, m2 = ref.quantize_pack(x.to(dtype), fmt)
    assert torch.equal(c1, c2) and torch.equal(m1.isnan(), m2.isnan())
    assert torch.equal(m1.nan_to_num(0.0), m2.nan_to_num(0.0)) and m1[1:3].isnan().all()


def _adversarial_rows(d: int, dtype: torch.dtype) -> torch.Tensor:
    """``[33, 2, d]`` rows, three of each kind: the clip threshold tied with many values, rows
    drawn from a tiny set of values, constant, zero, all-positive and all-negative rows, one huge
    outlier, rows so small that the scale sits at its floor, +-max ties, and permuted integer
    ramps (scaled by powers of two), whose values land exactly on rounding boundaries."""
    g = torch.Generator().manual_seed(d)
    shape = (3, 2, d)
    tied = torch.randn(shape, generator=g) * 3 + 0.5
    tied[:, :, : d // 8] = 7.0
    few = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0])[torch.randint(0, 8, shape, generator=g)]
    outlier = torch.randn(shape, generator=g)
    outlier[:, :, 3] = 1e4
    both = torch.randn(shape, generator=g)
    both[:, 0, :12], both[:, 1, :12] = both[:, 0].abs().amax(-1, keepdim=True), -5.0
    m = 3 * 2 ** ((d // 3).bit_length() - 1)  # range 3·2^j: scale 2^j, boundaries on integers
    ramp = (torch.arange(d) % (m + 1) - m // 2)[torch.argsort(torch.rand(shape, generator=g), -1)].float()
    ramp = ramp * torch.tensor([1.0, 2.0**-3, 2.0**-20])[:, None, None] + torch.tensor([0.0, 0.5])[:, None]
    parts = [tied, few, torch.full(shape, 0.75), torch.zeros(shape), torch.rand(shape, generator=g) + 0.1,
             -(torch.rand(shape, generator=g) + 1), outlier, torch.randn(shape, generator=g) * 1e-6, both,
             ramp, ramp.abs()]  # fmt: skip
    return torch.cat(parts).to(dtype)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("clip", [0.0, 0.8, 0.92, 0.96])
def test_quantize_pack_is_bit_exact_on_adversarial_rows(tk, d, clip):
    qp, _ = tk
    for meta in ("fp16", "bf16", "fp32"):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            fmt = RowFormat(d, 2, d, clip=clip, meta_dtype=meta)
            x = _adversarial_rows(d, dtype)
            c1, m1 = qp.quantize_pack(x, fmt)
            c2, m2 = ref.quantize_pack(x, fmt)
            assert torch.equal(c1, c2) and torch.equal(m1, m2), (meta, dtype)


def _launches(qp, monkeypatch) -> list[dict]:
    """The keyword arguments (constexprs) of each later ``_quantize_pack`` launch."""
    seen, launch = [], qp._QUANTIZE_PACK

    def spy(grid, *args, **kwargs):
        seen.append(kwargs)
        return launch(grid, *args, **kwargs)

    monkeypatch.setattr(qp, "_QUANTIZE_PACK", spy)
    return seen


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("clip", [0.0, 0.8, 0.92, 0.96])
def test_quantize_pack_packed_network_is_bit_exact(tk, d, clip, monkeypatch):
    """The clip network on packed pairs of the rows' bf16/fp16 values (``packed``), here at every
    round count (``ROUNDS > 1``: the drop value and the counts on int16 bit patterns), on the
    adversarial rows (ties at the threshold and across rounds, zero, constant and few-valued rows,
    a huge outlier, ...) and on rows with ten values of |x| 3 of either sign."""
    qp, _ = tk
    tuning = dataclasses.replace(qp.DEFAULT_TUNING, packed_rounds=99)
    seen = _launches(qp, monkeypatch)
    g = torch.Generator().manual_seed(d + 1)
    for dtype in (torch.bfloat16, torch.float16):
        fmt = RowFormat(d, 2, d, clip=clip, meta_dtype="bf16")
        signed = torch.randn(4, 2, d, generator=g)
        signed[:, :, :10] = 3.0 * (torch.rand(4, 2, 10, generator=g) - 0.5).sign()
        x = torch.cat([_adversarial_rows(d, dtype), signed.to(dtype)])
        c1, m1 = qp.quantize_pack(x, fmt, tuning)
        c2, m2 = ref.quantize_pack(x, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2), dtype
    assert [k["PACKED"] for k in seen] == [clip > 0] * 2


def test_quantize_pack_takes_the_packed_network_where_it_is_exact(tk, monkeypatch):
    """Packed only for bf16/fp16 rows with clipping, 16-byte aligned, up to ``packed_rounds``
    rounds, and never with ``packed`` off."""
    qp, _ = tk
    seen = _launches(qp, monkeypatch)
    buf = torch.randn(9 * 2 * 128 + 1).bfloat16()
    x, odd = buf[:-1].view(9, 2, 128), buf[1:].view(9, 2, 128)
    wide = torch.randn(9, 2, 132).bfloat16()[..., :128]  # rows 264 bytes apart: not all 16-byte aligned
    cases = [(x, 0.96, True), (x.half(), 0.96, True), (x.float(), 0.96, False), (x, 0.0, False),
             (x, 0.92, True),  # one round of 12
             (x, 0.8, False),  # 3 rounds
             (odd, 0.96, False), (wide, 0.96, False)]  # rows at a 2-byte offset  # fmt: skip
    for rows, clip, _ in cases:
        fmt = RowFormat(128, 2, 128, clip=clip)
        c1, m1 = qp.quantize_pack(rows, fmt)
        c2, m2 = ref.quantize_pack(rows, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2)
    assert [k["PACKED"] for k in seen] == [want for *_, want in cases]
    qp.quantize_pack(x, RowFormat(128, 2, 128, clip=0.92), dataclasses.replace(qp.DEFAULT_TUNING, round_k=6))
    assert (seen[-1]["PACKED"], seen[-1]["ROUNDS"], seen[-1]["TOP_K"]) == (False, 2, 6)  # two rounds of 6
    qp.quantize_pack(
        x, RowFormat(128, 2, 128, clip=0.96), dataclasses.replace(qp.DEFAULT_TUNING, packed=False)
    )
    assert seen[-1]["PACKED"] is False


@pytest.mark.parametrize("round_k", [6, 12])
@pytest.mark.parametrize(("d", "clip"), [(128, 0.92), (64, 0.8)])
def test_quantize_pack_rounds_of_six_and_twelve_are_bit_exact(tk, round_k, d, clip, monkeypatch):
    """Clip rounds of either size (``round_k``), one or several, on the packed network (at any
    round count) and the fp32 one, on the adversarial rows (ties at the threshold and across
    rounds)."""
    qp, _ = tk
    tuning = dataclasses.replace(qp.DEFAULT_TUNING, round_k=round_k, packed_rounds=99)
    seen = _launches(qp, monkeypatch)
    fmt = RowFormat(d, 2, d, clip=clip, meta_dtype="bf16")
    for dtype in (torch.bfloat16, torch.float32):
        x = _adversarial_rows(d, dtype)
        c1, m1 = qp.quantize_pack(x, fmt, tuning)
        c2, m2 = ref.quantize_pack(x, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2), dtype
    n_drop = d - 1 - math.floor(clip * d)
    want = (round_k, -(-(n_drop + 1) // round_k))
    assert [(k["TOP_K"], k["ROUNDS"], k["PACKED"]) for k in seen] == [(*want, True), (*want, False)]


@triton.jit
def _tau_kernel(X, T, ROWS: tl.constexpr, D8: tl.constexpr, N_DROP: tl.constexpr, ROUNDS: tl.constexpr,
                TREE: tl.constexpr, K: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, ROWS)[:, None] * (8 * D8) + tl.arange(0, D8)[None, :]
    a = (tl.load(X + offs), tl.load(X + offs + D8), tl.load(X + offs + 2 * D8), tl.load(X + offs + 3 * D8),
         tl.load(X + offs + 4 * D8), tl.load(X + offs + 5 * D8), tl.load(X + offs + 6 * D8),
         tl.load(X + offs + 7 * D8))  # fmt: skip
    tl.store(T + tl.arange(0, ROWS), clip_threshold(a, N_DROP, ROUNDS, TREE, K))


@pytest.mark.parametrize("k", [6, 12])
@pytest.mark.parametrize("tree", [1, 2])
def test_clip_threshold_at_every_merge_depth(k, tree):
    """``clip_threshold`` alone at merge depths that ``quantize_pack`` takes on the GPU but not
    under the interpreter (which merges all the way in-thread), fp32 and int16 (the packed network's bit patterns, here through ``tl.maximum``), on
    4 rows of 32 small integers (ties everywhere), in one round and in several."""
    g = torch.Generator().manual_seed(k + tree)
    x = torch.randint(0, 9, (4, 32), generator=g)
    x[:2] = torch.randint(0, 2, (2, 32), generator=g) * 7  # two values
    for dtype in (torch.float32, torch.int16):
        for n_drop in (5, 10, 25):
            tau = torch.empty(4, dtype=dtype)
            rounds = -(-(n_drop + 1) // k)
            _tau_kernel[(1,)](x.to(dtype), tau, ROWS=4, D8=4, N_DROP=n_drop, ROUNDS=rounds, TREE=tree, K=k)
            assert torch.equal(tau, x.sort(1, descending=True).values[:, n_drop].to(dtype)), (dtype, n_drop)


@pytest.mark.parametrize(("d", "clip"), [(64, 0.92), (128, 0.96), (128, 0.92), (256, 0.96)])
def test_quantize_pack_is_bit_exact_on_many_random_rows(tk, d, clip):
    qp, _ = tk
    g = torch.Generator().manual_seed(d)
    for meta in ("fp16", "bf16"):
        fmt = RowFormat(d, 2, d, clip=clip, meta_dtype=meta)
        x = (torch.randn(150, 4, d, generator=g) * 2 + 0.2).bfloat16()
        c1, m1 = qp.quantize_pack(x, fmt)
        c2, m2 = ref.quantize_pack(x, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2), meta


@pytest.mark.parametrize(("d", "bits", "clip", "meta"), [(64, 2, 0.92, "fp16"), (128, 2, 0.96, "bf16"),
                                                       (128, 4, 0.0, "fp32"), (64, 4, 0.9, "fp16")])  # fmt: skip
@pytest.mark.parametrize("gather", [False, True])
def test_quantize_pack_into_gathers_and_scatters_bit_exact(tk, d, bits, clip, meta, gather):
    """``quantize_pack_into``: rows ``pool[src]`` (a demotion) or the given rows (``src`` None)
    quantized straight into pool slots ``dst``, equal to the twin; every other slot untouched."""
    qp, _ = tk
    fmt = RowFormat(d, bits, d, clip=clip, meta_dtype=meta)
    g = torch.Generator().manual_seed(d + bits)
    pool = torch.randn(40, 3, d, generator=g) * 2
    n = 9
    src = torch.randperm(40, generator=g)[:n] if gather else None
    rows = pool if gather else pool[:n]
    dst = torch.randperm(30, generator=g)[:n]
    c0 = torch.randint(0, 256, (30, 3, fmt.packed_dim), dtype=torch.uint8, generator=g)
    m0 = torch.randn(30, 3, 1, 2, generator=g).to(ref.quantize_pack(pool[:1], fmt)[1].dtype)
    got, want = (c0.clone(), m0.clone()), (c0.clone(), m0.clone())
    qp.quantize_pack_into(rows, fmt, *got, dst, src)
    ref.quantize_pack_into(rows, fmt, *want, dst, src)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    c, m = ref.quantize_pack(rows[src] if gather else rows, fmt)
    assert torch.equal(want[0][dst], c) and torch.equal(want[1][dst], m)
    rest = torch.ones(30, dtype=torch.bool)
    rest[dst] = False
    assert torch.equal(got[0][rest], c0[rest]) and torch.equal(got[1][rest], m0[rest])
    with pytest.raises(ValueError, match="meta must be"):
        qp.quantize_pack_into(
            rows, fmt, got[0], got[1].float() if meta != "fp32" else got[1].half(), dst, src
        )


@pytest.mark.parametrize(("d", "meta"), [(128, "bf16"), (64, "fp32")])
def test_quantize_pack_into_interleaved_pools_bit_exact(tk, d, meta):
    """Pools as vLLM's pages lay them out: one row per token holding ``[k_meta | codes]`` (token
    stride the whole row), 16-bit rows interleaving K and V: the same bytes as the twin."""
    qp, _ = tk
    fmt = RowFormat(d, 2, d, clip=0.9, meta_dtype=meta)
    mt = ref.quantize_pack(torch.zeros(1, 1, d), fmt)[1].dtype
    g = torch.Generator().manual_seed(d)
    h, s, n = 3, 20, 7
    mb = h * 2 * mt.itemsize
    row = mb + h * fmt.packed_dim + 4  # padding bytes at the end of each token's row
    hp = torch.randn(30, 2, h, d, generator=g)[:, 0]  # K rows of a [slots, (K, V), H, d] store
    src, dst = torch.randperm(30, generator=g)[:n], torch.randperm(s, generator=g)[:n]
    base = torch.randint(0, 256, (s, row), dtype=torch.uint8, generator=g)
    pages = [base.clone(), base.clone()]

    def views(p):
        meta_v = p[:, :mb].view(mt).view(s, h, 1, 2)
        return p[:, mb : mb + h * fmt.packed_dim].view(s, h, fmt.packed_dim), meta_v

    qp.quantize_pack_into(hp, fmt, *views(pages[0]), dst, src)
    ref.quantize_pack_into(hp, fmt, *views(pages[1]), dst, src)
    assert torch.equal(pages[0], pages[1]) and not torch.equal(pages[0], base)
    c, m = ref.quantize_pack(hp[src], fmt)
    assert torch.equal(views(pages[0])[0][dst], c) and torch.equal(views(pages[0])[1][dst], m)


def test_triton_refuses_formats_it_does_not_implement(tk):
    qp, _ = tk
    with pytest.raises(ValueError, match="backend='torch'"):
        qp.quantize_pack(torch.randn(4, 1, 64), RowFormat(64, 3, 64))  # 4-bit rows: tests/test_kernels_k4.py
    with pytest.raises(ValueError, match="backend='torch'"):
        qp.quantize_pack(torch.randn(4, 1, 64), RowFormat(64, 2, 16))


def _rotation(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float()


@pytest.mark.parametrize("d", [16, 64, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_heads_matches_reference(d, per_head, inverse, dtype, close_rotations):
    """fp32 products in another order: at most one rounding step apart in the output dtype (the
    interpreter truncates to bf16 where the GPU rounds to nearest, so a bf16 ulp here)."""
    from oscarkv.kernels.triton.rotate import rotate_heads

    r = _rotation(d, d)
    if per_head:  # 8 heads sharing 4 matrices, in pairs
        r = torch.stack([r, r.T, -r, r.flip(0)])
    x = torch.randn(17, 8, d, generator=torch.Generator().manual_seed(1)).to(dtype)  # 17: two batch blocks
    got, want = rotate_heads(x, r, inverse), ref.rotate_heads(x, r, inverse)
    close_rotations(got, want)


@pytest.mark.parametrize("d", [16, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotate_rows_matches_reference(d, per_head, dtype, close_rotations):
    """A prefill's rows (70: two 64-row blocks) in both directions. bf16 rows run the kernel's exact
    three-piece split of R (here with fp32 dots, as the interpreter's bf16 dot is wrong)."""
    from oscarkv.kernels.triton.rotate import rotate_rows

    r = _rotation(d, d + 1)
    if per_head:
        r = torch.stack([r, r.T, -r, r.flip(0)])
    x = torch.randn(70, 8, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    strided = torch.randn(70, 12, d).to(dtype)[:, 2:10]  # heads of a wider tensor: not contiguous

    def close(got, want):
        assert got.dtype == dtype and got.shape == want.shape
        if dtype == torch.float16:  # one fp16 rounding step
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-10, atol=1e-5)
        else:
            close_rotations(got, want)

    for inverse in (False, True):
        close(rotate_rows(x, r, inverse), ref.rotate_rows(x, r, inverse))
    close(rotate_rows(strided, r), ref.rotate_rows(strided, r))
    assert rotate_rows(x, None) is x and ref.rotate_rows(x, None) is x


@pytest.mark.parametrize("rotate", [True, False])
def test_rotate_heads_scatters_rows_to_their_slots(rotate, close_rotations):
    from oscarkv.kernels.triton.rotate import rotate_heads

    d = 64
    r = _rotation(d, 3) if rotate else None
    x = torch.randn(5, 4, d).bfloat16()
    dst = torch.tensor([7, -1, 0, 3, -1])
    pool = torch.randn(9, 4, d).bfloat16()
    got = rotate_heads(x, r, False, pool.clone(), dst)
    want = ref.rotate_heads(x, r, False, pool.clone(), dst)
    close_rotations(got, want)
    untouched = torch.tensor([1, 2, 4, 5, 6, 8])
    assert torch.equal(got[untouched], pool[untouched])  # slots of -1 and other slots kept
    if not rotate:
        assert torch.equal(got[torch.tensor([7, 0, 3])], x[torch.tensor([0, 2, 3])])


def test_rotate_heads_refuses_bad_arguments():
    from oscarkv.kernels.triton.rotate import rotate_heads

    x = torch.randn(2, 4, 64).bfloat16()
    with pytest.raises(ValueError, match="r must be float32"):
        rotate_heads(x, torch.eye(64).bfloat16())
    with pytest.raises(ValueError, match="4 heads cannot share 3"):
        rotate_heads(x, torch.eye(64).repeat(3, 1, 1))
    with pytest.raises(ValueError, match="out and dst go together"):
        rotate_heads(x, None, False, torch.zeros(3, 4, 64))
    with pytest.raises(ValueError, match="head dims 16-256"):
        rotate_heads(torch.randn(2, 4, 48), None)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(("k_mats", "v_mats"), [(0, 0), (2, 2), (0, 2), (1, 2), (2, 1), (1, 0), (2, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_new_rows_matches_reference(d, k_mats, v_mats, dtype, close_rotations):
    """``k_mats``/``v_mats``: 0 a shared [d, d] matrix, n per-head [n, d, d] (K and V may differ),
    None no value rotation."""
    from oscarkv.kernels.triton.rotate import rotate_new_rows

    def mats(n, seed):
        r = _rotation(d, seed)
        return r if n == 0 else torch.stack([r if i % 2 == 0 else r.T for i in range(n)])

    r_k, r_v = mats(k_mats, 5), (None if v_mats is None else mats(v_mats, 6))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(17, 8, d, generator=gen).to(dtype)
    k, v = torch.randn(17, 2, d, generator=gen).to(dtype), torch.randn(17, 2, d, generator=gen).to(dtype)
    dst = torch.tensor([3 * i if i % 4 else -1 for i in range(17)], dtype=torch.int32)
    pools = [torch.randn(60, 2, d, generator=gen).to(dtype) for _ in range(2)]
    got_k, got_v = pools[0].clone(), pools[1].clone()
    want_k, want_v = pools[0].clone(), pools[1].clone()
    got = rotate_new_rows(q, k, v, r_k, r_v, got_k, got_v, dst)
    want = ref.rotate_new_rows(q, k, v, r_k, r_v, want_k, want_v, dst.long())
    for a, b in ((got, want), (got_k, want_k), (got_v, want_v)):
        close_rotations(a, b)
    assert torch.equal(got_k[1], pools[0][1])  # a slot no row targets is untouched
    empty = rotate_new_rows(q[:0], k[:0], v[:0], r_k, r_v, got_k, got_v, dst[:0])
    assert empty.shape == (0, 8, d)


def test_rotate_kernels_refuse_outputs_they_cannot_address():
    from oscarkv.kernels.triton.rotate import rotate_heads, rotate_new_rows

    x, dst = torch.randn(2, 4, 64).bfloat16(), torch.tensor([0, 1])
    strided = torch.zeros(3, 4, 128).bfloat16()[:, :, ::2]
    with pytest.raises(ValueError, match="out must have unit stride in its last dim"):
        rotate_heads(x, None, False, strided, dst)
    q, kv = torch.randn(2, 8, 64).bfloat16(), torch.randn(2, 4, 64).bfloat16()
    pool = torch.zeros(3, 4, 64).bfloat16()
    with pytest.raises(ValueError, match="k_out and v_out must share one layout"):
        rotate_new_rows(q, kv, kv, torch.eye(64), None, pool, strided, dst)
