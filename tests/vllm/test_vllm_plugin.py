"""The vLLM plug-in prototype (``oscarkv.vllm_plugin``, docs/vllm.md).

The options and layout tests run anywhere. The end-to-end test needs vLLM's CPU build
(``pip install -e ".[vllm]"`` in its own virtualenv, docs/vllm.md) and the shared reference
model; it is skipped without them and takes about a minute on two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscarkv.errors import InputError
from oscarkv.vllm_plugin.layout import hp_token_bytes, int2_token_bytes, page_rows, write_rows
from oscarkv.vllm_plugin.options import PluginOptions

HERE = Path(__file__).resolve().parent


def test_options_opt_in_only() -> None:
    assert PluginOptions.from_additional_config({}) is None
    assert PluginOptions.from_additional_config({"other": 1}) is None
    assert PluginOptions.from_additional_config({"oscarkv": {}}) == PluginOptions()
    assert PluginOptions.from_additional_config({"oscarkv": True}).kv_dtype == "bf16"


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"kv_dtype": "int2"}, "not implemented under vLLM"),
        ({"kv_dtype": "fp8"}, "kv_dtype must be one of"),
        ({"rotation": "x"}, "unknown option"),
        ("bf16", "must be a dict"),
    ],
)
def test_options_errors(raw: object, words: str) -> None:
    with pytest.raises(InputError, match=words):
        PluginOptions.from_additional_config({"oscarkv": raw})


def test_token_bytes() -> None:
    # the 30M reference model: 2 KV heads, head_dim 128, bf16
    assert hp_token_bytes(2, 128, 2) == 1024
    assert int2_token_bytes(2, 128) == 144  # 2 x 2 x (32 code bytes + fp16 scale and zero)


def test_pages_round_trip_and_padding() -> None:
    nb, bs, h, d = 3, 4, 2, 8
    cache = torch.zeros(nb, 1, bs, 2 * h * d, dtype=torch.bfloat16)
    pages = page_rows(cache, h, d)
    k = torch.randn(3, h, d).bfloat16()
    v = torch.randn(3, h, d).bfloat16()
    write_rows(pages, k, v, torch.tensor([9, -1, 2]))
    assert torch.equal(pages[2, 1, 0], k[0]) and torch.equal(pages[2, 1, 1], v[0])
    assert torch.equal(pages[0, 2, 0], k[2]) and torch.equal(pages[0, 2, 1], v[2])
    assert int((cache != 0).any(-1).sum()) == 2  # the padded row went nowhere
    with pytest.raises(RuntimeError, match="unexpected KV page view"):
        page_rows(torch.zeros(nb, h, bs, 2 * d), h, d)


def _run(model: Path, out: Path, *flags: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_vllm.py"), str(model), str(out), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


@pytest.mark.shared
@pytest.mark.slow
def test_passthrough_matches_vllm_greedy(shared_dir: Path, tmp_path: Path) -> None:
    # not "vllm": with tests/ on sys.path this folder is itself a namespace package of that name
    pytest.importorskip("vllm.entrypoints", reason="needs vLLM (the CPU build, docs/vllm.md)")
    model = shared_dir / "models" / "oscar-ref-qwen3-30m"
    plain, plain_log = _run(model, tmp_path / "plain.json")
    ours, log = _run(model, tmp_path / "ours.json", "--oscarkv", "--chunk", "64", "--hp-store")
    assert "oscarkv:" not in plain_log  # installed but not opted in: vLLM's own attention
    assert "oscarkv: KV pages in the oscarkv 16-bit passthrough layout" in log
    assert "oscarkv: 16-bit store" in log  # the per-request store was allocated and addressed
    assert ours["prefix_cache"].get("vllm:prefix_cache_hits", 0) > 0  # the cached-prefix path ran
    assert ours["tokens"] == plain["tokens"]


def test_int2_pages_fit_vllms_allocator() -> None:
    """vLLM's own spec classes size an INT2 page from what the backend publishes, and unify it
    with the per-request 16-bit store (docs/vllm.md, 'What the INT2 path needs')."""
    pytest.importorskip("vllm.entrypoints", reason="needs vLLM (the CPU build, docs/vllm.md)")
    from dataclasses import replace

    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size
    from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec

    h, d = 2, 128  # the 30M reference model
    int2 = FullAttentionSpec(block_size=64, num_kv_heads=h, head_size=d, dtype=torch.uint8)
    int2 = replace(int2, num_head_slots=1, state_content_bytes=int2_token_bytes(h, d))
    assert int2.page_size_bytes == 64 * 144
    # 16-bit rows cost 64/9 of an INT2 row at d = 128: a capacity of 9*37 = 333 >= 64 + 263 tokens
    store = CircularBufferSpec(block_size=333, num_kv_heads=h, head_size=d, dtype=torch.bfloat16)
    out = unify_kv_cache_spec_page_size({"attn": int2, "attn.oscarkv_hp": store})
    assert out["attn"].page_size_bytes == out["attn.oscarkv_hp"].page_size_bytes == 333 * 1024
    assert out["attn"].block_size == 64 * 37 and out["attn"].page_size_padded is None
