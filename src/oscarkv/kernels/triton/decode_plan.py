"""Launch planning of the Triton decode attention (host side, no Triton): KV heads per program,
token groups, and the split of each sequence's quantized list (the tuning ``CONFIG`` lives in
:mod:`.decode_config`).

Splits: a program takes one split of one (sequence, head group); the GPU runs ``slots`` of them at
once (SMs × one-warp programs per SM, register-limited). With ``CONFIG['fill_waves']`` (word-plane
path only, on CUDA or with ``CONFIG['sms']`` set) the split
size is chosen so that the INT2 programs fill whole waves of slots: for each wave count ``k`` the
largest split count that fits ``k`` waves, rounded to whole tiles, costs
``waves · (split + CONFIG['split_cost'])`` token-times (a program's fixed cost in tokens); the
cheapest wins. A last wave that is only partly filled costs nearly as much as a full one (H200,
``results/decode_variants_programs.md``), which the previous rule (about ``CONFIG['programs']``
programs, splits rounded to 256 tokens) did not see. The rule applies above
``CONFIG['few_units']`` (sequence, head group) pairs; fewer pairs keep ``CONFIG['programs_few']``
programs. The 16-bit tier's programs are short; with ``CONFIG['hp_first']`` they are launched
first so that they do not trail into an extra wave, and where they and the INT2 programs overflow
a wave they are cut to about ``CONFIG['hp_programs']`` (:func:`hp_split_size`); the INT2 programs
that still start after the first wave get shorter splits (:func:`taper`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from .decode_config import CONFIG

__all__ = ["CONFIG", "Int2Loop", "Taper", "heads_per_program", "hp_split_size", "int2_loop", "num_splits",
           "split_size", "swap_heads", "taper", "token_groups", "wave_split"]  # fmt: skip


def heads_per_program(g: int, kv_heads: int, tokens: int | None = None) -> int:
    """KV heads one INT2 program takes together: enough for ``CONFIG['rows']`` query rows (the MMA
    height), at most 8, and a divisor of ``kv_heads``. 1 when ``g`` is not a power of two, or when
    the batch holds fewer than ``CONFIG['group_tokens']`` quantized tokens (``tokens``): small
    batches need the programs of every head to fill the GPU (measured on the H200: grouping wins
    from batch × length ≈ 256K tokens, loses below)."""
    if g & (g - 1) or (tokens is not None and tokens < CONFIG["group_tokens"]):
        return 1
    hpb = max(1, min(8, kv_heads, CONFIG["rows"] // g))
    while kv_heads % hpb:
        hpb -= 1
    return hpb


def token_groups(g: int, hpb: int, block_n: int) -> int:
    """Token groups per word-plane tile (decode_groups.py), 0 for the padded loop: only with
    ``CONFIG['token_groups']``, one KV head per program, ``g <= 8`` a power of two (``16 / g``
    groups fill the 16 MMA rows) and at least 16 tokens per group (``tl.dot``'s minimum N)."""
    if not CONFIG["token_groups"] or hpb != 1 or g > 8 or g & (g - 1):
        return 0
    t = CONFIG["rows"] // g
    return t if t > 1 and block_n // t >= 16 else 0


class Int2Loop(NamedTuple):
    """The INT2 tile loop a launch takes and its shape. ``loop``: ``"bytes"`` (decode_tiles.py),
    ``"words"`` (decode_words.py, or decode_groups.py when ``token_groups`` > 0) or ``"swap"``
    (decode_swap.py); ``rows``: the query rows a program holds (padded to 16 MMA rows, or the
    swap loop's ``g`` rounded up to a power of two); ``hp_block``/``hp_stages``: the 16-bit tier's
    tile and pipeline depth compiled into the same kernel; ``per_sm``: programs per SM for the
    wave-filling splits (``None``: ``CONFIG['per_sm']``); ``min_split``: the least tokens per split
    (``None``: ``CONFIG['min_split']``); ``k_int8``: the swap loop's key product on int8 MMAs
    (decode_kint8.py)."""

    loop: str
    hpb: int
    block_n: int
    warps: int
    rows: int
    token_groups: int
    hp_block: int
    hp_stages: int
    per_sm: int | None
    min_split: int | None = None
    k_int8: bool = False


def swap_heads(g: int, kv_heads: int, d: int, tokens: int | None = None) -> int:
    """KV heads per swap-loop program at head dim ``d`` with ``tokens`` quantized tokens.

    1 below ``CONFIG['swap_pair_tokens']`` tokens: small batches need every head's programs to fill
    the GPU (two heads measured 25-38% slower at 32K tokens on the H200,
    results/dv_s10_pairs_small.md).
    Otherwise the most heads that

    - fit the MMA's 8 columns with their query heads (``g`` rounded up to a power of two each:
      2 at ``g = 4``, 1 from ``g = 5``);
    - fill at most 32 accumulator rows, ``hp·d/8``: 2 at head dim 128, 1 at 256 (offline sm_90,
      64 rows take all 255 registers and spill at head dim 256; on the H200 two heads at head dim
      256 measured 5.63 vs 5.37x SDPA at batch 8 / 128K but 4.36 vs 4.95x at 16 / 32K,
      results/dv_s10_d256.md);
    - are at most ``CONFIG['swap_heads']``, a power of two (the tile's columns are a
      ``tl.arange``) and a divisor of ``kv_heads``.
    """
    if tokens is not None and tokens < CONFIG["swap_pair_tokens"]:
        return 1
    hp = max(1, min(CONFIG["swap_heads"], kv_heads, 8 // _pow2(g), 256 // d))
    hp = 1 << (hp.bit_length() - 1)
    while kv_heads % hp:
        hp //= 2
    return hp


def hp_split_size(units: int, n_q_splits: int, max_h: int, tile: int, slots: int) -> int:
    """Tokens per split of the 16-bit lists (``max_h`` tokens at most) for ``units`` (sequence,
    head group) pairs with ``n_q_splits`` INT2 splits each: ``CONFIG['hp_split']``, unless those
    programs and the INT2 ones exceed ``slots`` (0: unknown) and ``CONFIG['hp_programs']`` is set;
    then about ``hp_programs`` 16-bit programs in all, in splits of whole ``tile``-token tiles."""
    split = CONFIG["hp_split"]
    if not CONFIG["hp_programs"] or not slots or units * (n_q_splits + math.ceil(max_h / split)) <= slots:
        return split
    n = max(1, round(CONFIG["hp_programs"] / units))
    return min(split, max(tile, _round_up(math.ceil(max_h / n), tile)))


class Taper(NamedTuple):
    """Split sizes of the quantized lists: splits ``< n_early`` of ``split`` positions, the later
    ones of ``split_late``."""

    n_early: int
    split: int
    split_late: int


def taper(units: int, n_q_splits: int, n_h_splits: int, split: int, split_h: int, max_len: int, tile: int,
          slots: int) -> Taper:  # fmt: skip
    """Shorter INT2 splits for the programs that start late. With the 16-bit tier's
    ``units · n_h_splits`` programs launched first, the INT2 splits ``>= n_early`` (those not all
    in the first wave of ``slots`` programs) start about when the 16-bit programs end, which
    costs them about ``CONFIG['taper'] · split_h`` positions of a program's time: they get that
    many fewer, the first ``n_early`` splits share the rest (whole ``tile`` tiles; the late ones
    at least one tile, possibly past the list's end), so that all end together.
    ``Taper(n_q_splits, split, split)`` (no taper) where the programs fit one wave, every INT2
    split starts late, ``slots`` is 0 or the taper is off."""
    plain = Taper(n_q_splits, split, split)
    free = slots - units * n_h_splits  # first-wave slots left to the INT2 programs
    n_early = free // units if units > 0 else 0
    if not CONFIG["taper"] or not slots or units * n_q_splits <= free or not 0 < n_early < n_q_splits:
        return plain
    n_late = n_q_splits - n_early
    delta = CONFIG["taper"] * split_h
    early = _round_up((max_len + n_late * delta) / n_q_splits, tile)
    # where the early splits take the whole list the late programs only write -inf; kept: at batch
    # 8 / 4K that measured 0.017 ms against 0.020 for no taper (results/gpu_check_s12_taper_floor.md)
    late = max(tile, _round_up((max_len - n_early * early) / n_late, tile))
    return Taper(n_early, early, late) if late < early else plain


def _round_up(x: float, step: int) -> int:
    """The smallest multiple of ``step`` that is ``>= x``."""
    return math.ceil(x / step) * step


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def int2_loop(d: int, g: int, kv_heads: int, tokens: int) -> Int2Loop:
    """The loop for head dim ``d``, ``g`` query heads per KV head and ``tokens`` quantized tokens
    (batch × longest list): the byte planes below ``CONFIG['small_tokens']`` and for head dim 64
    (int16 words need K = d/8 >= 16 per ``tl.dot``); otherwise the swap loop with
    ``CONFIG['swap']`` (:func:`swap_heads` KV heads per program) where it takes several heads,
    below ``CONFIG['swap_max_tokens']``, and wherever the padded loop would take one KV head per
    program too; else the padded word loop (grouped KV heads from ``CONFIG['group_tokens']``,
    token groups with ``CONFIG['token_groups']``)."""
    c = CONFIG
    if d < 128 or tokens < c["small_tokens"]:
        hpb = heads_per_program(g, kv_heads, tokens)
        b = c["bytes"]
        return Int2Loop("bytes", hpb, b["block_n"], b["num_warps"], max(16, _pow2(hpb * g)), 0,
                        c["hp_block"], c["hp_stages"], None)  # fmt: skip
    # from swap_max_tokens on, grouped padded heads beat only the one-head swap loop
    hpb = swap_heads(g, kv_heads, d, tokens)
    if c["swap"] and (
        hpb > 1 or tokens < c["swap_max_tokens"] or heads_per_program(g, kv_heads, tokens) == 1
    ):
        # a tile holds the code bytes of swap_block_n tokens of one head-dim-128 head: at head dim
        # 256, 128-token tiles spill (offline sm_90: 93 local-memory instructions per tile, 64: 30)
        block_n = max(16, c["swap_block_n"] * 128 // (d * hpb))
        # a split's floor counts the tokens of one head: hpb heads per program take 1/hpb of it;
        # int8 keys where a token's key bytes per program are >= 64 (measured faster there only)
        return Int2Loop("swap", hpb, block_n, c["num_warps"], _pow2(g), 0, c["swap_hp_block"], c["swap_hp_stages"],
                        c["swap_per_sm"], max(1, c["min_split"] // hpb), bool(c["swap_k_int8"]) and hpb * d >= 256)  # fmt: skip
    hpb = heads_per_program(g, kv_heads, tokens)
    block_n = c["block_n"] if hpb == 1 else c["block_n_grouped"]
    return Int2Loop("words", hpb, block_n, c["num_warps"], max(16, _pow2(hpb * g)), token_groups(g, hpb, block_n),
                    c["hp_block"], c["hp_stages"], None)  # fmt: skip


def num_splits(batch: int, kv_heads: int, max_len: int, min_split: int | None = None) -> int:
    """Splits per sequence: about ``CONFIG['programs']`` programs in flight (latency hiding for
    the gathered loads; ``CONFIG['programs_few']`` when ``batch · kv_heads`` — the head groups —
    is at most ``CONFIG['few_units']``), each split at least ``min_split`` tokens (default
    ``CONFIG['min_split']``)."""
    if max_len <= 0:
        return 1
    units = max(1, batch * kv_heads)
    want = max(1, CONFIG["programs_few" if units <= CONFIG["few_units"] else "programs"] // units)
    return max(1, min(want, math.ceil(max_len / (min_split or CONFIG["min_split"]))))


def wave_split(units: int, max_len: int, block_n: int, slots: int, min_split: int | None = None) -> int:
    """Tokens per split (whole ``block_n`` tiles, at least ``min_split`` (default
    ``CONFIG['min_split']``) rounded up to
    whole tiles unless the list is shorter) so that ``units`` (sequence, head group) pairs of
    ``max_len`` tokens fill whole waves of ``slots`` programs at the lowest cost
    ``waves · (split + CONFIG['split_cost'])``, over ``CONFIG['min_waves'] … CONFIG['max_waves']``
    waves."""
    if units < 1 or slots < 1 or block_n < 1:
        raise ValueError(
            f"wave_split: units, slots and block_n must be >= 1; got {units}, {slots}, {block_n}"
        )
    if not 1 <= CONFIG["min_waves"] <= CONFIG["max_waves"]:
        raise ValueError(
            f"CONFIG min_waves/max_waves must satisfy 1 <= min <= max; got {CONFIG['min_waves']}, "
            f"{CONFIG['max_waves']}"
        )
    whole = _round_up(max(max_len, 1), block_n)  # the whole list, in tiles
    floor = min(_round_up(min_split or CONFIG["min_split"], block_n), whole)
    best = None
    for k in range(CONFIG["min_waves"], CONFIG["max_waves"] + 1):
        sq = max(1, k * slots // units)
        split = max(_round_up(max(max_len, 1) / sq, block_n), floor)
        waves = math.ceil(math.ceil(max(max_len, 1) / split) * units / slots)
        cost = waves * (split + CONFIG["split_cost"])
        if best is None or cost < best[0]:
            best = (cost, split)
    return best[1]


# the CONFIG entries split_size reads: part of its cache key, so that sweeps that edit them
# get fresh plans
_SPLIT_KEYS = ("fill_waves", "few_units", "per_sm", "min_waves", "max_waves", "split_cost", "min_split",
               "programs", "programs_few", "split_gran")  # fmt: skip


def split_size(batch: int, head_groups: int, max_len: int, block_n: int, sms: int, words: bool,
               per_sm: int | None = None, min_split: int | None = None) -> int:  # fmt: skip
    """Tokens per split of the quantized lists (``max_len`` tokens at most, ``max_len >= 1``) for
    ``batch × head_groups`` (sequence, head group) pairs: wave-filling splits (:func:`wave_split`
    over ``sms × per_sm`` slots, ``per_sm`` defaulting to ``CONFIG['per_sm']``) on the word-plane
    path (``words``) with ``CONFIG['fill_waves']``, ``sms`` > 0 and more than
    ``CONFIG['few_units']`` pairs; otherwise :func:`num_splits` splits, rounded up to multiples of
    ``CONFIG['split_gran']`` tokens, or of the tile when that would leave fewer splits. Cached:
    this runs on every decode call (the wave search alone costs ~15 µs of Python)."""
    return _split_size(
        batch, head_groups, max_len, block_n, sms, words, per_sm or CONFIG["per_sm"],
        min_split or CONFIG["min_split"], tuple(CONFIG[k] for k in _SPLIT_KEYS),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _split_size(batch: int, head_groups: int, max_len: int, block_n: int, sms: int, words: bool, per_sm: int,
                min_split: int, _config: tuple) -> int:  # fmt: skip
    units = batch * head_groups
    if words and CONFIG["fill_waves"] and sms and units > CONFIG["few_units"]:
        return wave_split(units, max_len, block_n, sms * per_sm, min_split)
    sq = num_splits(batch, head_groups, max_len, min_split)
    gran = CONFIG["split_gran"] if max_len >= CONFIG["split_gran"] * sq else block_n
    return _round_up(max_len / sq, gran)
