"""`oscarkv generate --engine`: a JSONL batch through the engine, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oscarkv import LLM, SamplingParams
from oscarkv.cli import main
from oscarkv.demo import demo_model_path


def test_engine_batch_from_jsonl_matches_the_llm_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text('{"prompt": "def add(a, b):"}\n\n{"prompt_token_ids": [5, 6, 7]}\n')
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--engine", "--model", str(demo_model_path()), "--kv-dtype", "bf16", "--device", "cpu",
            "--prompts", str(reqs), "--out", str(out), "--max-new-tokens", "6", "--page-tokens", "8"]  # fmt: skip
    assert main(argv) == 0
    assert "2 requests, 12 tokens" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(str(demo_model_path()), kv_dtype="bf16", device="cpu", page_tokens=8)
    ref = llm.generate(["def add(a, b):", [5, 6, 7]], SamplingParams(max_tokens=6, temperature=0))
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in ref]
    assert [r["text"] for r in rows] == [o.text for o in ref]
    assert rows[1]["prompt_tokens"] == 3 and rows[0]["finish_reason"] in ("length", "stop")
    assert out.stat().st_mode & 0o777 == 0o644
    assert main(argv) == 2  # the output exists now
    assert main([*argv, "--overwrite"]) == 0
