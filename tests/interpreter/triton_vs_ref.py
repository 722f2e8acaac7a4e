"""Triton kernels against their torch twins, on the CPU through Triton's interpreter (tiny shapes).

Run by ``tests/test_kernels_triton.py`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (the
switch must be set before Triton creates any kernel, which other tests' imports could do first).
The same comparisons run at real shapes on the GPU in ``benchmarks/gpu_check.py``.
Tolerances: codes and metadata bit-exact; dequantized rows exact; attention outputs within a
relative 5e-3 of the fp32 oracle (the kernel rounds the softmax weights to fp16 for the V dot).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run through tests/test_kernels_triton.py (needs TRITON_INTERPRET=1)", allow_module_level=True
    )
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from oscarkv.kernels import ref  # noqa: E402
from oscarkv.kernels.triton.decode_tiles import taper_range  # noqa: E402
from oscarkv.kernels.triton.dequantize import dequantize  # noqa: E402
from oscarkv.kernels.triton.quantize_nets import _clip_threshold  # noqa: E402
from oscarkv.quant import RowFormat  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tk():
    from oscarkv.kernels.triton import decode_attention, quantize_pack

    return quantize_pack, decode_attention


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize(("d", "clip"), [(64, 0.92), (64, 0.0), (128, 0.96)])
def test_quantize_pack_is_bit_exact(tk, d, clip):
    qp, _ = tk
    fmt = RowFormat(d, 2, d, clip=clip)
    x = torch.randn(37, 2, d) * 3 + 0.5
    x[0, 0, :5] = 7.0  # ties at the clip threshold
    c1, m1 = qp.quantize_pack(x, None, fmt)
    c2, m2 = ref.quantize_pack(x, None, fmt)
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
    c1, m1 = qp.quantize_pack(x.to(dtype), None, fmt)
    c2, m2 = ref.quantize_pack(x.to(dtype), None, fmt)
    assert torch.equal(c1, c2) and torch.equal(m1.isnan(), m2.isnan())
    assert torch.equal(m1.nan_to_num(0.0), m2.nan_to_num(0.0)) and m1[1:3].isnan().all()


def test_quantize_pack_with_rotation(tk):
    qp, _ = tk
    fmt = RowFormat(64, 2, 64, clip=0.9)
    x = torch.randn(20, 2, 64)
    r = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))[0].float()
    c1, m1 = qp.quantize_pack(x, r, fmt)
    c2, m2 = ref.quantize_pack(x, r, fmt)
    assert (c1 == c2).float().mean() > 0.99
    assert _rel(ref.dequantize(c1, m1, fmt), ref.dequantize(c2, m2, fmt)) < 1e-2


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
            c1, m1 = qp.quantize_pack(x, None, fmt)
            c2, m2 = ref.quantize_pack(x, None, fmt)
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
    """The clip network on packed pairs of the rows' bf16/fp16 values (``PACKED``), here at every
    round count (``ROUNDS > 1``: the drop value and the counts on int16 bit patterns), on the
    adversarial rows (ties at the threshold and across rounds, zero, constant and few-valued rows,
    a huge outlier, ...) and on rows with ten values of |x| 3 of either sign."""
    qp, _ = tk
    monkeypatch.setattr(qp, "PACKED_ROUNDS", 99)
    seen = _launches(qp, monkeypatch)
    g = torch.Generator().manual_seed(d + 1)
    for dtype in (torch.bfloat16, torch.float16):
        fmt = RowFormat(d, 2, d, clip=clip, meta_dtype="bf16")
        signed = torch.randn(4, 2, d, generator=g)
        signed[:, :, :10] = 3.0 * (torch.rand(4, 2, 10, generator=g) - 0.5).sign()
        x = torch.cat([_adversarial_rows(d, dtype), signed.to(dtype)])
        c1, m1 = qp.quantize_pack(x, None, fmt)
        c2, m2 = ref.quantize_pack(x, None, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2), dtype
    assert [k["PACKED"] for k in seen] == [clip > 0] * 2


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # bf16 tl.dot
def test_quantize_pack_takes_the_packed_network_where_it_is_exact(tk, monkeypatch):
    """Packed only for bf16/fp16 rows without rotation, with clipping, 16-byte aligned, up to
    ``PACKED_ROUNDS`` rounds, and never with ``PACKED`` off."""
    qp, _ = tk
    seen = _launches(qp, monkeypatch)
    buf = torch.randn(9 * 2 * 128 + 1).bfloat16()
    x, odd = buf[:-1].view(9, 2, 128), buf[1:].view(9, 2, 128)
    wide = torch.randn(9, 2, 132).bfloat16()[..., :128]  # rows 264 bytes apart: not all 16-byte aligned
    r = torch.eye(128)
    cases = [(x, None, 0.96, True), (x.half(), None, 0.96, True), (x.float(), None, 0.96, False),
             (x, r, 0.96, False), (x, None, 0.0, False), (x, None, 0.92, True),  # one round of 12
             (x, None, 0.8, False),  # 3 rounds
             (odd, None, 0.96, False), (wide, None, 0.96, False)]  # rows at a 2-byte offset  # fmt: skip
    for rows, rot, clip, _ in cases:
        fmt = RowFormat(128, 2, 128, clip=clip)
        c1, m1 = qp.quantize_pack(rows, rot, fmt)
        if rot is None:  # (bf16 rows times R: not under the interpreter, whose bf16 tl.dot is off)
            c2, m2 = ref.quantize_pack(rows, rot, fmt)
            assert torch.equal(c1, c2) and torch.equal(m1, m2)
    assert [k["PACKED"] for k in seen] == [want for *_, want in cases]
    monkeypatch.setattr(qp, "ROUND_K", 6)
    qp.quantize_pack(x, None, RowFormat(128, 2, 128, clip=0.92))  # two rounds of 6
    assert (seen[-1]["PACKED"], seen[-1]["ROUNDS"], seen[-1]["TOP_K"]) == (False, 2, 6)
    monkeypatch.setattr(qp, "PACKED", False)
    qp.quantize_pack(x, None, RowFormat(128, 2, 128, clip=0.96))
    assert seen[-1]["PACKED"] is False


@pytest.mark.parametrize("round_k", [6, 12])
@pytest.mark.parametrize(("d", "clip"), [(128, 0.92), (64, 0.8)])
def test_quantize_pack_rounds_of_six_and_twelve_are_bit_exact(tk, round_k, d, clip, monkeypatch):
    """Clip rounds of either size (``ROUND_K``), one or several, on the packed network (at any
    round count) and the fp32 one, on the adversarial rows (ties at the threshold and across
    rounds)."""
    qp, _ = tk
    monkeypatch.setattr(qp, "ROUND_K", round_k)
    monkeypatch.setattr(qp, "PACKED_ROUNDS", 99)
    seen = _launches(qp, monkeypatch)
    fmt = RowFormat(d, 2, d, clip=clip, meta_dtype="bf16")
    for dtype in (torch.bfloat16, torch.float32):
        x = _adversarial_rows(d, dtype)
        c1, m1 = qp.quantize_pack(x, None, fmt)
        c2, m2 = ref.quantize_pack(x, None, fmt)
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
    tl.store(T + tl.arange(0, ROWS), _clip_threshold(a, N_DROP, ROUNDS, TREE, K))


@pytest.mark.parametrize("k", [6, 12])
@pytest.mark.parametrize("tree", [0, 2])
def test_clip_threshold_at_every_merge_depth(k, tree):
    """``_clip_threshold`` alone at merge depths that ``quantize_pack`` takes on the GPU but not
    under the interpreter (``TREE = 0``: ``tl.reduce`` of the column lists, eight-lists padded to
    twelve), fp32 and int16 (the packed network's bit patterns, here through ``tl.maximum``), on
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
        c1, m1 = qp.quantize_pack(x, None, fmt)
        c2, m2 = ref.quantize_pack(x, None, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2), meta


def _signed_permutation(d: int, g: torch.Generator) -> torch.Tensor:
    sign = torch.randint(0, 2, (d, 1), generator=g).float() * 2 - 1
    return torch.eye(d)[torch.randperm(d, generator=g)] * sign


@pytest.mark.parametrize(("d", "clip"), [(64, 0.92), (128, 0.96), (128, 0.0), (256, 0.92)])
def test_quantize_pack_with_exact_rotations_is_bit_exact(tk, d, clip):
    """Rotations whose products are exact in any summation order (signed permutations, and an
    unnormalised Hadamard matrix on small integers), per layer and per head: the kernel must then
    match the reference bit for bit (integer rows also tie heavily after the rotation)."""
    qp, _ = tk
    g = torch.Generator().manual_seed(d)
    fmt = RowFormat(d, 2, d, clip=clip)
    x = torch.randint(-8, 9, (40, 2, d), generator=g).float()
    had = torch.ones(1, 1)
    while had.shape[0] < d:
        had = torch.cat([torch.cat([had, had], 1), torch.cat([had, -had], 1)])
    per_head = torch.stack([_signed_permutation(d, g), _signed_permutation(d, g)])
    for r in (had, _signed_permutation(d, g), per_head):
        c1, m1 = qp.quantize_pack(x, r, fmt)
        c2, m2 = ref.quantize_pack(x, r, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2), r.shape


@pytest.mark.parametrize("per_sm", [1, 2])
def test_quantize_pack_with_rotation_loops_over_row_blocks(tk, per_sm, monkeypatch):
    """With rotation a program takes every ``programs``-th block of rows (R loaded once): several
    blocks per program, a partial last block, per layer and per head, stay bit-exact."""
    qp, _ = tk
    monkeypatch.setattr(qp, "ROT_PER_SM", per_sm)  # the interpreter counts one SM
    g = torch.Generator().manual_seed(per_sm)
    d = 64
    fmt = RowFormat(d, 2, d, clip=0.92)
    x = torch.randint(-8, 9, (301, 2, d), generator=g).float()  # 602 rows: 10 blocks, 5 per head
    per_head = torch.stack([_signed_permutation(d, g), _signed_permutation(d, g)])
    for r in (_signed_permutation(d, g), per_head):
        c1, m1 = qp.quantize_pack(x, r, fmt)
        c2, m2 = ref.quantize_pack(x, r, fmt)
        assert torch.equal(c1, c2) and torch.equal(m1, m2), r.shape


def test_triton_refuses_formats_it_does_not_implement(tk):
    qp, _ = tk
    with pytest.raises(ValueError, match="backend='torch'"):
        qp.quantize_pack(torch.randn(4, 1, 64), None, RowFormat(64, 4, 64))
    with pytest.raises(ValueError, match="backend='torch'"):
        qp.quantize_pack(torch.randn(4, 1, 64), None, RowFormat(64, 2, 16))


@triton.jit
def _taper_ranges(INDPTR, OUT, split, n_early, split_late, S: tl.constexpr):
    b = tl.program_id(0)
    k = tl.program_id(1)
    lo, hi = taper_range(INDPTR, b, k, split, n_early, split_late)
    tl.store(OUT + (b * S + k) * 2, lo)
    tl.store(OUT + (b * S + k) * 2 + 1, hi)


@pytest.mark.parametrize(
    ("n_early", "split", "split_late"), [(2, 48, 16), (0, 16, 16), (5, 32, 32), (1, 64, 32)]
)
def test_taper_range_gives_each_split_its_positions(n_early, split, split_late):
    """``decode_tiles.taper_range``: split ``k`` of a list ``[s, e)`` starts after ``min(k, n_early)``
    splits of ``split`` and ``max(k - n_early, 0)`` of ``split_late`` positions, is as long as its
    kind, and ends at ``e`` at the latest."""
    lens = [130, 0, 57, 200]
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n_splits = 6
    out = torch.zeros(len(lens), n_splits, 2, dtype=torch.int32)
    _taper_ranges[(len(lens), n_splits)](indptr, out, split, n_early, split_late, S=n_splits)
    for b in range(len(lens)):
        for k in range(n_splits):
            lo = int(indptr[b]) + min(k, n_early) * split + max(k - n_early, 0) * split_late
            hi = min(lo + (split if k < n_early else split_late), int(indptr[b + 1]))
            assert out[b, k].tolist() == [lo, hi], (b, k)


@pytest.mark.parametrize("loop", ["swap", "swap-one-head", "words", "bytes"])
def test_decode_attention_rescales_past_the_first_tile(tk, loop, monkeypatch):
    """Scores that grow along the list (large queries, the later keys 4x larger): the lazy
    rescale must fire after a split's first tile too (the first tile alone fixes the max
    otherwise, and the probabilities overflow fp16)."""
    _, da = tk
    settings = {"small_tokens": 1 << 30 if loop == "bytes" else 0, "swap": loop.startswith("swap"),
                "swap_heads": 1 if loop == "swap-one-head" else 8, "swap_pair_tokens": 0, "fill_waves": False,
                "programs": 1, "programs_few": 1, "group_tokens": 1 << 30}  # fmt: skip
    for key, val in settings.items():
        monkeypatch.setitem(da.CONFIG, key, val)
    hq, hkv, d, n = 32, 8, 128, 600
    fmt = RowFormat(d, 2, d)
    k = torch.randn(n, hkv, d)
    k[n // 2 :] *= 4.0
    kc, km = ref.quantize_pack(k, None, fmt)
    vc, vm = ref.quantize_pack(torch.randn(n, hkv, d), None, fmt)
    hk, hv = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    lists = (torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int32),
             torch.tensor([0, 4], dtype=torch.int32), torch.arange(4, dtype=torch.int32))  # fmt: skip
    q = torch.randn(1, hq, d) * 30.0
    args = (q, kc, km, vc, vm, hk, hv, *lists, 1 / math.sqrt(d), fmt, fmt)
    got = da.decode_attention(*args)
    # scores in the hundreds magnify the query rounding: fp16 planes 4.8e-3 here, the two-head
    # swap loop's int8 queries (decode_kint8.py, up to 2^-14 of a head's largest element) 6.5e-3
    tol = 1e-2 if da.int2_loop(d, hq // hkv, hkv, n).k_int8 else 5e-3
    assert torch.isfinite(got).all() and _rel(got, ref.decode_attention(*args)) < tol


def _pools(nq: int, nh: int, hkv: int, d: int, fmt: RowFormat):
    kc, km = ref.quantize_pack(torch.randn(max(nq, 1), hkv, d), None, fmt)
    vc, vm = ref.quantize_pack(torch.randn(max(nq, 1), hkv, d), None, fmt)
    return kc, km, vc, vm, torch.randn(max(nh, 1), hkv, d), torch.randn(max(nh, 1), hkv, d)


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "meta"),
    [
        ([1], [1], 4, 4, 64, "fp16"),  # a single token per tier, MHA
        ([70, 0, 129], [5, 9, 0], 8, 2, 64, "fp16"),  # empty tiers, lengths not multiples of the block
        ([300], [20], 8, 2, 128, "fp16"),  # several splits
        ([0, 0], [0, 3], 4, 2, 64, "fp16"),  # a sequence with no tokens at all
        ([90, 40], [7, 2], 8, 2, 64, "bf16"),  # metadata read as int32 words, bf16 halves
        ([90, 40], [7, 2], 8, 2, 64, "fp32"),  # metadata read as int64 words
        ([200, 33], [4, 0], 32, 8, 64, "fp16"),  # Qwen3-8B's GQA: 4 KV heads per program, 16 rows
        ([50], [3], 8, 8, 64, "fp16"),  # MHA: 8 KV heads per program, 8 rows padded to 16
        ([40], [2], 16, 1, 64, "fp16"),  # one KV head, 16 query heads
        ([70], [2], 12, 4, 64, "fp16"),  # g = 3 (not a power of two): one KV head per program
        ([70, 20], [2, 5], 16, 8, 64, "bf16"),  # g = 2: 8 KV heads per program
        ([17000], [3], 2, 1, 64, "fp16"),  # 67 + 1 splits: the merge takes them 64 at a time
    ],
)
@pytest.mark.parametrize("grouped", [False, True], ids=["auto-heads", "grouped-heads"])
def test_decode_attention_matches_reference(tk, lens_q, lens_h, hq, hkv, d, meta, grouped, monkeypatch):
    _, da = tk
    if grouped:  # several KV heads per program at any size (normally only for large batches)
        monkeypatch.setitem(da.CONFIG, "group_tokens", 0)
    _check_decode(da, lens_q, lens_h, hq, hkv, d, meta)


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "meta"),
    [
        ([1], [1], 4, 4, 128, "fp16"),  # a single token per tier, MHA
        ([70, 0, 129], [5, 9, 0], 8, 2, 128, "fp16"),  # empty tiers, lengths not multiples of the block
        ([300], [20], 8, 2, 128, "fp16"),  # several splits
        ([90, 40], [7, 2], 8, 2, 128, "bf16"),
        ([90, 40], [7, 2], 8, 2, 128, "fp32"),
        ([200, 33], [4, 0], 32, 8, 128, "fp16"),  # Qwen3-8B's GQA
        ([70], [2], 12, 4, 128, "fp16"),  # g = 3
        ([50], [3], 4, 4, 256, "fp16"),  # head dim 256
        ([40, 9], [2, 1], 16, 8, 128, "fp16"),  # g = 2: two KV heads per swap program
        ([60], [3], 8, 8, 128, "fp16"),  # g = 1: two KV heads per swap program (2 of the 8 MMA columns)
    ],
)
@pytest.mark.parametrize("loop", ["auto-heads", "grouped-heads", "swap", "swap-one-head", "swap-fp16-keys"])
def test_decode_attention_word_planes_match_reference(
    tk, lens_q, lens_h, hq, hkv, d, meta, loop, monkeypatch
):
    """The int16-word tile loops, which the launch takes for head dim >= 128 from
    ``CONFIG['small_tokens']`` quantized tokens on, forced at these small sizes: query heads as the
    MMA rows (decode_words.py, one or several KV heads per program) and tokens as the MMA rows
    (decode_swap.py, ``CONFIG['swap']``: as many KV heads per program as fill the MMA's 8 columns,
    or one with ``CONFIG['swap_heads']`` 1). The swap loop's key product runs on int8 MMAs where
    a program reads >= 64 key bytes per token (two heads, or head dim 256; ``CONFIG['swap_k_int8']``),
    ``-fp16-keys`` on fp16 planes everywhere."""
    _, da = tk
    monkeypatch.setitem(da.CONFIG, "small_tokens", 0)
    keys16 = loop.endswith("-fp16-keys")
    monkeypatch.setitem(da.CONFIG, "swap_k_int8", not keys16)
    loop = loop.removesuffix("-fp16-keys")
    if loop == "grouped-heads":
        monkeypatch.setitem(da.CONFIG, "group_tokens", 0)
    monkeypatch.setitem(da.CONFIG, "swap", loop.startswith("swap"))
    if loop == "swap-one-head":
        monkeypatch.setitem(da.CONFIG, "swap_heads", 1)
    if loop == "swap":  # several KV heads per swap program at any size
        monkeypatch.setitem(da.CONFIG, "swap_pair_tokens", 0)
    if loop.startswith("swap"):  # the heads per program the launch takes (two at head dim 128)
        want = 2 if loop == "swap" and d == 128 else 1
        lp = da.int2_loop(d, hq // hkv, hkv, sum(lens_q))
        assert lp[:2] == ("swap", want)
        # int8 keys where a program reads >= 64 key bytes per token, unless turned off
        assert lp.k_int8 == (want * d >= 256 and not keys16)
    _check_decode(da, lens_q, lens_h, hq, hkv, d, meta)


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "meta", "block_n", "groups"),
    [
        ([70, 0, 129], [5, 9, 0], 8, 2, 128, "fp16", 64, 4),  # empty tiers, tiles and groups not full
        ([300], [20], 8, 2, 128, "fp16", 64, 4),  # several splits
        ([90, 40], [7, 2], 8, 2, 128, "bf16", 64, 4),
        ([90, 40], [7, 2], 8, 2, 128, "fp32", 64, 4),
        ([200, 33], [4, 0], 32, 8, 128, "fp16", 64, 4),  # Qwen3-8B's GQA
        ([50, 3], [3, 1], 16, 4, 256, "fp16", 64, 4),  # head dim 256
        ([150, 7], [2, 3], 16, 8, 128, "fp16", 128, 8),  # g = 2: 8 groups of 16 tokens
        ([100], [2], 16, 2, 128, "fp32", 64, 2),  # g = 8: 2 groups of 32 tokens
        ([300, 5], [1, 0], 4, 4, 128, "fp16", 256, 16),  # g = 1 (MHA): 16 groups of 16 tokens
        ([70, 20], [2, 5], 16, 8, 128, "fp16", 64, 0),  # g = 2 with 64-token tiles: padded loop
        ([70], [2], 12, 4, 128, "fp16", 64, 0),  # g = 3: padded loop
    ],
)
def test_decode_attention_token_groups_match_reference(
    tk, lens_q, lens_h, hq, hkv, d, meta, block_n, groups, monkeypatch
):
    """The opt-in token-group loop (decode_groups.py, ``CONFIG['token_groups']``): one KV head per
    program, each tile split into 16 / g groups of tokens so that the 16 MMA rows carry no padding."""
    _, da = tk
    monkeypatch.setitem(da.CONFIG, "small_tokens", 0)
    monkeypatch.setitem(da.CONFIG, "token_groups", True)
    monkeypatch.setitem(da.CONFIG, "swap", False)
    monkeypatch.setitem(da.CONFIG, "block_n", block_n)
    assert da.token_groups(hq // hkv, 1, block_n) == groups
    _check_decode(da, lens_q, lens_h, hq, hkv, d, meta)


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "merge_d"),
    [
        ([300, 0, 70], [20, 3, 0], 8, 2, 128, 32),  # several splits, an empty tier
        ([17000], [3], 2, 1, 64, 16),  # 67 + 1 splits: the merge takes them 64 at a time
    ],
)
@pytest.mark.parametrize("partials", ["fp32", "fp16"])
def test_decode_attention_partials_and_merge_slices_match_reference(
    tk, lens_q, lens_h, hq, hkv, d, merge_d, partials, monkeypatch
):
    """``CONFIG['partials']`` (the split outputs' dtype) and ``CONFIG['merge_d']`` (the merge
    program's slice of the head dim)."""
    _, da = tk
    monkeypatch.setitem(da.CONFIG, "partials", partials)
    monkeypatch.setitem(da.CONFIG, "merge_d", merge_d)
    _check_decode(da, lens_q, lens_h, hq, hkv, d, "fp16")


@pytest.mark.parametrize(("hp_split", "hp_block", "hp_stages"), [(64, 16, 1), (32, 16, 2)])
def test_decode_attention_16bit_tier_tunables_match_reference(tk, hp_split, hp_block, hp_stages, monkeypatch):
    """The 16-bit tier's split size, tile and pipeline depth (``CONFIG['hp_*']``), over windows
    of several splits, one split, a partial tile and none."""
    _, da = tk
    for key, val in (("hp_split", hp_split), ("hp_block", hp_block), ("hp_stages", hp_stages)):
        monkeypatch.setitem(da.CONFIG, key, val)
    _check_decode(da, [90, 40, 0, 5], [150, 3, 7, 0], 8, 2, 64, "fp16")


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "loop", "sms", "split_h"),
    [
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap-one-head", 4, 16),  # 6 units: 7 splits of one tile
        ([500, 40], [5, 70], 32, 8, "swap", 4, 16),  # two heads per program
        ([700, 0, 300], [330, 40, 0], 8, 2, "words", 4, 32),  # the padded word loop: 32-token tiles
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap-one-head", 64, 32),  # all programs fit: hp_split
    ],
)
def test_decode_attention_short_16bit_splits_where_the_programs_overflow_match_reference(
    tk, lens_q, lens_h, hq, hkv, loop, sms, split_h, monkeypatch
):
    """``CONFIG['hp_programs']``: where the INT2 programs and the 16-bit ones of ``hp_split`` tokens
    exceed one wave of ``sms × per_sm`` slots, about ``hp_programs`` 16-bit programs of whole tiles."""
    _, da = tk
    settings = {"hp_programs": 60, "small_tokens": 0, "hp_split": 32, "min_split": 64, "fill_waves": False,
                "programs": 64, "programs_few": 64, "swap": loop != "words", "group_tokens": 0, "sms": sms,
                "swap_pair_tokens": 0, "per_sm": 2, "swap_per_sm": 2,
                "swap_heads": 1 if loop == "swap-one-head" else 8}  # fmt: skip
    for key, val in settings.items():
        monkeypatch.setitem(da.CONFIG, key, val)
    launches = []
    stage1 = da._STAGE1

    def spy(grid, *args, **kwargs):
        launches.append(args[15])  # split_h
        return stage1(grid, *args, **kwargs)

    monkeypatch.setattr(da, "_STAGE1", spy)
    _check_decode(da, lens_q, lens_h, hq, hkv, 128, "fp16")
    assert launches == [split_h]


@pytest.mark.parametrize(
    ("lens_q", "loop", "plan"),
    [
        ([900, 0, 300], "swap-one-head", (1, 272, 80)),  # 6 units, 10 splits; the 300 ends in split 1
        ([900, 0, 300], "words", (1, 272, 80)),  # the padded word loop
        ([1000], "swap", (4, 208, 16)),  # two heads per program: 4 units, 16 splits
    ],
)
def test_decode_attention_tapered_splits_match_reference(tk, lens_q, loop, plan, monkeypatch):
    """``CONFIG['taper']``: where the 16-bit programs leave too few first-wave slots, the INT2
    splits from ``n_early`` on are shorter (``decode_plan.taper``), the first ones longer."""
    _, da = tk
    settings = {"hp_programs": 0, "small_tokens": 0, "hp_split": 32, "min_split": 64, "fill_waves": False,
                "programs": 64, "programs_few": 64, "swap": loop != "words", "group_tokens": 1 << 30,
                "sms": 8, "swap_pair_tokens": 0 if loop == "swap" else 1 << 30, "per_sm": 4, "swap_per_sm": 4,
                "swap_heads": 1 if loop == "swap-one-head" else 8, "swap_block_n": 16, "block_n": 16,
                "taper": 6.0}  # fmt: skip
    for key, val in settings.items():
        monkeypatch.setitem(da.CONFIG, key, val)
    launches = []
    stage1 = da._STAGE1

    def spy(grid, *args, **kwargs):
        launches.append((args[18], args[14], args[19]))  # n_early, split, split_late
        return stage1(grid, *args, **kwargs)

    monkeypatch.setattr(da, "_STAGE1", spy)
    hq, hkv = (32, 8) if loop == "swap" else (8, 2)
    _check_decode(da, lens_q, [100, 40, 0][: len(lens_q)], hq, hkv, 128, "fp16")
    assert launches == [plan]


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "loop"),
    [
        (
            [700, 0, 300],
            [100, 40, 0],
            8,
            2,
            "one-head",
        ),  # one KV head per program, empty tiers, 4 16-bit splits
        ([700, 0, 300], [100, 40, 0], 8, 2, "grouped"),  # 2 KV heads per program
        ([500, 40], [5, 70], 32, 8, "grouped"),  # Qwen3-8B's GQA: 4 KV heads per program
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap"),
        ([500, 40], [5, 70], 32, 8, "swap"),
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap-one-head"),
    ],
)
def test_decode_attention_wave_splits_and_hp_first_match_reference(
    tk, lens_q, lens_h, hq, hkv, loop, monkeypatch
):
    """The word-plane paths with ``CONFIG['fill_waves']`` (split sizes that fill whole waves of a
    pretend 16-SM device) and ``CONFIG['hp_first']`` (grid (head group, sequence, split), 16-bit
    splits first), over several 16-bit splits."""
    _, da = tk
    settings = {"fill_waves": True, "sms": 16, "per_sm": 2, "swap_per_sm": 3, "hp_first": True, "few_units": 0,
                "hp_split": 32, "small_tokens": 0, "group_tokens": 0 if loop == "grouped" else 1 << 30,
                "swap_pair_tokens": 0 if loop == "swap" else 1 << 30,
                "swap": loop.startswith("swap"), "swap_heads": 1 if loop == "swap-one-head" else 8, "min_split": 64}  # fmt: skip
    for key, val in settings.items():
        monkeypatch.setitem(da.CONFIG, key, val)
    splits = []  # (per_sm the launch passed, tokens per split)
    split_size = da.split_size

    def spy(*args):
        splits.append((args[6], split_size(*args)))
        return splits[-1][1]

    monkeypatch.setattr(da, "split_size", spy)
    _check_decode(da, lens_q, lens_h, hq, hkv, 128, "fp16")
    per_sm, split = splits[0]
    assert per_sm == (3 if loop.startswith("swap") else None)
    if loop.startswith("swap"):
        assert da.int2_loop(128, hq // hkv, hkv, max(lens_q)).hpb == (2 if loop == "swap" else 1)
    assert split < max(lens_q)  # several INT2 splits per sequence


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("partials", "bf16", "'fp32' or 'fp16'"),
        ("merge_d", 48, "power of two"),
        ("merge_d", 0, "power of two"),
        ("swap_block_n", 96, "power of two >= 16"),
        ("hp_block", 8, "power of two >= 16"),
        ("swap_heads", 0, "positive integer"),
        ("swap_per_sm", 2.5, "positive integer"),
        ("hp_programs", -1, "integer >= 0"),
        ("swap_pair_tokens", "64K", "integer >= 0"),
        ("pdl", "yes", "True or False"),
        ("swap_k_int8", 2, "True or False"),
        ("taper", -1.0, "finite number >= 0"),
        ("taper", float("nan"), "finite number >= 0"),
        ("taper", True, "finite number >= 0"),
        ("swap_block_n", 128.0, "power of two >= 16"),
    ],
)
def test_decode_attention_refuses_bad_config(tk, key, value, match, monkeypatch):
    _, da = tk
    da._check_config()  # the valid defaults cached first: a bad value equal to one must still fail
    monkeypatch.setitem(da.CONFIG, key, value)
    fmt = RowFormat(64, 2, 64)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    with pytest.raises(ValueError, match=match):
        da.decode_attention(torch.randn(1, 4, 64), kc, km, vc, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt)


def _check_decode(da, lens_q, lens_h, hq, hkv, d, meta) -> None:
    fmt = RowFormat(d, 2, d, meta_dtype=meta)
    nq, nh = sum(lens_q), sum(lens_h)
    kc, km, vc, vm, hk, hv = _pools(nq, nh, hkv, d, fmt)
    qi = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    hi = torch.tensor([0, *torch.tensor(lens_h).cumsum(0).tolist()], dtype=torch.int32)
    qx = torch.randperm(max(nq, 1))[:nq].to(torch.int32)
    hx = torch.randperm(max(nh, 1))[:nh].to(torch.int32)
    q = torch.randn(len(lens_q), hq, d)
    scale = 1 / math.sqrt(d)
    want = ref.decode_attention(q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, fmt, fmt)
    got = da.decode_attention(q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, fmt, fmt)
    for b in range(len(lens_q)):
        if lens_q[b] + lens_h[b] == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))
        else:
            assert _rel(got[b], want[b]) < 5e-3


def _one_sequence(fmt: RowFormat):
    """Pools and CSR lists of one sequence: 8 quantized and 2 16-bit tokens, 2 KV heads."""
    kc, km, vc, vm, hk, hv = _pools(8, 2, 2, fmt.head_dim, fmt)
    lists = (
        torch.tensor([0, 8], dtype=torch.int32),
        torch.arange(8, dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
        torch.arange(2, dtype=torch.int32),
    )
    return (kc, km, vc, vm, hk, hv), lists


def test_decode_attention_refuses_non_contiguous_pools(tk):
    _, da = tk
    fmt = RowFormat(64, 2, 64)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    strided = torch.cat([kc, kc], 2)[:, :, ::2]
    with pytest.raises(ValueError, match="k_codes must be contiguous"):
        da.decode_attention(
            torch.randn(1, 4, 64), strided, km, vc, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt
        )


def test_decode_attention_refuses_mismatched_metadata(tk):
    _, da = tk
    fmt = RowFormat(64, 2, 64)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    with pytest.raises(ValueError, match="k_meta/v_meta must both be"):
        da.decode_attention(
            torch.randn(1, 4, 64), kc, km, vc, vm.float(), hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt
        )


@pytest.mark.parametrize(
    ("g", "hkv", "want"), [(4, 8, 4), (1, 8, 8), (8, 8, 2), (16, 1, 1), (3, 6, 1), (32, 2, 1), (4, 2, 2)]
)
def test_heads_per_program_fills_sixteen_rows_with_a_divisor_of_the_kv_heads(g, hkv, want):
    from oscarkv.kernels.triton.decode_attention import heads_per_program

    assert heads_per_program(g, hkv) == want
    assert heads_per_program(g, hkv, tokens=1000) == 1  # small batches: one KV head per program


def test_decode_attention_refuses_head_dims_it_does_not_implement(tk):
    """d = 192 passed the old ``d % 64`` check and then failed inside Triton (no 48-wide arange)."""
    _, da = tk
    fmt = RowFormat(192, 2, 192)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    with pytest.raises(ValueError, match="head_dim must be 64, 128 or 256"):
        da.decode_attention(torch.randn(1, 4, 192), kc, km, vc, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt)


def test_decode_attention_refuses_pools_of_the_wrong_shape(tk):
    """Strides come from ``d`` and ``hp_k``'s head count: a code pool of another row width or head
    count would be read out of bounds, so it is refused."""
    _, da = tk
    fmt = RowFormat(128, 2, 128)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    q = torch.randn(1, 4, 128)
    for bad in (kc[:, :, :16].contiguous(), kc[:, :1].contiguous(), kc.view(torch.int8)):
        with pytest.raises(ValueError, match="k_codes must be uint8"):
            da.decode_attention(q, bad, km, vc, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt)


@pytest.mark.parametrize("small_tokens", [0, 1 << 30], ids=["word-planes", "byte-planes"])
def test_decode_attention_refuses_pools_off_their_word_boundary(tk, small_tokens, monkeypatch):
    """Head dim >= 128 reads the codes as int16 words and every (scale, zero) pair as one word: a
    pool that is a view at an odd byte offset is refused with a clear error, whichever tile loop
    the problem size picks (it used to fail in ``Tensor.view`` only on the word path)."""
    _, da = tk
    monkeypatch.setitem(da.CONFIG, "small_tokens", small_tokens)
    fmt = RowFormat(128, 2, 128)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    q = torch.randn(1, 4, 128)
    odd = torch.empty(kc.numel() + 1, dtype=torch.uint8)[1:].view(kc.shape)
    odd.copy_(kc)
    with pytest.raises(ValueError, match="v_codes must start at a multiple of 2 bytes"):
        da.decode_attention(q, kc, km, odd, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt)
    odd_meta = torch.empty(km.numel() + 1, dtype=km.dtype)[1:].view(km.shape)
    odd_meta.copy_(km)
    with pytest.raises(ValueError, match="k_meta must start at a multiple of 4 bytes"):
        da.decode_attention(q, kc, odd_meta, vc, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt)


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


@pytest.mark.parametrize(("heads", "meta", "via_idx"), [(1, 1, 1), (1, 0, 0), (2, 1, 1), (8, 1, 0)])
def test_gather_probe_reads_every_word_of_its_heads(heads, meta, via_idx, monkeypatch):
    """``benchmarks/gather_probe.py`` (the reads-only probe behind the paired swap heads): its
    per-program XOR equals one computed in torch from the words of the program's heads and slots,
    so the probe loads exactly the decode kernel's bytes (masked tails included)."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    gp = __import__("gather_probe")
    sys.modules.pop("gather_probe", None)
    g = torch.Generator().manual_seed(heads)
    hkv, d, lens, split, block_n = 8, 128, [70, 45], 40, 16
    n = sum(lens)
    kc, vc = (torch.randint(0, 256, (n, hkv, d // 4), dtype=torch.uint8, generator=g) for _ in range(2))
    km, vm = (torch.randn(n, hkv, 1, 2, generator=g).half() for _ in range(2))
    indptr = torch.tensor([0, lens[0], n], dtype=torch.int32)
    idx = torch.randperm(n, generator=g).to(torch.int32) if via_idx else torch.arange(n, dtype=torch.int32)
    splits = math.ceil(max(lens) / split)
    got = gp.launch((kc, km, vc, vm, indptr, idx), hkv, d, split, splits, 2, heads, meta, via_idx, block_n)
    kw, vw = (
        kc.view(torch.int16).view(n, hkv * d // 8).int(),
        vc.view(torch.int16).view(n, hkv * d // 8).int(),
    )
    kmw, vmw = km.view(torch.int32).view(n, hkv), vm.view(torch.int32).view(n, hkv)
    want = torch.zeros_like(got)
    for b in range(2):
        for sp in range(splits):
            lo = int(indptr[b]) + sp * split
            hi = min(lo + split, int(indptr[b + 1]))
            for hg in range(hkv // heads):
                cols = slice(hg * heads * d // 8, (hg + 1) * heads * d // 8)
                acc = torch.zeros(block_n, heads * d // 8, dtype=torch.int32)
                macc = torch.zeros(block_n, heads, dtype=torch.int32)
                for n0 in range(lo, hi, block_n):
                    rows = idx[n0:hi][:block_n].long()
                    acc[: len(rows)] ^= kw[rows, cols] ^ (vw[rows, cols] << 16)
                    if meta:
                        macc[: len(rows)] ^= kmw[rows, hg * heads : (hg + 1) * heads]
                        macc[: len(rows)] ^= vmw[rows, hg * heads : (hg + 1) * heads]
                want[(b * splits + sp) * (hkv // heads) + hg] = acc.sum() + macc.sum()
    assert torch.equal(got, want)
