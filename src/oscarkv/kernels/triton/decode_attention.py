"""Triton split-K decode attention over packed INT2 history and 16-bit windows.

One stage-1 launch covers both tiers: program ``(head group, split, sequence)`` takes a split of
the sequence's quantized slot list (``split < n_q_splits``) or of its 16-bit list (the rest; the
word-plane path launches ``(head group, sequence, split)`` with the 16-bit splits first), walks
it in ``BLOCK_N`` tiles with an online softmax (base 2), and writes a normalised partial output and
its log-sum-exp. Stage 2 merges every split of both tiers by log-sum-exp.

On the word-plane path (head dim >= 128, from ``CONFIG['small_tokens']`` quantized tokens) an
INT2 program puts the tokens on the MMA rows and the query heads of one KV head, or from
``CONFIG['swap_pair_tokens']`` of the adjacent KV heads that fill its 8 columns, on its N side
(:mod:`.decode_swap`, ``CONFIG['swap']``, ``decode_plan.swap_heads``), except where it takes one
head above ``CONFIG['swap_max_tokens']`` and the padded loop would group KV heads
(``decode_plan.int2_loop``). Otherwise the query heads are the MMA rows, padded to 16, and the
rest of this paragraph applies.
For large batches (``CONFIG['group_tokens']`` quantized tokens or more) an INT2 program takes
``HPB`` KV heads at once, so that their ``HPB·g`` query heads fill the 16 rows of the MMA (4 KV
heads × 4 query heads for Qwen3-8B) instead of padding one KV head's ``g`` rows to 16: the softmax
and the score scaling run on 16 useful rows with the same number of tensor-core instructions
(``q·k`` is one dot per KV head whose rows are kept by head; ``p·V`` one dot per KV head with the
other heads' rows of ``p`` zeroed). Smaller batches keep one KV head per program, which gives more
programs to fill the GPU (measured faster there).

In every INT2 loop the accumulators are rescaled only when a head's running maximum grows by more
than 2⁸ (the probabilities then stay ≤ 256, well inside fp16), which skips the rescale on almost
every tile.

The INT2 tile loops live in :mod:`.decode_swap` and :mod:`.decode_words` (codes read as int16
words) and :mod:`.decode_tiles` (codes read as bytes; it also holds the 16-bit tier's loop and the
helpers the INT2 loops share); :mod:`.decode_groups` is
an opt-in word loop without padding rows for one KV head per program (``CONFIG['token_groups']``,
measured slower on the H200). Strides are derived
from the (validated) contiguous layouts, which keeps the launch short. The tuning ``CONFIG`` lives
in :mod:`.decode_config`; the loop choice (``int2_loop``), the heads per program and the split
sizes (filling whole waves of programs, tapered behind the 16-bit programs) in :mod:`.decode_plan`.
"""

from __future__ import annotations

import functools
import math
import operator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...quant import RowFormat
from .decode_groups import int2_split_groups
from .decode_plan import (
    CONFIG,
    _pow2,
    heads_per_program,
    hp_split_size,
    int2_loop,
    num_splits,
    split_size,
    taper,
    token_groups,
)
from .decode_swap import int2_split_swap
from .decode_tiles import hp_split, int2_split_bytes, taper_range
from .decode_words import int2_split_words
from .launch import Launcher, pdl_ok

__all__ = ["CONFIG", "decode_attention", "heads_per_program", "int2_loop", "num_splits", "token_groups"]

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["split_q", "split_h", "n_q_splits", "total", "n_early", "split_late"])
def _stage1(Q, KC, KM, VC, VM, HK, HV, QPTR, QIDX, HPTR, HIDX, O, LSE, qk_scale, split_q, split_h,
            n_q_splits, total, n_early, split_late, HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr,
            R_PAD: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
            ASM: tl.constexpr, META: tl.constexpr, WORDS: tl.constexpr, TG: tl.constexpr = 0,
            HP_STAGES: tl.constexpr = 3, HP_FIRST: tl.constexpr = False, SWAP: tl.constexpr = False,
            PDL: tl.constexpr = False, KI8: tl.constexpr = False):  # fmt: skip
    if PDL:  # the merge may launch (and wait) once every program of this grid has started
        gdc_launch_dependents()
    # axis 0 is the group of HPB KV heads, so that programs reading the same tokens run together
    hg = tl.program_id(0)
    if HP_FIRST:  # grid (head group, sequence, split): the 16-bit tier's splits launch first
        b = tl.program_id(1)
        p = tl.program_id(2)
        n_h = total - n_q_splits
        # partial-state index: INT2 splits first, as below
        sp = tl.where(p >= n_h, p - n_h, n_q_splits + p)
    else:
        sp = tl.program_id(1)
        b = tl.program_id(2)
    if sp < n_q_splits:
        lo, hi = taper_range(QPTR, b, sp, split_q, n_early, split_late)
        if TG > 1:  # opt-in: one KV head's g rows times TG token groups fill the MMA rows
            int2_split_groups(Q, KC, KM, VC, VM, QIDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                              HKV, G, R_PAD, D, BLOCK_N, TG, ASM, META)  # fmt: skip
        elif SWAP:  # tokens as the MMA rows, HPB KV heads' query heads as its columns (decode_swap.py)
            int2_split_swap(Q, KC, KM, VC, VM, QIDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                            HKV, G, R_PAD, HPB, D, BLOCK_N, ASM, META, KI8)  # fmt: skip
        elif WORDS:  # codes read as int16 words (head dim >= 128)
            int2_split_words(Q, KC, KM, VC, VM, QIDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                             HKV, G, HPB, R_PAD, D, BLOCK_N, ASM, META)  # fmt: skip
        else:
            int2_split_bytes(Q, KC, KM, VC, VM, QIDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                             HKV, G, HPB, R_PAD, D, BLOCK_N, ASM, META)  # fmt: skip
    else:
        for j in tl.static_range(HPB):  # the 16-bit tier is short (sink + recent): one head at a time
            hp_split(Q, HK, HV, HPTR, HIDX, O, LSE, qk_scale, split_h, total, hg * HPB + j, sp, b,
                     n_q_splits, HKV, G, G_PAD, D, BLOCK_H, HP_STAGES)  # fmt: skip


@triton.jit(do_not_specialize=["total"])
def _merge(
    O, LSE, OUT, total, S_BLOCK: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, PDL: tl.constexpr = False
):
    """Log-sum-exp merge of the ``total`` partial outputs of one ``(sequence, query head)`` row,
    dims ``DB·program_id(1)`` onwards, ``S_BLOCK`` splits at a time (a running maximum keeps it
    exact). ``PDL``: launched as a programmatic dependent of stage 1, so wait for its writes."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0)  # b * Hq + hq
    offs_d = tl.program_id(1) * DB + tl.arange(0, DB)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([DB], tl.float32)
    for s0 in range(0, total, S_BLOCK):
        offs_s = s0 + tl.arange(0, S_BLOCK)
        smask = offs_s < total
        lse = tl.load(LSE + row * total + offs_s, mask=smask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_safe)
        o = tl.load(O + (row * total + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
        scale = tl.exp2(m - m_safe)
        acc = acc * scale + tl.sum(o.to(tl.float32) * w[:, None], 0)
        den = den * scale + tl.sum(w, 0)
        m = m_new
    tl.store(OUT + row * D + offs_d, (acc / tl.where(den > 0, den, 1.0)).to(OUT.dtype.element_ty))


_PARTIALS = {"fp32": torch.float32, "fp16": torch.float16}
_STAGE1, _MERGE = Launcher(_stage1), Launcher(_merge)


# tile sizes (tokens): tl.arange lengths and tl.dot's K or N side, so powers of two >= 16
_TILE_KEYS = ("block_n", "block_n_grouped", "swap_block_n", "hp_block", "swap_hp_block")
# counts that must be positive integers
_COUNT_KEYS = ("swap_heads", "swap_per_sm", "per_sm", "num_warps", "num_stages", "hp_split", "min_split")
# sizes and thresholds that must be integers >= 0 (0 turns hp_programs off), and flags
_SIZE_KEYS = ("hp_programs", "swap_pair_tokens")
_FLAG_KEYS = ("pdl", "swap_k_int8")
# real numbers >= 0
_RATE_KEYS = ("taper",)
_KEYS = _TILE_KEYS + _COUNT_KEYS + _SIZE_KEYS + _FLAG_KEYS + _RATE_KEYS
_CHECKED = operator.itemgetter(*_KEYS)


def _check_config() -> None:
    """Refuse CONFIG values the launch cannot honour (they are edited by hand in sweeps)."""
    values = _CHECKED(CONFIG)
    _check_config_values(CONFIG["partials"], CONFIG["merge_d"], values, tuple(map(type, values)))


@functools.lru_cache(maxsize=64)
def _check_config_values(partials: str, md: int, values: tuple, _types: tuple) -> None:
    """The checks of :func:`_check_config`, cached on the values and their types (it runs on every
    decode call; ``True == 1`` and ``64.0 == 64`` as keys, but only one of each is valid)."""
    if partials not in _PARTIALS:
        raise ValueError(f"CONFIG['partials'] must be 'fp32' or 'fp16'; got {partials!r}")
    if not isinstance(md, int) or md < 1 or md & (md - 1):
        raise ValueError(f"CONFIG['merge_d'] must be a power of two (dims per merge program); got {md!r}")
    for key, v in zip(_KEYS, values, strict=True):
        if key in _TILE_KEYS and (not isinstance(v, int) or v < 16 or v & (v - 1)):
            raise ValueError(
                f"CONFIG[{key!r}] must be a power of two >= 16 (tokens per tile: tl.dot needs 16); got {v!r}"
            )
        if key in _COUNT_KEYS and (not isinstance(v, int) or v < 1):
            raise ValueError(f"CONFIG[{key!r}] must be a positive integer; got {v!r}")
        if key in _SIZE_KEYS and (not isinstance(v, int) or v < 0):
            raise ValueError(f"CONFIG[{key!r}] must be an integer >= 0; got {v!r}")
        if key in _RATE_KEYS and (
            isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf
        ):
            raise ValueError(f"CONFIG[{key!r}] must be a finite number >= 0; got {v!r}")
        if key in _FLAG_KEYS and v not in (True, False):
            raise ValueError(f"CONFIG[{key!r}] must be True or False (or 1 / 0); got {v!r}")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _check(fmt: RowFormat) -> None:
    if fmt.bits != 2 or fmt.groups != 1 or fmt.quantizer not in ("asymmetric", "symmetric", "lloyd_max"):
        raise ValueError(
            f"the Triton decode kernel reads 2-bit affine rows with one (scale, zero) per row; got "
            f"{fmt.bits}-bit, {fmt.groups} groups, {fmt.quantizer} (use backend='torch')"
        )


# metadata dtype -> (the word one (scale, zero) pair is read as, the kernel's META id)
_POOL_NAMES = ("k_codes", "k_meta", "v_codes", "v_meta", "hp_k", "hp_v")
_META_WORDS = {
    torch.float16: (torch.int32, 0),
    torch.bfloat16: (torch.int32, 1),
    torch.float32: (torch.int64, 2),
}


def _check_layout(d: int, hkv: int, meta_word: torch.dtype, pools: tuple[torch.Tensor, ...]) -> None:
    """Strides are derived from ``d``, ``hkv`` and the contiguous layouts, and the codes (head dim
    >= 128, whichever tile loop the size picks) and the ``(scale, zero)`` pairs are read as words:
    refuse pools that would be read out of bounds or off a word boundary. ``pools``: k_codes,
    k_meta, v_codes, v_meta, hp_k, hp_v."""
    # per pool: (dtype or None for any, shape after the slot dim, bytes of the word it is read in)
    codes = (torch.uint8, (hkv, d // 4), 2 if d >= 128 else 1)
    meta = (None, (hkv, 1, 2), meta_word.itemsize)
    hp = (None, (hkv, d), 1)
    for name, t, (dtype, rows, size) in zip(
        _POOL_NAMES, pools, (codes, meta, codes, meta, hp, hp), strict=True
    ):
        if not t.is_contiguous():
            raise ValueError(
                f"decode_attention: {name} must be contiguous (shape {tuple(t.shape)}, stride "
                f"{t.stride()}); the kernel derives its strides from the pool layout"
            )
        if (dtype is not None and t.dtype != dtype) or t.shape[1:] != rows:
            raise ValueError(
                f"decode_attention: {name} must be {str(dtype or t.dtype)[6:]} [N, {', '.join(map(str, rows))}]; "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        if t.data_ptr() % size:
            raise ValueError(
                f"decode_attention: {name} must start at a multiple of {size} bytes (it is read as "
                f"{size}-byte words); got a view at byte offset {t.storage_offset() * t.element_size()}"
            )


def decode_attention(q_rot, k_codes, k_meta, v_codes, v_meta, hp_k, hp_v, int2_indptr, int2_indices,
                     hp_indptr, hp_indices, sm_scale, k_fmt, v_fmt, lens_hint=None):  # fmt: skip
    """Same contract as ``kernels.ref.decode_attention``. ``lens_hint``: optional host-side
    ``(longest quantized list, longest 16-bit list)``, which saves a device sync."""
    _check(k_fmt), _check(v_fmt)
    _check_config()
    bsz, hq, d = q_rot.shape
    hkv = hp_k.shape[1]
    g = hq // hkv
    if d not in (64, 128, 256) or hq % hkv:
        raise ValueError(f"head_dim must be 64, 128 or 256 and Hq a multiple of Hkv; got d={d}, {hq}/{hkv}")
    if k_meta.dtype != v_meta.dtype or k_meta.dtype not in _META_WORDS or k_meta.shape[-2:] != (1, 2):
        raise ValueError(
            f"decode_attention: k_meta/v_meta must both be [N, Hkv, 1, 2] fp16/bf16/fp32 (one scale/zero "
            f"pair per row, as quantize_pack writes); got {k_meta.dtype} {tuple(k_meta.shape)} and "
            f"{v_meta.dtype} {tuple(v_meta.shape)} (use backend='torch' for grouped formats)"
        )
    word, meta_id = _META_WORDS[k_meta.dtype]
    _check_layout(d, hkv, word, (k_codes, k_meta, v_codes, v_meta, hp_k, hp_v))
    if lens_hint is None:
        lens = torch.stack(
            [(int2_indptr[1:] - int2_indptr[:-1]).max(), (hp_indptr[1:] - hp_indptr[:-1]).max()]
        )
        lens_hint = tuple(int(x) for x in lens.tolist()) if bsz else (0, 0)
    max_q, max_h = max(int(lens_hint[0]), 1), max(int(lens_hint[1]), 1)
    lp = int2_loop(d, g, hkv, bsz * max_q)
    swap, words, hpb, block_n = lp.loop == "swap", lp.loop != "bytes", lp.hpb, lp.block_n
    opts = {"maxnreg": CONFIG["maxnreg"]} if words and CONFIG["maxnreg"] and q_rot.is_cuda else {}
    sms = CONFIG["sms"] or (_sm_count(q_rot.device) if q_rot.is_cuda else 0)
    split_q = split_size(bsz, hkv // hpb, max_q, block_n, sms, words, lp.per_sm, lp.min_split)
    sq = math.ceil(max_q / split_q)
    slots = sms * (lp.per_sm or CONFIG["per_sm"]) if words else 0  # the byte path keeps hp_split
    split_h = hp_split_size(bsz * (hkv // hpb), sq, max_h, lp.hp_block, slots)
    sh = math.ceil(max_h / split_h)
    total = sq + sh
    hp_first = CONFIG["hp_first"] and words
    # the INT2 splits that start after the first wave get fewer positions (only with hp_first)
    tp = taper(bsz * (hkv // hpb), sq, sh, split_q, split_h, max_q, block_n, slots if hp_first else 0)
    pdt = _PARTIALS[CONFIG["partials"]]
    o_part = torch.empty(bsz, hq, total, d, device=q_rot.device, dtype=pdt)
    lse = torch.empty(bsz, hq, total, device=q_rot.device, dtype=torch.float32)
    # 16-bit queries: the model's bf16/fp16 as they are; anything else (fp32 on the CPU) as fp16
    q = q_rot.contiguous() if q_rot.dtype in (torch.bfloat16, torch.float16) else q_rot.half().contiguous()
    kc, vc = (k_codes.view(torch.int16), v_codes.view(torch.int16)) if words else (k_codes, v_codes)
    # the merge as a programmatic dependent launch of stage 1 (Hopper and newer; not the interpreter)
    pdl = bool(CONFIG["pdl"]) and pdl_ok(q.device)
    grid = (hkv // hpb, bsz, total) if hp_first else (hkv // hpb, total, bsz)
    _STAGE1(
        grid, q, kc, k_meta.view(word), vc, v_meta.view(word), hp_k, hp_v, int2_indptr, int2_indices, hp_indptr, hp_indices,
        o_part, lse, sm_scale * LOG2E, tp.split, split_h, sq, total, tp.n_early, tp.split_late,
        HKV=hkv, G=g, HPB=hpb, R_PAD=lp.rows, G_PAD=max(16, _pow2(g)),
        D=d, BLOCK_N=block_n,
        BLOCK_H=lp.hp_block, ASM=q.is_cuda, META=meta_id, WORDS=words, TG=lp.token_groups, HP_STAGES=lp.hp_stages,
        HP_FIRST=hp_first, SWAP=swap, PDL=pdl, KI8=lp.k_int8,
        num_warps=lp.warps, num_stages=CONFIG["num_stages"], **opts,
    )  # fmt: skip
    out = torch.empty_like(q_rot)
    db = min(d, CONFIG["merge_d"])
    _MERGE(
        (bsz * hq, d // db), o_part, lse, out, total, S_BLOCK=min(64, max(2, _pow2(total))), D=d, DB=db,
        PDL=pdl, num_warps=CONFIG["merge_warps"], **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out
