"""The scheduler, pages and prefix cache on a simulated KV store (engine.md §8.1 regressions).

``SimRunner`` plays the model runner: it writes each token id where the planner would store its
K/V (sink pages, INT2 pages, the request's ring slab; demotions first), reads every sequence's
context back from that storage and checks it equals the tokens, then samples a hash of the
context. Any page shared by mistake, freed while held or evicted while indexed shows up as a
wrong context. ``check()`` (I1–I8) runs after every schedule and postprocess.
"""

from __future__ import annotations

import struct
from collections import Counter
from hashlib import blake2b

import pytest

from oscarkv import QuantSpec
from oscarkv.config import EngineConfig
from oscarkv.engine.check import check
from oscarkv.engine.pages import PagePool
from oscarkv.engine.prefix_cache import PrefixCache
from oscarkv.engine.request import Batch, FinishReason, SamplingParams, Sequence, Status
from oscarkv.engine.scheduler import Scheduler
from oscarkv.errors import InputError
from oscarkv.quant.tiers import tier_map

SPEC = QuantSpec(sink_tokens=8, recent_tokens=8, demote_block=4)
PS, VOCAB, EOS = 4, 50, 0
KINDS = ("int2", "bf16")


def make_sched(kv: str = "int2", q_pages: int = 12, hp_pages: int | None = None, max_running: int = 3,
               budget: int = 16, prefix: bool = True, reserve: int = 1, mml: int = 40,
               pool_cls: type[PagePool] = PagePool) -> Scheduler:  # fmt: skip
    """Tiny pools: ``q_pages`` of the growing tier (INT2, or 16-bit in BF16 mode)."""
    cfg = EngineConfig(kv_dtype=kv, page_tokens=PS, max_running=max_running, max_batched_tokens=budget,
                       decode_reserve_pages=reserve, max_model_len=mml, check_invariants=True, spec=SPEC)  # fmt: skip
    if kv == "int2":
        hp = pool_cls(1 + (hp_pages or max_running * SPEC.sink_tokens // PS * 2))
        q = pool_cls(1 + q_pages)
    else:
        hp, q = pool_cls(1 + (hp_pages or q_pages)), pool_cls(1)
    pc = PrefixCache(b"test-model", PS, SPEC, kv, hp, q) if prefix else None
    return Scheduler(cfg, hp, q, pc, eos_ids=(EOS,))


def next_token(ctx: list[int]) -> int:
    return (
        int.from_bytes(blake2b(struct.pack(f"<{len(ctx)}q", *ctx), digest_size=8).digest(), "little") % VOCAB
    )


def reference(prompt: list[int], p: SamplingParams) -> list[int]:
    """The tokens a request gets when nothing goes wrong (the fake model is deterministic)."""
    out: list[int] = []
    while True:
        out.append(next_token(prompt + out))
        t = out[-1]
        if t in p.stop_token_ids or (not p.ignore_eos and t == EOS) or len(out) >= p.max_tokens:
            return out


class SimRunner:
    """Token ids stored where K/V would be; contexts read back from that storage."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.hp: dict[tuple[int, int], int] = {}
        self.q: dict[tuple[int, int], int] = {}
        self.ring: dict[tuple[int, int], int] = {}

    def _put(self, pool: PagePool, mem: dict, pages: list[int], i: int, v: int) -> None:
        p = pages[i // PS]
        assert p >= pool.reserved, f"write to dummy page {p}"
        assert pool.ref[p] == 1 and p not in pool.hash_of, f"write to shared or published page {p}"
        mem[(p, i % PS)] = v

    def write(self, item) -> None:
        s, seq, pre, m = self.s, item.seq, item.pre, item.moves
        toks = iter(seq.tokens[item.start : item.start + item.n_new])
        for j in range(m.demote):  # demotions first: a freed ring index may take a new token
            self._put(s.q, self.q, seq.q_pages, pre.n_q + j, self.ring[(seq.slot, (pre.head + j) % s.ring)])
        for j in range(m.to_sink):
            self._put(s.hp, self.hp, seq.hp_pages, pre.n_sink + j, next(toks))
        for j in range(m.to_int2):
            self._put(s.q, self.q, seq.q_pages, pre.n_q + m.demote + j, next(toks))
        head, n_rec = (pre.head + m.demote) % s.ring, pre.n_recent - m.demote
        for j in range(m.to_ring):
            self.ring[(seq.slot, (head + n_rec + j) % s.ring)] = next(toks)

    def context(self, seq: Sequence) -> list[int]:
        st, s = seq.tiers, self.s
        out = [self.hp[(seq.hp_pages[i // PS], i % PS)] for i in range(st.n_sink)]
        out += [self.q[(seq.q_pages[i // PS], i % PS)] for i in range(st.n_q)]
        return out + [self.ring[(seq.slot, (st.head + j) % s.ring)] for j in range(st.n_recent)]

    def __call__(self, batch: Batch) -> list[int | None]:
        for item in batch.items:
            self.write(item)
        out: list[int | None] = []
        for item in batch.items:
            seq = item.seq
            ctx = self.context(seq)
            assert ctx == seq.tokens[: seq.n_computed], f"{seq.rid}: stored KV differs from its tokens"
            out.append(next_token(ctx) if item.ends_prompt else None)
        return out


def step(s: Scheduler, r: SimRunner) -> list[Sequence] | None:
    b = s.schedule()
    return None if b is None else s.postprocess(b, r(b))


def drain(s: Scheduler, r: SimRunner, limit: int = 5000) -> list[Sequence]:
    done: list[Sequence] = []
    for _ in range(limit):
        if s.idle:
            check(s)
            return done
        got = step(s, r)
        assert got is not None, "work left but nothing scheduled (stuck)"
        done += got
    raise AssertionError("did not drain")


def req(rid: str, prompt: list[int], max_tokens: int = 6, **kw) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


def toks(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt * 13 + i * i * salt) % (VOCAB - 1) for i in range(n)]


class FreeSpy(PagePool):
    """Records every page whose last owner lets go."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.frees: list[int] = []

    def decref(self, p: int) -> None:
        super().decref(p)
        if self.ref[p] == 0:
            self.frees.append(p)


# ---- §8.1 regressions ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", KINDS)
@pytest.mark.parametrize("prefix", [False, True])
def test_chunked_prefill_demotion_finish_frees_each_page_once(kv: str, prefix: bool):
    s = make_sched(kv, q_pages=16, budget=3, prefix=prefix, pool_cls=FreeSpy)
    r, seq = SimRunner(s), req("a", toks(30), max_tokens=9)
    s.add(seq)
    saw_demote, held = False, None
    while not seq.finished:
        b = s.schedule()
        saw_demote |= any(i.moves.demote for i in b.items)
        held = Counter(seq.hp_pages + [-p for p in seq.q_pages])
        assert not s.hp.frees and not s.q.frees, "a page was freed while its sequence runs"
        s.postprocess(b, r(b))
    assert kv == "bf16" or saw_demote
    assert Counter(s.hp.frees + [-p for p in s.q.frees]) == held, "each held page is freed exactly once"
    st = seq.tiers  # finishing publishes first: every page in a fixed tier is cached now
    fixed = st.n_sink // PS + (st.n_q // PS if seq.sink_len == SPEC.sink_tokens else 0)
    assert s.hp.n_cached + s.q.n_cached == (fixed if prefix else 0) and fixed > 0
    assert seq.out == reference(seq.prompt, seq.params) and seq.finish_reason is FinishReason.LENGTH
    assert s.hp.n_free == s.hp.capacity and s.q.n_free == s.q.capacity and s.idle


@pytest.mark.parametrize("kv", KINDS)
def test_two_identical_new_prefixes_in_one_batch(kv: str):
    s = make_sched(kv, q_pages=24, budget=64)
    r = SimRunner(s)
    a, b = req("a", toks(24), 8), req("b", toks(24), 8)
    s.add(a), s.add(b)
    batch = s.schedule()
    assert [i.seq for i in batch.items] == [a, b] and b.n_cached == 0
    s.postprocess(batch, r(batch))
    pools = (s.hp, s.q)
    mine = {
        pool: [p for p in pages if p in pool.hash_of]
        for pool, pages in zip(pools, (a.hp_pages, a.q_pages), strict=True)
    }
    theirs = [
        p
        for pool, pages in zip(pools, (b.hp_pages, b.q_pages), strict=True)
        for p in pages
        if p in pool.hash_of
    ]
    assert sum(map(len, mine.values())) == a.published > 0 and b.published == a.published
    assert theirs == [], "the second copy stays private (no remap, no free)"
    assert len(s.hp.index) + len(s.q.index) == a.published, "one published copy per page"
    s.abort("a")
    assert all(p not in s.hp.free for p in b.hp_pages) and all(p not in s.q.free for p in b.q_pages)
    c = req("c", toks(24), 8)
    s.add(c)
    step(s, r)
    assert c.n_cached > 0 and not set(c.hp_pages) & set(b.hp_pages) and not set(c.q_pages) & set(b.q_pages)
    assert set(c.hp_pages) & set(mine[s.hp]), "the cached copy is revived"
    drain(s, r)
    for seq in (b, c):
        assert seq.finish_reason is FinishReason.LENGTH and seq.out == reference(seq.prompt, seq.params)


@pytest.mark.parametrize("kv", KINDS)
def test_finish_while_another_holds_the_published_pages(kv: str):
    s = make_sched(kv, q_pages=14, budget=64, max_running=3, reserve=0)
    r = SimRunner(s)
    a = req("a", toks(26), 2)
    s.add(a)
    step(s, r)
    b = req("b", toks(26) + toks(4, 5), 10)
    s.add(b)
    step(s, r)
    shared = set(a.hp_pages + a.q_pages) & set(b.hp_pages + b.q_pages)
    assert b.n_cached > 0 and shared
    while not a.finished:
        step(s, r)
    for p in b.hp_pages:
        assert s.hp.ref[p] == 1 and p not in s.hp.free
    for p in b.q_pages:
        assert s.q.ref[p] == 1 and p not in s.q.free
    for i in range(3):  # allocation pressure: the held pages must never be handed out again
        s.add(req(f"x{i}", toks(12 + 3 * i, 9 + i), 5))
    drain(s, r)  # SimRunner checks b's stored context at every step
    assert b.out == reference(b.prompt, b.params)


@pytest.mark.parametrize("kv", KINDS)
@pytest.mark.parametrize("n_prompt", [6, 20])
def test_preempt_and_resume_keeps_sink_len_and_tier_map(kv: str, n_prompt: int):
    s, twin = make_sched(kv, q_pages=16), make_sched(kv, q_pages=16)
    r, rt = SimRunner(s), SimRunner(twin)
    a, ta = req("a", toks(n_prompt, 3), 14), req("a", toks(n_prompt, 3), 14)
    s.add(a), twin.add(ta)
    for _ in range(8):
        step(s, r), step(twin, rt)
    assert a.n_computed == ta.n_computed > n_prompt
    sink_len = a.sink_len
    assert sink_len == min(n_prompt, SPEC.sink_tokens)
    s.add(req("w", toks(3), 2))
    assert s.preempt_newest() is a and a.status is Status.WAITING and a.n_computed == 0
    assert list(s.waiting) == [a, s.live["w"]], "the preempted sequence goes first"
    check(s)
    assert a.sink_len == sink_len and a.preemptions == 1
    step(s, r), step(twin, rt)  # recompute prompt + out in one prefill (hit + budget 16)
    assert a.sink_len == sink_len and ta.n_computed == a.n_computed
    assert a.tiers.n_sink == ta.tiers.n_sink == (sink_len if kv == "int2" else a.n_computed)
    assert tier_map(a.tiers)[:sink_len] == tier_map(ta.tiers)[:sink_len]
    assert a.tiers.n_q + a.tiers.n_recent == ta.tiers.n_q + ta.tiers.n_recent
    if kv == "int2":  # the one known difference: the ring holds exactly R after recompute
        assert a.tiers.n_recent == min(SPEC.recent_tokens, a.n_computed - sink_len)
        assert SPEC.recent_tokens <= ta.tiers.n_recent <= SPEC.recent_tokens + SPEC.demote_block - 1
    assert a.n_cached > 0, "resume hits the pages it published"
    drain(s, r)
    assert a.out == reference(a.prompt, a.params)


def test_int2_exhaustion_with_free_16bit_pages_preempts():
    s = make_sched("int2", q_pages=7, hp_pages=40, max_running=3, budget=64, reserve=0)
    r = SimRunner(s)
    seqs = [req(f"r{i}", toks(18, i), 20) for i in range(3)]
    for q in seqs:
        s.add(q)
    preempted_with_free_hp = False
    for _ in range(2000):
        if s.idle:
            break
        before, newest = sum(q.preemptions for q in seqs), s.running[-1] if s.running else None
        step(s, r)
        if sum(q.preemptions for q in seqs) > before:
            preempted_with_free_hp |= s.hp.n_free > 0
            assert newest.status is Status.WAITING and s.waiting[0].preemptions, (
                "newest preempted, to the front"
            )
    assert s.idle and preempted_with_free_hp
    for q in seqs:
        assert q.out == reference(q.prompt, q.params), q.rid


# ---- prefix hits give a fresh run's layout ----------------------------------------------------------
@pytest.mark.parametrize("kv", KINDS)
@pytest.mark.parametrize("n", [5, 9, 13, 16, 17, 23, 30])
@pytest.mark.parametrize("budget", [3, 64])
def test_prefix_hit_gives_the_fresh_tier_layout(kv: str, n: int, budget: int):
    s, fresh = (
        make_sched(kv, q_pages=20, budget=budget),
        make_sched(kv, q_pages=20, budget=budget, prefix=False),
    )
    r, rf = SimRunner(s), SimRunner(fresh)
    prompt = toks(n, 4)
    s.add(req("a", prompt, 6))
    drain(s, r)
    b, fb = req("b", prompt, 8), req("b", prompt, 8)
    s.add(b), fresh.add(fb)
    step(s, r)
    sink_len, m = min(n, SPEC.sink_tokens), b.n_cached
    assert m == s.prefix.cap(n, sink_len) and (n < PS or m > 0), "the whole capped prefix hits"
    assert s.trace["b"][:2] == [("admit", n), ("hit", m)]
    fixed = n - min(SPEC.recent_tokens, n - sink_len) if kv == "int2" else n
    assert m <= min(fixed, n - 1), "no hit token lies in a fresh run's ring"
    while fb.n_computed < n:
        step(fresh, rf)
    while b.n_computed < n:
        step(s, r)
    while True:
        assert b.n_computed == fb.n_computed and tier_map(b.tiers) == tier_map(fb.tiers), (b.tiers, fb.tiers)
        if b.finished or fb.finished:
            break
        step(s, r), step(fresh, rf)
    assert b.finished and fb.finished
    drain(s, r)
    assert b.out == fb.out == reference(prompt, b.params)


# ---- add() errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [
        ([], 4, "empty prompt"),
        (toks(40), 1, r"shorter than max_model_len \(40\)"),
        (toks(30), 11, r"max_tokens \(11\) must be <= max_model_len \(40\)"),
    ],
)
def test_add_rejects_bad_requests(prompt: list[int], max_tokens: int, match: str):
    s = make_sched()
    with pytest.raises(InputError, match=match):
        s.add(req("x", prompt, max_tokens))
    assert s.idle and not s.live


@pytest.mark.parametrize("kv", KINDS)
def test_add_rejects_a_request_that_can_never_fit(kv: str):
    s = make_sched(kv, q_pages=3, mml=100)
    kind = "INT2" if kv == "int2" else "16-bit"
    with pytest.raises(InputError, match=rf"needs \d+ {kind} pages of 4 tokens; the pool has 3") as e:
        s.add(req("x", toks(30), 10))
    assert "--kv-budget-gb" in e.value.hint
    s.add(req("y", toks(6), 2))  # a small one still fits
    s.add(req("z", toks(4), 2))
    with pytest.raises(InputError, match="already in use"):
        s.add(req("z", toks(4), 2))


def test_check_detects_broken_accounting():
    s = make_sched(budget=64)
    r = SimRunner(s)
    s.add(req("a", toks(20), 4))
    step(s, r)
    check(s)
    a = s.running[0]
    a.q_pages.append(a.q_pages[-1])
    with pytest.raises(AssertionError, match=r"I2|I5"):
        check(s)
    a.q_pages.pop()
    s.hp.free[a.hp_pages[0]] = None
    with pytest.raises(AssertionError, match=r"I1|I3"):
        check(s)
    del s.hp.free[a.hp_pages[0]]
    a.tiers.n_recent += 1
    with pytest.raises(AssertionError, match="I5"):
        check(s)
    a.tiers.n_recent -= 1
    a.tiers.head = (a.tiers.head + 1) % s.ring
    with pytest.raises(AssertionError, match="I8"):
        check(s)
