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
    for mod in ("e2e_decode", "_harness", "calibration_speed", "gpu_check"):
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
