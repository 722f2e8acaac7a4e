"""The tier rules (``oscarkv.quant.tiers``) over random token streams, and the HF slot layout.

A shadow model follows every position through the moves (sink, INT2 and ring lists, plus a ring
array written at the ring indices the moves imply) and is checked against the tier state after
every step. Exact bounds checked (``S, R, db`` = sink, recent, demote block; ``N`` = non-sink
tokens stored; quantization on):

* after a prefill step that stores a non-sink token: ``n_recent == min(R, N)``;
* after a decode step: ``min(R, N) <= n_recent <= max(R + db − 1, 1)``, and with ``R >= 1``
  a step demotes 0 or exactly ``db`` tokens. (``R = 0, db = 1`` keeps one token, the newest:
  a decode token is always written to 16 bits first.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscarkv import QuantSpec
from oscarkv.hf.pools import LayerPools
from oscarkv.hf.slots import SlotTable
from oscarkv.kernels import Backend, KernelOps
from oscarkv.quant import RowFormat
from oscarkv.quant.tiers import (
    Moves,
    Tier,
    TierState,
    apply_moves,
    plan_moves,
    ring_spans,
    tier_map,
    window_limit,
)

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = settings(max_examples=200, deadline=None)

SPECS = st.one_of(
    st.sampled_from([QuantSpec(), QuantSpec(sink_tokens=4, recent_tokens=8, demote_block=3)]),
    st.builds(
        QuantSpec,
        sink_tokens=st.integers(0, 6),
        recent_tokens=st.integers(0, 10),
        demote_block=st.integers(1, 5),
    ),
)


# ---- the pure tier rules ----------------------------------------------------------------------------
@dataclass
class Turn:
    """A prompt (or follow-up) of ``sum(chunks)`` tokens in prefill chunks, then decode steps."""

    chunks: list[int]
    decode: int


@dataclass
class Shadow:
    """Positions per tier, in storage order, and the ring array as written."""

    cap: int
    sink: list[int] = field(default_factory=list)
    int2: list[int] = field(default_factory=list)
    ring: deque[int] = field(default_factory=deque)
    arr: dict[int, int] = field(default_factory=dict)
    seen: int = 0


@st.composite
def streams(draw: st.DrawFn) -> tuple[QuantSpec, bool, int, list[Turn]]:
    spec = draw(SPECS)
    quantize = draw(st.sampled_from([True, True, True, False]))  # passthrough in 1 of 4
    span = spec.sink_tokens + spec.recent_tokens + spec.demote_block
    extra_cap = draw(st.integers(0, 5))  # an engine's page-aligned ring is larger than the window
    turns = []
    for i in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 2 * span + 8)) if i == 0 else draw(st.integers(1, span))
        cuts = sorted(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=6, unique=True)))
        cuts = [c for c in cuts if c < n]
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True) if b > a]
        turns.append(Turn(chunks, draw(st.integers(0, 2 * (spec.recent_tokens + spec.demote_block) + 4))))
    return spec, quantize, extra_cap, turns


def step(
    t: TierState, sh: Shadow, n: int, is_decode: bool, spec: QuantSpec, quantize: bool, target: int | None
) -> Moves:
    """One step through plan/apply, mirrored in the shadow; returns the moves."""
    m = plan_moves(t, n, is_decode, spec, target, quantize)
    assert min(m.to_sink, m.demote, m.to_int2, m.to_ring) >= 0 and m.n_new == n
    new = list(range(sh.seen, sh.seen + n))
    sh.seen += n
    sh.sink += new[: m.to_sink]
    for _ in range(m.demote):  # demotion takes the oldest ring rows, before the new tokens
        sh.int2.append(sh.ring.popleft())
    sh.int2 += new[m.to_sink : m.to_sink + m.to_int2]
    for j, pos in enumerate(new[m.to_sink + m.to_int2 :]):  # ring index head + n_recent + j (pre-step)
        sh.arr[(t.head + t.n_recent + j) % sh.cap] = pos
        sh.ring.append(pos)
    apply_moves(t, m, sh.cap)
    check_state(t, sh, full=not is_decode or sh.seen <= 300)
    return m


def check_state(t: TierState, sh: Shadow, full: bool) -> None:
    """The shadow against the state; ``full`` also walks every position (O(seen))."""
    assert (t.n_sink, t.n_q, t.n_recent) == (len(sh.sink), len(sh.int2), len(sh.ring))
    assert t.n_sink + t.n_q + t.n_recent == sh.seen
    (h, n1), (z, n2) = ring_spans(t, sh.cap)
    assert z == 0 and 0 <= t.head < max(sh.cap, 1)
    assert [sh.arr[i] for i in [*range(h, h + n1), *range(n2)]] == list(sh.ring)
    runs = (
        (sh.sink, 0, t.n_sink),
        (sh.int2, t.n_sink, t.n_sink + t.n_q),
        (sh.ring, sh.seen - t.n_recent, sh.seen),
    )
    for got, lo, hi in runs:  # each tier is one run of positions: its ends here, all of it below
        assert not got or (got[0], got[-1]) == (lo, hi - 1)
    if not full:
        return
    everything = sh.sink + sh.int2 + list(sh.ring)
    assert sorted(everything) == list(range(sh.seen))  # every position in exactly one tier
    tiers = {p: Tier.SINK for p in sh.sink} | {p: Tier.INT2 for p in sh.int2}
    tiers |= {p: Tier.RING for p in sh.ring}
    assert tier_map(t) == [tiers[p] for p in range(sh.seen)]
    # each tier is one run of positions, in order (so INT2 is contiguous and in token order)
    assert everything == list(range(sh.seen))


def run(spec: QuantSpec, quantize: bool, extra_cap: int, turns: list[Turn], pinned: bool) -> list:
    """Replay a stream; returns the tier maps after each turn's prefill and each decode step."""
    total = sum(sum(tn.chunks) + tn.decode for tn in turns)
    cap = window_limit(spec) + extra_cap if quantize else total + 1
    prompt = sum(turns[0].chunks)
    target = min(prompt, spec.sink_tokens) if pinned else None
    t, sh, maps, first = TierState(), Shadow(cap), [], 0
    r, db = spec.recent_tokens, spec.demote_block
    for tn in turns:
        for n in tn.chunks:
            first = first or n  # the HF rule's sink is min(first write, S)
            m = step(t, sh, n, False, spec, quantize, target)
            if quantize and m.n_new > m.to_sink:
                assert t.n_recent == min(r, t.n_q + t.n_recent)
        maps.append(tier_map(t))
        for _ in range(tn.decode):
            first = first or 1
            m = step(t, sh, 1, True, spec, quantize, target)
            if quantize:
                assert min(r, t.n_q + t.n_recent) <= t.n_recent <= max(r + db - 1, 1)
                assert r == 0 or m.demote in (0, db)
            maps.append(tier_map(t))
        check_state(t, sh, full=True)
        if not quantize:  # passthrough: nothing is quantized, the ring grows
            assert t.n_q == 0 and t.n_sink + t.n_recent == sh.seen
    # the sink holds positions 0 … n_sink − 1 (checked above) and never grows after the prompt:
    # pinned, min(prompt, S); the HF rule, min(first write, S), the first chunk when it is shorter
    hf_sink = min(first, spec.sink_tokens) if quantize else 0
    assert t.n_sink == (target if pinned else hf_sink)
    return maps


@FAST
@given(streams(), st.booleans())
def test_random_streams_keep_the_tier_invariants(stream, pinned) -> None:
    run(*stream, pinned=pinned)


@FAST
@given(streams())
def test_chunked_prefill_gives_the_tier_maps_of_a_single_prefill(stream) -> None:
    """With the sink pinned at ``min(prompt, S)`` any chunking ends in single prefill's tier map
    (and stays equal through the decode steps). The HF rule pins the sink at the first write, so
    there the same holds when the first chunk covers the sink."""
    spec, quantize, extra_cap, turns = stream
    single = [Turn([sum(tn.chunks)] if sum(tn.chunks) else [], tn.decode) for tn in turns]
    assert run(spec, quantize, extra_cap, turns, True) == run(spec, quantize, extra_cap, single, True)
    prompt = sum(turns[0].chunks)
    if turns[0].chunks and turns[0].chunks[0] >= min(prompt, spec.sink_tokens):
        assert run(spec, quantize, extra_cap, turns, False) == run(spec, quantize, extra_cap, single, False)


def test_defaults_cycle_the_window_through_256_to_263() -> None:
    spec, t = QuantSpec(), TierState()
    apply_moves(t, plan_moves(t, 1000, False, spec), window_limit(spec))
    assert (t.n_sink, t.n_q, t.n_recent) == (64, 1000 - 64 - 256, 256)
    seen = []
    for _ in range(20):
        apply_moves(t, plan_moves(t, 1, True, spec), window_limit(spec))
        seen.append(t.n_recent)
    assert seen == [*range(257, 264), *range(256, 264), *range(256, 261)]


# ---- the HF slot layout: slot ids point at the planned tokens ------------------------------------
D = 8


def _fake_ops() -> KernelOps:
    """'Quantizes' a row to its first element (kept in fp32 metadata), so ids survive exactly."""

    def quantize_pack(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.zeros(*rows.shape[:2], fmt.packed_dim, dtype=torch.uint8)
        return codes, rows[..., :1, None].expand(*rows.shape[:2], 1, 2).float()

    def dequantize(codes, meta, fmt: RowFormat, out_dtype=torch.float32) -> torch.Tensor:
        return meta[..., 0, :1].expand(*meta.shape[:2], fmt.head_dim).to(out_dtype)

    def quantize_pack_into(rows, fmt: RowFormat, codes, meta, dst, src=None) -> None:
        c, m = quantize_pack(rows if src is None else rows[src.long()], fmt)
        codes[dst.long()], meta[dst.long()] = c, m.to(meta.dtype)

    return KernelOps(Backend.TORCH, quantize_pack, dequantize, None, None, None, None, None,
                     quantize_pack_into=quantize_pack_into)  # fmt: skip


@st.composite
def batches(draw: st.DrawFn) -> tuple[QuantSpec, bool, list[int], list[int]]:
    spec = draw(
        st.builds(
            QuantSpec,
            sink_tokens=st.integers(0, 5),
            recent_tokens=st.integers(0, 9),
            demote_block=st.integers(1, 4),
            meta_dtype=st.just("fp32"),
        )
    )
    prompts = draw(st.lists(st.integers(0, 90), min_size=1, max_size=3))
    steps = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))  # covering the padded prompt
    steps += draw(st.lists(st.sampled_from([1, 1, 1, 2, 5]), max_size=30))  # t == 1: a decode step
    return spec, draw(st.booleans()), prompts, steps


@settings(max_examples=100, deadline=None)
@given(batches())
def test_slot_table_slots_hold_the_planned_tokens(batch) -> None:
    """Write each token's id through the plan into pools, read the tiers back through the CSRs."""
    spec, quantize, prompts, steps = batch
    cpu, ops, bsz, width = torch.device("cpu"), _fake_ops(), len(prompts), max(prompts)
    table = SlotTable(bsz, spec, quantize)
    fmt = RowFormat.from_spec(spec, D, "k")
    pools = LayerPools(bsz, 1, D, torch.float32, cpu, fmt, fmt)
    total = max(width, sum(steps))
    valid = torch.ones(bsz, total, dtype=torch.bool)
    for b, n in enumerate(prompts):
        valid[b, : width - n] = False  # left pads, stored nowhere
    ids = (valid.cumsum(1) - 1 + 1000 * torch.arange(1, bsz + 1)[:, None]).float()  # b·1000 + position
    rows = ids[:, :, None, None].expand(bsz, total, 1, D)

    def expected(b: int) -> tuple[list[float], list[float]]:
        s, base = table.seqs[b], 1000 * (b + 1)
        n = s.n_sink + s.n_q + s.n_recent
        hp = [*range(s.n_sink), *range(n - s.n_recent, n)]
        return [base + i for i in hp], [base + i for i in range(s.n_sink, s.n_sink + s.n_q)]

    pos = 0
    for t in steps:
        if pos >= total:
            break
        t = min(t, total - pos)
        before = [expected(b) for b in range(bsz)]
        plan = table.plan(valid[:, pos : pos + t], cpu)
        pools.ensure(plan.cap_q, plan.cap_h)
        if plan.is_decode:  # as OscarCacheLayer._decode: demote, then the new rows to decode_dst
            pools.demote(plan, ops)
            keep = plan.decode_dst >= 0
            assert plan.decode_dst[keep].tolist() == plan.new_hp[2].tolist()
            pools.hp_k[plan.decode_dst[keep]] = rows[keep, pos]
            pools.hp_v[plan.decode_dst[keep]] = -rows[keep, pos]
        else:
            for b in range(bsz):  # the prefix a prefill attends to: 16-bit rows, then INT2 rows
                k, v = pools.gather_prefix(*plan.pre, b, ops)
                assert k[:, 0, 0].tolist() == before[b][0] + before[b][1]
                assert (v[:, 0, 0] == -k[:, 0, 0]).all()
            pools.apply(plan, rows[:, pos : pos + t], -rows[:, pos : pos + t], ops)
        pos += t
        q_ptr, q_idx, h_ptr, h_idx = (x.long() for x in plan.post)
        for b in range(bsz):
            want_hp, want_q = expected(b)
            hi, qi = h_idx[h_ptr[b] : h_ptr[b + 1]], q_idx[q_ptr[b] : q_ptr[b + 1]]
            assert pools.hp_k[hi, 0, 0].tolist() == want_hp and pools.k_meta[qi, 0, 0, 0].tolist() == want_q
            assert pools.hp_v[hi, 0, 0].tolist() == [-x for x in want_hp]
            assert pools.v_meta[qi, 0, 0, 0].tolist() == [-x for x in want_q]
            assert sum(map(len, expected(b))) == int(valid[b, :pos].sum())
        assert plan.post_lens == (
            max(s.n_q for s in table.seqs),
            max(s.n_sink + s.n_recent for s in table.seqs),
        )
