"""Smoke runs of GPU benchmark scripts on the CPU with tiny models: their plumbing (argument
handling, cache bookkeeping across rounds, result files) works before GPU time is spent on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    import _harness

    monkeypatch.setattr(_harness, "RESULTS", tmp_path)
    monkeypatch.setattr(_harness, "git_commit", lambda: "test")
    yield tmp_path
    for mod in (
        "e2e_decode",
        "_harness",
        "calibration_speed",
        "gpu_check",
        "trace_decode",
        "gpu_lane",
        "decode_breakdown",
    ):
        sys.modules.pop(mod, None)


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


def test_trace_decode_patches_the_current_kernel_and_its_summary_reads_the_timeline(bench):
    """``benchmarks/trace_decode.py`` edits a copy of the decode kernel by text: every edit must
    still match the kernel's current source, and the summary must place a known timeline."""
    import torch
    import trace_decode

    mod = trace_decode.traced_module()
    assert "TR" in mod._stage1.arg_names and "TRM" in mod._merge.arg_names
    # the end-of-program record sits in _stage1 itself, after both tiers
    src = mod._stage1.src
    assert src.rstrip().endswith("_record(TR, (sp < n_q_splits).to(tl.int64))") and "_start(TR)" in src
    assert mod._merge.src.rstrip().endswith("_record(TRM, 2)")
    # stage 1: two INT2 programs (kind 1) on SMs 0/1 and one 16-bit program (kind 0); ns
    mod.TRACE[0] = torch.tensor([[0, 5000, 0, 1], [1000, 9000, 1, 1], [0, 2000, 1, 0]])
    mod.TRACE[1] = torch.tensor([[10000, 12000, 0, 2], [10500, 11000, 1, 2]])
    s = trace_decode.summarise(mod, 0.015)
    assert (s["int2_programs"], s["hp_programs"], s["merge_programs"]) == (2, 1, 2)
    assert s["int2_late"] == 0 and s["stage1_span_us"] == 9.0 and s["merge_gap_us"] == 1.0
    assert s["by_int2_per_sm"] == "1: 2 SMs, 7.0 µs, 0.5 hp"
    assert s["kernel_span_us"] == 12.0 and s["outside_us"] == 3.0 and s["sm_end_us"] == [5.0, 5.0, 9.0, 9.0]


def test_heads_argument_of_the_decode_benchmarks_is_checked(bench):
    """``--heads QUERYxKVxHEAD_DIM`` of decode_variants.py and trace_decode.py."""
    import gpu_check

    assert gpu_check.parse_heads("16x4x256") == (16, 4, 256)
    for bad, match in (
        ("32x8", "QUERYxKVxHEAD_DIM"),
        ("32x6x128", "multiple of KV heads"),
        ("32x8x96", "head dim"),
    ):
        with pytest.raises(ValueError, match=match):
            gpu_check.parse_heads(bad)


def test_gpu_lane_splits_contiguously_and_reports_a_failing_shard(bench):
    import gpu_lane

    ids = [f"t{i}" for i in range(10)]
    parts = gpu_lane.split(ids, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2] and [t for p in parts for t in p] == ids
    assert gpu_lane.split(ids[:2], 4) == [["t0"], ["t1"]]
    target = bench / "test_tiny.py"
    target.write_text(
        "def test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    assert False\n"
    )
    assert (
        gpu_lane.main(
            ["--target", str(target), "--shards", "2", "--out", str(bench / "ok"), "-k", "not test_c"]
        )
        == 0
    )
    text = (bench / "ok" / "gpu_lane.md").read_text()
    assert (
        "2 tests of test_tiny.py" in text and text.count("1 passed") == 2 and "every shard exited 0" in text
    )
    assert gpu_lane.main(["--target", str(target), "--shards", "2", "--out", str(bench / "bad")]) == 1
    text = (bench / "bad" / "gpu_lane.md").read_text()
    assert "NOT every shard exited 0" in text and "1 failed" in text and "2 passed" in text


def test_decode_breakdown_hot_variant_folds_the_slot_list_and_checks_its_argument(bench):
    """``--hot N`` points the quantized slot list at slots 0 … N-1; N must be an integer >= 1."""
    import argparse

    import decode_breakdown
    import torch

    idx = torch.arange(10, dtype=torch.int32)
    assert decode_breakdown.hot_slots(idx, 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert decode_breakdown._slots("256") == 256
    for bad in ("0", "-3", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="number of slots >= 1"):
            decode_breakdown._slots(bad)
