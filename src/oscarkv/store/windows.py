"""Prefill attention over a mix of 16-bit and INT2 keys chosen per query: the rules under which a
prompt token does not see its own prefix in 16 bits.

**Invariant** (``EngineConfig.prefill_attention="invariant"``). A fresh prefill lets the step's
tokens attend each other in 16 bits, while a prefix hit or a later chunk attends to earlier tokens
as stored (INT2 beyond the sink and the recent window), so the same prompt gives different hidden
states, and different stored K/V, depending on what was cached and how the prompt was chunked or
batched. Under the invariant rule a query at position ``t`` sees a key ``s <= t`` in 16 bits iff
``s`` is in its sequence's sink (``s < sink_len``) or in ``t``'s own **window block**
(``s >= align_down(t, G)``, ``G`` = :func:`window_block`: the recent window rounded down to whole
pages); every other key is its INT2 value, exactly what the store holds or will hold for it (the
stored rows dequantized; 16-bit rows quantized and dequantized by the store's own write op,
:func:`quantize_dequantize`).

Why blocks and not the last ``R`` positions: a prefix hit of ``m`` tokens serves positions
``< m`` in INT2 only (rings are never shared), so no query ``t >= m`` may want one of them in 16
bits; with windows that start at a multiple of ``G`` and hits that end at one (the prefix cache's
``hit_block``), none does. A chunk boundary ``c`` keeps the last ``R >= G`` positions in the ring,
so every 16-bit key a later query wants is still held. Hence a token's hidden states and stored
K/V are a function of the request's tokens alone, whatever the chunking, prefix hits or batch.

**Decode** (``EngineConfig.prompt_scoring="decode"``: scored prompts, int2). Position ``t`` is
scored against its prefix as a decode step at ``t`` reads it: 16 bits in the sink and from
:func:`decode_window_start` (the recent window as the ring keeps it, ``R`` to ``R + db - 1``
tokens: demotions come in blocks of ``db``), INT2 between. The reference is ``OscarCache``
prefilled with the first ``min(L, sink + R)`` tokens (all of them 16-bit for every rule) and fed
the rest one token at a time. Such requests take no prefix hit, and their chunks end where
:func:`decode_chunk_ok` allows, so every 16-bit key a later chunk wants is still in the ring.

Two forms of the key lists. **Varlen** (the device kernels): the keys of each (sequence, query
run with one window start) are gathered into one list, the sink in 16 bits, INT2 values up to the
window, then 16-bit rows from the window start, and ``ops.prefill_attention_varlen`` attends each
run's queries to its list; the gather costs ``O(runs x prefix)`` memory traffic per layer:
``L / G`` runs under the invariant rule, ``L / db`` under the decode rule. **Masked** (the CPU):
a decode-rule sequence's runs are merged into pieces of up to ``PIECE_QUERIES`` queries, each one
key list holding both forms of what its queries read and one masked attention call
(:mod:`.masked_pieces`); invariant-rule pieces stay one window block each. Sequences under
neither rule (fresh, in a step that has some) are one run over their keys as stored and their
new rows as computed.

**FP8 windows** (``QuantSpec.window_dtype="fp8_e4m3"``): "16 bits" above reads "as the windows
hold it". Stored window rows are upcast to the model dtype, and under either rule a new row's
16-bit form is the row rounded through fp8 (its INT2 form is quantized from that), which is what
the store will hold for it; a fresh prefill still reads its own new rows as computed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..kernels import KernelOps
from ..quant import RowFormat
from ..quant.quantizer import META_TORCH_DTYPES
from ..quant.window import through_window
from .masked_pieces import PIECE_QUERIES, masked_attention, merge_runs, piece_keys, piece_mask

__all__ = [
    "SeqWindow",
    "decode_chunk_ok",
    "decode_window_start",
    "invariant_prefill",
    "quantize_dequantize",
    "window_block",
    "window_tensors",
]


def window_block(recent_tokens: int, page_tokens: int) -> int:
    """``G``: the recent window rounded down to whole pages (0 when it holds no whole page)."""
    return recent_tokens // page_tokens * page_tokens


def decode_window_start(t: int, sink: int, recent: int, demote_block: int) -> int:
    """The first 16-bit position after the sink that a decode step at position ``t`` reads, for a
    sequence with ``sink`` sink tokens whose first ``min(t, sink + recent)`` tokens were prefilled
    and the rest decoded one at a time (the tier rules of :mod:`oscarkv.quant.tiers`: the ring
    holds ``recent`` tokens after the prefill and demotes the ``demote_block`` oldest when it holds
    ``max(recent + demote_block - 1, 1)``). Keys ``sink <= s < start`` are INT2."""
    db = demote_block
    if recent >= 1:
        a = sink + recent - 1  # the last prefilled position: the window is [sink, a] there
        return sink if t <= a else sink + db * ((t - a) // db)
    # no recent window: the ring restarts from the new token whenever it holds max(db - 1, 1)
    m, j = max(db - 1, 1), t - sink
    if j <= 0:
        return max(t, sink)
    n = 1 + (j - 1) % m  # ring entries before the step
    return t if n == m else t - n


def decode_chunk_ok(c: int, sink: int, recent: int, demote_block: int) -> bool:
    """Whether a prefill chunk of a decode-rule sequence may end at ``c``: the ring then holds
    positions ``[max(sink, c - recent), c)``, which must cover every 16-bit key a query ``t >= c``
    reads (true at least every ``demote_block`` positions)."""
    return c <= sink + recent or decode_window_start(c, sink, recent, demote_block) >= c - recent


def quantize_dequantize(rows: torch.Tensor, fmt: RowFormat, ops: KernelOps) -> torch.Tensor:
    """``rows [N, H, d]`` (16-bit) as the INT2 tier will give them back: quantized by the store's
    write op (``quantize_pack_into``, what a demotion and an INT2 write run), then dequantized as
    a prefill reads stored rows; in ``rows.dtype``."""
    n, h = rows.shape[0], rows.shape[1]
    if n == 0:
        return rows.clone()
    dev = rows.device
    codes = torch.empty((n, h, fmt.packed_dim), dtype=torch.uint8, device=dev)
    meta = torch.empty((n, h, fmt.groups, 2), dtype=META_TORCH_DTYPES[fmt.meta_dtype], device=dev)
    ops.quantize_pack_into(rows, fmt, codes, meta, torch.arange(n, device=dev))
    return ops.dequantize(codes, meta, fmt, rows.dtype)


class SeqWindow(NamedTuple):
    """One sequence of a prefill step: its tier counts before the step, its first position, its
    new tokens, its pinned sink length, and whether it is a scored prompt under the decode rule."""

    n_sink: int
    n_q: int
    n_recent: int
    start: int
    n_new: int
    sink_len: int
    decode: bool = False


def _runs(w: SeqWindow, block: int, score: tuple[int, int]):
    """``(t, e, lo)``: the sequence's new positions ``[t, e)`` in runs whose queries read 16-bit
    keys from ``lo`` on (and in the sink), INT2 before; ``lo = -1``: every key as stored."""
    end = w.start + w.n_new
    if w.decode:
        t = w.start
        while t < end:
            lo = decode_window_start(t, w.sink_len, *score)
            e = t + 1
            while e < end and decode_window_start(e, w.sink_len, *score) == lo:
                e += 1
            yield t, e, lo
            t = e
    elif block:
        t = w.start
        while t < end:
            lo = t // block * block
            e = min(lo + block, end)
            yield t, e, lo
            t = e
    else:
        yield w.start, end, -1


def window_tensors(
    seqs: Sequence[SeqWindow],
    block: int,
    device: torch.device | str,
    score: tuple[int, int] = (0, 0),
    masked: bool = False,
) -> dict:
    """The ``PrefillTensors`` fields of one step under the invariant rule (window block ``block``;
    0: none) and the decode rule (``score = (recent_tokens, demote_block)`` for the sequences
    marked ``decode``): ``win_idx`` (long, the rows of each piece's key list in the layer's key
    bank, see :func:`invariant_prefill`), ``win_cu`` (int32 ``[2, pieces+1]``: query and key
    offsets), ``win_max`` (host ``(longest query piece, longest key list)``) and ``win_groups``.
    A piece is one run (varlen form), or with ``masked`` runs merged as
    :mod:`.masked_pieces` says, with ``win_mask`` (bool, each piece's ``[queries, keys]`` mask
    flat, in piece order) and one group per piece. ``win_raw``: the bank must also hold the new
    rows as computed (fresh sequences in a step with decode-rule ones read them there).

    Raises ``AssertionError`` when a stored INT2 row falls where a query wants 16 bits (a prefix
    hit not on a block boundary, or a decode-rule chunk that :func:`decode_chunk_ok` refuses)."""
    if block <= 0 and not any(w.decode for w in seqs):
        raise ValueError(f"the invariant rule needs a window block of >= 1 page; got {block}")
    if any(w.decode for w in seqs) and score[1] < 1:
        raise ValueError(f"the decode rule needs (recent_tokens, demote_block >= 1); got {score}")
    n_hp = sum(s[0] + s[2] for s in seqs)
    n_q = sum(s[1] for s in seqs)
    n_t = sum(s[4] for s in seqs)
    # bank rows: [hp rows | INT2 rows (dequantized) | new rows | hp rows qdq | new rows qdq], then
    # (win_raw) the new rows as computed, read by the fresh sequences of a step with a rule
    q0, t0 = n_hp, n_hp + n_q
    h2, t2 = n_hp + n_q + n_t, 2 * n_hp + n_q + n_t
    raw = block <= 0 and not all(w.decode for w in seqs)
    r0 = 2 * n_hp + n_q + 2 * n_t
    idx: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    cu_q, cu_k = [0], [0]
    h, q, a = 0, 0, 0
    for w in seqs:
        ns, nq, nr, start, n_new, sink = w[:6]
        if ns + nq + nr != start:
            raise AssertionError(f"tier counts {ns}+{nq}+{nr} != the step's start {start}")
        ar = torch.arange
        # 16-bit and INT2 version of positions 0 .. end-1, in position order
        new0 = r0 if block <= 0 and not w.decode else t0  # a fresh sequence's new rows as computed
        pos16 = torch.cat(
            [ar(h, h + ns), ar(q0 + q, q0 + q + nq), ar(h + ns, h + ns + nr), ar(new0 + a, new0 + a + n_new)]
        )
        pos2 = torch.cat(
            [
                ar(h2 + h, h2 + h + ns),
                ar(q0 + q, q0 + q + nq),
                ar(h2 + h + ns, h2 + h + nr + ns),
                ar(t2 + a, t2 + a + n_new),
            ]
        )
        runs = list(_runs(w, block, score))
        for _, _, lo in runs:
            if lo >= 0 and nq and ns + nq > lo:
                raise AssertionError(
                    f"stored INT2 rows up to position {ns + nq} fall in the 16-bit window from {lo} "
                    "(a prefix hit must end on a window block: PrefixCache(hit_block=...); a "
                    "decode-rule chunk must end where decode_chunk_ok allows)"
                )
        for piece in merge_runs(runs, PIECE_QUERIES if masked and w.decode else 0):
            idx.append(piece_keys(pos16, pos2, sink, piece))
            if masked:
                masks.append(piece_mask(sink, piece).reshape(-1))
            cu_q.append(cu_q[-1] + piece[-1][1] - piece[0][0])
            cu_k.append(cu_k[-1] + len(idx[-1]))
        h, q, a = h + ns + nr, q + nq, a + n_new
    lens_q = [y - x for x, y in itertools.pairwise(cu_q)]
    lens_k = [y - x for x, y in itertools.pairwise(cu_k)]
    cu = torch.tensor([cu_q, cu_k], dtype=torch.int32)
    flat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
    out = {
        "win_idx": flat.to(device, non_blocking=True),
        "win_cu": cu.to(device, non_blocking=True),
        "win_max": (max(lens_q, default=0), max(lens_k, default=0)),
        "win_groups": _groups(cu_q, cu_k, 0 if masked else GATHER_ROWS_PER_TOKEN * (n_hp + n_q + n_t)),
        "win_raw": raw,
    }
    if masked:
        mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        out["win_mask"] = mask.to(device, non_blocking=True)
    return out


#: the key rows one attention call of the invariant rule gathers, per stored or new token of the
#: step (further pieces go to the next call): bounds the gather to ~2x the fresh rule's
GATHER_ROWS_PER_TOKEN = 2
#: a group of pieces: ``(first piece, end piece, query rows [q0, q1), key rows [k0, k1))``
Group = tuple[int, int, int, int, int, int]


def _groups(cu_q: list[int], cu_k: list[int], cap: int) -> tuple[Group, ...]:
    """Runs of consecutive pieces whose key lists hold at most ``cap`` rows together (or one
    piece), each attended by one call."""
    out: list[Group] = []
    a, n = 0, len(cu_k) - 1
    for b in range(1, n + 1):
        if b == n or cu_k[b + 1] - cu_k[a] > cap:
            out.append((a, b, cu_q[a], cu_q[b], cu_k[a], cu_k[b]))
            a = b
    return tuple(out)


def invariant_prefill(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    v_rot: torch.Tensor,
    pools,
    pre_hp: torch.Tensor,
    pre_q: torch.Tensor,
    win_idx: torch.Tensor,
    win_cu: torch.Tensor,
    win_max: tuple[int, int],
    ops: KernelOps,
    sm_scale: float,
    win_groups: tuple[Group, ...] = (),
    win_mask: torch.Tensor | None = None,
    win_raw: bool = False,
) -> torch.Tensor:
    """Attention of a prefill step's queries ``q_rot [T, Hq, d]`` (rotated) under the invariant
    and decode rules; ``k_rot, v_rot [T, Hkv, d]`` the step's new rows, ``pre_hp``/``pre_q`` the stored rows'
    ids (the step's pre-step lists, flat), ``win_*`` from :func:`window_tensors`: each group of
    pieces gathers its key lists and attends in one call (all pieces in one call without groups;
    with ``win_mask``, one masked call per piece). Window rows are read in the model dtype
    (``k_rot.dtype``), the new rows as the windows will hold them (fp8 windows round them)."""
    dt = k_rot.dtype  # the model's (the window pools may be fp8)
    hi, qi = pre_hp.long(), pre_q.long()

    def bank(hp: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, fmt: RowFormat, new: torch.Tensor):
        """One side's key bank: window rows, stored INT2 rows, new rows, then the INT2 values of
        the window and new rows (the row order :func:`window_tensors` indexes). New rows are read
        as the windows will hold them (rounded through fp8 with fp8 windows)."""
        raw = [new.to(dt)] if win_raw else []
        hp, new = hp[hi].to(dt), through_window(new, hp.dtype).to(dt)
        deq = ops.dequantize(codes[qi], meta[qi], fmt, dt)
        return torch.cat(
            [hp, deq, new, quantize_dequantize(hp, fmt, ops), quantize_dequantize(new, fmt, ops), *raw]
        )

    bank_k = bank(pools.hp_k, pools.k_codes, pools.k_meta, pools.k_fmt, k_rot)
    bank_v = bank(pools.hp_v, pools.v_codes, pools.v_meta, pools.v_fmt, v_rot)
    if win_mask is not None:
        out, m0 = torch.empty_like(q_rot), 0
        for _, _, q0, q1, k0, k1 in win_groups:
            rows, m1 = win_idx[k0:k1], m0 + (q1 - q0) * (k1 - k0)
            mask = win_mask[m0:m1].view(q1 - q0, k1 - k0)
            out[q0:q1] = masked_attention(q_rot[q0:q1], bank_k[rows], bank_v[rows], mask, sm_scale)
            m0 = m1
        return out
    if len(win_groups) <= 1:
        k_all, v_all = bank_k[win_idx], bank_v[win_idx]
        return ops.prefill_attention_varlen(
            q_rot, k_all, v_all, win_cu[0], win_cu[1], win_max[0], win_max[1], sm_scale
        )
    out = torch.empty_like(q_rot)
    for a, b, q0, q1, k0, k1 in win_groups:
        rows = win_idx[k0:k1]
        cu = win_cu[:, a : b + 1] - torch.tensor([[q0], [k0]], dtype=win_cu.dtype, device=win_cu.device)
        out[q0:q1] = ops.prefill_attention_varlen(
            q_rot[q0:q1], bank_k[rows], bank_v[rows], cu[0], cu[1], win_max[0], win_max[1], sm_scale
        )
    return out
