"""The decode plan built on the host (numpy) against the device-built one it replaced.

``Segments.rows_np``/``tok_np`` must equal ``Segments.expand`` on any segment table, and
``plan_decode`` must give the tensors of the old ``plan_decode`` (kept below as
``_plan_decode_torch``: the same tables expanded with torch ops) for random scheduler states,
padded or not, in INT2 and BF16 mode; the flat-buffer layout must keep its regions apart.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscarkv import QuantSpec
from oscarkv.engine.decode_buffers import DecodeLayout, DecodeStaging
from oscarkv.engine.graphs import len_bucket, len_buckets
from oscarkv.engine.planner import _check, _post, _tables_for, fill_lists, plan_decode, plan_decode_host
from oscarkv.engine.request import Batch, SamplingParams, Sequence, StepSeq
from oscarkv.quant.tiers import Moves, TierState, plan_moves, window_limit
from oscarkv.store import DecodeTensors, PagedStep, PageList, PoolPlan, Segments

CPU = torch.device("cpu")


# ---- Segments: numpy twin == torch ---------------------------------------------------------
@st.composite
def segment_tables(draw: st.DrawFn) -> tuple[Segments, PageList]:
    ps = draw(st.sampled_from([1, 2, 3, 4, 16]))
    pages = PageList()
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        ids = draw(st.lists(st.integers(1, 5000), max_size=6))
        seqs.append((pages.add(ids), len(ids)))
    seg = Segments(ps)
    for _ in range(draw(st.integers(0, 10))):
        off, n_pages = draw(st.sampled_from(seqs))
        if draw(st.booleans()) and n_pages:
            lo = draw(st.integers(0, n_pages * ps - 1))
            n = draw(st.integers(0, n_pages * ps - lo))  # 0: an empty segment
            seg.paged(pages, off, n_pages, lo, n, draw(st.integers(0, 99)))
        else:
            mod = draw(st.integers(1, 40))
            start = draw(st.integers(0, 2 * mod))  # may start past the slab: taken mod it
            seg.ring(
                draw(st.integers(0, 10**6)), start, draw(st.integers(0, mod)), mod, draw(st.integers(0, 99))
            )
        if draw(st.booleans()):
            seg.end_seq()
    return seg, pages


@settings(max_examples=300, deadline=None)
@given(segment_tables())
def test_rows_np_equals_expand(table: tuple[Segments, PageList]) -> None:
    seg, pages = table
    rows, tok = seg.expand(pages.tensor(CPU))
    rows_np, tok_np = seg.expand_np(pages.array())
    assert rows_np.dtype == tok_np.dtype == np.int64
    assert rows_np.tolist() == rows.tolist() and tok_np.tolist() == tok.tolist()
    out = np.full(seg.total, -7, np.int32)
    assert seg.rows_np(pages.array(), out=out) is out and out.tolist() == rows.tolist()
    both = Segments.joined(seg, seg)
    assert both.rows_np(pages.array()).tolist() == rows.tolist() * 2


def test_ring_wraps_and_rows_np_checks_out() -> None:
    pages = PageList()
    seg = Segments(4)
    seg.ring(1000, 9, 5, 11)  # ring indices 9, 10, 0, 1, 2
    seg.ring(2000, 25, 3, 11)  # 25 % 11 = 3: 3, 4, 5
    assert seg.rows_np(pages.array()).tolist() == [1009, 1010, 1000, 1001, 1002, 2003, 2004, 2005]
    with pytest.raises(ValueError, match="shape"):
        seg.rows_np(pages.array(), out=np.empty(3, np.int64))


# ---- plan_decode: host-built == device-built -----------------------------------------------
def _plan_decode_torch(
    batch: Batch, plan: PoolPlan, bs_pad: int | None, demote_block: int
) -> SimpleNamespace:
    """The device-built ``plan_decode`` the host planner replaced (torch ops over segment tables
    that list every stored row): the oracle of the page-table plan."""
    step, lens_q, lens_h = PagedStep(plan), [0], [0]
    for it in batch.items:
        step.add_seq(it.seq.hp_pages, it.seq.q_pages)
    n = len(batch.items)
    b_pad = n if bs_pad is None else bs_pad
    pos = []
    for i, it in enumerate(batch.items):
        _check(it, plan)
        post = _post(it, plan)
        slot = it.seq.slot or 0
        step.stored(i, slot, post, it.start + 1)
        step.writes(i, slot, it.pre, it.moves, it.start, it.n_new, i)
        pos.append(it.start)
        lens_q.append(post.n_q)
        lens_h.append(post.n_sink + post.n_recent if plan.int2 else it.start + 1)
    t = step.tabs
    for _ in range(b_pad - n):
        t["lq"].end_seq()
        t["lh"].end_seq()
    pages = step.pages.tensor(CPU)
    dst_rows, dst_tok = t["hp"].expand(pages)
    decode_dst = torch.full((b_pad,), -1, dtype=torch.long).index_copy_(0, dst_tok, dst_rows)
    src, dst = t["dem_src"].expand(pages)[0], t["dem_dst"].expand(pages)[0]
    if bs_pad is not None and plan.int2:
        fixed = bs_pad * demote_block
        src = torch.cat([src, src.new_zeros(fixed - src.numel())])
        dst = torch.cat([dst, dst.new_zeros(fixed - dst.numel())])
    return SimpleNamespace(
        positions=torch.tensor(pos + [0] * (b_pad - n), dtype=torch.long),
        decode_dst=decode_dst,
        demote_src=src,
        demote_dst=dst,
        q=t["lq"].csr(pages),
        hp=t["lh"].csr(pages),
        lens_hint=(max(lens_q), max(lens_h)),
    )


@st.composite
def decode_steps(draw: st.DrawFn, int2: bool) -> tuple[Batch, PoolPlan, QuantSpec]:
    """A decode batch over random tier states, shuffled page ids and slots."""
    ps = draw(st.sampled_from([1, 2, 4, 8]))
    spec = QuantSpec(
        sink_tokens=ps * draw(st.integers(0, 3)),
        recent_tokens=draw(st.integers(0, 12)),
        demote_block=draw(st.integers(1, ps)),
    )
    ring = window_limit(spec) if int2 else 0
    mr = draw(st.integers(1, 6))
    plan = PoolPlan(int2, ps, mr, spec.sink_tokens // ps if int2 else 0, 10**4, 10**4, ring, -(-ring // ps) * ps, 1, 1, 1)  # fmt: skip
    slots = draw(st.permutations(range(mr)))
    free = iter(draw(st.permutations(range(1, 400))))
    items = []
    for i in range(draw(st.integers(1, mr))):
        if int2:
            n_sink = draw(st.integers(0, spec.sink_tokens))
            pre = TierState(n_sink, draw(st.integers(0, 40)), draw(st.integers(0, ring - 1)),
                            draw(st.integers(0, ring)), True)  # fmt: skip
            m = plan_moves(pre, 1, True, spec, sink_target=draw(st.integers(n_sink, spec.sink_tokens)))
        else:
            pre, m = TierState(), Moves(to_ring=1)
        start = pre.n_sink + pre.n_q + pre.n_recent if int2 else draw(st.integers(0, 60))
        cut = draw(st.integers(0, start + 1))  # the token at ``start`` in the prompt or the output
        seq = Sequence(f"r{i}", list(range(100, 100 + cut)), SamplingParams())
        seq.out = list(range(200 + cut, 200 + start + 1))
        seq.slot = slots[i]
        n_q = pre.n_q + m.demote
        n_h = pre.n_sink + m.to_sink if int2 else start + 1
        seq.q_pages = [next(free) for _ in range(-(-n_q // ps))]
        seq.hp_pages = [next(free) for _ in range(-(-n_h // ps) + draw(st.integers(0, 1)))]
        items.append(StepSeq(seq, start, 1, pre, m))
    return Batch("decode", tuple(items)), plan, spec


def _assert_same(got: DecodeTensors, want: SimpleNamespace) -> None:
    for f in ("positions", "decode_dst", "demote_src", "demote_dst"):
        g, w = getattr(got, f), getattr(want, f)
        assert g.dtype == w.dtype == torch.long and g.tolist() == w.tolist(), f
    for f in ("q", "hp"):
        g, w = getattr(got, f), getattr(want, f)
        assert g.indptr.dtype == g.indices.dtype == torch.int32, f
        assert g.indptr.tolist() == w.indptr.tolist() and g.indptr_host == w.indptr_host, f
        assert g.indices.tolist() == w.indices.tolist(), f
    assert got.lens_hint == want.lens_hint


@pytest.mark.parametrize("int2", [True, False])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_plan_decode_equals_device_built(int2: bool, data: st.DataObject) -> None:
    batch, plan, spec = data.draw(decode_steps(int2))
    n, db = len(batch.items), spec.demote_block
    _assert_same(plan_decode(batch, plan, "cpu"), _plan_decode_torch(batch, plan, None, 0))
    b = data.draw(st.integers(n, n + 3))
    want = _plan_decode_torch(batch, plan, b, db)
    _assert_same(plan_decode(batch, plan, "cpu", bs_pad=b, demote_block=db), want)
    # what CUDA runs: bucketed lens and a graph's capacities, in one buffer per dtype, the lists
    # filled from page tables that earlier steps brought up to date
    tables = _tables_for(batch, plan)
    h = plan_decode_host(batch, plan, b, db, bucket=len_bucket, tables=tables)
    got = h.views(h.h64, h.h32)
    fill_lists(got, tables, plan)
    lens = want.lens_hint
    _assert_same(
        got, SimpleNamespace(**{**vars(want), "lens_hint": (len_bucket(lens[0]), len_bucket(lens[1]))})
    )
    assert h.layout == DecodeLayout.bucketed(b, b * db if plan.int2 else 0, h.lens_hint)
    assert got.ids.tolist() == [it.seq.tokens[it.start] for it in batch.items] + [0] * (b - n)
    assert got.slots.tolist()[:n] == [it.seq.slot for it in batch.items]
    assert got.positions.data_ptr() == h.h64[h.layout.s64("positions")].data_ptr()  # views, no copy
    assert h.used32 == h.layout.meta32 <= h.layout.n32
    assert h.changes.shape[1] == sum(len(it.seq.q_pages) + len(it.seq.hp_pages) for it in batch.items)
    # the next step of the same sequences sends no page that the tables already hold
    assert plan_decode_host(batch, plan, b, db, bucket=len_bucket, tables=tables).changes.shape[1] == 0


@given(st.integers(0, 70_000))
def test_len_buckets_hold_every_bucket_up_to_n(n: int) -> None:
    """Start-up capture relies on it: every length a step can plan is among the buckets."""
    bs = len_buckets(n)
    assert bs == sorted(set(bs)) and bs[-1] == len_bucket(n)
    assert {len_bucket(m) for m in (0, 1, n // 3, n // 2, n - 1, n) if 0 <= m <= n} <= set(bs)


def test_plan_decode_refuses_too_many_demotions() -> None:
    spec = QuantSpec(sink_tokens=0, recent_tokens=2, demote_block=2)
    plan = PoolPlan(True, 2, 1, 0, 100, 100, window_limit(spec), 4, 1, 1, 1)
    seq = Sequence("a", list(range(10)), SamplingParams())
    seq.slot, seq.q_pages = 0, [5, 6]
    pre = TierState(0, 1, 0, 3, True)
    item = StepSeq(seq, 4, 1, pre, plan_moves(pre, 1, True, spec, sink_target=0))
    with pytest.raises(ValueError, match="exceed the fixed 1"):
        plan_decode_host(Batch("decode", (item,)), plan, bs_pad=1, demote_block=1)


@pytest.mark.parametrize(
    ("b", "nd", "cap_h", "cap_q"), [(1, 0, 1, 1), (3, 24, 70, 5), (24, 192, 12288, 49152)]
)
def test_layout_regions_are_aligned_and_apart(b: int, nd: int, cap_h: int, cap_q: int) -> None:
    lay = DecodeLayout(b, nd, cap_h, cap_q)
    for names, get, n, align in (
        (("ids", "positions", "decode_dst", "demote_src", "demote_dst"), lay.s64, lay.n64, 32),
        (("q_indptr", "hp_indptr", "slots", "n_sink", "head", "hp_ids", "q_ids"), lay.s32, lay.n32, 64),
    ):
        spans = [get(x) for x in names]
        assert all(s.start % align == 0 for s in spans)
        assert all(a.stop <= c.start for a, c in itertools.pairwise(spans)) and spans[-1].stop == n
    t = lay.views(
        torch.zeros(lay.n64, dtype=torch.long), torch.zeros(lay.n32, dtype=torch.int32), lens=(7, 9)
    )
    assert t.ids.numel() == t.positions.numel() == t.decode_dst.numel() == t.slots.numel() == b
    assert t.demote_src.numel() == nd and lay.meta32 == lay.s32("hp_ids").start
    assert (t.q.indices.numel(), t.hp.indices.numel(), t.lens_hint) == (cap_q, cap_h, (7, 9))
    assert t.q.indptr_host == (0,) * (b + 1) and t.hp.indptr.numel() == b + 1


def _small_int2_batch() -> tuple[Batch, PoolPlan, QuantSpec]:
    """Three sequences mid-decode, one of them demoting this step."""
    spec = QuantSpec(sink_tokens=4, recent_tokens=6, demote_block=2)
    ring = window_limit(spec)
    plan = PoolPlan(True, 4, 4, 1, 100, 100, ring, 8, 1, 1, 1)
    items = []
    for i, (n_q, head, n_recent) in enumerate([(9, 3, 7), (0, 0, 2), (30, 6, 6)]):
        pre = TierState(4, n_q, head, n_recent, True)
        m = plan_moves(pre, 1, True, spec, sink_target=4)
        seq = Sequence(f"r{i}", list(range(4 + n_q + n_recent + 1)), SamplingParams())
        seq.slot, seq.hp_pages = 3 - i, [10 + i]
        seq.q_pages = [20 + 10 * i + j for j in range(-(-(n_q + m.demote) // 4))]
        items.append(StepSeq(seq, 4 + n_q + n_recent, 1, pre, m))
    return Batch("decode", tuple(items)), plan, spec


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staging_is_not_refilled_before_its_copy_ran() -> None:
    """Copies queued behind a long kernel: refilling a pinned pair must wait for the copy that
    reads it, so every device buffer ends up holding its own step."""
    batch, plan, spec = _small_int2_batch()
    dev = torch.device("cuda")
    staging = DecodeStaging(dev)
    got, want = [], []
    for k in range(5):
        torch.cuda._sleep(20_000_000)  # the stream runs behind the host
        it = batch.items[k % 3]
        it.seq.prompt[it.start] = 1000 + k  # a different step each time
        h = plan_decode_host(batch, plan, 4, spec.demote_block, len_bucket, staging.alloc)
        d64 = torch.empty(h.layout.n64, dtype=torch.long, device=dev)
        d32 = torch.empty(h.layout.n32, dtype=torch.int32, device=dev)
        staging.copy(h, d64, d32)
        got.append(h.views(d64, d32))
        w = plan_decode_host(batch, plan, 4, spec.demote_block, len_bucket)
        want.append(w.views(w.h64, w.h32))
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        for f in ("ids", "positions", "decode_dst", "demote_src", "demote_dst", "slots", "n_sink", "head"):
            assert getattr(g, f).tolist() == getattr(w, f).tolist(), f
        assert g.q.indptr.tolist() == w.q.indptr.tolist() and g.hp.indptr.tolist() == w.hp.indptr.tolist()
