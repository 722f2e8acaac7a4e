"""The launch plan of the Triton decode attention (host side, no Triton): which INT2 tile loop,
how many KV heads per program, how each tier's slot lists are split, and the grids.

:func:`plan` is the one entry point. It is pure in its arguments (cached), so a batch step can
compute it once and pass it to every layer's ``decode_attention``. The rules:

- **Loop** (:func:`int2_loop`): the byte-plane loop below ``small_tokens`` quantized tokens, at
  head dim 64 and for 4-bit keys (the only loop that reads them); otherwise the swap loop (tokens
  as MMA rows), except where it would take one KV head per program above ``swap_max_tokens`` and
  the padded word loop can group heads.
- **Live lengths**: the split sizes below are planned for the longest lists (``lens``, a graph's
  length bucket); each list's splits are scaled to its own length in the kernel
  (:func:`live_split`), so every program has work when the lists are shorter than the plan.
- **Splits of the INT2 lists**: the word and swap loops with more than ``few_units`` (sequence,
  head group) pairs fill whole waves of ``sms x per_sm`` programs (:func:`wave_split`: the wave
  count with the lowest ``waves x (split + split_cost)``); otherwise about ``programs`` programs
  (:func:`num_splits`). The 16-bit splits are launched first on the word and swap loops and cut
  to about ``hp_programs`` programs where both tiers overflow a wave (:func:`hp_split_size`);
  the INT2 splits that then start after the first wave get fewer positions (:func:`taper`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..launch import device_facts
from .tuning import DEFAULT_TUNING, DecodeTuning

__all__ = ["LOOPS", "MMA_ROWS", "DecodePlan", "Int2Loop", "Taper", "heads_per_program", "hp_split_size",
           "int2_loop", "live_split", "num_splits", "plan", "split_size", "swap_heads", "taper", "wave_split"]  # fmt: skip

#: the INT2 tile loops, by the id the kernel's ``LOOP`` constexpr takes
LOOPS = ("bytes", "words", "swap")
#: rows of one MMA instruction: the padded loops fill them with query heads
MMA_ROWS = 16


def _round_up(x: float, step: int) -> int:
    """The smallest multiple of ``step`` that is ``>= x``."""
    return math.ceil(x / step) * step


def live_split(n: int, split: int, planned: int, tile: int) -> int:
    """Positions per split the kernel gives a list of ``n`` tokens from a plan made for lists of
    ``planned`` tokens in splits of ``split`` (the host twin of ``common.live_split``): scaled by
    ``n / planned``, rounded up to whole tiles. A plan made for a padded length bucket then spreads
    each list over all of its splits."""
    return _round_up(-(-n * split // max(planned, 1)), tile)


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def heads_per_program(
    g: int, kv_heads: int, tokens: int | None = None, t: DecodeTuning = DEFAULT_TUNING
) -> int:
    """KV heads one padded-loop program takes: enough for ``MMA_ROWS`` query rows, at most 8, a
    divisor of ``kv_heads``; 1 when ``g`` is not a power of two or below ``t.group_tokens``."""
    if g & (g - 1) or (tokens is not None and tokens < t.group_tokens):
        return 1
    hpb = max(1, min(8, kv_heads, MMA_ROWS // g))
    while kv_heads % hpb:
        hpb -= 1
    return hpb


def swap_heads(
    g: int, kv_heads: int, d: int, tokens: int | None = None, t: DecodeTuning = DEFAULT_TUNING
) -> int:
    """KV heads per swap-loop program: 1 below ``t.swap_pair_tokens``; otherwise the most heads
    whose query heads (``g`` rounded up to a power of two each) fit the MMA's 8 columns, with at
    most 32 accumulator rows (``hp·d/8``: 2 at head dim 128, 1 at 256), at most
    ``t.swap_heads``, a power of two and a divisor of ``kv_heads``."""
    if tokens is not None and tokens < t.swap_pair_tokens:
        return 1
    hp = max(1, min(t.swap_heads, kv_heads, 8 // _pow2(g), 256 // d))
    hp = 1 << (hp.bit_length() - 1)
    while kv_heads % hp:
        hp //= 2
    return hp


class Int2Loop(NamedTuple):
    """The INT2 tile loop and its shape: ``rows`` query rows per program (padded to 16 MMA rows,
    or ``g`` rounded up to a power of two in the swap loop), the 16-bit tier's tile and depth
    compiled into the same kernel, the least tokens per split, and int8 key MMAs (swap loop)."""

    loop: str
    hpb: int
    block_n: int
    warps: int
    rows: int
    hp_block: int
    hp_stages: int
    min_split: int
    k_int8: bool = False


def int2_loop(d: int, g: int, kv_heads: int, tokens: int, t: DecodeTuning = DEFAULT_TUNING,
              key_bits: int = 2) -> Int2Loop:  # fmt: skip
    """The loop for head dim ``d``, ``g`` query heads per KV head, ``tokens`` quantized tokens
    (batch × longest list) and ``key_bits``-bit keys; see the module docstring."""
    # int16 words need K = d/8 >= 16 per tl.dot; 4-bit keys: byte planes only
    if key_bits == 4 or d < 128 or tokens < t.small_tokens:
        hpb = heads_per_program(g, kv_heads, tokens, t)
        return Int2Loop("bytes", hpb, t.bytes_block_n, t.bytes_warps, max(MMA_ROWS, _pow2(hpb * g)), t.hp_block,
                        t.hp_stages, t.min_split)  # fmt: skip
    hpb = swap_heads(g, kv_heads, d, tokens, t)
    if hpb > 1 or tokens < t.swap_max_tokens or heads_per_program(g, kv_heads, tokens, t) == 1:
        # a tile holds the code bytes of swap_block_n tokens of one head-dim-128 head; a split's
        # floor counts the tokens of one head
        block_n = max(16, t.swap_block_n * 128 // (d * hpb))
        return Int2Loop("swap", hpb, block_n, t.num_warps, _pow2(g), t.swap_hp_block, t.swap_hp_stages,
                        max(1, t.min_split // hpb), hpb * d // 4 >= t.int8_key_bytes)  # fmt: skip
    hpb = heads_per_program(g, kv_heads, tokens, t)  # > 1: else the swap loop runs
    return Int2Loop("words", hpb, t.words_block_n, t.num_warps, max(MMA_ROWS, _pow2(hpb * g)), t.hp_block, t.hp_stages,
                    t.min_split)  # fmt: skip


def num_splits(units: int, max_len: int, min_split: int, t: DecodeTuning = DEFAULT_TUNING) -> int:
    """Splits per list for ``units`` (sequence, head group) pairs: about ``t.programs`` programs
    (``t.programs_few`` for at most ``t.few_units`` pairs), each at least ``min_split`` tokens."""
    if max_len <= 0:
        return 1
    units = max(1, units)
    want = max(1, (t.programs_few if units <= t.few_units else t.programs) // units)
    return max(1, min(want, math.ceil(max_len / min_split)))


def wave_split(units: int, max_len: int, block_n: int, slots: int, min_split: int,
               t: DecodeTuning = DEFAULT_TUNING) -> int:  # fmt: skip
    """Tokens per split (whole ``block_n`` tiles, at least ``min_split`` rounded up to whole tiles
    unless the list is shorter) so that ``units`` pairs of ``max_len`` tokens fill whole waves of
    ``slots`` programs at the lowest cost ``waves · (split + t.split_cost)``, over
    ``t.min_waves … t.max_waves`` waves."""
    if units < 1 or slots < 1 or block_n < 1:
        raise ValueError(
            f"wave_split: units, slots and block_n must be >= 1; got {units}, {slots}, {block_n}"
        )
    whole = _round_up(max(max_len, 1), block_n)  # the whole list, in tiles
    floor = min(_round_up(min_split, block_n), whole)
    best = None
    for k in range(t.min_waves, t.max_waves + 1):
        sq = max(1, k * slots // units)
        split = max(_round_up(max(max_len, 1) / sq, block_n), floor)
        waves = math.ceil(math.ceil(max(max_len, 1) / split) * units / slots)
        cost = waves * (split + t.split_cost)
        if best is None or cost < best[0]:
            best = (cost, split)
    return best[1]


def split_size(units: int, max_len: int, lp: Int2Loop, sms: int, t: DecodeTuning = DEFAULT_TUNING) -> int:
    """Tokens per split of the quantized lists (``max_len >= 1``) for ``units`` pairs: wave-filling
    splits on the word and swap loops with ``sms > 0`` and more than ``t.few_units`` pairs, else
    :func:`num_splits` splits rounded up to ``t.split_gran`` tokens (or to the tile where that
    would leave fewer splits)."""
    if lp.loop != "bytes" and sms and units > t.few_units:
        return wave_split(units, max_len, lp.block_n, sms * t.per_sm, lp.min_split, t)
    sq = num_splits(units, max_len, lp.min_split, t)
    gran = t.split_gran if max_len >= t.split_gran * sq else lp.block_n
    return _round_up(max_len / sq, gran)


def hp_split_size(units: int, n_q_splits: int, max_h: int, tile: int, slots: int,
                  t: DecodeTuning = DEFAULT_TUNING) -> int:  # fmt: skip
    """Tokens per 16-bit split: ``t.hp_split``, unless those programs and the INT2 ones exceed
    ``slots`` (0: unknown) and ``t.hp_programs`` is set; then about ``hp_programs`` 16-bit
    programs in all, in splits of whole ``tile``-token tiles."""
    split = t.hp_split
    if not t.hp_programs or not slots or units * (n_q_splits + math.ceil(max_h / split)) <= slots:
        return split
    n = max(1, round(t.hp_programs / units))
    return min(split, max(tile, _round_up(math.ceil(max_h / n), tile)))


class Taper(NamedTuple):
    """INT2 split sizes: splits ``< n_early`` of ``split`` positions, the later ones of ``split_late``."""

    n_early: int
    split: int
    split_late: int


def taper(units: int, n_q_splits: int, n_h_splits: int, split: int, split_h: int, max_len: int, tile: int,
          slots: int, t: DecodeTuning = DEFAULT_TUNING) -> Taper:  # fmt: skip
    """Shorter INT2 splits for the programs that start late. With the ``units · n_h_splits``
    16-bit programs launched first, the INT2 splits ``>= n_early`` (not in the first wave of
    ``slots``) start about when those end, which costs them ``t.taper · split_h`` positions: they
    get that many fewer (whole tiles, at least one), the first ``n_early`` share the rest. No
    taper where everything fits one wave, every INT2 split starts late, ``slots`` is 0 or
    ``t.taper`` is 0."""
    plain = Taper(n_q_splits, split, split)
    free = slots - units * n_h_splits  # first-wave slots left to the INT2 programs
    n_early = free // units if units > 0 else 0
    if not t.taper or not slots or units * n_q_splits <= free or not 0 < n_early < n_q_splits:
        return plain
    n_late = n_q_splits - n_early
    early = _round_up((max_len + n_late * t.taper * split_h) / n_q_splits, tile)
    # where the early splits take the whole list the late programs only write -inf; kept: at batch
    # 8 / 4K that measured 0.017 ms against 0.020 without the taper
    late = max(tile, _round_up((max_len - n_early * early) / n_late, tile))
    return Taper(n_early, early, late) if late < early else plain


@dataclass(frozen=True)
class DecodePlan:
    """One launch of the decode attention for a problem shape (the first six fields): the loop
    and its shape (:class:`Int2Loop`), the INT2 splits (:class:`Taper`, ``n_q_splits`` per list),
    the 16-bit split size, ``total`` partial states per query row, the stage-1 grid, and the
    merge. ``max_q``/``max_h`` bound every list's length: a launch with longer lists would drop
    tokens. ``key_bits``: the key width it was made for (4: the byte loop, which reads 2-bit keys
    too)."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_q: int
    max_h: int
    lp: Int2Loop
    splits: Taper
    n_q_splits: int
    split_h: int
    total: int
    grid: tuple[int, int, int]
    num_stages: int
    pdl: bool
    merge_d: int
    merge_block: int
    merge_warps: int
    key_bits: int = 2

    @property
    def hp_first(self) -> bool:
        """The word and swap loops launch the 16-bit splits first (grid: head group, sequence, split)."""
        return self.lp.loop != "bytes"


def plan(batch: int, q_heads: int, kv_heads: int, head_dim: int, lens: tuple[int, int],
         device: torch.device | str = "cpu", tuning: DecodeTuning = DEFAULT_TUNING,
         key_bits: int = 2) -> DecodePlan:  # fmt: skip
    """The launch for ``batch`` sequences of ``q_heads``/``kv_heads`` heads of ``head_dim`` whose
    longest quantized and 16-bit lists hold ``lens`` tokens, on ``device`` (its SM count, unless
    ``tuning.sms`` sets one, and whether it can launch the merge as a dependent), for
    ``key_bits``-bit keys (2 or 4; values are 2-bit)."""
    sms, pdl = device_facts(torch.device(device))
    return _plan(batch, q_heads, kv_heads, head_dim, int(lens[0]), int(lens[1]), tuning.sms or sms,
                 pdl and tuning.pdl, tuning, key_bits)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _plan(batch: int, hq: int, hkv: int, d: int, max_q: int, max_h: int, sms: int, pdl: bool,
          t: DecodeTuning, key_bits: int = 2) -> DecodePlan:  # fmt: skip
    if batch < 0 or hkv < 1 or hq % hkv or d not in (64, 128, 256):
        raise ValueError(
            f"decode plan: head_dim must be 64, 128 or 256 and Hq a multiple of Hkv; got d={d}, {hq}/{hkv}"
        )
    if key_bits not in (2, 4):
        raise ValueError(f"decode plan: key_bits must be 2 or 4; got {key_bits!r}")
    mq, mh = max(max_q, 1), max(max_h, 1)
    lp = int2_loop(d, hq // hkv, hkv, batch * mq, t, key_bits)
    if max_q == 0:  # 16-bit lists only (the BF16 engine): the byte loop with its own 16-bit tile
        lp = lp._replace(hp_block=t.bf16_block, hp_stages=t.bf16_stages, warps=t.bf16_warps)
    units = batch * (hkv // lp.hpb)
    split_q = split_size(units, mq, lp, sms, t)
    sq = math.ceil(mq / split_q)
    slots = sms * t.per_sm if lp.loop != "bytes" else 0  # the byte loop keeps hp_split and no taper
    if max_q == 0 and t.bf16_per_sm and sms:
        split_h = wave_split(units, mh, lp.hp_block, sms * t.bf16_per_sm, t.bf16_min_split, t)
    else:
        split_h = hp_split_size(units, sq, mh, lp.hp_block, slots, t)
    sh = math.ceil(mh / split_h)
    total = sq + sh
    splits = taper(units, sq, sh, split_q, split_h, mq, lp.block_n, slots, t)
    grid = (hkv // lp.hpb, batch, total) if lp.loop != "bytes" else (hkv // lp.hpb, total, batch)
    return DecodePlan(batch, hq, hkv, d, max_q, max_h, lp, splits, sq, split_h, total, grid, t.num_stages, pdl,
                      min(d, t.merge_d), min(64, max(2, _pow2(total))), t.merge_warps, key_bits)  # fmt: skip
