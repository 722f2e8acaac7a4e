"""Tuning of the Triton decode attention: one frozen object, validated once.

Every number was measured on one H200 (torch 2.11, Triton 3.6) side by side with its
alternatives; the line above each field says what it sets and why it has its value. Build
variants with ``dataclasses.replace(DEFAULT_TUNING, ...)`` and pass them to
:func:`~oscarkv.kernels.triton.decode.plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["DEFAULT_TUNING", "DecodeTuning"]

# fields by the check they get
_TILES = ("words_block_n", "swap_block_n", "bytes_block_n", "hp_block", "swap_hp_block", "bf16_block")
_POWERS = ("merge_d",)
_COUNTS = ("num_warps", "bytes_warps", "bf16_stages", "bf16_warps", "bf16_min_split", "num_stages", "hp_stages", "swap_hp_stages", "merge_warps", "swap_heads",
           "per_sm", "hp_split", "min_split", "split_gran", "programs", "programs_few", "min_waves", "max_waves")  # fmt: skip
_SIZES = ("small_tokens", "swap_max_tokens", "swap_pair_tokens", "group_tokens", "int8_key_bytes", "few_units",
          "split_cost", "sms", "hp_programs", "bf16_per_sm")  # fmt: skip
_FLAGS = ("pdl",)
_RATES = ("taper",)


@dataclass(frozen=True)
class DecodeTuning:
    """Launch tuning of :func:`~oscarkv.kernels.triton.decode.decode_attention` (see ``docs/kernels.md``)."""

    # -- which INT2 tile loop runs (planner.int2_loop) -------------------------------------------
    # below this many quantized tokens (batch x longest list), and at head dim 64, the byte-plane
    # loop: 1.05-1.55x SDPA at batch 1 / 4K-16K against 0.78-1.43x for the word planes
    small_tokens: int = 24576
    # from here the padded word loop with grouped KV heads wherever the swap loop would take one
    # head per program: at batch 32 / 128K 3.33-3.38x SDPA against 3.10-3.35x for one-head swap
    swap_max_tokens: int = 3 << 20
    # from here a swap program takes several KV heads (up to swap_heads): below it two heads
    # measured 25-38% slower at 32K tokens (small batches need every head's programs)
    swap_pair_tokens: int = 65536
    # most KV heads per swap program (their query heads fill the MMA's 8 columns)
    swap_heads: int = 8
    # from here the padded loops group KV heads so their query heads fill 16 MMA rows (grouping
    # wins from batch x length ~ 256K tokens, loses below)
    group_tokens: int = 262144
    # the swap loop's key product on int8 MMAs where a program reads >= this many key bytes per
    # token (two heads at head dim 128, head dim 256): batch 8 / 32K 0.0585 -> 0.0562 ms; with one
    # head at head dim 128 it lost (1 / 32K 0.0152 -> 0.0158 ms)
    int8_key_bytes: int = 64
    # -- tiles, warps and pipelines -------------------------------------------------------------
    # one-warp programs (no CTA barriers in the tile loop) beat 4-warp ones at every shape
    num_warps: int = 1
    # pipeline depth of the INT2 loads (cp.async stages)
    num_stages: int = 3
    # padded word loop (it always groups KV heads): tokens per tile
    words_block_n: int = 32
    # swap loop: the code bytes of 128 tokens of one head-dim-128 head per tile (at head dim 256,
    # 128-token tiles spill: 93 local-memory instructions per tile against 30 at 64)
    swap_block_n: int = 128
    # byte-plane loop: its own 4-warp launch with 128-token tiles
    bytes_block_n: int = 128
    bytes_warps: int = 4
    # 16-bit tier (sink + window, <= 327 tokens by default): tokens per split, tile and pipeline
    # depth; compiled into the INT2 loop's kernel, so its registers can set the whole kernel's
    hp_split: int = 128
    hp_block: int = 32
    hp_stages: int = 3
    # in the swap kernel: 16-token tiles and 2 stages keep it at the swap loop's own registers
    # (248 with two heads of 64-token tiles, offline sm_90)
    swap_hp_block: int = 16
    swap_hp_stages: int = 2
    # -- splits ---------------------------------------------------------------------------------
    # byte-plane loop and few (sequence, head group) pairs: about this many programs in flight,
    # programs_few at most few_units pairs (batch 1 / 128K: 2.5x vs 2.0x SDPA), >= min_split
    # tokens each, rounded to split_gran tokens where that keeps the split count
    programs: int = 3072
    programs_few: int = 1024
    few_units: int = 16
    min_split: int = 256
    split_gran: int = 256
    # word and swap loops with more than few_units pairs: splits that fill whole waves of
    # sms x per_sm one-warp programs (sms 0: the device's count), min_waves..max_waves waves, a
    # program's fixed cost split_cost tokens: batch 8 / 32K 0.0949 -> 0.0841 ms, 32 / 32K 0.331 ->
    # 0.309 against ~programs programs
    per_sm: int = 8
    sms: int = 0
    min_waves: int = 1
    max_waves: int = 8
    split_cost: int = 160
    # where the 16-bit programs (launched first) and the INT2 ones overflow one wave: about this
    # many 16-bit programs in all (0: always hp_split tokens), so they free their slots sooner
    hp_programs: int = 320
    # INT2 splits that start after the first wave are shorter by this many positions per token of
    # a 16-bit split (0: off): 1-3% at most shapes (batch 8 / 32K 0.0604 -> 0.0586 ms); 7-10 lose
    taper: float = 4.0
    # -- lists without INT2 tokens (the BF16 engine: every token in 16-bit pages) --------------
    # the byte loop's 16-bit tile, pipeline depth and warps, and the splits: with bf16_per_sm > 0
    # wave-filling splits (wave_split over sms x bf16_per_sm programs, at least bf16_min_split
    # tokens), else hp_split tokens each. Swept on the H200 (benchmarks/bf16_paged_decode.py):
    # 64 / 2 / 4 with 4 programs per SM reads 16-bit pages at 0.96-0.99x cuDNN SDPA on contiguous
    # BF16 (batch 1-32, 8K-128K); 32 / 3 with hp_split tokens per program was 0.74-0.89x
    bf16_block: int = 64
    bf16_stages: int = 2
    bf16_warps: int = 4
    bf16_per_sm: int = 4
    bf16_min_split: int = 256
    # -- merge ----------------------------------------------------------------------------------
    # the merge as a programmatic dependent launch of stage 1 (compute capability >= 9)
    pdl: bool = True
    # merge: head dims per program and its warps
    merge_d: int = 32
    merge_warps: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v, name = getattr(self, f.name), f.name
            whole = isinstance(v, int) and not isinstance(v, bool)
            if name in _TILES and not (whole and v >= 16 and v & (v - 1) == 0):
                raise ValueError(f"DecodeTuning.{name} must be a power of two >= 16 (tokens per tile: tl.dot "
                                 f"needs 16); got {v!r}")  # fmt: skip
            if name in _POWERS and not (whole and v >= 1 and v & (v - 1) == 0):
                raise ValueError(f"DecodeTuning.{name} must be a power of two; got {v!r}")
            if name in _COUNTS and not (whole and v >= 1):
                raise ValueError(f"DecodeTuning.{name} must be a positive integer; got {v!r}")
            if name in _SIZES and not (whole and v >= 0):
                raise ValueError(f"DecodeTuning.{name} must be an integer >= 0; got {v!r}")
            if name in _FLAGS and not isinstance(v, bool):
                raise ValueError(f"DecodeTuning.{name} must be True or False; got {v!r}")
            if name in _RATES and (
                isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf
            ):
                raise ValueError(f"DecodeTuning.{name} must be a finite number >= 0; got {v!r}")
        if self.min_waves > self.max_waves:
            raise ValueError(
                f"DecodeTuning: min_waves must be <= max_waves; got {self.min_waves} and {self.max_waves}"
            )


DEFAULT_TUNING = DecodeTuning()
