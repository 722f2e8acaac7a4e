"""The decode launch plan (host side): split sizes that fill whole waves of programs."""

from __future__ import annotations

import math

import pytest

from oscarkv.kernels.triton import decode_plan as plan


@pytest.mark.parametrize(
    ("units", "max_len", "block_n", "slots"),
    [(8, 130745, 64, 1056), (64, 32441, 64, 1056), (256, 130745, 32, 1056), (3, 100, 64, 16), (1, 5, 32, 4)],
)
def test_wave_split_is_whole_tiles_and_fills_the_waves_it_pays_for(units, max_len, block_n, slots):
    split = plan.wave_split(units, max_len, block_n, slots)
    assert split % block_n == 0 and split >= min(plan.CONFIG["min_split"], max_len)
    programs = math.ceil(max_len / split) * units
    waves = math.ceil(programs / slots)
    cost = waves * (split + plan.CONFIG["split_cost"])
    # no other whole-tile split is cheaper by the same cost model
    for other in range(block_n, max(max_len, block_n) + block_n, block_n):
        if other < min(plan.CONFIG["min_split"], math.ceil(max_len / block_n) * block_n):
            continue
        w = math.ceil(math.ceil(max_len / other) * units / slots)
        if w <= plan.CONFIG["max_waves"]:
            assert cost <= w * (other + plan.CONFIG["split_cost"])


def test_wave_split_hand_computed_cases():
    # 8 (sequence, head group) pairs of 128K tokens on 1056 slots: 128 splits of 1024 tokens =
    # 1024 programs, one wave (decode_attention itself keeps programs_few for <= few_units pairs)
    assert plan.wave_split(8, 130745, 64, 1056) == 1024
    # batch 8 / 32K: one wave of 16 splits of 2048 tokens beats 3 waves of 704
    assert plan.wave_split(64, 32441, 64, 1056) == 2048


def test_wave_split_min_waves(monkeypatch):
    monkeypatch.setitem(plan.CONFIG, "min_waves", 3)
    split = plan.wave_split(64, 32441, 64, 1056)
    assert split == 704 and math.ceil(32441 / split) * 64 <= 3 * 1056


def test_wave_split_edges(monkeypatch):
    # an empty or tiny list is one tile
    assert plan.wave_split(4, 0, 64, 16) == 64
    assert plan.wave_split(4, 5, 64, 16) == 64
    # the min_split floor is rounded up to whole tiles
    monkeypatch.setitem(plan.CONFIG, "min_split", 100)
    assert plan.wave_split(64, 10_000, 64, 10_000) == 128
    with pytest.raises(ValueError, match="units, slots and block_n"):
        plan.wave_split(0, 100, 64, 16)
    monkeypatch.setitem(plan.CONFIG, "min_waves", 9)
    with pytest.raises(ValueError, match="min_waves"):
        plan.wave_split(4, 100, 64, 16)


def test_split_size_picks_the_rule_and_follows_config_edits(monkeypatch):
    # word-plane path, 64 pairs > few_units: the wave rule
    assert plan.split_size(8, 8, 32441, 64, 132, True) == plan.wave_split(64, 32441, 64, 132 * 8)
    # byte path, or no SM count: about CONFIG['programs'] programs, splits in multiples of 256
    assert plan.split_size(8, 8, 32441, 64, 132, False) == 768
    assert plan.split_size(8, 8, 32441, 64, 0, True) == 768
    # few pairs: programs_few (1024 programs = 128 splits of 1024 tokens)
    assert plan.split_size(1, 8, 130745, 64, 132, True) == 1024
    # the cache keys on the CONFIG entries it reads
    monkeypatch.setitem(plan.CONFIG, "fill_waves", False)
    assert plan.split_size(8, 8, 32441, 64, 132, True) == 768
    monkeypatch.setitem(plan.CONFIG, "split_gran", 64)
    assert plan.split_size(8, 8, 32441, 64, 132, True) == 704


def test_int2_loop_picks_bytes_swap_or_the_padded_words_by_size(monkeypatch):
    """Byte planes below ``small_tokens`` and for head dim 64; the swap loop (``swap_heads`` KV heads
    per program, the query heads rounded up to a power of two) up to ``swap_max_tokens``; above it,
    or with ``swap`` off, the padded word loop, whose KV heads are grouped from ``group_tokens``."""
    for key, val in (("small_tokens", 100), ("swap", True), ("swap_max_tokens", 1000), ("group_tokens", 500),
                     ("swap_pair_tokens", 500)):  # fmt: skip
        monkeypatch.setitem(plan.CONFIG, key, val)
    assert plan.int2_loop(128, 4, 8, 99).loop == "bytes"
    assert plan.int2_loop(64, 4, 8, 10_000).loop == "bytes"
    lp = plan.int2_loop(128, 3, 8, 999)
    # two KV heads of 4 (padded) query heads fill the 8 columns; the tile keeps its code bytes
    assert (lp.loop, lp.hpb, lp.rows, lp.block_n) == ("swap", 2, 4, plan.CONFIG["swap_block_n"] // 2)
    assert lp.per_sm == plan.CONFIG["swap_per_sm"]
    assert plan.int2_loop(256, 4, 8, 999)[1:3] == (1, plan.CONFIG["swap_block_n"] // 2)  # same tile bytes
    assert lp.min_split == plan.CONFIG["min_split"] // 2  # the same head-tokens per program
    monkeypatch.setitem(plan.CONFIG, "swap_heads", 1)
    assert plan.int2_loop(128, 4, 8, 999)[:3] == ("swap", 1, plan.CONFIG["swap_block_n"])
    monkeypatch.setitem(plan.CONFIG, "swap_heads", 8)
    assert plan.int2_loop(128, 4, 8, 1000)[:2] == ("swap", 2)  # several heads: the swap loop at any size
    lp = plan.int2_loop(256, 4, 8, 1000)  # one head per swap program: grouped padded heads
    assert (lp.loop, lp.hpb, lp.rows, lp.per_sm) == ("words", 4, 16, None)
    monkeypatch.setitem(plan.CONFIG, "swap", False)
    lp = plan.int2_loop(128, 4, 8, 400)
    assert (lp.loop, lp.hpb, lp.rows) == ("words", 1, 16)


def test_int2_loop_takes_int8_keys_where_a_program_reads_64_key_bytes_per_token(monkeypatch):
    """The swap loop's key product on int8 MMAs (decode_kint8.py) with two KV heads at head dim 128
    and at head dim 256 (measured faster), the fp16 planes with one head at head dim 128 (measured
    slower) and in every other loop; ``CONFIG['swap_k_int8']`` off turns it off everywhere."""
    for key, val in (("small_tokens", 100), ("swap", True), ("swap_max_tokens", 1 << 30),
                     ("swap_pair_tokens", 500), ("swap_k_int8", True)):  # fmt: skip
        monkeypatch.setitem(plan.CONFIG, key, val)
    assert plan.int2_loop(128, 4, 8, 1000)[:2] == ("swap", 2) and plan.int2_loop(128, 4, 8, 1000).k_int8
    assert plan.int2_loop(256, 4, 8, 1000)[:2] == ("swap", 1) and plan.int2_loop(256, 4, 8, 1000).k_int8
    assert plan.int2_loop(128, 4, 8, 400)[:2] == ("swap", 1) and not plan.int2_loop(128, 4, 8, 400).k_int8
    assert not plan.int2_loop(128, 4, 8, 99).k_int8  # byte planes
    monkeypatch.setitem(plan.CONFIG, "swap", False)
    assert not plan.int2_loop(128, 4, 8, 1000).k_int8  # padded word loop
    monkeypatch.setitem(plan.CONFIG, "swap", True)
    monkeypatch.setitem(plan.CONFIG, "swap_k_int8", False)
    assert not plan.int2_loop(128, 4, 8, 1000).k_int8


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


def test_swap_heads_is_a_power_of_two_under_the_config_cap(monkeypatch):
    """``CONFIG['swap_heads']`` caps the heads; a cap that is not a power of two rounds down."""
    monkeypatch.setitem(plan.CONFIG, "swap_heads", 3)
    assert plan.swap_heads(1, 8, 64) == 2  # 8 columns and 64/8 rows would allow 4
    monkeypatch.setitem(plan.CONFIG, "swap_heads", 1)
    assert plan.swap_heads(1, 8, 64) == 1


def test_swap_heads_take_one_head_below_swap_pair_tokens():
    """Small batches need every head's programs to fill the GPU: one head per swap program below
    ``CONFIG['swap_pair_tokens']`` quantized tokens."""
    gt = plan.CONFIG["swap_pair_tokens"]
    assert plan.swap_heads(4, 8, 128, gt - 1) == 1
    assert plan.swap_heads(4, 8, 128, gt) == 2
    assert plan.int2_loop(128, 4, 8, gt - 1)[:3] == ("swap", 1, plan.CONFIG["swap_block_n"])
    assert plan.int2_loop(128, 4, 8, gt)[:3] == ("swap", 2, plan.CONFIG["swap_block_n"] // 2)


def test_split_size_fills_the_waves_of_the_given_programs_per_sm():
    """``per_sm`` (the swap loop's ``CONFIG['swap_per_sm']``) sets the wave size; None means
    ``CONFIG['per_sm']``."""
    a = plan.split_size(8, 8, 32441, 128, 132, True, 8)
    b = plan.split_size(8, 8, 32441, 128, 132, True, 3)
    assert a == plan.wave_split(64, 32441, 128, 132 * 8)
    assert b == plan.wave_split(64, 32441, 128, 132 * 3)
    assert a != b
    assert plan.split_size(8, 8, 32441, 128, 132, True) == plan.wave_split(
        64, 32441, 128, 132 * plan.CONFIG["per_sm"]
    )


def test_min_split_sets_the_floor_of_both_split_rules():
    """``min_split`` (the swap loop's, scaled by its heads per program) replaces
    ``CONFIG['min_split']`` in the few-units rule and in the wave-filling one."""
    # 4 (sequence, head group) pairs: the few-units rule, bounded by the floor
    assert plan.split_size(1, 4, 32768, 64, 132, True) == 256
    assert plan.split_size(1, 4, 32768, 64, 132, True, 8, 128) == 128
    assert plan.num_splits(1, 4, 32768, 128) == 2 * plan.num_splits(1, 4, 32768)
    # many pairs on few SMs: the wave rule; a floor above its choice wins
    assert plan.wave_split(64, 4096, 64, 4096, 1024) == 1024
    assert plan.split_size(16, 4, 4096, 64, 16, True, 64, 1024) == 1024


def test_int2_loop_keeps_the_swap_loop_where_the_padded_loop_would_not_group_heads(monkeypatch):
    """Above ``swap_max_tokens`` the padded loop wins only with grouped heads: with ``g`` not a
    power of two (one head per program) the swap loop stays."""
    for key, val in (("small_tokens", 0), ("swap", True), ("swap_max_tokens", 1000), ("group_tokens", 500),
                     ("swap_pair_tokens", 500)):  # fmt: skip
        monkeypatch.setitem(plan.CONFIG, key, val)
    assert plan.int2_loop(128, 3, 8, 5000).loop == "swap"
    assert plan.int2_loop(128, 4, 8, 5000).loop == "swap"  # two heads per swap program
    assert plan.int2_loop(128, 8, 8, 5000)[:2] == ("words", 2)  # one head per swap program
    monkeypatch.setitem(plan.CONFIG, "swap_heads", 1)
    assert plan.int2_loop(128, 4, 8, 5000).loop == "words"


def test_hp_split_size_keeps_hp_split_where_all_programs_fit_one_wave(monkeypatch):
    """16-bit splits of ``CONFIG['hp_split']`` tokens unless the INT2 programs and those exceed
    the slots; then about ``hp_programs`` 16-bit programs of whole tiles, within ``hp_split``."""
    monkeypatch.setitem(plan.CONFIG, "hp_split", 128)
    monkeypatch.setitem(plan.CONFIG, "hp_programs", 320)
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
    monkeypatch.setitem(plan.CONFIG, "hp_programs", 0)
    assert plan.hp_split_size(32, 32, 320, 16, 1056) == 128
    # a tile longer than hp_split never makes the splits longer than hp_split
    monkeypatch.setitem(plan.CONFIG, "hp_programs", 320)
    monkeypatch.setitem(plan.CONFIG, "hp_split", 16)
    assert plan.hp_split_size(64, 32, 320, 32, 1056) == 16


def test_taper_shortens_the_splits_that_start_after_the_first_wave(monkeypatch):
    """Batch 32 / 32K at Qwen3-8B (two heads per program: 128 units of 8 splits of 4096 and 3
    16-bit splits of 128 tokens): 1056 - 384 slots leave 5 whole INT2 splits per unit in the
    first wave; the 3 after them are shorter by about ``taper · split_h`` positions."""
    monkeypatch.setitem(plan.CONFIG, "taper", 6.0)
    t = plan.taper(128, 8, 3, 4096, 128, 32768, 64, 1056)
    assert t.n_early == 5 and t.split % 64 == 0 and t.split_late % 64 == 0
    assert t.n_early * t.split + 3 * t.split_late >= 32768  # the splits still cover the list
    assert abs((t.split - t.split_late) - 6.0 * 128) <= 128  # within the tile roundings
    # no taper where every program fits the first wave, every INT2 split starts late, slots are
    # unknown or the taper is off
    assert plan.taper(128, 5, 3, 6554, 128, 32768, 64, 1056) == (5, 6554, 6554)
    assert plan.taper(128, 8, 9, 4096, 128, 32768, 64, 1056) == (8, 4096, 4096)
    assert plan.taper(128, 8, 3, 4096, 128, 32768, 64, 0) == (8, 4096, 4096)
    monkeypatch.setitem(plan.CONFIG, "taper", 0)
    assert plan.taper(128, 8, 3, 4096, 128, 32768, 64, 1056) == (8, 4096, 4096)


@pytest.mark.parametrize("rate", [0.5, 4.0, 9.0, 100.0])
@pytest.mark.parametrize(("units", "n_q", "n_h", "max_len", "tile"), [(32, 32, 10, 32768, 64), (128, 8, 3, 32700, 64),
                                                                        (64, 16, 5, 16384, 32), (8, 30, 100, 5000, 16)])  # fmt: skip
def test_taper_always_covers_the_list_in_whole_tiles(units, n_q, n_h, max_len, tile, rate, monkeypatch):
    monkeypatch.setitem(plan.CONFIG, "taper", rate)
    split = math.ceil(max_len / n_q / tile) * tile
    t = plan.taper(units, n_q, n_h, split, 32, max_len, tile, 1056)
    assert 0 < t.n_early <= n_q and t.split_late <= t.split
    assert t.n_early * t.split + (n_q - t.n_early) * t.split_late >= max_len
    assert t.split_late >= tile and t.split_late % tile == 0 and t.split % tile == 0
