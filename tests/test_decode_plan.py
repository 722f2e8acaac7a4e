"""The decode launch plan (host side, no GPU): the loop choice, split sizes that fill whole waves of
programs, the tapered INT2 splits, the 16-bit splits, and the frozen tuning's checks."""

from __future__ import annotations

import dataclasses
import math

import pytest

from oscarkv.kernels.triton.decode import DEFAULT_TUNING, DecodeTuning
from oscarkv.kernels.triton.decode import planner as plan

T = DEFAULT_TUNING


def tuned(**changes) -> DecodeTuning:
    return dataclasses.replace(DEFAULT_TUNING, **changes)


@pytest.mark.parametrize(
    ("units", "max_len", "block_n", "slots"),
    [(8, 130745, 64, 1056), (64, 32441, 64, 1056), (256, 130745, 32, 1056), (3, 100, 64, 16), (1, 5, 32, 4)],
)
def test_wave_split_is_whole_tiles_and_fills_the_waves_it_pays_for(units, max_len, block_n, slots):
    split = plan.wave_split(units, max_len, block_n, slots, T.min_split)
    assert split % block_n == 0 and split >= min(T.min_split, max_len)
    programs = math.ceil(max_len / split) * units
    waves = math.ceil(programs / slots)
    cost = waves * (split + T.split_cost)
    # no other whole-tile split is cheaper by the same cost model
    for other in range(block_n, max(max_len, block_n) + block_n, block_n):
        if other < min(T.min_split, math.ceil(max_len / block_n) * block_n):
            continue
        w = math.ceil(math.ceil(max_len / other) * units / slots)
        if w <= T.max_waves:
            assert cost <= w * (other + T.split_cost)


def test_wave_split_hand_computed_cases():
    # 8 (sequence, head group) pairs of 128K tokens on 1056 slots: 128 splits of 1024 tokens =
    # 1024 programs, one wave (decode_attention itself keeps programs_few for <= few_units pairs)
    assert plan.wave_split(8, 130745, 64, 1056, 256) == 1024
    # batch 8 / 32K: one wave of 16 splits of 2048 tokens beats 3 waves of 704
    assert plan.wave_split(64, 32441, 64, 1056, 256) == 2048


def test_wave_split_min_waves():
    split = plan.wave_split(64, 32441, 64, 1056, 256, tuned(min_waves=3))
    assert split == 704 and math.ceil(32441 / split) * 64 <= 3 * 1056


def test_wave_split_edges():
    # an empty or tiny list is one tile
    assert plan.wave_split(4, 0, 64, 16, 256) == 64
    assert plan.wave_split(4, 5, 64, 16, 256) == 64
    # the min_split floor is rounded up to whole tiles
    assert plan.wave_split(64, 10_000, 64, 10_000, 100) == 128
    with pytest.raises(ValueError, match="units, slots and block_n"):
        plan.wave_split(0, 100, 64, 16, 256)


def _lp(loop: str, block_n: int = 64, min_split: int = 256) -> plan.Int2Loop:
    return plan.Int2Loop(loop, 1, block_n, 1, 16, 32, 3, min_split)


def test_split_size_picks_the_rule():
    # word-plane path, 64 pairs > few_units: the wave rule
    assert plan.split_size(64, 32441, _lp("words"), 132) == plan.wave_split(64, 32441, 64, 132 * 8, 256)
    assert plan.split_size(64, 32441, _lp("swap"), 132) == plan.wave_split(64, 32441, 64, 132 * 8, 256)
    # byte path, or no SM count: about `programs` programs, splits in multiples of 256
    assert plan.split_size(64, 32441, _lp("bytes"), 132) == 768
    assert plan.split_size(64, 32441, _lp("words"), 0) == 768
    # few pairs: programs_few (1024 programs = 128 splits of 1024 tokens)
    assert plan.split_size(8, 130745, _lp("words"), 132) == 1024
    # split_gran: multiples of 64 tokens instead of 256
    assert plan.split_size(64, 32441, _lp("words"), 0, tuned(split_gran=64)) == 704


def test_int2_loop_picks_bytes_swap_or_the_padded_words_by_size():
    """Byte planes below ``small_tokens`` and for head dim 64; the swap loop (``swap_heads`` KV heads
    per program, the query heads rounded up to a power of two) up to ``swap_max_tokens``; above it
    the padded word loop where the swap loop would take one head and the padded loop can group."""
    t = tuned(small_tokens=100, swap_max_tokens=1000, group_tokens=500, swap_pair_tokens=500)
    assert plan.int2_loop(128, 4, 8, 99, t).loop == "bytes"
    assert plan.int2_loop(64, 4, 8, 10_000, t).loop == "bytes"
    lp = plan.int2_loop(128, 3, 8, 999, t)
    # two KV heads of 4 (padded) query heads fill the 8 columns; the tile keeps its code bytes
    assert (lp.loop, lp.hpb, lp.rows, lp.block_n) == ("swap", 2, 4, T.swap_block_n // 2)
    assert plan.int2_loop(256, 4, 8, 999, t)[1:3] == (1, T.swap_block_n // 2)  # same tile bytes
    assert lp.min_split == T.min_split // 2  # the same head-tokens per program
    assert plan.int2_loop(128, 4, 8, 999, dataclasses.replace(t, swap_heads=1))[:3] == (
        "swap",
        1,
        T.swap_block_n,
    )
    assert plan.int2_loop(128, 4, 8, 1000, t)[:2] == ("swap", 2)  # several heads: the swap loop at any size
    lp = plan.int2_loop(256, 4, 8, 1000, t)  # one head per swap program: grouped padded heads
    assert (lp.loop, lp.hpb, lp.rows, lp.min_split) == ("words", 4, 16, T.min_split)


def test_int2_loop_takes_int8_keys_where_a_program_reads_enough_key_bytes_per_token():
    """The swap loop's key product on int8 MMAs with two KV heads at head dim 128 and at head dim 256
    (measured faster), the fp16 planes with one head at head dim 128 (measured slower) and in the
    padded loops; ``int8_key_bytes`` moves the threshold."""
    t = tuned(small_tokens=100, swap_max_tokens=1 << 30, swap_pair_tokens=500)
    assert plan.int2_loop(128, 4, 8, 1000, t)[:2] == ("swap", 2) and plan.int2_loop(128, 4, 8, 1000, t).k_int8
    assert plan.int2_loop(256, 4, 8, 1000, t)[:2] == ("swap", 1) and plan.int2_loop(256, 4, 8, 1000, t).k_int8
    assert (
        plan.int2_loop(128, 4, 8, 400, t)[:2] == ("swap", 1) and not plan.int2_loop(128, 4, 8, 400, t).k_int8
    )
    assert not plan.int2_loop(128, 4, 8, 99, t).k_int8  # byte planes
    assert plan.int2_loop(128, 4, 8, 400, dataclasses.replace(t, int8_key_bytes=32)).k_int8
    assert not plan.int2_loop(128, 4, 8, 1000, dataclasses.replace(t, int8_key_bytes=65)).k_int8


@pytest.mark.parametrize(
    ("g", "kv_heads", "d", "want"),
    [
        (4, 8, 128, 2),  # Qwen3-8B: 2 x 4 query heads fill the 8 columns
        (3, 4, 128, 2),  # g = 3 is padded to 4
        (2, 8, 128, 2),  # 4 would fit the columns, not the 32 accumulator rows
        (1, 8, 128, 2),
        (4, 8, 256, 1),  # head dim 256: one head
        (8, 8, 128, 1),
        (16, 2, 128, 1),
        (2, 6, 128, 2),  # a power of two dividing the KV heads
        (1, 12, 128, 2),
        (4, 3, 128, 1),  # 2 does not divide 3 KV heads
        (4, 1, 128, 1),
    ],
)
def test_swap_heads_fill_the_mma_columns_within_the_register_budget(g, kv_heads, d, want):
    assert plan.swap_heads(g, kv_heads, d) == want


def test_swap_heads_is_a_power_of_two_under_the_tuning_cap():
    """``swap_heads`` caps the heads; a cap that is not a power of two rounds down."""
    assert plan.swap_heads(1, 8, 64, None, tuned(swap_heads=3)) == 2  # 8 columns and 64/8 rows would allow 4
    assert plan.swap_heads(1, 8, 64, None, tuned(swap_heads=1)) == 1


def test_swap_heads_take_one_head_below_swap_pair_tokens():
    """Small batches need every head's programs to fill the GPU: one head per swap program below
    ``swap_pair_tokens`` quantized tokens."""
    gt = T.swap_pair_tokens
    assert plan.swap_heads(4, 8, 128, gt - 1) == 1
    assert plan.swap_heads(4, 8, 128, gt) == 2
    assert plan.int2_loop(128, 4, 8, gt - 1)[:3] == ("swap", 1, T.swap_block_n)
    assert plan.int2_loop(128, 4, 8, gt)[:3] == ("swap", 2, T.swap_block_n // 2)


def test_split_size_fills_the_waves_of_per_sm_programs():
    a = plan.split_size(64, 32441, _lp("swap", 128), 132)
    b = plan.split_size(64, 32441, _lp("swap", 128), 132, tuned(per_sm=3))
    assert a == plan.wave_split(64, 32441, 128, 132 * 8, 256)
    assert b == plan.wave_split(64, 32441, 128, 132 * 3, 256)
    assert a != b


def test_min_split_sets_the_floor_of_both_split_rules():
    """The loop's ``min_split`` (the swap loop's, scaled by its heads per program) is the floor in
    the few-units rule and in the wave-filling one."""
    # 4 (sequence, head group) pairs: the few-units rule, bounded by the floor
    assert plan.split_size(4, 32768, _lp("words"), 132) == 256
    assert plan.split_size(4, 32768, _lp("words", min_split=128), 132) == 128
    assert plan.num_splits(4, 32768, 128) == 2 * plan.num_splits(4, 32768, 256)
    # many pairs on few SMs: the wave rule; a floor above its choice wins
    assert plan.wave_split(64, 4096, 64, 4096, 1024) == 1024
    assert plan.split_size(64, 4096, _lp("words", min_split=1024), 16, tuned(per_sm=64)) == 1024


def test_int2_loop_keeps_the_swap_loop_where_the_padded_loop_would_not_group_heads():
    """Above ``swap_max_tokens`` the padded loop wins only with grouped heads: with ``g`` not a
    power of two (one head per program) the swap loop stays."""
    t = tuned(small_tokens=0, swap_max_tokens=1000, group_tokens=500, swap_pair_tokens=500)
    assert plan.int2_loop(128, 3, 8, 5000, t).loop == "swap"
    assert plan.int2_loop(128, 4, 8, 5000, t).loop == "swap"  # two heads per swap program
    assert plan.int2_loop(128, 8, 8, 5000, t)[:2] == ("words", 2)  # one head per swap program
    assert plan.int2_loop(128, 4, 8, 5000, dataclasses.replace(t, swap_heads=1)).loop == "words"


def test_hp_split_size_keeps_hp_split_where_all_programs_fit_one_wave():
    """16-bit splits of ``hp_split`` tokens unless the INT2 programs and those exceed the slots;
    then about ``hp_programs`` 16-bit programs of whole tiles, within ``hp_split``."""
    # batch 1 / 128K: 8 units x (128 + 3) programs fit 1056 slots
    assert plan.hp_split_size(8, 128, 320, 16, 1056) == 128
    assert plan.hp_split_size(32, 32, 320, 16, 0) == 128  # slots unknown (the CPU, the byte path)
    # batch 8 / 32K, two heads per program: 32 x (32 + 3) > 1056: 10 splits of 32 tokens
    assert plan.hp_split_size(32, 32, 320, 16, 1056) == 32
    assert plan.hp_split_size(64, 16, 320, 16, 1056) == 64  # 5 splits
    assert plan.hp_split_size(128, 8, 320, 16, 1056) == 128  # 2.5 splits: capped at hp_split
    assert plan.hp_split_size(16, 64, 320, 16, 1056) == 16  # 20 splits: one tile each
    assert plan.hp_split_size(8, 200, 320, 16, 1056) == 16  # 40 would be shorter than a tile
    assert plan.hp_split_size(40, 32, 100, 32, 1056) == 32  # 8 splits of 13 tokens: one 32-token tile
    assert plan.hp_split_size(32, 32, 320, 16, 1056, tuned(hp_programs=0)) == 128
    # a tile longer than hp_split never makes the splits longer than hp_split
    assert plan.hp_split_size(64, 32, 320, 32, 1056, tuned(hp_split=16)) == 16


def test_taper_shortens_the_splits_that_start_after_the_first_wave():
    """Batch 32 / 32K at Qwen3-8B (two heads per program: 128 units of 8 splits of 4096 and 3
    16-bit splits of 128 tokens): 1056 - 384 slots leave 5 whole INT2 splits per unit in the
    first wave; the 3 after them are shorter by about ``taper · split_h`` positions."""
    t = plan.taper(128, 8, 3, 4096, 128, 32768, 64, 1056, tuned(taper=6.0))
    assert t.n_early == 5 and t.split % 64 == 0 and t.split_late % 64 == 0
    assert t.n_early * t.split + 3 * t.split_late >= 32768  # the splits still cover the list
    assert abs((t.split - t.split_late) - 6.0 * 128) <= 128  # within the tile roundings
    # no taper where every program fits the first wave, every INT2 split starts late, slots are
    # unknown or the taper is off
    assert plan.taper(128, 5, 3, 6554, 128, 32768, 64, 1056) == (5, 6554, 6554)
    assert plan.taper(128, 8, 9, 4096, 128, 32768, 64, 1056) == (8, 4096, 4096)
    assert plan.taper(128, 8, 3, 4096, 128, 32768, 64, 0) == (8, 4096, 4096)
    assert plan.taper(128, 8, 3, 4096, 128, 32768, 64, 1056, tuned(taper=0.0)) == (8, 4096, 4096)


@pytest.mark.parametrize("rate", [0.5, 4.0, 9.0, 100.0])
@pytest.mark.parametrize(("units", "n_q", "n_h", "max_len", "tile"), [(32, 32, 10, 32768, 64), (128, 8, 3, 32700, 64),
                                                                        (64, 16, 5, 16384, 32), (8, 30, 100, 5000, 16)])  # fmt: skip
def test_taper_always_covers_the_list_in_whole_tiles(units, n_q, n_h, max_len, tile, rate):
    split = math.ceil(max_len / n_q / tile) * tile
    t = plan.taper(units, n_q, n_h, split, 32, max_len, tile, 1056, tuned(taper=rate))
    assert 0 < t.n_early <= n_q and t.split_late <= t.split
    assert t.n_early * t.split + (n_q - t.n_early) * t.split_late >= max_len
    assert t.split_late >= tile and t.split_late % tile == 0 and t.split % tile == 0


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "d", "lens", "loop", "grid"),
    [
        (8, 32, 8, 128, (32448, 320), "swap", (4, 8, 42)),  # two heads per program, 16-bit splits first
        (1, 32, 8, 128, (3776, 320), "bytes", (8, 18, 1)),  # small: byte planes, (group, split, seq)
        (32, 64, 8, 128, (130752, 320), "words", (4, 32, 11)),  # g = 8 above swap_max_tokens: grouped
        (8, 9, 3, 64, (7872, 320), "bytes", (3, 34, 8)),  # head dim 64
    ],
)
def test_plan_at_known_shapes(b, hq, hkv, d, lens, loop, grid):
    """The whole plan on a 132-SM device: its loop, that the splits cover every list, and the grid
    the planner computed before its tuning became a frozen object (recorded offline)."""
    p = plan.plan(b, hq, hkv, d, lens, "cpu", tuned(sms=132))
    assert p.lp.loop == loop and p.grid == grid and p.hp_first == (loop != "bytes")
    s = p.splits
    assert s.n_early * s.split + (p.n_q_splits - s.n_early) * s.split_late >= lens[0]
    assert p.split_h * (p.total - p.n_q_splits) >= lens[1]
    assert plan.plan(b, hq, hkv, d, lens, "cpu", tuned(sms=132)) is p  # cached: one per batch step


def test_plan_refuses_head_dims_and_head_counts_it_cannot_launch():
    with pytest.raises(ValueError, match="head_dim must be 64, 128 or 256"):
        plan.plan(1, 4, 4, 192, (10, 10))
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        plan.plan(1, 6, 4, 128, (10, 10))


def test_every_tuning_field_is_checked():
    """Each field belongs to one of the validation groups (a new field cannot skip the checks)."""
    from oscarkv.kernels.triton.decode import tuning

    groups = (tuning._TILES, tuning._POWERS, tuning._COUNTS, tuning._SIZES, tuning._FLAGS, tuning._RATES)
    names = [n for g in groups for n in g]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(DecodeTuning))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("merge_d", 48, "power of two"),
        ("merge_d", 0, "power of two"),
        ("swap_block_n", 96, "power of two >= 16"),
        ("swap_block_n", 128.0, "power of two >= 16"),
        ("hp_block", 8, "power of two >= 16"),
        ("swap_heads", 0, "positive integer"),
        ("per_sm", 2.5, "positive integer"),
        ("hp_programs", -1, "integer >= 0"),
        ("swap_pair_tokens", "64K", "integer >= 0"),
        ("pdl", 1, "True or False"),
        ("taper", -1.0, "finite number >= 0"),
        ("taper", float("nan"), "finite number >= 0"),
        ("taper", True, "finite number >= 0"),
        ("min_waves", 9, "min_waves must be <= max_waves"),
    ],
)
def test_decode_tuning_refuses_values_the_launch_cannot_honour(field, value, match):
    with pytest.raises(ValueError, match=match):
        tuned(**{field: value})
