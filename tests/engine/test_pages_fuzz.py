"""Page-accounting fuzz (engine.md §8.1): pools, prefix cache and scheduler under tiny budgets.

Random operations (add from 3 shared stems with random tails, step, abort before or during a
step, stop-string finish, forced preemption) drive a scheduler whose steps go through
``SimRunner`` (a fake model reading every context back from simulated KV storage). After every
operation ``check()`` asserts I1–I8; every request that finishes on its own must have produced
exactly the tokens of an undisturbed run. The default run is bounded (~10 s); the ``slow``
variant (≥ 1e5 operations) runs only when selected with ``-m slow``.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import KINDS, PS, VOCAB, SimRunner, make_sched, reference

from oscarkv.engine.check import check, check_pool
from oscarkv.engine.pages import OutOfPages, PagePool
from oscarkv.engine.request import FinishReason, SamplingParams, Sequence, Status
from oscarkv.errors import InputError

STEMS = (
    [1 + (7 * i + 3) % (VOCAB - 1) for i in range(22)],
    [5 + i % 9 for i in range(13)],
    [9, 8, 7, 6, 5, 4],
)
MML = 40


class Fuzz:
    """One scheduler driven by ``draw(lo, hi)`` (hypothesis or a seeded RNG)."""

    def __init__(self, draw: Callable[[int, int], int], kv: str) -> None:
        self.draw, self.kv = draw, kv
        self.q_pages = (6, 12)[draw(0, 1)]
        self.s = make_sched(kv, q_pages=self.q_pages, max_running=draw(1, 4), budget=(1, 3, 5, 16, 64)[draw(0, 4)],
                            prefix=draw(0, 3) > 0, reserve=draw(0, 2), mml=MML)  # fmt: skip
        self.r = SimRunner(self.s)
        self.n, self.forced, self.finished = 0, set(), 0

    def fits(self, n: int, mt: int) -> bool:
        if n == 0 or n + mt > MML:
            return False
        total = n + mt - 1
        if self.kv == "bf16":
            return -(-total // PS) <= self.q_pages
        return -(-max(0, total - min(n, 8) - 8) // PS) <= self.q_pages

    def add(self) -> None:
        d = self.draw
        stem = STEMS[d(0, 2)]
        seed, tail = d(0, 3), d(0, 9)
        prompt = stem[: d(0, len(stem))] + [
            1 + (seed * 31 + 17 * j + seed * j * j) % (VOCAB - 1) for j in range(tail)
        ]
        stop = (d(1, VOCAB - 1),) if d(0, 3) == 0 else ()
        p = SamplingParams(max_tokens=d(1, 12), ignore_eos=d(0, 1) == 1, stop_token_ids=stop)
        self.n += 1
        seq = Sequence(f"r{self.n}", prompt, p)
        try:
            self.s.add(seq)
        except InputError:
            assert not self.fits(len(prompt), p.max_tokens), f"rejected a request that fits: {len(prompt)}"
            return
        assert self.fits(len(prompt), p.max_tokens), "accepted a request that can never fit"

    def done(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            assert seq.status is Status.FINISHED and seq.slot is None and not seq.hp_pages and not seq.q_pages
            self.finished += 1
            if seq.rid not in self.forced:
                assert seq.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
                assert seq.out == reference(seq.prompt, seq.params), f"{seq.rid}: wrong tokens"

    def step(self, abort_in_flight: bool = False) -> None:
        b = self.s.schedule()
        if b is None:
            assert self.s.idle, "work left but nothing scheduled (stuck)"
            return
        victim = b.items[self.draw(0, len(b.items) - 1)].seq if abort_in_flight else None
        if victim is not None:
            n_out = len(victim.out)
            assert self.s.abort(victim.rid) is None and not victim.finished, "deferred to the step boundary"
            self.forced.add(victim.rid)
        got = self.s.postprocess(b, self.r(b))
        if victim is not None:
            assert victim in got and victim.finish_reason is FinishReason.ABORT and len(victim.out) == n_out
        self.done(got)

    def op(self) -> None:
        k, s = self.draw(0, 11), self.s
        if k <= 2:
            self.add()
        elif k <= 7:
            self.step(abort_in_flight=k == 7 and self.draw(0, 1) == 1)
        elif k == 8 and s.live:
            rid = sorted(s.live)[self.draw(0, len(s.live) - 1)]
            self.forced.add(rid)
            self.done([s.abort(rid)])
        elif k == 9:
            s.preempt_newest()
        elif k == 10 and s.running:
            seq = s.running[self.draw(0, len(s.running) - 1)]  # a stop string (mid-chunk too)
            self.forced.add(seq.rid)
            s.finish(seq, FinishReason.STOP)
            self.done([seq])
        check(s)

    def drain(self) -> None:
        for _ in range(2000):
            if self.s.idle:
                break
            self.step()
        assert self.s.idle, "did not drain"
        check(self.s)
        assert self.s.hp.n_free == self.s.hp.capacity and self.s.q.n_free == self.s.q.capacity


@pytest.mark.parametrize("kv", KINDS)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(data=st.data())
def test_scheduler_fuzz(kv: str, data: st.DataObject):
    fz = Fuzz(lambda lo, hi: data.draw(st.integers(lo, hi)), kv)
    for _ in range(data.draw(st.integers(10, 120))):
        fz.op()
    fz.drain()


@pytest.mark.slow
@pytest.mark.parametrize("kv", KINDS)
def test_scheduler_fuzz_long(kv: str, request: pytest.FixtureRequest):
    expr = request.config.getoption("markexpr") or ""
    n_ops = 100_000 if "slow" in expr and "not slow" not in expr else 0
    if not n_ops:
        pytest.skip("long fuzz: select with -m slow")
    rng, ops, t0 = random.Random(f"{kv}-fuzz"), 0, time.perf_counter()
    while ops < n_ops:
        fz, n = Fuzz(rng.randint, kv), rng.randint(50, 1000)
        for _ in range(n):
            fz.op()
        fz.drain()
        ops += n
    print(f"{kv}: {ops} ops in {time.perf_counter() - t0:.1f} s")


# ---- the pool alone ----------------------------------------------------------------------------------
def test_page_pool_lru_publish_and_eviction():
    pool = PagePool(5)  # dummy 0 + pages 1..4
    a = pool.alloc(3)
    assert a == [1, 2, 3] and pool.n_free == 1
    with pytest.raises(OutOfPages):
        pool.alloc(2)
    assert pool.n_free == 1, "a failed alloc takes nothing"
    assert pool.publish(2, b"h2") and not pool.publish(3, b"h2") and pool.lookup(b"h2") == 2
    for p in reversed(a):
        pool.decref(p)
    assert list(pool.free) == [4, 3, 2, 1] and pool.n_cached == 1 and pool.lookup(b"h2") == 2
    pool.incref(2)  # a prefix hit revives the cached page
    assert pool.n_cached == 0 and 2 not in pool.free and pool.ref[2] == 1
    pool.decref(2)
    assert pool.alloc(3) == [4, 3, 1] and pool.lookup(b"h2") == 2
    assert pool.alloc(1) == [2] and pool.lookup(b"h2") is None and pool.n_cached == 0, "evicted on reuse"
    with pytest.raises(AssertionError, match="double free"):
        PagePool(3).decref(1)
    with pytest.raises(AssertionError, match="not a real page"):
        pool.incref(0)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 7)), max_size=80))
def test_page_pool_fuzz(ops: list[tuple[int, int]]):
    pool, owners = PagePool(8, reserved=2), []  # owners: one entry per held reference
    for kind, x in ops:
        if kind == 0:
            try:
                got = pool.alloc(x % 4)
            except OutOfPages:
                assert pool.n_free < x % 4
                got = []
            assert all(p >= 2 for p in got)
            owners += got
        elif kind == 1 and owners:
            pool.decref(owners.pop(x % len(owners)))
        elif kind == 2 and (pool.lookup(bytes([x])) is not None):
            pool.incref(pool.lookup(bytes([x])))
            owners.append(pool.lookup(bytes([x])))
        elif kind == 3 and owners and owners[x % len(owners)] not in pool.hash_of:
            p = owners[x % len(owners)]
            assert pool.publish(p, bytes([x])) == (pool.lookup(bytes([x])) == p)
        check_pool(pool, "pool", Counter(owners))
    for p in owners:
        pool.decref(p)
    assert pool.n_free == pool.capacity and not any(pool.ref)
