"""``TierAttention`` on paged pools against the HF ``OscarCacheLayer`` (engine.md §8.3(a)), BF16 mode
against plain causal SDPA, and the planner's row lists (CPU, torch backend).

A tiny stand-in for the scheduler builds each :class:`StepSeq` (``plan_moves`` with
``sink_target = min(prompt, S)``, pages from shuffled free lists, ``apply_moves``), so layout bugs
cannot hide behind page ids that happen to be in order.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from conftest import random_orthogonal
from oscarkv import QuantSpec
from oscarkv.config import EngineConfig
from oscarkv.engine.kv_pool import KVPool, plan_pools
from oscarkv.engine.planner import plan_decode, plan_prefill
from oscarkv.engine.request import Batch, SamplingParams, Sequence, StepSeq
from oscarkv.hf.cache import OscarCache
from oscarkv.kernels import resolve
from oscarkv.quant import RowFormat
from oscarkv.quant.tiers import TierState, apply_moves, plan_moves, ring_spans
from oscarkv.rotation import LayerRotation, RotationSet
from oscarkv.store import PageList, PoolPlan, Segments, TierAttention

SPEC = QuantSpec(sink_tokens=8, recent_tokens=8, demote_block=4)
PS, HQ, HKV, D = 4, 4, 2, 32
SCALE = 1 / math.sqrt(D)
OPS = resolve("torch", "cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


class MiniScheduler:
    """What the scheduler does for one step of one sequence, over shuffled page ids."""

    def __init__(self, plan: PoolPlan, seed: int = 0):
        rng = random.Random(seed)
        self.plan = plan
        self.free_h, self.free_q = list(range(1, plan.hp_pages)), list(range(1, plan.q_pages))
        self.slots = list(range(plan.max_running))
        for free in (self.free_h, self.free_q, self.slots):
            rng.shuffle(free)

    def admit(self, rid: str, prompt: int) -> Sequence:
        seq = Sequence(rid, list(range(prompt)), SamplingParams(max_tokens=100))
        seq.sink_len = min(prompt, SPEC.sink_tokens) if self.plan.int2 else 10**9
        seq.slot = self.slots.pop()
        return seq

    def step(self, seq: Sequence, n: int, decode: bool) -> StepSeq:
        if decode:
            seq.out.append(0)  # the token this step computes (sampled by the previous step)
        assert seq.sink_len is not None
        m = plan_moves(seq.tiers, n, decode, SPEC, sink_target=seq.sink_len)
        pre, post = replace(seq.tiers), replace(seq.tiers)
        apply_moves(post, m, self.plan.ring)
        ceil = lambda x: -(-x // PS)  # noqa: E731
        need_h = ceil(post.n_sink) if self.plan.int2 else ceil(seq.n_computed + n)
        seq.hp_pages += [self.free_h.pop() for _ in range(need_h - len(seq.hp_pages))]
        seq.q_pages += [self.free_q.pop() for _ in range(ceil(post.n_q) - len(seq.q_pages))]
        item = StepSeq(seq, seq.n_computed, n, pre, m)
        seq.tiers, seq.n_computed = post, seq.n_computed + n
        return item


def signed_permutation(d: int, gen: torch.Generator) -> torch.Tensor:
    """An orthogonal matrix whose products are exact in any summation order (one term per output)."""
    sign = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return torch.eye(d)[torch.randperm(d, generator=gen)] * sign


def make_rotation(granularity: str, seed: int, kind: str = "orthogonal") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    make = random_orthogonal if kind == "orthogonal" else signed_permutation
    n = 1 if granularity == "layer" else HKV
    r_k, r_v = (torch.stack([make(D, gen) for _ in range(n)]) for _ in range(2))
    return (r_k[0], r_v[0]) if granularity == "layer" else (r_k, r_v)


def streams(n: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[n, Hq, d]``, k, v ``[n, Hkv, d]``; keys with a few outlier channels (clipping matters)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    k[..., :3] *= 6
    return q.to(dtype), k.to(dtype), v.to(dtype)


def int2_setup(dtype: torch.dtype, max_running: int = 4) -> tuple[PoolPlan, KVPool, RowFormat, RowFormat]:
    cfg = EngineConfig(kv_dtype="int2", page_tokens=PS, max_running=max_running)
    plan = plan_pools(cfg, SPEC, 1, HKV, D, dtype, 1 << 20)
    kf, vf = RowFormat.from_spec(SPEC, D, "k"), RowFormat.from_spec(SPEC, D, "v")
    return plan, KVPool(plan, 1, HKV, D, dtype, [(kf, vf)], "cpu"), kf, vf


# (rid, prompt length, prefill chunks); then steps: ("prefill"|"decode", [(rid, n), ...])
PROMPTS = {"A": 27, "B": 5, "C": 13}
SCHEDULE = [
    ("prefill", [("A", 10), ("B", 5)]),
    ("decode", [("B", 1)]),
    ("prefill", [("A", 9), ("C", 13)]),
    ("prefill", [("A", 8)]),
    *[("decode", [("A", 1), ("B", 1), ("C", 1)])] * 18,
]


def _rows_of_state(plan: PoolPlan, seq: Sequence, st: TierState) -> tuple[list[int], list[int], list[int]]:
    """Engine rows of INT2 indices, sink positions and live ring indices (oldest first)."""
    row = lambda pages, i: pages[i // PS] * PS + i % PS  # noqa: E731
    (h0, n0), (_, n1) = ring_spans(st, plan.ring)
    ring_idx = [*range(h0, h0 + n0), *range(n1)]
    q = [row(seq.q_pages, i) for i in range(st.n_q)]
    sink = [row(seq.hp_pages, j) for j in range(st.n_sink)]
    assert seq.slot is not None
    return q, sink, [plan.ring_base(seq.slot) + r for r in ring_idx]


@pytest.mark.parametrize(
    ("kind", "granularity", "prerotated", "dtype"),
    [
        ("orthogonal", "layer", False, torch.float32),
        ("orthogonal", "kv_head", True, torch.float32),
        ("permutation", "layer", False, torch.float32),
        ("permutation", "kv_head", False, torch.bfloat16),
        ("permutation", "layer", True, torch.bfloat16),
    ],
)
def test_engine_attention_equals_oscar_cache_layer(kind, granularity, prerotated, dtype):
    """Same q/k/v streams through both: equal outputs, tier states and stored rows.

    A random orthogonal R gives products whose last bit depends on the BLAS kernel the row count
    picks (the HF oracle runs one sequence at a time, the engine a flat batch): outputs and
    16-bit rows then agree to 1e-6 while the INT2 codes and metadata are compared bit for bit.
    A signed permutation R makes every product exact, so everything must be bit-identical.
    """
    exact = kind == "permutation"
    r_k, r_v = make_rotation(granularity, seed=3, kind=kind)
    plan, pool, kf, vf = int2_setup(dtype)
    views = pool.layer(0)
    attn = TierAttention(0, r_k, r_v, kf, vf, OPS, SCALE, values_prerotated=prerotated)
    sched = MiniScheduler(plan, seed=7)
    rot = RotationSet({0: LayerRotation(r_k, r_v, torch.ones(r_k.shape[:-1]), torch.ones(r_v.shape[:-1]))}, SPEC, granularity)  # fmt: skip
    seqs, hf, data = {}, {}, {}
    for i, (rid, n) in enumerate(PROMPTS.items()):
        seqs[rid] = sched.admit(rid, n)
        cache = OscarCache(rot, 1, spec=SPEC, backend="torch", values_prerotated=prerotated)
        hf[rid] = cache
        data[rid] = streams(n + 30, seed=10 + i, dtype=dtype)
    demotions = 0
    for kind, work in SCHEDULE:
        items = tuple(sched.step(seqs[rid], n, kind == "decode") for rid, n in work)
        demotions += sum(it.moves.demote > 0 for it in items)
        rows = [tuple(x[it.start : it.start + it.n_new] for x in data[it.seq.rid]) for it in items]
        q, k, v = (torch.cat([r[j] for r in rows]) for j in range(3))
        batch = Batch(kind, items)
        if kind == "prefill":
            p = plan_prefill(batch, plan, "cpu")
            assert p.positions.tolist() == [it.start + j for it in items for j in range(it.n_new)]
            ends = [it.ends_prompt for it in items]
            assert p.last_idx.tolist() == [c - 1 for c, e in zip(p.cu_host[1:], ends, strict=True) if e]
            out = attn.prefill(q, k, v, views, p)
        else:
            p = plan_decode(batch, plan, "cpu")
            # the torch reference ignores lens_hint; Triton sizes its grid from it (trap 4)
            assert p.lens_hint == (p.q.max_len, p.hp.max_len)
            assert p.lens_hint[1] <= SPEC.sink_tokens + plan.ring
            out = attn.decode(q, k, v, views, p)
        off = 0
        for it, (qi, ki, vi) in zip(items, rows, strict=True):
            layer = hf[it.seq.rid].layers[0]
            q4, k4, v4 = (x.transpose(0, 1)[None] for x in (qi, ki, vi))  # [1, H, T, d]
            if not layer.is_initialized:
                layer.lazy_initialization(k4, v4)
            want = layer.attend(q4, k4, v4, None, SCALE)[0]
            got = out[off : off + it.n_new]
            off += it.n_new
            if exact:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            _assert_same_storage(plan, views, it.seq, hf[it.seq.rid], exact)
    assert demotions >= 6  # decode crossed several demotions, with ring wrap-around


def _assert_same_storage(plan: PoolPlan, views, seq: Sequence, cache: OscarCache, exact: bool) -> None:
    st_hf, hp = cache.table.seqs[0], cache.layers[0].pools
    st = seq.tiers
    assert (st.n_sink, st.n_q, st.head, st.n_recent) == (st_hf.n_sink, st_hf.n_q, st_hf.head, st_hf.n_recent)
    q_rows, sink_rows, ring_rows = (torch.tensor(r, dtype=torch.long) for r in _rows_of_state(plan, seq, st))
    n_q = st.n_q
    for mine, theirs in ((views.k_codes, hp.k_codes), (views.v_codes, hp.v_codes),
                         (views.k_meta, hp.k_meta), (views.v_meta, hp.v_meta)):  # fmt: skip
        assert torch.equal(mine[q_rows], theirs[:n_q])
    (h0, n0), (_, n1) = ring_spans(st_hf, plan.ring)
    hf_hp = torch.tensor(
        [*range(st.n_sink), *[SPEC.sink_tokens + r for r in [*range(h0, h0 + n0), *range(n1)]]]
    )
    mine_hp = torch.cat([sink_rows, ring_rows])
    for mine, theirs in ((views.hp_k, hp.hp_k), (views.hp_v, hp.hp_v)):
        if exact:
            assert torch.equal(mine[mine_hp], theirs[hf_hp])
        else:
            torch.testing.assert_close(mine[mine_hp], theirs[hf_hp], atol=1e-6, rtol=1e-6)


def test_padded_decode_writes_nothing_outside_dummy_rows():
    """``bs_pad`` rows (CUDA graphs) change neither the real outputs nor any live pool row."""
    r_k, r_v = make_rotation("layer", seed=5)
    plan, pool, kf, vf = int2_setup(torch.float32)
    attn = TierAttention(0, r_k, r_v, kf, vf, OPS, SCALE)
    sched = MiniScheduler(plan, seed=1)
    seqs = [sched.admit("A", 20), sched.admit("B", 9)]
    data = [streams(40, seed=s, dtype=torch.float32) for s in (1, 2)]
    views = pool.layer(0)
    for s, n in ((0, 20), (1, 9)):
        it = sched.step(seqs[s], n, False)
        attn.prefill(*(x[:n] for x in data[s]), views, plan_prefill(Batch("prefill", (it,)), plan, "cpu"))
    for t in range(6):  # across demotions
        items = tuple(sched.step(s, 1, True) for s in seqs)
        rows = [tuple(x[it.start : it.start + 1] for x in d) for it, d in zip(items, data, strict=True)]
        q, k, v = (torch.cat([r[j] for r in rows]) for j in range(3))
        pad = lambda x: torch.cat([x, torch.randn(3, *x.shape[1:])])  # noqa: E731
        batch = Batch("decode", items)
        ref = KVPool(plan, 1, HKV, D, torch.float32, [(kf, vf)], "cpu")
        for name in ("k_codes", "v_codes", "k_meta", "v_meta", "hp_k", "hp_v"):
            getattr(ref.layer(0), name).copy_(getattr(views, name))
        want = attn.decode(q, k, v, ref.layer(0), plan_decode(batch, plan, "cpu"))
        p = plan_decode(batch, plan, "cpu", bs_pad=5, demote_block=SPEC.demote_block)
        assert p.decode_dst[2:].tolist() == [-1] * 3 and p.demote_src.numel() == 5 * SPEC.demote_block
        got = attn.decode(pad(q), pad(k), pad(v), views, p)
        assert torch.equal(got[:2], want), t
        for name in ("k_codes", "v_codes", "k_meta", "v_meta"):  # dummy INT2 page 0 may differ
            assert torch.equal(getattr(views, name)[PS:], getattr(ref.layer(0), name)[PS:]), name
        assert torch.equal(pool.hp_k, ref.hp_k) and torch.equal(pool.hp_v, ref.hp_v)


def test_bf16_mode_equals_causal_sdpa():
    cfg = EngineConfig(kv_dtype="bf16", page_tokens=PS, max_running=4)
    plan = plan_pools(cfg, None, 1, HKV, D, torch.float32, 1 << 18)
    pool = KVPool(plan, 1, HKV, D, torch.float32, None, "cpu")
    views = pool.layer(0)
    attn = TierAttention(0, None, None, views.k_fmt, views.v_fmt, OPS, SCALE)
    sched = MiniScheduler(plan, seed=3)
    seqs = {"A": sched.admit("A", 11), "B": sched.admit("B", 3)}
    data = {"A": streams(20, 1, torch.float32), "B": streams(20, 2, torch.float32)}
    steps = [("prefill", [("A", 6), ("B", 3)]), ("prefill", [("A", 5)])]
    steps += [("decode", [("A", 1), ("B", 1)])] * 6
    for kind, work in steps:
        items = tuple(sched.step(seqs[r], n, kind == "decode") for r, n in work)
        q, k, v = (
            torch.cat([data[it.seq.rid][j][it.start : it.start + it.n_new] for it in items]) for j in range(3)
        )
        batch = Batch(kind, items)
        if kind == "prefill":
            out = attn.prefill(q, k, v, views, plan_prefill(batch, plan, "cpu"))
        else:
            out = attn.decode(q, k, v, views, plan_decode(batch, plan, "cpu"))
        off = 0
        for it in items:
            dq, dk, dv = data[it.seq.rid]
            end = it.start + it.n_new
            ref = torch.nn.functional.scaled_dot_product_attention(
                dq[:end].transpose(0, 1), dk[:end].transpose(0, 1).repeat_interleave(HQ // HKV, 0),
                dv[:end].transpose(0, 1).repeat_interleave(HQ // HKV, 0), is_causal=True, scale=SCALE,
            ).transpose(0, 1)  # fmt: skip
            torch.testing.assert_close(out[off : off + it.n_new], ref[it.start : end], atol=1e-5, rtol=1e-5)
            off += it.n_new
            rows = [it.seq.hp_pages[j // PS] * PS + j % PS for j in range(end)]
            assert torch.equal(views.hp_k[rows], dk[:end]) and torch.equal(views.hp_v[rows], dv[:end])


def test_segments_expand_paged_and_ring_rows_in_order():
    pages = PageList()
    a, b = pages.add([7, 3, 9]), pages.add([5])
    seg = Segments(page_tokens=4)
    seg.paged(pages, a, 3, 2, 7, tok0=100)  # list indices 2..8 over pages 7, 3, 9
    seg.ring(1000, 9, 5, 11, tok0=200)  # ring indices 9, 10, 0, 1, 2
    seg.end_seq()
    seg.end_seq()  # an empty list
    seg.paged(pages, b, 1, 0, 3)
    seg.end_seq()
    want = [30, 31, 12, 13, 14, 15, 36, 1009, 1010, 1000, 1001, 1002, 20, 21, 22]
    rows, tok = seg.expand(pages.tensor(torch.device("cpu")))
    assert rows.tolist() == want
    assert tok.tolist() == [*range(100, 107), *range(200, 205), 0, 1, 2]
    csr = seg.csr(pages.tensor(torch.device("cpu")))
    assert csr.indptr.tolist() == [0, 12, 12, 15] and csr.indices.dtype == torch.int32
    assert csr.indices.tolist() == want and csr.max_len == 12
    with pytest.raises(ValueError, match="allocated too few"):
        seg.paged(pages, b, 1, 2, 3)


def test_planner_refuses_inconsistent_steps():
    plan, *_ = int2_setup(torch.float32)
    sched = MiniScheduler(plan)
    seq = sched.admit("A", 20)
    it = sched.step(seq, 20, False)
    with pytest.raises(ValueError, match="starts at"):
        plan_prefill(Batch("prefill", (replace(it, start=3),)), plan, "cpu")
    seq.q_pages.pop()
    with pytest.raises(ValueError, match="allocated too few"):
        plan_prefill(Batch("prefill", (it,)), plan, "cpu")
