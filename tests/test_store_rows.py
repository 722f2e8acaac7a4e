"""The store's span arithmetic (``store/rows.py``) over random tier streams: every layout places
a step's writes where the stored lists later find them, and the paged segment tables
(``store/paged.py``) give the rows :class:`PagedRows` gives."""

from __future__ import annotations

import random

import pytest

from oscarkv import QuantSpec
from oscarkv.quant.tiers import TierState, plan_moves, window_limit
from oscarkv.store import (
    PagedRows,
    PagedStep,
    PoolPlan,
    PositionRows,
    RegionRows,
    WriteRows,
    held_rows,
    paged_decode_rows,
    post_state,
    step_spans,
)

SPEC = QuantSpec(sink_tokens=4, recent_tokens=6, demote_block=3)
RING = window_limit(SPEC)
PS = 4


def _layouts(rng: random.Random, post: TierState) -> list:
    pages = rng.sample(range(1, 200), 60)
    return [
        RegionRows(q0=1000, h0=50, sink_cap=SPEC.sink_tokens, ring_mod=RING),
        PositionRows(
            table=pages,
            bs=PS,
            rpb=PS + 1,
            store0=7,
            sink_cap=SPEC.sink_tokens,
            ring_mod=RING,
            n_sink=post.n_sink,
        ),
        PagedRows(q_pages=pages[:30], hp_pages=pages[30:], ps=PS, ring_base=900, ring_mod=RING),
    ]


@pytest.mark.parametrize("seed", range(20))
def test_writes_land_where_the_lists_read(seed: int) -> None:
    rng = random.Random(seed)
    st = TierState()
    rows_of: dict[int, dict[tuple[str, int], int]] = {i: {} for i in range(3)}  # layout -> row -> token
    pos, prompt = 0, rng.randint(1, 30)
    steps = [("prefill", n) for n in _chunks(rng, prompt)] + [("decode", 1)] * rng.randint(0, 25)
    for kind, n in steps:
        m = plan_moves(st, n, kind == "decode", SPEC, sink_target=min(prompt, SPEC.sink_tokens))
        post = post_state(st, m, RING)
        for i, rows in enumerate(_layouts(random.Random(seed), post)):
            w = WriteRows()
            w.add(rows, step_spans(st, m, 0))
            mem = rows_of[i]
            for src, dst in zip(w.demote_src, w.demote_dst, strict=True):
                mem[("q", dst)] = mem.pop(("h", src))
            for t, r in zip(w.q_tok, w.q_dst, strict=True):
                mem[("q", r)] = pos + t
            for t, r in zip(w.hp_tok, w.hp_dst, strict=True):
                mem[("h", r)] = pos + t
            q_rows, hp_rows = held_rows(rows, post)
            # INT2 in token order, then the sink and the ring oldest first: every token once
            got = [mem[("q", r)] for r in q_rows], [mem[("h", r)] for r in hp_rows]
            sink, q = list(range(post.n_sink)), list(range(post.n_sink, post.n_sink + post.n_q))
            ring = list(range(post.n_sink + post.n_q, pos + n))
            assert got == (q, sink + ring), (i, kind)
        st, pos = post, pos + n


def _chunks(rng: random.Random, n: int) -> list[int]:
    out = []
    while n:
        c = rng.randint(1, n)
        out.append(c)
        n -= c
    return out


def test_paged_segments_equal_paged_rows() -> None:
    import torch

    plan = PoolPlan(True, PS, 2, 1, 50, 10, RING, 12, 0, 0, 0)
    rng = random.Random(0)
    q_pages, hp_pages = rng.sample(range(1, 50), 8), [3]
    pre = TierState(n_sink=4, n_q=9, head=5, n_recent=RING, started=True)
    m = plan_moves(pre, 1, True, SPEC)
    step = PagedStep(plan)
    i = step.add_seq(hp_pages, q_pages)
    step.stored(i, 1, post_state(pre, m, RING), 0)
    step.writes(i, 1, pre, m, 0, 1, 0)
    pages = step.pages.tensor(torch.device("cpu"))
    rows = PagedRows(q_pages, hp_pages, PS, plan.ring_base(1), RING)
    w = WriteRows()
    w.add(rows, step_spans(pre, m))
    q_list, hp_list = held_rows(rows, post_state(pre, m, RING))
    assert step.tabs["lq"].expand(pages)[0].tolist() == q_list
    assert step.tabs["lh"].expand(pages)[0].tolist() == hp_list
    assert step.tabs["dem_src"].expand(pages)[0].tolist() == w.demote_src
    assert step.tabs["dem_dst"].expand(pages)[0].tolist() == w.demote_dst
    assert step.tabs["hp"].expand(pages)[0].tolist() == w.hp_dst


@pytest.mark.parametrize("seed", range(10))
def test_paged_decode_rows_equal_the_spans(seed: int) -> None:
    rng = random.Random(seed)
    q_pages, hp_pages = rng.sample(range(1, 99), 20), [5]
    n_recent = rng.randint(0, RING)
    pre = TierState(n_sink=rng.choice([3, 4]), n_q=rng.randint(0, 60), head=rng.randrange(RING),
                    n_recent=n_recent, started=True)  # fmt: skip
    m = plan_moves(pre, 1, True, SPEC, sink_target=4)
    src: list[int] = []
    dst: list[int] = []
    row = paged_decode_rows(pre, m, q_pages, hp_pages, PS, 300, RING, "r", src, dst)
    w = WriteRows()
    w.add(PagedRows(q_pages, hp_pages, PS, 300, RING), step_spans(pre, m))
    assert (src, dst, [row]) == (w.demote_src, w.demote_dst, w.hp_dst)
