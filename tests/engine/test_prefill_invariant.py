"""``prefill_attention="invariant"``: a token's hidden states and stored K/V depend on the request's
tokens alone (issue 44, item 5). Layer level: the attention equals an explicit per-query mask
reference, and the INT2 values it uses equal what the store keeps. Engine level (the demo model,
INT2 with small windows): a repeated request served from the prefix cache, a chunked prefill and
concurrent requests give the tokens of a fresh, one-chunk, one-at-a-time run."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from tier_steps import check_against_masks, run_steps, signed_perm, use_form

from conftest import random_rotation_set
from oscarkv import LLM, QuantSpec, SamplingParams
from oscarkv.config import EngineConfig
from oscarkv.demo import demo_model_path
from oscarkv.engine.kv_pool import KVPool, plan_pools
from oscarkv.kernels import pool_ops, resolve
from oscarkv.quant import RowFormat
from oscarkv.rotation import save_rotations
from oscarkv.store import TierAttention, windows
from oscarkv.store.windows import quantize_dequantize

pytestmark = pytest.mark.usefixtures("one_thread")
OPS = resolve("torch", "cpu")


# ---- layer level ------------------------------------------------------------------------------
L_SPEC = QuantSpec(sink_tokens=8, recent_tokens=14, demote_block=4)  # window block G = 12 < R
PS, HQ, HKV, D = 4, 4, 2, 32
G = 12


def _setup(window: torch.dtype | None = None):
    cfg = EngineConfig(kv_dtype="int2", page_tokens=PS, max_running=4, prefill_attention="invariant")
    plan = plan_pools(cfg, L_SPEC, 1, HKV, D, torch.float32, 1 << 20)
    assert plan.window_block == G
    kf, vf = RowFormat.from_spec(L_SPEC, D, "k"), RowFormat.from_spec(L_SPEC, D, "v")
    return plan, KVPool(plan, 1, HKV, D, torch.float32, [(kf, vf)], "cpu", window), kf, vf


def test_quantize_dequantize_equals_what_the_store_keeps():
    """The INT2 value the invariant rule reads for a 16-bit row is bit-identical to that row after
    a demotion (ring -> INT2) and after a direct INT2 write, as a later prefill reads them."""
    _, pool, kf, vf = _setup()
    views = pool.layer(0)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, HKV, D, generator=g), torch.randn(10, HKV, D, generator=g)
    k[..., :3] *= 6
    hp_rows, q_rows = torch.arange(40, 50), torch.arange(8, 18)
    pool_ops.write_hp(views, hp_rows, k, v)
    pool_ops.demote(views, hp_rows, q_rows, OPS)
    pool_ops.write_int2(views, q_rows + 20, k, v, OPS)
    for dst in (q_rows, q_rows + 20):
        got_k = OPS.dequantize(views.k_codes[dst], views.k_meta[dst], kf, torch.float32)
        got_v = OPS.dequantize(views.v_codes[dst], views.v_meta[dst], vf, torch.float32)
        assert torch.equal(got_k, quantize_dequantize(k, kf, OPS))
        assert torch.equal(got_v, quantize_dequantize(v, vf, OPS))


@pytest.mark.parametrize(("form", "rows_per_token"), [("varlen", 2), ("varlen", 0), ("masked", 2)])
@pytest.mark.parametrize("window", [None, torch.float8_e4m3fn], ids=["16-bit", "fp8"])
def test_invariant_attention_equals_explicit_masks(
    form: str, rows_per_token: int, window: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
):
    """Three prompts prefilled together in ragged chunks (sink-only starts, chunk ends inside and
    on window blocks, INT2 demotions): every query row equals the per-query mask reference, with
    the varlen key lists gathered in one call or one piece per call (``GATHER_ROWS_PER_TOKEN =
    0``), and in the masked form (the CPU's: one call per piece); with fp8 windows every 16-bit
    key as fp8 holds it and every INT2 key quantized from that."""
    use_form(monkeypatch, form)
    monkeypatch.setattr(windows, "GATHER_ROWS_PER_TOKEN", rows_per_token)
    calls = []
    real = windows.invariant_prefill
    monkeypatch.setattr("oscarkv.store.attention.invariant_prefill",
                        lambda *a, **k: calls.append(len(a[-1])) or real(*a, **k))  # fmt: skip
    plan, pool, kf, vf = _setup(window)
    views = pool.layer(0)
    gen = torch.Generator().manual_seed(3)
    r_k, r_v = signed_perm(D, gen), signed_perm(D, gen)
    scale = 1 / math.sqrt(D)
    attn = TierAttention(0, r_k, r_v, kf, vf, OPS, scale)
    prompts = {"A": (61, None), "B": (9, None), "C": (40, None)}
    schedule = [[("A", 5), ("B", 9), ("C", 13)], [("A", 19), ("C", 11)], [("A", 24), ("C", 16)], [("A", 13)]]
    res = run_steps(attn, plan, views, L_SPEC, prompts, schedule, (HQ, HKV, D), random.Random(1))
    assert res["demoted"] > 0
    assert max(calls) > 1 if rows_per_token == 0 or form == "masked" else max(calls) == 1, calls  # groups
    check_against_masks(attn, res, dict.fromkeys(prompts, lambda t: t // G * G), L_SPEC, scale, window)


# ---- engine level (demo model) -------------------------------------------------------------
SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
VOCAB = 2048
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def rotations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rot")
    save_rotations(random_rotation_set(4, 128, SPEC), d)
    return d


def _llm(rot: Path, mode: str, **kw) -> LLM:
    return LLM(str(demo_model_path()), rotations=str(rot), device="cpu", page_tokens=8, spec=SPEC,
               check_invariants=True, prefill_attention=mode, **kw)  # fmt: skip


def _prompts(lens, seed: int = 0, stem: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(3, VOCAB, (stem,), generator=g).tolist()
    return [s + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mode", ["fresh", "invariant"])
def test_repeat_served_from_the_prefix_cache_gives_the_same_tokens(rotations, mode):
    ps = _prompts((130, 200, 75), seed=1)
    llm = _llm(rotations, mode)
    first = llm.generate(ps, GREEDY)
    again = llm.generate(ps, GREEDY)
    hits = [o.num_cached_tokens for o in again]
    assert all(h > SPEC.sink_tokens for h in hits), hits  # INT2 pages served from the cache
    same = _tokens(first) == _tokens(again)
    assert same if mode == "invariant" else not same  # fresh: the hit changes the text
    if mode == "invariant":
        assert all(h % 32 == 0 for h in hits)  # hits end on a window block


def test_chunked_prefill_equals_one_chunk(rotations):
    ps = _prompts((130, 200, 61), seed=2)
    want = _tokens(_llm(rotations, "invariant", prefix_cache=False).generate(ps, GREEDY))
    for chunk in (24, 37):
        llm = _llm(rotations, "invariant", prefix_cache=False, max_batched_tokens=chunk)
        assert _tokens(llm.generate(ps, GREEDY)) == want, chunk


def test_concurrent_equals_sequential(rotations):
    """Prompts sharing a 100-token stem: run together (no hits between them, one batch) and one
    at a time (each later one served from the cache)."""
    ps = _prompts((40, 70, 9, 120), seed=3, stem=100)
    together = _tokens(_llm(rotations, "invariant").generate(ps, GREEDY))
    llm = _llm(rotations, "invariant", max_batched_tokens=64)
    alone = []
    for p in ps:
        o = llm.generate([p], GREEDY)[0]
        alone.append(o.token_ids)
    assert alone == together


def test_invariant_needs_a_page_of_window():
    with pytest.raises(ValueError, match="recent_tokens"):
        EngineConfig(kv_dtype="int2", page_tokens=16, prefill_attention="invariant").check_spec(
            QuantSpec(sink_tokens=16, recent_tokens=8, demote_block=8)
        )
    with pytest.raises(ValueError, match="prefill_attention"):
        EngineConfig(prefill_attention="as-stored")


def test_a_hit_that_misses_mid_block_is_cut_to_the_block(rotations):
    """A shared stem of 80 tokens (not a multiple of the 32-token block): the second prompt's
    match stops at the first page that differs, mid-block, and is cut back to the block (64);
    its tokens equal a run with no cache."""
    a, b = _prompts((120, 120), seed=4, stem=80)
    llm = _llm(rotations, "invariant")
    llm.generate([a], GREEDY)
    o = llm.generate([b], GREEDY)[0]
    assert o.num_cached_tokens == 64
    assert o.token_ids == _llm(rotations, "invariant", prefix_cache=False).generate([b], GREEDY)[0].token_ids


def test_preempted_requests_resume_under_the_invariant_rule(rotations):
    """Four requests in a budget that holds three: preemption releases pages tail first, so a
    resumed request's match ends wherever eviction cut it; it resumes and every page comes back."""
    ps = _prompts((150, 140, 160, 130), seed=14)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plan = _llm(rotations, "invariant", max_running=4).engine.runner.plan
    fixed = plan.total_bytes - plan.q_pages * plan.q_page_bytes
    budget = (fixed + 40 * plan.q_page_bytes) / 2**30
    llm = _llm(rotations, "invariant", max_running=4, kv_budget_gb=budget, decode_reserve_pages=0)
    outs = llm.generate(ps, params)
    assert all(len(o.token_ids) == 40 for o in outs) and llm.engine.stats["preemptions"] > 0
    eng = llm.engine
    assert eng.scheduler.idle and eng.q.n_free == eng.q.capacity
