"""Triton decode attention against its torch twin, on the CPU through Triton's interpreter (tiny
shapes), with each tile loop and split rule forced by a tuning (``dataclasses.replace`` of the
defaults) where the default would not take it at these sizes.

Run by ``tests/test_kernels_triton.py`` in a fresh interpreter with ``TRITON_INTERPRET=1``.
Tolerance: outputs within a relative 5e-3 of the fp32 oracle (the kernel rounds the softmax
weights to fp16 for the V dot).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run through tests/test_kernels_triton.py (needs TRITON_INTERPRET=1)", allow_module_level=True
    )

import triton
import triton.language as tl

from oscarkv.kernels import ref
from oscarkv.kernels.triton.decode.common import taper_range
from oscarkv.quant import RowFormat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from token_cases import coverage_case, drop_effects, rel, split_edges

torch.set_num_threads(1)

# tunings that force each INT2 loop at any size, and the loop the plan then takes
LOOPS = {
    "bytes": ({"small_tokens": 1 << 40, "group_tokens": 1 << 40}, "bytes"),
    "words": ({"small_tokens": 0, "swap_max_tokens": 0, "swap_heads": 1, "group_tokens": 0}, "words"),
    "swap": ({"small_tokens": 0, "swap_pair_tokens": 0}, "swap"),
    "swap-one-head": ({"small_tokens": 0, "swap_heads": 1, "swap_max_tokens": 1 << 40}, "swap"),
    "swap-fp16-keys": ({"small_tokens": 0, "swap_pair_tokens": 0, "int8_key_bytes": 1 << 20}, "swap"),
}


def tuned(**changes):
    from oscarkv.kernels.triton.decode import DEFAULT_TUNING

    return dataclasses.replace(DEFAULT_TUNING, **changes)


@pytest.fixture(scope="module")
def tk():
    from oscarkv.kernels.triton import decode

    return None, decode


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@triton.jit
def _taper_ranges(INDPTR, OUT, split, n_early, split_late, planned, S: tl.constexpr, TILE: tl.constexpr):
    b = tl.program_id(0)
    k = tl.program_id(1)
    lo, hi = taper_range(INDPTR, b, k, split, n_early, split_late, planned, TILE)
    tl.store(OUT + (b * S + k) * 2, lo)
    tl.store(OUT + (b * S + k) * 2 + 1, hi)


def _live(n: int, split: int, planned: int, tile: int) -> int:
    return math.ceil(math.ceil(n * split / planned) / tile) * tile


@pytest.mark.parametrize("planned", [200, 400, 1024])
@pytest.mark.parametrize(
    ("n_early", "split", "split_late"), [(2, 48, 16), (0, 40, 40), (5, 32, 32), (1, 64, 32), (3, 48, 32)]
)
def test_taper_range_gives_each_split_its_positions(n_early, split, split_late, planned):
    """``common.taper_range``: split ``k`` of a list ``[s, e)`` planned at ``planned`` tokens starts
    after ``min(k, n_early)`` splits of ``split`` and ``max(k - n_early, 0)`` of ``split_late``
    positions, each scaled by ``(e - s) / planned`` and rounded up to whole tiles, is as long as its
    kind, and ends at ``e`` at the latest; where the plan covers ``planned`` tokens the splits cover
    every list (a list shorter than its plan: every split gets positions)."""
    lens = [130, 0, 57, 200]
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n_splits, tile = 6, 16
    out = torch.zeros(len(lens), n_splits, 2, dtype=torch.int32)
    _taper_ranges[(len(lens), n_splits)](
        indptr, out, split, n_early, split_late, planned, S=n_splits, TILE=tile
    )
    covers = min(n_early, n_splits) * split + max(n_splits - n_early, 0) * split_late >= planned
    for b, n in enumerate(lens):
        early, late = _live(n, split, planned, tile), _live(n, split_late, planned, tile)
        start, end = int(indptr[b]), int(indptr[b + 1])
        for k in range(n_splits):
            lo = start + min(k, n_early) * early + max(k - n_early, 0) * late
            hi = min(lo + (early if k < n_early else late), end)
            assert out[b, k].tolist() == [lo, hi], (b, k)
        if covers:
            assert max(int(out[b, k, 1]) for k in range(n_splits)) == end, b


@pytest.mark.parametrize("loop", ["swap", "swap-one-head", "words", "bytes"])
def test_decode_attention_rescales_past_the_first_tile(tk, loop):
    """Scores that grow along the list (large queries, the later keys 4x larger): the lazy
    rescale must fire after a split's first tile too (the first tile alone fixes the max
    otherwise, and the probabilities overflow fp16)."""
    _, da = tk
    t = tuned(**LOOPS[loop][0], programs=1, programs_few=1)
    hq, hkv, d, n = 32, 8, 128, 600
    fmt = RowFormat(d, 2, d)
    k = torch.randn(n, hkv, d)
    k[n // 2 :] *= 4.0
    kc, km = ref.quantize_pack(k, fmt)
    vc, vm = ref.quantize_pack(torch.randn(n, hkv, d), fmt)
    hk, hv = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    lists = (torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int32),
             torch.tensor([0, 4], dtype=torch.int32), torch.arange(4, dtype=torch.int32))  # fmt: skip
    q = torch.randn(1, hq, d) * 30.0
    args = (q, kc, km, vc, vm, hk, hv, *lists, 1 / math.sqrt(d), fmt, fmt)
    p = da.plan(1, hq, hkv, d, (n, 4), "cpu", t)
    assert p.lp.loop == LOOPS[loop][1] and p.n_q_splits == 1  # one split: the rescale must fire inside it
    got = da.decode_attention(*args, plan=p)
    # scores in the hundreds magnify the query rounding: fp16 planes 4.8e-3 here, the two-head
    # swap loop's int8 queries (up to 2^-14 of a head's largest element) 6.5e-3
    tol = 1e-2 if p.lp.k_int8 else 5e-3
    assert torch.isfinite(got).all() and _rel(got, ref.decode_attention(*args)) < tol


def _pools(nq: int, nh: int, hkv: int, d: int, fmt: RowFormat):
    kc, km = ref.quantize_pack(torch.randn(max(nq, 1), hkv, d), fmt)
    vc, vm = ref.quantize_pack(torch.randn(max(nq, 1), hkv, d), fmt)
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
def test_decode_attention_matches_reference(tk, lens_q, lens_h, hq, hkv, d, meta, grouped):
    _, da = tk
    # grouped: several KV heads per program at any size (normally only for large batches)
    _check_decode(da, lens_q, lens_h, hq, hkv, d, meta, tuned(group_tokens=0) if grouped else None)


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
@pytest.mark.parametrize("loop", ["words", "swap", "swap-one-head", "swap-fp16-keys"])
def test_decode_attention_word_planes_match_reference(tk, lens_q, lens_h, hq, hkv, d, meta, loop):
    """The int16-word tile loops, which the launch takes for head dim >= 128 from ``small_tokens``
    quantized tokens on, forced at these small sizes: query heads as the MMA rows with grouped KV
    heads (``loop_words``) and tokens as the MMA rows (``loop_swap``: as many KV heads per program
    as fill the MMA's 8 columns, or one). The swap loop's key product runs on int8 MMAs where a
    program reads >= ``int8_key_bytes`` key bytes per token (two heads, or head dim 256),
    ``-fp16-keys`` on fp16 planes everywhere."""
    _, da = tk
    t = tuned(**LOOPS[loop][0])
    p = da.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cpu", t)
    if p.lp.loop != LOOPS[loop][1]:  # g not a power of two: the padded loop cannot group, swap runs
        assert loop == "words" and (hq // hkv) & (hq // hkv - 1) and p.lp.loop == "swap"
    if loop.startswith("swap"):  # the heads per program the launch takes (two at head dim 128)
        want = 2 if loop != "swap-one-head" and d == 128 else 1
        assert p.lp.hpb == want
        # int8 keys where a program reads >= 64 key bytes per token, unless turned off
        assert p.lp.k_int8 == (want * d >= 256 and loop != "swap-fp16-keys")
    _check_decode(da, lens_q, lens_h, hq, hkv, d, meta, t)


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "merge_d"),
    [
        ([300, 0, 70], [20, 3, 0], 8, 2, 128, 32),  # several splits, an empty tier
        ([17000], [3], 2, 1, 64, 16),  # 67 + 1 splits: the merge takes them 64 at a time
    ],
)
def test_decode_attention_merge_slices_match_reference(tk, lens_q, lens_h, hq, hkv, d, merge_d):
    """``merge_d``: the merge program's slice of the head dim."""
    _, da = tk
    _check_decode(da, lens_q, lens_h, hq, hkv, d, "fp16", tuned(merge_d=merge_d))


@pytest.mark.parametrize(("hp_split", "hp_block", "hp_stages"), [(64, 16, 1), (32, 16, 2)])
def test_decode_attention_16bit_tier_tunables_match_reference(tk, hp_split, hp_block, hp_stages):
    """The 16-bit tier's split size, tile and pipeline depth (``hp_*``), over windows of several
    splits, one split, a partial tile and none."""
    _, da = tk
    t = tuned(hp_split=hp_split, hp_block=hp_block, hp_stages=hp_stages)
    _check_decode(da, [90, 40, 0, 5], [150, 3, 7, 0], 8, 2, 64, "fp16", t)


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "loop", "sms", "split_h"),
    [
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap-one-head", 4, 16),  # 6 units: 7 splits of one tile
        ([500, 40], [5, 70], 32, 8, "swap", 4, 16),  # two heads per program
        ([700, 0, 300], [330, 40, 0], 8, 2, "words", 2, 32),  # the padded word loop: 32-token tiles
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap-one-head", 64, 32),  # all programs fit: hp_split
    ],
)
def test_decode_attention_short_16bit_splits_where_the_programs_overflow_match_reference(
    tk, lens_q, lens_h, hq, hkv, loop, sms, split_h
):
    """``hp_programs``: where the INT2 programs and the 16-bit ones of ``hp_split`` tokens exceed one
    wave of ``sms × per_sm`` slots, about ``hp_programs`` 16-bit programs of whole tiles."""
    _, da = tk
    t = tuned(**LOOPS[loop][0], hp_programs=60, hp_split=32, min_split=64, programs=64, programs_few=64, sms=sms,
              per_sm=2, few_units=1 << 20)  # fmt: skip
    p = _check_decode(da, lens_q, lens_h, hq, hkv, 128, "fp16", t)
    assert p.lp.loop == LOOPS[loop][1] and p.split_h == split_h


@pytest.mark.parametrize(
    ("lens_q", "loop", "plan"),
    [
        ([900, 0, 300], "swap-one-head", (1, 272, 80)),  # 6 units, 10 splits; the 300 ends in split 1
        (
            [900, 0, 300],
            "words",
            (6, 176, 16),
        ),  # padded words, 2 heads a program: 3 units; 6 early splits cover the list
        ([1000], "swap", (4, 208, 16)),  # two heads per program: 4 units, 16 splits
    ],
)
def test_decode_attention_tapered_splits_match_reference(tk, lens_q, loop, plan):
    """``taper``: where the 16-bit programs leave too few first-wave slots, the INT2 splits from
    ``n_early`` on are shorter (``planner.taper``), the first ones longer."""
    _, da = tk
    t = tuned(**LOOPS[loop][0], hp_programs=0, hp_split=32, min_split=64, programs=64, programs_few=64, sms=8,
              per_sm=4, few_units=1 << 20, swap_block_n=16, words_block_n=16, taper=6.0)  # fmt: skip
    hq, hkv = (32, 8) if loop == "swap" else (8, 2)
    p = _check_decode(da, lens_q, [100, 40, 0][: len(lens_q)], hq, hkv, 128, "fp16", t)
    assert p.lp.loop == LOOPS[loop][1] and tuple(p.splits) == plan


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "loop"),
    [
        (
            [700, 0, 300],
            [100, 40, 0],
            8,
            2,
            "swap-one-head",
        ),  # one KV head per program, empty tiers, 4 16-bit splits
        ([700, 0, 300], [100, 40, 0], 8, 2, "words"),  # padded: 4 KV heads... of 2: 2 per program
        ([500, 40], [5, 70], 32, 8, "words"),  # Qwen3-8B's GQA: 4 KV heads per program
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap"),
        ([500, 40], [5, 70], 32, 8, "swap"),
        ([700, 0, 300], [100, 40, 0], 8, 2, "swap-one-head"),
    ],
)
def test_decode_attention_wave_splits_and_hp_first_match_reference(tk, lens_q, lens_h, hq, hkv, loop):
    """The word-plane paths with split sizes that fill whole waves of a pretend 16-SM device and the
    16-bit splits launched first (grid (head group, sequence, split)), over several 16-bit splits."""
    _, da = tk
    t = tuned(**LOOPS[loop][0], sms=16, per_sm=2, few_units=0, hp_split=32, min_split=64)
    p = _check_decode(da, lens_q, lens_h, hq, hkv, 128, "fp16", t)
    assert p.lp.loop == LOOPS[loop][1] and p.hp_first and p.grid[1] == len(lens_q)
    assert p.lp.hpb == {"swap": 2, "swap-one-head": 1}.get(loop, p.lp.hpb)
    assert p.splits.split < max(lens_q) and p.total - p.n_q_splits > 1  # several splits of each tier


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "loop", "sms"),
    [
        ([700, 0, 301], [40, 7, 0], "bytes", 0),
        ([700, 0, 301], [40, 7, 0], "swap-one-head", 0),
        ([600, 599], [300, 33], "swap", 8),  # waves, 16-bit splits first, the taper
        ([600, 599], [300, 33], "words", 8),
        ([0, 0], [700, 301], "bytes", 8),  # the BF16 engine: 16-bit lists only, wave splits
    ],
)
def test_decode_attention_sees_every_token_with_a_plan_for_longer_lists(tk, lens_q, lens_h, loop, sms):
    """A plan made for lists 2.5x longer than the live ones (a graph's padded length bucket): each
    list's splits are scaled to its own length, so every split has positions and every token is
    still seen once (mean of every value, closer than a third of a lost split-edge token)."""
    _, da = tk
    hq, hkv, d = 8, 2, 128
    t = tuned(**LOOPS[loop][0], min_split=48, programs=96, programs_few=24, hp_split=64, sms=sms, per_sm=2,
              few_units=0 if sms else 1 << 20, swap_block_n=16, words_block_n=16, bytes_block_n=16, taper=2.0,
              hp_programs=0, bf16_per_sm=2, bf16_min_split=32)  # fmt: skip
    args, want, _ = coverage_case(lens_q, lens_h, hq, hkv, d, "cpu")
    planned = (5 * max(lens_q) // 2, 5 * max(lens_h) // 2)
    p = da.plan(len(lens_q), hq, hkv, d, planned, "cpu", t)
    got = da.decode_attention(*args, plan=p)
    if not max(lens_q):  # 16-bit lists only: their values are exact, so the mean is all but exact
        for s in range(len(lens_h)):
            v = args[6][args[10][int(args[9][s])].long()].double().repeat_interleave(hq // hkv, 0)
            effect = rel((lens_h[s] * want[s] - v) / (lens_h[s] - 1), want[s])  # one token lost
            assert rel(got[s], want[s]) < min(effect / 3, 1e-5), (s, rel(got[s], want[s]), effect)
        assert p.total > 2  # several 16-bit splits per list
        return
    edges = split_edges(p, lens_q)
    effects = drop_effects(args, want, edges)
    for (s, pos), effect in zip(edges, effects, strict=True):
        assert rel(got[s], want[s]) < effect / 3, (s, pos, rel(got[s], want[s]), effect)
    # the longest list reaches into its plan's last split: every split has positions
    assert max(pos for s, pos in edges if s == 0) == lens_q[0] - 1 and p.n_q_splits > 1
    assert len({pos for s, pos in edges if s == 0}) == 2 * p.n_q_splits


def _check_decode(da, lens_q, lens_h, hq, hkv, d, meta, tuning=None):
    """Random pools and shuffled slot lists; the kernel (with a plan from ``tuning``, if given)
    against the reference per sequence. Returns the plan it ran."""
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
    p = da.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cpu", tuning or da.DEFAULT_TUNING)
    got = da.decode_attention(q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, scale, fmt, fmt, plan=p)
    for b in range(len(lens_q)):
        if lens_q[b] + lens_h[b] == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))
        else:
            assert _rel(got[b], want[b]) < 5e-3
    return p


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
def test_decode_attention_refuses_pools_off_their_word_boundary(tk, small_tokens):
    """Head dim >= 128 reads the codes as int16 words and every (scale, zero) pair as one word: a
    pool that is a view at an odd byte offset is refused with a clear error, whichever tile loop
    the problem size picks (it used to fail in ``Tensor.view`` only on the word path)."""
    _, da = tk
    fmt = RowFormat(128, 2, 128)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    q = torch.randn(1, 4, 128)
    p = da.plan(1, 4, 2, 128, (8, 2), "cpu", tuned(small_tokens=small_tokens))
    odd = torch.empty(kc.numel() + 1, dtype=torch.uint8)[1:].view(kc.shape)
    odd.copy_(kc)
    with pytest.raises(ValueError, match="v_codes must start at a multiple of 2 bytes"):
        da.decode_attention(q, kc, km, odd, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt, plan=p)
    odd_meta = torch.empty(km.numel() + 1, dtype=km.dtype)[1:].view(km.shape)
    odd_meta.copy_(km)
    with pytest.raises(ValueError, match="k_meta must start at a multiple of 4 bytes"):
        da.decode_attention(q, kc, odd_meta, vc, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt, plan=p)


def test_decode_attention_refuses_a_plan_for_another_shape_or_shorter_lists(tk):
    """A plan is made for a shape and the longest lists: another shape, or lists longer than it was
    made for (its splits would drop tokens), is refused with the reason."""
    _, da = tk
    fmt = RowFormat(64, 2, 64)
    (kc, km, vc, vm, hk, hv), (ip, idx, hp, hidx) = _one_sequence(fmt)
    q = torch.randn(1, 4, 64)
    args = (q, kc, km, vc, vm, hk, hv, ip, idx, hp, hidx, 0.1, fmt, fmt)
    with pytest.raises(ValueError, match="the plan was made for batch, query heads, KV heads, head dim"):
        da.decode_attention(*args, plan=da.plan(2, 4, 2, 64, (8, 2)))
    with pytest.raises(ValueError, match="exceed the plan's"):
        da.decode_attention(*args, lens_hint=(8, 2), plan=da.plan(1, 4, 2, 64, (7, 2)))
    got = da.decode_attention(*args, lens_hint=(8, 2), plan=da.plan(1, 4, 2, 64, (8, 2)))
    assert torch.equal(got, da.decode_attention(*args))


@pytest.mark.parametrize(
    ("lens_q", "lens_h", "hq", "hkv", "d", "sms", "loop"),
    [
        # about `programs` splits, partial tiles and tails, an empty sequence tier
        ([700, 0, 301], [40, 7, 0], 8, 2, 128, 0, "bytes"),
        ([700, 0, 301], [40, 7, 0], 8, 2, 128, 0, "words"),
        ([700, 0, 301], [40, 7, 0], 8, 2, 128, 0, "swap-one-head"),
        # waves on 8 SMs: the 16-bit splits first, the INT2 splits tapered
        ([600, 599], [300, 33], 8, 2, 128, 8, "swap"),
        ([600, 599], [300, 33], 8, 2, 128, 8, "swap-fp16-keys"),
        ([600, 599], [300, 33], 8, 2, 128, 8, "words"),
        ([333, 64], [5, 320], 12, 4, 256, 0, "swap-one-head"),  # g = 3 (a padding head), head dim 256
        ([777], [129], 4, 4, 64, 0, "bytes"),  # head dim 64
    ],
)
def test_decode_attention_sees_every_token(tk, loop, lens_q, lens_h, hq, hkv, d, sms):
    """Zero queries: the output is the exact mean of every value of both lists (``token_cases``),
    against which the kernel must be closer than a third of what losing or repeating the first or
    last token of any INT2 split would change, across forced splits (48-token floor, tiles of 16
    where the loop allows), the 16-bit splits first, the taper, and the merge."""
    _, da = tk
    t = tuned(**LOOPS[loop][0], min_split=48, programs=96, programs_few=24, hp_split=64, sms=sms, per_sm=2,
              few_units=0 if sms else 1 << 20, swap_block_n=16, words_block_n=16, bytes_block_n=16, taper=2.0,
              hp_programs=0)  # fmt: skip
    args, want, _ = coverage_case(lens_q, lens_h, hq, hkv, d, "cpu")
    p = da.plan(len(lens_q), hq, hkv, d, (max(lens_q), max(lens_h)), "cpu", t)
    assert p.lp.loop == (LOOPS[loop][1] if d >= 128 else "bytes") and p.n_q_splits > 1
    got = da.decode_attention(*args, plan=p)
    edges = split_edges(p, lens_q)
    effects = drop_effects(args, want, edges)
    for (s, pos), effect in zip(edges, effects, strict=True):
        assert rel(got[s], want[s]) < effect / 3, (s, pos, rel(got[s], want[s]), effect)
    for s in range(len(lens_q)):
        if lens_q[s] + lens_h[s] == 0:
            assert torch.equal(got[s], torch.zeros_like(got[s]))
