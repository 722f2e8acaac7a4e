"""Invariants of page accounting and tiers (engine.md §3.5), checked after every step in tests.

:func:`check` raises ``AssertionError`` naming the invariant (I1–I8) and what broke. I8 replays
each running sequence's recorded steps (``Scheduler.trace``, kept when ``check_invariants`` is
on) through ``quant/tiers`` and compares the tier state; once its prompt is done, also against a
run without prefix hits (the layout a fresh run has).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..quant.tiers import TierState, apply_moves, plan_moves
from .pages import PagePool
from .request import Sequence, Status

#: the scheduler (typed loosely: the scheduler imports this module to check itself)
Scheduler = Any

__all__ = ["check", "check_pool", "replay_tiers"]


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check_pool(pool: PagePool, name: str, owners: Counter[int]) -> None:
    """I1–I4 for one pool; ``owners[p]`` = how many live page lists hold ``p``."""
    held = [p for p in range(pool.total) if pool.ref[p] > 0]
    if pool.n_free + len(held) != pool.capacity:
        _fail(f"I1 {name}: {pool.n_free} free + {len(held)} held != {pool.capacity} pages")
    for p in set(owners) | set(held):
        if pool.ref[p] != owners[p]:
            _fail(f"I2 {name}: page {p} has ref {pool.ref[p]} but {owners[p]} owners")
    for p in range(pool.reserved):
        if p in pool.free or pool.ref[p] or owners[p] or p in pool.hash_of:
            _fail(f"I3 {name}: dummy page {p} was handed out, freed or published")
    if len(set(pool.free)) != len(pool.free) or any(pool.ref[p] for p in pool.free):
        _fail(f"I3 {name}: free list has duplicates or held pages")
    n_unheld = pool.capacity - len(held)
    if n_unheld != len(pool.free):
        _fail(f"I3 {name}: {n_unheld} pages have no owner but {len(pool.free)} are on the free list")
    if len(pool.index) != len(pool.hash_of) or any(pool.hash_of.get(p) != h for h, p in pool.index.items()):
        _fail(f"I4 {name}: index and hash_of disagree")
    cached = sum(1 for p in pool.free if p in pool.hash_of)
    if cached != pool.n_cached:
        _fail(f"I4 {name}: n_cached {pool.n_cached} but {cached} free pages are published")
    for p in held:
        if pool.ref[p] > 1 and p not in pool.hash_of:
            _fail(f"I6 {name}: unpublished page {p} is held by {pool.ref[p]} sequences")


def replay_tiers(s: Scheduler, seq: Sequence, steps: list[tuple[str, int]], fresh: bool) -> TierState:
    """The tier state after ``steps``; ``fresh`` replays a prefix hit as a prefill instead."""
    st, target = TierState(), s.kv.sink_target(seq)
    for kind, n in steps[1:]:
        if kind == "hit" and not fresh:
            n_sink = min(n, target)
            st = TierState(n_sink=n_sink, n_q=n - n_sink, started=n > 0)
        else:
            apply_moves(st, plan_moves(st, n, kind == "decode", s.spec, sink_target=target), s.ring)
    return st


def _counts(st: TierState) -> tuple[int, int, int]:
    return st.n_sink, st.n_q, st.n_recent


def _check_seq(s: Scheduler, seq: Sequence) -> None:
    st, ps, r = seq.tiers, s.ps, seq.rid
    if st.n_sink + st.n_q + st.n_recent != seq.n_computed:
        _fail(f"I5 {r!r}: tiers {st} do not add up to n_computed {seq.n_computed}")
    if len(seq.hp_pages) != -(-st.n_sink // ps) or len(seq.q_pages) != -(-st.n_q // ps):
        _fail(f"I5 {r!r}: {len(seq.hp_pages)} hp / {len(seq.q_pages)} q pages for tiers {st}")
    if seq.n_computed > seq.num_tokens or st.n_sink > s.kv.sink_target(seq):
        _fail(f"I5 {r!r}: n_computed {seq.n_computed} / n_sink {st.n_sink} beyond its limits")
    if not 0 <= st.head < s.ring or st.n_recent > s.ring:
        _fail(f"I5 {r!r}: ring (head {st.head}, n_recent {st.n_recent}) outside its slab of {s.ring}")
    if not s.int2 and (st.n_q or st.n_recent or seq.q_pages):
        _fail(f"I5 {r!r}: BF16 mode stores tokens outside 16-bit pages: {st}")
    for pool, pages, n in ((s.hp, seq.hp_pages, st.n_sink), (s.q, seq.q_pages, st.n_q)):
        if n % ps and (pool.ref[pages[-1]] != 1 or pages[-1] in pool.hash_of):
            _fail(f"I6 {r!r}: partial tail page {pages[-1]} is shared or published")
    pages: list[tuple[PagePool, int, int | None]] = [(s.hp, p, k) for k, p in enumerate(seq.hp_pages)]
    if s.int2:  # INT2 pages lie on the global grid only behind a full sink
        k0 = s.spec.sink_tokens // ps if seq.sink_len == s.spec.sink_tokens else None
        pages += [(s.q, p, None if k0 is None else k0 + i) for i, p in enumerate(seq.q_pages)]
    for pool, p, k in pages:
        h = pool.hash_of.get(p)
        if h is not None and (k is None or k >= len(seq.hashes) or seq.hashes[k] != h):
            _fail(f"I4 {r!r}: page {p} (global page {k}) is published under another chain hash")
    if s.trace is not None:
        steps = s.trace.get(r)
        if steps is None:
            _fail(f"I8 {r!r}: running without a step trace")
        got = replay_tiers(s, seq, steps, fresh=False)
        if got != st:
            _fail(f"I8 {r!r}: tiers {st} but a replay of {steps} gives {got}")
        fresh = replay_tiers(s, seq, steps, fresh=True)  # the layout is a function of the counts
        if seq.n_computed >= steps[0][1] and _counts(fresh) != _counts(st):
            _fail(f"I8 {r!r}: tier map {st} differs from a run without prefix hits: {fresh}")


def check(s: Scheduler) -> None:
    """Check I1–I7 (and I8 when the scheduler keeps traces); raise AssertionError on a breach."""
    owners: dict[str, Counter[int]] = {"hp": Counter(), "q": Counter()}
    slots = []
    for seq in s.running:
        if seq.status is not Status.RUNNING or seq.slot is None or s.live.get(seq.rid) is not seq:
            _fail(f"I5 {seq.rid!r}: running with status {seq.status} and slot {seq.slot}")
        owners["hp"].update(seq.hp_pages)
        owners["q"].update(seq.q_pages)
        slots.append(seq.slot)
        _check_seq(s, seq)
    for seq in s.waiting:
        if seq.status is not Status.WAITING or seq.hp_pages or seq.q_pages or seq.slot is not None:
            _fail(f"I7 {seq.rid!r}: waiting but holds pages or a slot")
        if seq.n_computed or s.live.get(seq.rid) is not seq:
            _fail(f"I7 {seq.rid!r}: waiting with n_computed {seq.n_computed} or not live")
    if len(s.live) != len(s.running) + len(s.waiting):
        _fail(f"I7: {len(s.live)} live requests but {len(s.running)} running + {len(s.waiting)} waiting")
    check_pool(s.hp, "hp", owners["hp"])
    check_pool(s.q, "q", owners["q"])
    all_slots = sorted(slots + list(s.free_slots))
    if all_slots != list(range(s.cfg.max_running)):
        _fail(f"I5: request slots {sorted(slots)} in use and {sorted(s.free_slots)} free overlap or leak")
    if s.idle and s.kv.in_use:
        _fail("I7: idle, but some pages still have owners")
