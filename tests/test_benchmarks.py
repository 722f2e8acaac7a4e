"""Smoke runs of GPU benchmark scripts on the CPU with tiny models: their plumbing (argument
handling, cache bookkeeping across rounds, result files, the CSV history) works before GPU time is
spent on them."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# the benchmark modules the tests import, dropped after each (each test patches _harness anew)
MODULES = (
    "e2e_decode",
    "_harness",
    "calibration_speed",
    "gpu_check",
    "gpu_lane",
    "roofline",
    "bench_engine",
    "bench_prefix",
)


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    import _harness

    monkeypatch.setattr(_harness, "RESULTS", tmp_path)
    monkeypatch.setattr(_harness, "HISTORY", tmp_path / "history.csv")
    monkeypatch.setattr(_harness, "git_commit", lambda: "test")
    yield tmp_path
    for mod in MODULES:
        sys.modules.pop(mod, None)


def history(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_e2e_decode_alternates_rounds_and_keeps_each_cache_consistent(bench):
    import e2e_decode

    e2e_decode.main(["--device", "cpu", "--tiny", "--shapes", "2x300", "--chunk", "128", "--new", "3",
                     "--repeats", "3", "--name", "smoke"])  # fmt: skip
    res = json.loads((bench / "smoke.json").read_text())["results"]["2x300"]
    for name in ("bf16", "oscar"):
        rounds = res[name]["ms_per_step_rounds"]
        assert len(rounds) == 3 and all(v > 0 for v in rounds)
        assert res[name]["ms_per_step"] == sorted(rounds)[1]
        assert res[name]["tokens_cached"] == 300 + 1 + 3 * 3  # prompt, warm-up, 3 rounds of 3 steps
    assert res["oscar"]["bits_per_element"] > 2
    assert "ratio of the medians" in (bench / "smoke.md").read_text()
    rows = history(bench / "history.csv")
    assert {r["benchmark"] for r in rows} == {"smoke"} and {r["shape"] for r in rows} == {"2x300"}
    got = {r["metric"]: r["value"] for r in rows}
    assert set(got) == {
        f"{c}_{m}" for c in ("bf16", "oscar") for m in ("ms_per_step", "tok_per_s", "kv_bytes")
    } | {"speedup"}
    assert float(got["oscar_ms_per_step"]) == pytest.approx(res["oscar"]["ms_per_step"], rel=1e-5)


def test_save_appends_history_rows_and_never_rewrites_them(bench):
    import _harness

    _harness.save("one", {}, "x", history=[("8x32768", "decode_int2_ms", 0.0562187), ("16x32768", "kv_bytes", 11688814592)])  # fmt: skip
    path = bench / "history.csv"
    first = path.read_text()
    assert first.splitlines()[0] == ",".join(_harness.HISTORY_FIELDS)
    rows = history(path)
    assert [(r["benchmark"], r["shape"], r["metric"], r["value"]) for r in rows] == [
        ("one", "8x32768", "decode_int2_ms", "0.0562187"), ("one", "16x32768", "kv_bytes", "11688814592")]  # fmt: skip
    assert rows[0]["commit"] == "test" and rows[0]["torch"] and rows[0]["date"]
    _harness.save("two", {}, "y", history=[("a, b", "seconds", 1.5)])
    _harness.save("three", {}, "z")  # no figures: nothing appended
    second = path.read_text()
    assert second.startswith(first) and second.count("\n") == first.count("\n") + 1
    assert history(path)[-1]["shape"] == "a, b"
    path.write_text("date,value\n1,2\n")  # another header: refused, left as it is
    with pytest.raises(ValueError, match="header"):
        _harness.save("four", {}, "", history=[("s", "m", 1.0)])
    assert path.read_text() == "date,value\n1,2\n"


def test_gpu_check_headline_reads_its_saved_results(bench):
    import gpu_check

    payload = json.loads((BENCH / "results" / "gpu_check.json").read_text())
    figs = gpu_check.headline(payload)
    assert len(figs) == 4 * len(payload["decode"]) + 2 * len(payload["quantize"])
    d, q = payload["decode"][0], payload["quantize"][0]
    assert (f"{d['batch']}x{d['len']}", "decode_speedup", d["speedup"]) in figs
    assert (f"{q['rows']}x128 clip {q['clip']}", "quantize_pack_TBps", q["input_TBps"]) in figs


def test_gpu_lane_splits_contiguously_and_fails_on_failures_unexpected_skips_and_nothing_run(
    bench, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_lane

    ids = [f"t{i}" for i in range(10)]
    parts = gpu_lane.split(ids, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2] and [t for p in parts for t in p] == ids
    assert gpu_lane.split(ids[:2], 4) == [["t0"], ["t1"]]
    target = bench / "test_tiny.py"
    target.write_text(
        "import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    assert False\n\n"
        "def test_d():\n    pytest.skip('words: this shape takes the bytes loop')\n\n"
        "def test_e():\n    pytest.skip('needs a CUDA device')\n"
    )  # fmt: skip

    def lane(name: str, select: str, shards: int = 1) -> tuple[int, str]:
        out = str(bench / name)
        rc = gpu_lane.main(["--target", str(target), "--shards", str(shards), "--out", out, "-k", select])
        return rc, (bench / name / "gpu_lane.md").read_text()

    rc, text = lane("ok", "test_a or test_b or test_d")
    assert (
        rc == 0
        and "# GPU lane at test: PASSED" in text
        and "2 passed, 0 failed, 0 errors, 1 skipped (1 expected)" in text
    )
    assert "1 × words: this shape takes the bytes loop" in text
    rc, text = lane("bad", "test_a or test_b or test_c", shards=2)
    assert rc == 1 and "FAILED: shard 1 exited 1" in text and "1 failed" in text
    rc, text = lane("skip", "test_a or test_e")
    assert rc == 1 and "FAILED: unexpected skip: needs a CUDA device" in text
    rc, text = lane("none", "test_d or test_e")
    assert rc == 1 and "no test passed" in text and "unexpected skip: needs a CUDA device" in text


def test_bench_engine_runs_both_kv_dtypes_at_one_budget(bench):
    import bench_engine

    res = bench_engine.main(["--shape", "demo", "--device", "cpu", "--jobs", "3", "--prompt-len", "24",
                             "--gen-len", "5", "--kv-budget-gb", "0.02", "--name", "smoke"])  # fmt: skip
    saved = json.loads((bench / "smoke.json").read_text())
    assert saved["budget_bytes"] == int(0.02 * 2**30)
    for kv in ("int2", "bf16"):
        r = res[kv]
        assert r["jobs"] == 3 and r["preemptions"] == 0 and r["running_peak"] == 3
        assert r["output_tok_s"] > 0 and r["pool_bytes"] <= saved["budget_bytes"]
        assert saved["results"][kv]["max_running"] == r["max_running"] >= 3
        check_roofline(r, saved["copy_bytes_per_s"])
        assert r["timed_steps"] == r["decode_steps"] == 4  # 5 tokens: 1 from the prefill, 4 decoded
        assert 0 < r["prefill_share"] < 1  # the one prefill step, then four decode-only steps
    assert res["int2"]["int2_bytes"] > 0 and res["bf16"]["int2_bytes"] == 0
    md = (bench / "smoke.md").read_text()
    assert "int2 / bf16" in md and "% of roofline" in md and "wall in prefill steps" in md
    assert {r["benchmark"] for r in history(bench / "history.csv")} == {"smoke"}
    sys.modules.pop("bench_engine", None)


def test_bench_engine_key_bits_layers_cost_capacity_and_bits(bench, tmp_path):
    """``--key-bits-layers N``: N layers with 4-bit keys hold fewer long requests at one budget,
    and the results state the artifact's bits per element."""
    import bench_engine

    from oscarkv.config import EngineConfig

    shape = bench_engine.SHAPES["demo"]
    layers, d = shape["num_hidden_layers"], shape["head_dim"]
    held = {}
    for n in (0, 2):
        rot = bench_engine.random_rotations(layers, d, tmp_path / f"rot{n}", high_layers=n)
        cfg = EngineConfig(model="unused", rotations=str(rot), kv_dtype="int2", device="cpu")
        held[n] = bench_engine.capacity(cfg, shape, 16384, 64 << 20, torch.float32)
    assert held[2] < held[0]
    common = ["--shape", "demo", "--device", "cpu", "--backend", "torch", "--steady", "160", "--steps", "1",
              "--warmup", "0", "--kv-budget-gb", "0.004", "--kv-dtypes", "int2", "--overlap", "off"]  # fmt: skip
    plain = bench_engine.main([*common, "--name", "plain"])["int2"]
    mixed = bench_engine.main([*common, "--key-bits-layers", "2", "--name", "mixed"])["int2"]
    assert mixed["bits_per_element_128k"] > plain["bits_per_element_128k"] > 2
    assert "bits per K/V element at 128K" in (bench / "mixed.md").read_text()
    sys.modules.pop("bench_engine", None)


def check_roofline(r: dict, bw: float) -> None:
    """The roofline columns of one side (CPU: no device time, no gap)."""
    assert bw > 0 and r["copy_GBps"] == pytest.approx(bw / 1e9)
    assert r["weight_bytes"] > 0 and r["kv_bytes"] > 0
    assert r["step_bytes"] == pytest.approx(r["weight_bytes"] + r["kv_bytes"], abs=1)
    assert r["roofline_ms"] == pytest.approx(1e3 * r["step_bytes"] / bw)
    assert r["step_ms"] > 0 and r["host_ms"] > 0
    assert r["roofline_frac"] == pytest.approx(r["roofline_ms"] / r["step_ms"])
    assert math.isnan(r["gpu_ms"]) and math.isnan(r["gap_ms"])


def test_bench_engine_steady_state_holds_every_slot_and_reports_the_roofline(bench):
    import bench_engine

    res = bench_engine.main(["--shape", "demo", "--device", "cpu", "--backend", "torch", "--steady", "48",
                             "--steps", "3", "--warmup", "1", "--kv-budget-gb", "0.002", "--overlap", "off"])  # fmt: skip
    name = "bench_engine_demo_steady_48"
    saved = json.loads((bench / f"{name}.json").read_text())
    assert saved["args"]["overlap"] == "off" and saved["args"]["steady"] == 48
    assert saved["budget_bytes"] == int(0.002 * 2**30)
    for kv in ("int2", "bf16"):
        r = saved["results"][kv]
        assert res[kv]["batch"] == r["batch"] and res[kv]["decode_tok_s"] == r["decode_tok_s"]
        assert r["batch"] == r["requests"] == r["max_running"] >= 1 and r["overlap"] == "off"
        assert r["steps"] == r["timed_steps"] == 3 and r["prefill_tokens_in_window"] == 0
        assert r["decode_tokens"] == 3 * r["batch"] and r["decode_tok_s"] > 0
        assert r["step_ms"] == pytest.approx(1e3 * r["wall_s"] / 3)
        check_roofline(r, saved["copy_bytes_per_s"])
    int2, bf16 = saved["results"]["int2"], saved["results"]["bf16"]
    # every token of a 48-token context is 16-bit in both modes (sink + recent window > 48)
    per_token = bf16["kv_bytes"] / bf16["batch"]
    assert int2["kv_bytes"] / int2["batch"] == pytest.approx(per_token)
    ratios = saved["ratios"]
    assert ratios["decode_tok_s"] == pytest.approx(int2["decode_tok_s"] / bf16["decode_tok_s"])
    assert ratios["max_running"] == pytest.approx(int2["max_running"] / bf16["max_running"])
    md = (bench / f"{name}.md").read_text()
    assert "decode tok/s" in md and "% of roofline" in md and "int2 / bf16" in md
    rows = history(bench / "history.csv")
    assert {r["benchmark"] for r in rows} == {name}
    assert {r["metric"] for r in rows} == {"decode_tok_s", "step_ms", "roofline_frac"}


def test_roofline_counts_each_weight_once_and_the_kv_bytes_per_tier(bench):
    import roofline
    from torch import nn

    from oscarkv.quant.tiers import TierState

    class Model(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed_tokens = nn.Embedding(100, 8)  # 800 fp32 = 3200 bytes, one row 32
            self.proj = nn.Linear(8, 8, bias=False)  # 256 bytes
            self.lm_head = None if tied else nn.Linear(8, 100, bias=False)  # 3200 bytes

    def engine(model: nn.Module, int2: bool) -> SimpleNamespace:
        plan = SimpleNamespace(page_tokens=16, q_page_bytes=16 * 10, hp_page_bytes=16 * 64, int2=int2)
        return SimpleNamespace(runner=SimpleNamespace(model=model, plan=plan))

    def seq(n_sink: int, n_q: int, n_recent: int, prompt: int, out: int) -> SimpleNamespace:
        st = TierState(n_sink=n_sink, n_q=n_q, n_recent=n_recent)
        return SimpleNamespace(tiers=st, n_computed=n_sink + n_q + n_recent, num_tokens=prompt + out)

    running = [seq(4, 100, 20, 120, 5), seq(4, 0, 12, 16, 1), seq(4, 0, 12, 40, 0)]  # the last: prefilling
    rf = roofline.Roofline.of(engine(Model(tied=False), True), bandwidth=1e9)
    assert (rf.weights, rf.embed_row, rf.q_tok, rf.hp_tok) == (256 + 3200, 32, 10, 64)
    snap = rf.snapshot(running)
    assert snap == roofline.StepBytes(2, 100 * 10 + 24 * 64 + 16 * 64)
    assert rf.step_bytes(snap) == 3456 + 2 * 32 + snap.kv and rf.step_s(snap) == rf.step_bytes(snap) / 1e9
    tied = roofline.Roofline.of(engine(Model(tied=True), False), bandwidth=1e9)
    assert (tied.weights, tied.embed_row) == (3200 + 256, 0)  # the table counts once, as the LM head
    assert tied.snapshot(running) == roofline.StepBytes(2, (124 + 16) * 64)  # bf16: every token 16-bit
    fig = roofline.step_figures(rf, [snap], 2 * 1e3 * rf.step_s(snap), [])
    assert fig["roofline_frac"] == pytest.approx(0.5) and math.isnan(fig["host_ms"])
    assert roofline.cell(float("nan"), "{:.1f}") == roofline.cell(None, "{}") == "-"
    # a MoE layer: only the experts the batch's tokens choose count, E(1 - (1 - k/E)^B) in expectation
    from oscarkv.engine.models.linear import Unquantized
    from oscarkv.engine.models.moe import Experts

    moe = Model(tied=False)
    moe.experts = Experts(4, 8, 2, Unquantized(), names=("g", "u", "d"), dtype=torch.float32, device="cpu")
    eng = engine(moe, True)
    eng.runner.shape = SimpleNamespace(experts_per_token=2)
    mrf = roofline.Roofline.of(eng, bandwidth=1e9)
    assert (mrf.weights, mrf.expert_bytes, mrf.experts, mrf.top_k) == (3456, 3 * 8 * 2 * 4, 4, 2)
    assert mrf.experts_touched(1) == pytest.approx(2) and mrf.experts_touched(3) == pytest.approx(
        4 * (1 - 0.5**3)
    )
    assert mrf.step_bytes(snap) == rf.step_bytes(snap) + round(4 * (1 - 0.5**2) * 192)


def test_bench_prefix_runs_sessions_turn_by_turn_and_reports_the_cache_hits(bench):
    """Prefix reuse: every session's turns run one after another, each turn's prompt is the
    session's history (so later turns hit the cache), and the sweep writes its plot."""
    import bench_prefix

    pts = bench_prefix.main(["--shape", "demo", "--device", "cpu", "--system", "48", "--turns", "3", "--user", "16",
                             "--gen", "8", "--sessions", "4", "--concurrency", "1,2", "--kv-budget-gb", "0.02",
                             "--name", "prefix"])  # fmt: skip
    saved = json.loads((bench / "prefix.json").read_text())
    for kv in ("int2", "bf16"):
        one, two = sorted(pts[kv], key=lambda r: r["concurrency"])
        assert (one["concurrency"], one["sessions"], one["jobs"]) == (1, 2, 6)
        assert (two["concurrency"], two["sessions"], two["jobs"]) == (2, 4, 12)
        for r in (one, two):
            assert r["preemptions"] == 0 and r["output_tok_s"] > 0
            # the system prompt (3 of its pages) and the earlier turns are there to be served
            assert 0 < r["hit_ratio"] <= r["reusable_ratio"] < 1
            check_roofline(r, saved["copy_bytes_per_s"])
    # one session alone: its second and third turns find the whole history but the newest partial page
    one = min(pts["bf16"], key=lambda r: r["concurrency"])
    assert one["hit_ratio"] > 0.5
    assert (bench / "prefix.png").stat().st_size > 0
    md = (bench / "prefix.md").read_text()
    assert "prefix hit ratio" in md and "int2 / bf16" in md and "% of roofline" in md


def test_bench_engine_fp8_window_side_pays_a_byte_per_window_element(bench):
    """``int2-fp8w``: int2 with fp8 windows; its rings cost 1 byte per element against the model
    dtype's 4 (fp32 on the CPU), so the same budget holds more requests."""
    import bench_engine

    res = bench_engine.main(["--shape", "demo", "--device", "cpu", "--jobs", "2", "--prompt-len", "24",
                             "--gen-len", "3", "--kv-budget-gb", "0.02", "--kv-dtypes", "int2,int2-fp8w,bf16",
                             "--name", "fp8w"])  # fmt: skip
    a, f = res["int2"], res["int2-fp8w"]
    assert a["ring_bytes"] / a["max_running"] == 4 * f["ring_bytes"] / f["max_running"]
    assert f["max_running"] > a["max_running"] and f["jobs"] == 2 and f["preemptions"] == 0
    assert f["bits_per_element_128k"] < a["bits_per_element_128k"]
    md = (bench / "fp8w.md").read_text()
    assert "int2 / bf16" in md and "int2-fp8w / bf16" in md
    with pytest.raises(SystemExit):
        bench_engine.main(["--kv-dtypes", "int2,fp8"])
