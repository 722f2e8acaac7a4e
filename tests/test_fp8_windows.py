"""FP8 windows (``QuantSpec.window_dtype="fp8_e4m3"``, docs/kv_format.md): the spec field, its
artifact round trip, the bytes it saves, the torch twins and pool ops that write and read fp8
window rows, and ``OscarCache`` storing them. The engine's token equality with ``OscarCache`` is in
``tests/engine/test_engine_e2e.py``; the Triton kernels in ``tests/interpreter/fp8_windows_vs_ref.py``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from conftest import random_rotation_set
from oscarkv import QuantSpec
from oscarkv.config import EngineConfig, SpecError
from oscarkv.engine.kv_pool import GIB, KVPool, plan_pools
from oscarkv.kernels import pool_ops, ref, resolve
from oscarkv.quant import RowFormat
from oscarkv.quant.window import FP8_MAX, through_window, to_window
from oscarkv.rotation import load_rotations, save_rotations
from oscarkv.rotation.metadata import build_metadata

F8 = torch.float8_e4m3fn
FP8_SPEC = QuantSpec(window_dtype="fp8_e4m3")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


# ---- the spec -----------------------------------------------------------------------------------
def test_fp8_windows_on_a_gpu_before_sm89_are_refused_at_start_up(monkeypatch):
    """The Triton backend's check (Triton's float8e4nv needs compute capability 8.9) runs when an
    engine or cache starts, with the fix, not at its first decode; other dtypes and devices pass."""
    pytest.importorskip("triton")
    from oscarkv.kernels import BackendError
    from oscarkv.kernels.triton.decode import attention

    monkeypatch.setattr(attention, "_capability", lambda device: (8, 0))
    ops = dataclasses.replace(resolve("torch", "cpu"), check_windows=attention.check_windows)
    with pytest.raises(
        BackendError, match=r"compute capability 8.9 or newer; cuda:0 has \(8, 0\); use --window"
    ):
        ops.require_windows("fp8_e4m3", "cuda:0", "use --window-dtype model")
    ops.require_windows("model", "cuda:0", "")
    ops.require_windows("fp8_e4m3", "cpu", "")
    resolve("torch", "cpu").require_windows("fp8_e4m3", "cuda:0", "")  # the reference reads fp8 anywhere


def test_window_dtype_is_validated_and_round_trips():
    assert QuantSpec().window_dtype == "model"
    for bad in ("fp8", "bf16", 8, None):
        with pytest.raises(SpecError, match=r"QuantSpec.window_dtype must be one of model, fp8_e4m3") as e:
            QuantSpec(window_dtype=bad)
        assert "--window-dtype" in e.value.hint
    assert QuantSpec.from_dict(FP8_SPEC.to_dict()) == FP8_SPEC
    old = {k: v for k, v in QuantSpec().to_dict().items() if k != "window_dtype"}  # written before it
    assert QuantSpec.from_dict(old).window_dtype == "model"


def test_bits_per_element_counts_8_bit_windows():
    # by hand: sink + recent = 320 tokens at 8 (or 16) bits, the rest at 2.25
    assert FP8_SPEC.bits_per_element(4096) == pytest.approx((320 * 8 + 3776 * 2.25) / 4096)
    assert QuantSpec().bits_per_element(4096) == pytest.approx((320 * 16 + 3776 * 2.25) / 4096)
    assert FP8_SPEC.bits_per_element(None) == 2.25 and FP8_SPEC.window_bits == 8
    assert FP8_SPEC.bits_per_element(100) == 8.0


def test_the_artifact_keeps_fp8_windows_and_info_shows_them(tmp_path: Path, capsys, monkeypatch):
    from oscarkv.cli import main

    rs = random_rotation_set(2, 64, FP8_SPEC)
    save_rotations(rs, tmp_path / "fp8")
    back = load_rotations(tmp_path / "fp8")
    assert back.spec == FP8_SPEC
    assert back.bits_per_element(4096) == pytest.approx(FP8_SPEC.bits_per_element(4096, 64))
    save_rotations(random_rotation_set(2, 64), tmp_path / "default")
    assert load_rotations(tmp_path / "default").spec.window_dtype == "model"
    # the default is left out of the header (readers older than the field would note it)
    assert "window_dtype" not in build_metadata(random_rotation_set(2, 64))["spec"]
    assert build_metadata(rs)["spec"]["window_dtype"] == "fp8_e4m3"
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["info", str(tmp_path / "fp8")]) == 0
    out = capsys.readouterr().out
    assert "window_dtype=fp8_e4m3" in out and f"4K: {FP8_SPEC.bits_per_element(4096, 64):.3f}" in out


def test_engine_config_window_dtype():
    assert EngineConfig().window_dtype is None
    with pytest.raises(SpecError, match=r"EngineConfig\.window_dtype must be unset or one of"):
        EngineConfig(window_dtype="fp8")
    with pytest.raises(SpecError, match="fp8 windows need int2") as e:
        EngineConfig(kv_dtype="bf16", window_dtype="fp8_e4m3")
    assert "--kv-dtype int2" in e.value.hint
    EngineConfig(kv_dtype="bf16", window_dtype="model")


# ---- bytes --------------------------------------------------------------------------------------
# Qwen3-8B in bf16: 36 layers, 8 KV heads, head dim 128; requests of 1K prompt + 1K output
L, HKV, D, LEN = 36, 8, 128, 2048


@pytest.mark.parametrize(
    ("window", "hp_tok", "slots"),
    [("model", 2 * L * HKV * D * 2, 42), ("fp8_e4m3", 2 * L * HKV * D * 1, 60)],
)
def test_fp8_windows_take_one_byte_per_element_and_hold_more_requests(window, hp_tok, slots):
    """At 4 GiB and requests of 1K + 1K: a slot holds 4 sink pages twice (the pinned sink and
    its copy), a 272-row ring and 124 INT2 pages; fp8 halves the first two (147,456 -> 73,728
    bytes a window token), so 60 requests fit where 42 did."""
    spec = QuantSpec(window_dtype=window)
    cfg = EngineConfig(page_tokens=16)
    plan = plan_pools(cfg, spec, L, HKV, D, torch.bfloat16, 4 * GIB, max_model_len=LEN)
    int2_tok = 20_736  # INT2 codes + fp16 (scale, zero), K and V, every layer
    assert plan.hp_page_bytes == 16 * hp_tok and plan.q_page_bytes == 16 * int2_tok
    assert (plan.sink_pages, plan.ring_cap) == (4, 272)
    per_request = 4 * 2 * 16 * hp_tok + 272 * hp_tok + (LEN - 64) // 16 * 16 * int2_tok
    assert plan.request_bytes(LEN) == per_request
    assert (window, per_request) in (("model", 100_122_624), ("fp8_e4m3", 70_631_424))
    assert plan.max_running == (4 * GIB - 16 * (hp_tok + int2_tok)) // per_request == slots
    fixed = (1 + slots * 4 * 2) * 16 * hp_tok + slots * 272 * hp_tok
    assert plan.q_pages == (4 * GIB - fixed) // plan.q_page_bytes
    pool = KVPool(
        dataclasses.replace(plan, q_pages=2, hp_pages=3, max_running=1), 2, 2, 64, torch.bfloat16,
        [(RowFormat(64, 2, 64),) * 2] * 2, "cpu", F8 if window == "fp8_e4m3" else None,
    )  # fmt: skip
    assert pool.hp_k.dtype == pool.hp_v.dtype == (F8 if window == "fp8_e4m3" else torch.bfloat16)
    assert pool.memory_report()["hp_bytes_per_token"] == 2 * 2 * 2 * 64 * pool.hp_k.element_size()


# ---- twins and pool ops -------------------------------------------------------------------------
def test_to_window_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([0.0, 1.0625, 1.1875, 447.0, 460.0, 1e5, -1e5, math.inf, -math.inf, 2**-10, 3 * 2**-10])
    got = to_window(x, F8).float()
    want = [0.0, 1.0, 1.25, 448.0, 448.0, 448.0, -448.0, 448.0, -448.0, 0.0, 2**-8]
    assert got.tolist() == want
    assert to_window(torch.tensor([math.nan]), F8).float().isnan().all()
    assert through_window(x, torch.float32) is x
    assert through_window(x.bfloat16(), F8).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_twins_round_into_fp8_pools_as_a_prefill_stores(dtype):
    """``rotate_heads``/``rotate_new_rows`` into fp8 pools: the fp32 product rounded to the rows'
    dtype, then ``x.float().clamp(-448, 448).to(float8_e4m3fn)`` (for fp32 rows: the product
    itself); values past ±448 saturate instead of becoming NaN."""
    g = torch.Generator().manual_seed(0)
    r = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0].float()
    k = (torch.randn(6, 2, 64, generator=g) * 400).to(dtype)
    q = torch.randn(6, 4, 64, generator=g).to(dtype)
    dst = torch.tensor([4, -1, 0, 7, 2, -1])
    pools = [torch.zeros(9, 2, 64, dtype=F8) for _ in range(2)]
    ref.rotate_new_rows(q, k, k, r, None, pools[0], pools[1], dst)
    keep = dst >= 0
    product = k.float() @ r  # one matrix for every head
    want_k = product.to(dtype).float().clamp(-FP8_MAX, FP8_MAX).to(F8)
    assert torch.equal(_bits(pools[0][dst[keep]]), _bits(want_k[keep]))
    assert torch.equal(_bits(pools[1][dst[keep]]), _bits(k[keep].float().clamp(-448, 448).to(F8)))
    assert pools[0].float().isfinite().all() and (pools[0].float().abs() == 448).any()
    assert not pools[0][torch.tensor([1, 3, 5, 6, 8])].float().any()  # slots no row targets


@pytest.mark.parametrize("gather", [False, True])
def test_quantize_pack_into_from_fp8_rows_equals_quantize_pack_of_the_upcast_rows(gather):
    fmt = RowFormat(64, 2, 64, clip=0.92)
    g = torch.Generator().manual_seed(1)
    pool = to_window(torch.randn(20, 3, 64, generator=g) * 30, F8)
    src = torch.tensor([5, 0, 17, 3]) if gather else None
    rows = pool if gather else pool[:4]
    codes = torch.zeros(10, 3, fmt.packed_dim, dtype=torch.uint8)
    meta = torch.zeros(10, 3, 1, 2, dtype=torch.float16)
    dst = torch.tensor([9, 2, 4, 0])
    ref.quantize_pack_into(rows, fmt, codes, meta, dst, src)
    c, m = ref.quantize_pack((pool[src] if gather else rows).float(), fmt)
    assert torch.equal(codes[dst], c) and torch.equal(meta[dst], m)


def test_decode_twin_over_fp8_windows_equals_it_over_the_upcast_windows():
    fmt = RowFormat(64, 2, 64)
    g = torch.Generator().manual_seed(2)
    kc, km = ref.quantize_pack(torch.randn(30, 2, 64, generator=g), fmt)
    vc, vm = ref.quantize_pack(torch.randn(30, 2, 64, generator=g), fmt)
    hk, hv = (to_window(torch.randn(12, 2, 64, generator=g) * 3, F8) for _ in range(2))
    lists = (torch.tensor([0, 20, 30]), torch.randperm(30), torch.tensor([0, 5, 12]), torch.randperm(12))
    q = torch.randn(2, 4, 64, generator=g)
    got = ref.decode_attention(q, kc, km, vc, vm, hk, hv, *lists, 0.125, fmt, fmt)
    want = ref.decode_attention(q, kc, km, vc, vm, hk.float(), hv.float(), *lists, 0.125, fmt, fmt)
    assert torch.equal(got, want)
    assert not torch.equal(got, ref.decode_attention(q, kc, km, vc, vm, hk.float() * 1.01, hv.float(),
                                                     *lists, 0.125, fmt, fmt))  # fmt: skip


class _Pools:
    """A layer's flat pools with fp8 windows (``kernels.pool_ops.FlatPools``)."""

    def __init__(self, fmt: RowFormat, window: torch.dtype):
        self.k_fmt = self.v_fmt = fmt
        self.k_codes = torch.zeros(8, 2, fmt.packed_dim, dtype=torch.uint8)
        self.v_codes = self.k_codes.clone()
        self.k_meta = torch.zeros(8, 2, 1, 2, dtype=torch.float16)
        self.v_meta = self.k_meta.clone()
        self.hp_k = torch.zeros(6, 2, fmt.head_dim, dtype=window)
        self.hp_v = self.hp_k.clone()


def test_pool_ops_store_fp8_windows_and_read_them_in_the_model_dtype():
    """A write saturates into the fp8 windows; an INT2 write quantizes the rows as fp8 holds them
    (what demoting them would store); a demotion from the fp8 ring stores the same codes; the
    prefix gather returns the model dtype."""
    fmt = RowFormat(64, 2, 64, clip=0.92)
    ops = resolve("torch", "cpu")
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(3, 2, 64, generator=g) * 200).bfloat16()
    v = torch.randn(3, 2, 64, generator=g).bfloat16()
    p = _Pools(fmt, F8)
    pool_ops.write_step(p, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                        torch.tensor([0, 1, 2]), (k, v), torch.tensor([3, 4, 5]), (k, v), ops)  # fmt: skip
    assert torch.equal(_bits(p.hp_k[3:]), _bits(to_window(k, F8))) and p.hp_k.float().isfinite().all()
    c, m = ref.quantize_pack(to_window(k, F8).float(), fmt)
    assert torch.equal(p.k_codes[:3], c) and torch.equal(p.k_meta[:3], m)
    direct = ref.quantize_pack(k.float(), fmt)
    assert not (torch.equal(direct[0], c) and torch.equal(direct[1], m))  # the fp8 rounding mattered
    codes, meta = p.k_codes[:3].clone(), p.k_meta[:3].clone()
    pool_ops.demote(p, torch.tensor([3, 4, 5]), torch.tensor([5, 6, 7]), ops)
    assert torch.equal(p.k_codes[5:8], codes) and torch.equal(p.k_meta[5:8], meta)
    pk, pv = pool_ops.gather_prefix(p, torch.tensor([0]), torch.tensor([3, 4]), ops, torch.bfloat16)
    assert pk.dtype == pv.dtype == torch.bfloat16 and pk.shape == (3, 2, 64)
    assert torch.equal(pk[:2], to_window(k[:2], F8).bfloat16())


def test_oscarcache_stores_fp8_windows_and_counts_their_bytes(tmp_path: Path):
    """``OscarCache`` with fp8 windows: window pools of float8_e4m3fn, half the window bytes of
    the default in bf16 (a quarter in the fp32 of this CPU model), the same INT2 bytes."""
    from transformers import AutoModelForCausalLM

    from oscarkv import OscarCache
    from oscarkv.demo import demo_model_path

    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    spec = QuantSpec(sink_tokens=16, recent_tokens=16, demote_block=8)
    rs = random_rotation_set(4, 128, spec)
    ids = torch.randint(3, 2000, (1, 80), generator=torch.Generator().manual_seed(4))
    reports, logits = [], []
    for window in ("model", "fp8_e4m3"):
        cache = OscarCache.from_rotations(model, rs.with_spec(dataclasses.replace(spec, window_dtype=window)),
                                          backend="torch")  # fmt: skip
        with torch.no_grad():
            out = model(ids, past_key_values=cache)
            out = model(ids[:, :1], past_key_values=cache)  # a decode step reads the windows
        assert cache.layers[0].pools.hp_k.dtype == (F8 if window == "fp8_e4m3" else torch.float32)
        reports.append(cache.memory_report())
        logits.append(out.logits)
    (a, b) = reports
    assert a["quantized_bytes"] == b["quantized_bytes"] and b["hp_bytes"] * 4 == a["hp_bytes"]
    assert b["bits_per_element"] < a["bits_per_element"]
    assert torch.isfinite(logits[1]).all() and not torch.equal(logits[0], logits[1])
