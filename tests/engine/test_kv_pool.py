"""KV pool sizing and allocation (engine.md §3.1, §5.2): bytes per token, budgets, views."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from oscarkv import QuantSpec
from oscarkv.config import EngineConfig, SpecError
from oscarkv.config.engine import CPU_BUDGET_CAP_GB, CPU_BUDGET_FRACTION, CPU_FALLBACK_BUDGET_GB
from oscarkv.engine.kv_budget import available_memory, cpu_default_budget, kv_budget
from oscarkv.engine.kv_pool import GIB, KVPool, longest_request, plan_pools
from oscarkv.errors import InputError
from oscarkv.quant import RowFormat

# Qwen3-8B: 36 layers, 8 KV heads, head dim 128, bf16; the default (OSCAR) spec
L, HKV, D = 36, 8, 128
INT2_PER_TOKEN, BF16_PER_TOKEN = 20_736, 147_456  # engine.md §3.1


def test_qwen3_8b_int2_plan_matches_the_design_numbers():
    cfg = EngineConfig(kv_dtype="int2", page_tokens=16, max_running=64)
    plan = plan_pools(cfg, QuantSpec(), L, HKV, D, torch.bfloat16, 60 * GIB)
    assert plan.q_page_bytes == 16 * INT2_PER_TOKEN
    assert plan.hp_page_bytes == 16 * BF16_PER_TOKEN
    assert (plan.ring, plan.ring_cap, plan.sink_pages) == (263, 272, 4)
    assert plan.ring_cap * BF16_PER_TOKEN == 40_108_032  # "a 272-slot ring (40.1 MB)"
    assert plan.hp_pages == 1 + 64 * 4 * 2
    fixed = plan.hp_pages * plan.hp_page_bytes + 64 * 272 * BF16_PER_TOKEN
    assert plan.q_pages == (60 * GIB - fixed) // plan.q_page_bytes
    assert plan.total_bytes == fixed + plan.q_pages * plan.q_page_bytes <= 60 * GIB
    assert 60 * GIB - plan.total_bytes < plan.q_page_bytes
    assert round(BF16_PER_TOKEN / INT2_PER_TOKEN, 1) == 7.1


def test_qwen3_8b_bf16_plan_gives_every_byte_to_16_bit_pages():
    cfg = EngineConfig(kv_dtype="bf16", page_tokens=16, max_running=64)
    plan = plan_pools(cfg, None, L, HKV, D, torch.bfloat16, 60 * GIB)
    assert (plan.q_pages, plan.ring_cap, plan.q_rows, plan.int2) == (0, 0, 0, False)
    assert plan.hp_pages == 60 * GIB // (16 * BF16_PER_TOKEN)
    assert plan.hp_rows == plan.hp_pages * 16 and plan.total_bytes == plan.hp_pages * plan.hp_page_bytes


@pytest.mark.parametrize("kv_dtype", ["int2", "bf16"])
def test_too_small_budget_names_the_bytes_and_the_flag(kv_dtype):
    cfg = EngineConfig(kv_dtype=kv_dtype, page_tokens=16, max_running=64)
    spec = QuantSpec() if kv_dtype == "int2" else None
    ok = plan_pools(cfg, spec, L, HKV, D, torch.bfloat16, 8 * GIB)
    need = ok.total_bytes - (ok.q_pages - 2) * ok.q_page_bytes if ok.int2 else 2 * ok.hp_page_bytes
    assert plan_pools(cfg, spec, L, HKV, D, torch.bfloat16, need).total_bytes == need  # just enough
    with pytest.raises(InputError, match=f"at least {need} bytes") as e:
        plan_pools(cfg, spec, L, HKV, D, torch.bfloat16, need - 1)
    assert "kv_budget_gb" in e.value.hint


@pytest.mark.parametrize("kv_dtype", ["int2", "bf16"])
def test_unset_max_running_takes_the_requests_of_max_model_len_the_budget_holds(kv_dtype):
    """Slots unset: every slot's full-length request fits (sinks, ring and INT2 pages for every token
    past the sink, or 16-bit pages for all of them); one slot more would not; at most 64. A budget
    without room for one such request names both numbers and both fixes."""
    cfg = EngineConfig(kv_dtype=kv_dtype, page_tokens=16)
    spec = QuantSpec() if kv_dtype == "int2" else None
    n = 32768
    for budget in (6 * GIB, 40 * GIB, 300 * GIB):
        plan = plan_pools(cfg, spec, L, HKV, D, torch.bfloat16, budget, max_model_len=n)
        per = (
            (INT2_PER_TOKEN * (n - 64) + BF16_PER_TOKEN * (4 * 2 * 16 + 272))
            if plan.int2
            else BF16_PER_TOKEN * n
        )
        fixed = plan.hp_page_bytes + plan.q_page_bytes * plan.int2
        assert plan.max_running == min(64, (budget - fixed) // per), budget
        assert plan.request_bytes(n) == per
        if plan.max_running < 64:  # explicit slots: the same plan
            assert plan == plan_pools(replace(cfg, max_running=plan.max_running), spec, L, HKV, D, torch.bfloat16,
                                      budget)  # fmt: skip
        if plan.int2:  # every slot's request fits the INT2 pages left after the fixed part
            assert (plan.q_pages - 1) * 16 >= plan.max_running * (n - 64)
        else:
            assert (plan.hp_pages - 1) * 16 >= plan.max_running * n
    with pytest.raises(InputError, match="too small for one request of max_model_len=32768") as e:
        plan_pools(cfg, spec, L, HKV, D, torch.bfloat16, GIB // 4, max_model_len=n)
    assert "--kv-budget-gb" in e.value.hint and "--max-model-len" in e.value.hint
    with pytest.raises(SpecError, match="max_running"):
        EngineConfig(max_running=0)


def test_int2_plan_checks_the_spec_against_the_page_size():
    cfg = EngineConfig(kv_dtype="int2", page_tokens=16)
    with pytest.raises(SpecError, match="page_tokens"):
        plan_pools(cfg, QuantSpec(sink_tokens=24), 2, 2, 64, torch.float32, GIB)
    with pytest.raises(InputError, match="QuantSpec"):
        plan_pools(cfg, None, 2, 2, 64, torch.float32, GIB)


def _pool(kv_dtype: str = "int2") -> KVPool:
    spec = QuantSpec(sink_tokens=8, recent_tokens=8, demote_block=4)
    cfg = EngineConfig(kv_dtype=kv_dtype, page_tokens=4, max_running=3)
    plan = plan_pools(cfg, spec, 3, 2, 32, torch.float32, 1 << 18)
    fmts = [
        (RowFormat.from_spec(spec, 32, "k", 0.9 - i / 10), RowFormat.from_spec(spec, 32, "v"))
        for i in range(3)
    ]
    return KVPool(plan, 3, 2, 32, torch.float32, fmts if plan.int2 else None, "cpu")


@pytest.mark.parametrize("kv_dtype", ["int2", "bf16"])
def test_layer_views_are_contiguous_disjoint_and_shaped_for_the_kernels(kv_dtype):
    pool = _pool(kv_dtype)
    p = pool.plan
    spans = []
    for l in range(3):
        v = pool.layer(l)
        assert v.k_fmt == pool.fmts[l][0] and v.v_fmt == pool.fmts[l][1]
        assert v.k_codes.shape == (p.q_rows, 2, 8) and v.k_codes.dtype == torch.uint8
        assert v.k_meta.shape == (p.q_rows, 2, 1, 2) and v.k_meta.dtype == torch.float16
        assert v.hp_k.shape == (p.hp_rows, 2, 32) and v.hp_v.dtype == torch.float32
        for name in ("k_codes", "v_codes", "k_meta", "v_meta", "hp_k", "hp_v"):
            t = getattr(v, name)
            assert t.is_contiguous(), name
            if t.numel():
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    before = pool.layer(0).hp_k.clone()
    pool.layer(1).hp_k.fill_(1.0)  # a write to one layer's view leaves the others alone
    assert torch.equal(pool.layer(0).hp_k, before) and bool((pool.hp_k[1] == 1).all())
    if p.int2:
        assert p.hp_rows == (1 + 3 * 2 * 2) * 4 + 3 * 12 and p.ring_base(2) == p.ring0 + 24


def test_memory_report_counts_the_allocated_tensors():
    pool = _pool("int2")
    p = pool.plan
    r = pool.memory_report(tokens_quantized=100, tokens_hp=20)
    assert r["total_bytes"] == p.total_bytes == r["int2_bytes"] + r["hp_bytes"]
    assert r["int2_bytes"] == p.q_pages * p.q_page_bytes
    assert r["ring_bytes"] == 3 * p.ring_cap * p.hp_page_bytes // p.page_tokens
    assert r["hp_paged_bytes"] == p.hp_pages * p.hp_page_bytes
    # per token, 3 layers × 2 heads × (K, V): INT2 8 code bytes + fp16 (scale, zero); fp32 rows
    assert r["int2_bytes_per_token"] == 3 * 2 * 2 * (8 + 4) and r["hp_bytes_per_token"] == 3 * 2 * 2 * 128
    elems = 120 * 3 * 2 * 2 * 32
    assert r["bits_per_element"] == pytest.approx(8 * (100 * 144 + 20 * 1536) / elems)
    assert pool.memory_report()["bits_per_element"] != pool.memory_report()["bits_per_element"]  # nan


def test_kv_budget_from_the_config_or_the_available_memory():
    assert kv_budget(EngineConfig(kv_budget_gb=0.5), "cpu").bytes == GIB // 2
    avail = available_memory()
    assert avail is not None and avail > 0  # Linux: MemAvailable
    got = kv_budget(EngineConfig(), "cpu")
    assert 0 < got.bytes <= CPU_BUDGET_CAP_GB * GIB and "available" in got.source
    assert got.bytes == pytest.approx(min(CPU_BUDGET_FRACTION * avail, CPU_BUDGET_CAP_GB * GIB), rel=0.2)


def test_cpu_default_budget_is_a_capped_share_of_the_available_memory(tmp_path):
    assert cpu_default_budget(GIB).bytes == int(CPU_BUDGET_FRACTION * GIB)
    assert cpu_default_budget(1000 * GIB).bytes == int(CPU_BUDGET_CAP_GB * GIB)
    two = cpu_default_budget(1000 * GIB, ranks=2)  # ranks share the host: the cap is split
    assert two.bytes == int(CPU_BUDGET_CAP_GB * GIB) // 2 and "2 ranks" in two.source
    unknown = cpu_default_budget(None)
    assert unknown.bytes == int(CPU_FALLBACK_BUDGET_GB * GIB) and "could not be read" in unknown.source
    # MemAvailable in kB; a file without it falls back to sysconf (still a number on Linux)
    (tmp_path / "meminfo").write_text("MemTotal:  2048 kB\nMemAvailable:    1024 kB\n")
    assert available_memory(str(tmp_path / "meminfo")) == 1024 * 1024
    (tmp_path / "other").write_text("MemTotal: 2048 kB\n")
    assert available_memory(str(tmp_path / "other")) == available_memory(str(tmp_path / "missing"))


def test_an_explicit_budget_over_the_available_memory_is_refused():
    avail = available_memory()
    assert avail is not None
    huge = EngineConfig(kv_budget_gb=1e6)
    with pytest.raises(
        InputError, match=r"kv_budget_gb=1e\+06 is more than the .* GiB of memory available"
    ) as e:
        kv_budget(huge, "cpu")
    assert "--kv-budget-gb" in e.value.hint
    half = EngineConfig(kv_budget_gb=0.6 * avail / GIB)  # fits one rank, not two on one host
    assert kv_budget(half, "cpu").bytes == int(half.kv_budget_gb * GIB)
    with pytest.raises(InputError, match="on each of 2 ranks"):
        kv_budget(half, "cpu", ranks=2)


def test_a_pool_the_allocator_refuses_is_an_input_error():
    """The allocation itself failing (the check above passed, or a CUDA device is full) is one
    line naming the pools' size and the flag, not the allocator's RuntimeError."""
    cfg = EngineConfig(kv_dtype="bf16", page_tokens=16, max_running=1)
    plan = plan_pools(cfg, None, L, HKV, D, torch.bfloat16, 1 << 52)  # 4 PiB: no machine allocates it
    with pytest.raises(InputError, match="could not be allocated on cpu: out of memory") as e:
        KVPool(plan, L, HKV, D, torch.bfloat16, None, "cpu")
    assert "--kv-budget-gb" in e.value.hint


@pytest.mark.parametrize("kv_dtype", ["int2", "bf16"])
def test_longest_request_is_the_longest_one_slot_holds(kv_dtype):
    """The length an unset max_model_len is lowered to: the plan of that length fits the budget
    with one slot; one page more does not; a budget without a 256-token request is refused."""
    cfg = EngineConfig(kv_dtype=kv_dtype, page_tokens=16)
    spec = QuantSpec() if kv_dtype == "int2" else None
    args = (cfg, spec, L, HKV, D, torch.bfloat16)
    assert longest_request(*args, 40 * GIB, None, 32768) == 32768  # fits: unchanged
    n = longest_request(*args, GIB // 4, None, 32768)
    assert 256 <= n < 32768 and n % 16 == 0
    plan = plan_pools(*args, GIB // 4, None, n)
    assert plan.max_running >= 1 and plan.total_bytes <= GIB // 4
    with pytest.raises(InputError, match=f"max_model_len={n + 16} tokens"):
        plan_pools(*args, GIB // 4, None, n + 16)
    if plan.int2:
        assert (plan.q_pages - 1) * 16 >= n - 64
    else:
        assert (plan.hp_pages - 1) * 16 >= n
    tiny = plan_pools(*args, GIB // 4, None, 256).request_bytes(256)
    with pytest.raises(InputError, match="too small for one request of max_model_len=256") as e:
        longest_request(*args, tiny, None, 32768)
    assert "--kv-budget-gb" in e.value.hint and "--max-model-len" in e.value.hint


def test_kv_pool_refuses_mismatched_formats():
    spec = QuantSpec(sink_tokens=8, recent_tokens=8, demote_block=4)
    cfg = EngineConfig(kv_dtype="int2", page_tokens=4, max_running=2)
    plan = plan_pools(cfg, spec, 2, 2, 32, torch.float32, 1 << 18)
    f2 = RowFormat.from_spec(spec, 32, "k")
    f4 = RowFormat(32, bits=4, group=32)
    with pytest.raises(ValueError, match="differ only in the key bits"):
        KVPool(plan, 2, 2, 32, torch.float32, [(f2, f2), (f2, f4)], "cpu")
    with pytest.raises(ValueError, match="k_fmt, v_fmt"):
        KVPool(plan, 2, 2, 32, torch.float32, None, "cpu")


def test_kv_pool_per_layer_key_bits():
    """Layers with 4-bit keys get wider key-code rows; the INT2 page cost counts each layer's."""
    spec = QuantSpec(sink_tokens=8, recent_tokens=8, demote_block=4)
    cfg = EngineConfig(kv_dtype="int2", page_tokens=4, max_running=2)
    f2, fv = RowFormat.from_spec(spec, 32, "k"), RowFormat.from_spec(spec, 32, "v")
    f4 = RowFormat.from_spec(spec, 32, "k", bits=4)
    fmts = [(f2, fv), (f4, fv)]
    uniform = plan_pools(cfg, spec, 2, 2, 32, torch.float32, 1 << 18)
    mixed = plan_pools(cfg, spec, 2, 2, 32, torch.float32, 1 << 18, fmts)
    assert mixed.q_page_bytes - uniform.q_page_bytes == 4 * 2 * (16 - 8)  # ps · heads · extra bytes
    assert mixed.q_pages < uniform.q_pages
    pool = KVPool(mixed, 2, 2, 32, torch.float32, fmts, "cpu")
    assert pool.layer(0).k_codes.shape[-1] == 8 and pool.layer(1).k_codes.shape[-1] == 16
    assert pool.layer(1).k_fmt.bits == 4 and pool.layer(1).k_codes.is_contiguous()
    r = pool.memory_report(tokens_quantized=10)
    assert r["int2_bytes_per_token"] == 2 * ((8 + 16) + 2 * 8 + 4 * 4)  # heads · (K codes, V codes, 4 metas)
