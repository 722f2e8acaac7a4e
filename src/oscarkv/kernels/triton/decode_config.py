"""Tuning of the Triton decode attention: the ``CONFIG`` dict that :mod:`.decode_plan` and
:mod:`.decode_attention` read on every call (sweeps edit it in place; ``decode_attention`` checks
the values). Each entry says what it sets and the H200 measurement behind its value."""

from __future__ import annotations

__all__ = ["CONFIG"]

# Tuning, from the H200 sweeps of benchmarks/decode_variants.py (results/decode_variants_w1.md):
# one-warp programs (no CTA barriers in the tile loop) beat 4-warp ones at every shape; tiles of
# 64 tokens for one KV head per program, 32 when a program takes several KV heads. Split count:
# the word-plane path with more than ``few_units`` (sequence, head group) pairs fills whole waves
# (``fill_waves``, below; on CUDA or with ``sms`` set); otherwise about ``programs`` programs, but
# ``programs_few`` when there are at most ``few_units`` pairs, whose splits would otherwise get
# too short (batch 1 / 128K: 2.5x vs 2.0x SDPA; batch 8 / 128K: 3.3x vs 2.8x)
CONFIG = {
    "block_n": 64,
    "block_n_grouped": 32,
    "num_warps": 1,
    "num_stages": 3,
    "programs": 3072,
    "programs_few": 1024,
    "few_units": 16,
    "min_split": 256,
    # splits are multiples of this many tokens (a multiple of every tile size) when that leaves
    # the planned split count, otherwise of the tile
    "split_gran": 256,
    "rows": 16,
    "group_tokens": 262144,
    # below ``small_tokens`` quantized tokens (batch x longest list), and for head dim 64, the byte
    # planes of decode_tiles.py with their own launch (4 warps, 128-token tiles): at batch 1 and
    # 4K-16K they measured 1.05-1.55x SDPA against 0.78-1.43x for the word planes
    "small_tokens": 24576,
    "bytes": {"block_n": 128, "num_warps": 4},
    # opt-in, measured slower on the H200 (results/decode_variants_tg.md): with one KV head per
    # program, split each word-plane tile into 16 / g token groups so that the 16 MMA rows are
    # (group, query head) pairs, no padding rows (decode_groups.py); taken for g <= 8 (power of
    # two) when a group still has >= 16 tokens
    "token_groups": False,
    # the split partial outputs (written by stage 1, read by the merge): "fp32" or "fp16"
    "partials": "fp32",
    # merge: dims per program (head dim = one program per query row) and warps
    "merge_d": 32,
    "merge_warps": 1,
    # 16-bit tier (at most sink + recent + 7 = 327 tokens by default): tokens per split and per
    # tile, and its loop's pipeline depth. Its loop is compiled into the same kernel as the INT2
    # loop, so its register need can set the whole kernel's allocation
    "hp_split": 128,
    "hp_block": 32,
    "hp_stages": 3,
    # register cap of the word-plane launch (0: none); 200 allows 10 one-warp programs per SM
    "maxnreg": 0,
    # split rule of the word-plane path when there are more than ``few_units`` (sequence, head
    # group) pairs (see the module docstring): fill whole waves of ``sms`` x ``per_sm`` programs
    # (``sms`` 0: the device's SM count; ``per_sm``: one-warp programs at 255 registers; a
    # ``maxnreg`` cap changes how many fit, and ``per_sm`` must then be set to match),
    # ``min_waves`` to ``max_waves``, a program's fixed cost in tokens. H200, side by side
    # (results/decode_variants_waves_{a,b}.md): batch 8 / 32K 0.0949 -> 0.0841 ms, 32 / 32K 0.331 ->
    # 0.309, 32 / 128K 1.136 -> 1.103; with few units (batch 1-2 / 128K, 8 / 128K) it lost up to
    # 5%, so they keep the ``programs_few`` rule
    "fill_waves": True,
    "sms": 0,
    "per_sm": 8,
    "min_waves": 1,
    "max_waves": 8,
    "split_cost": 160,
    # word-plane path: launch the 16-bit tier's programs first (grid: head group, sequence,
    # split), so that the short programs do not trail the INT2 ones into an extra wave (batch
    # 16 / 32K 0.187 -> 0.169 ms; the byte path lost 4% at batch 1 / 16K and keeps the old grid)
    "hp_first": True,
    # the word-plane path's loop: tokens as the MMA rows and the query heads as its N side
    # (decode_swap.py) instead of the query heads padded to 16 rows (the padded loops, and so
    # token_groups, only with swap off or from swap_max_tokens); its tile (the code bytes of
    # swap_block_n tokens of one head dim 128 head), the 16-bit tier's tile and pipeline depth in
    # that kernel (16 tokens and 2 stages keep the kernel at the swap loop's own registers, 248
    # with 2 heads of 64-token tiles, offline sm_90), and the one-warp programs per SM that then
    # fit (for the wave-filling splits)
    "swap": True,
    # from this many quantized tokens (batch x longest list) the grouped padded loop instead where
    # the swap loop takes one KV head per program (swap_heads returns 1: g >= 5, head dim 256, an
    # odd number of KV heads) and the padded loop would group heads: at batch 32 / 128K one-head
    # swap measured 3.10-3.35x SDPA against 3.33-3.38x for the grouped loop (results/dv_swap_c.md,
    # gpu_check.md at 2bafed1, dv_s10_pairs.md); the two-head swap loop measured 4.44x there
    "swap_max_tokens": 3 << 20,
    "swap_block_n": 128,
    "swap_hp_block": 16,
    "swap_hp_stages": 2,
    "swap_per_sm": 8,
    # KV heads one swap program takes at most (decode_plan.swap_heads: their query heads fill the
    # MMA's 8 columns, 2 at g = 4); 1 for one head per program, the session-9 loop
    "swap_heads": 8,
    # H200 measurements of the three below: docs/kernels.md, "Where the time goes" (session 11).
    # The merge as a programmatic dependent launch of stage 1 (compute capability >= 9)
    "pdl": True,
    # word-plane path, where the INT2 programs and the 16-bit ones of hp_split tokens overflow one
    # wave of slots: about this many 16-bit programs in all (whole 16-bit tiles, at most
    # hp_split tokens; 0: always hp_split), so that they free their slots sooner
    "hp_programs": 320,
    # from this many quantized tokens (batch x longest list) a swap program takes several KV heads
    # (swap_heads; below it one head per program)
    "swap_pair_tokens": 65536,
    # word-plane path, where the 16-bit programs (launched first) leave too few slots for every
    # INT2 program: the INT2 splits launched after the first wave start about when the 16-bit
    # programs end, so they get fewer slot-list positions and the others more (decode_plan.taper):
    # the late ones are shorter by this many positions per token of a 16-bit split (0: off).
    # H200, side by side (results/dv_s12_taper.md, dv_s12_vote.md): 4 gains 1-3% at most shapes
    # (batch 8 / 32K 0.0604 -> 0.0586 ms, 4 / 32K 0.0358 -> 0.0349), 7-10 lose at some; small,
    # because an SM's throughput, not a program's latency, sets most of the time
    "taper": 4.0,
    # the swap loop's key product on int8 MMAs (decode_kint8.py: four codes per operand register,
    # the queries as two int8 parts), taken where a program reads >= 64 key bytes per token (two
    # heads at head dim 128, head dim 256). H200, side by side (results/dv_s15_kint8.md,
    # dv_s15_kint8_d256.md): batch 8 / 32K 0.0585 -> 0.0562 ms, 32 / 32K 0.218 -> 0.208, 8 / 64K
    # -4%, 8 / 128K -1.5..-4.4%, 32 / 8K and 32 / 128K under 1%, head dim 256 -5% (0 at batch 1);
    # with one head at head dim 128 it lost (1 / 32K 0.0152 -> 0.0158), so there the fp16 planes stay
    "swap_k_int8": True,
}
