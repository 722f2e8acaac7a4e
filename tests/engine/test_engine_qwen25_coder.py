"""A real head_dim-128 model (Qwen2.5-Coder-1.5B-Instruct: Qwen2 with q/k/v biases, 28 layers, 12
query / 2 KV heads, a 152K vocabulary): the BF16 engine's greedy answers equal transformers' greedy
answers, the INT2 engine's greedy tokens equal transformers' through ``OscarCache`` on prompts
whose history is read from INT2, and the INT2 engine starts with default flags and answers.

Skipped unless the model is there (``--qwen25-coder DIR``; scripts/get_qwen25_coder.sh DIR makes
one). The rotations are random (a calibration takes minutes): these tests check that the engine
computes what ``OscarCache`` computes on a real model, not the quality of INT2 answers.

The model is 6 GiB in fp32: each test computes transformers' references first and frees its model
before an engine loads, so one copy of the weights is held at a time.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conftest import random_rotation_set
from oscarkv import LLM, OscarCache, QuantSpec, SamplingParams
from oscarkv.rotation import RotationSet, save_rotations

LAYERS, HEAD_DIM = 28, 128
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "In one sentence, what does `git rebase` do?",
]
CHAT_TOKENS = 16
SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
#: real code from this repository, cut to these lengths in tokens: both prompts run past the sink
#: and the recent window (48 tokens), so their decode reads INT2 history
CODE_FILES = ("src/oscarkv/engine/kv_budget.py", "src/oscarkv/engine/scheduler.py")
CODE_LENS = (256, 96)
INT2_TOKENS = 16
REPO = Path(__file__).resolve().parents[2]


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@pytest.fixture(scope="module")
def rotations(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RotationSet]:
    rs = random_rotation_set(LAYERS, HEAD_DIM, SPEC)
    d = tmp_path_factory.mktemp("qwen25-rot")
    save_rotations(rs, d)
    return d, rs


def _code_prompts(tokenizer) -> list[list[int]]:
    out = []
    for f, n in zip(CODE_FILES, CODE_LENS, strict=True):
        ids = tokenizer.encode((REPO / f).read_text(encoding="utf-8"), add_special_tokens=False)
        assert len(ids) >= n, f
        out.append(ids[:n])
    return out


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(model, ids: torch.Tensor, n: int, **kw) -> list[int]:
    """transformers' greedy tokens after ``ids`` [1, T] (a pure argmax: no repetition penalty
    whatever the model's generation_config says)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             repetition_penalty=1.0, **kw)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.slow
def test_bf16_engine_answers_like_transformers(qwen25_coder_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen25_coder_dir)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    model = _hf_model(qwen25_coder_dir)
    refs = []
    for chat in chats:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        refs.append((ids["input_ids"][0].tolist(), _hf_greedy(model, ids["input_ids"], CHAT_TOKENS)))
    del model  # one copy of the weights at a time (6 GiB each)
    gc.collect()

    llm = LLM(str(qwen25_coder_dir), kv_dtype="bf16", device="cpu", dtype="fp32", check_invariants=True,
              kv_budget_gb=0.5, max_model_len=2048)  # fmt: skip
    outs = llm.chat(chats, SamplingParams(max_tokens=CHAT_TOKENS, temperature=0))
    for (ids, ref), out, q in zip(refs, outs, QUESTIONS, strict=True):
        assert out.prompt_token_ids == ids, q  # the engine renders the chat template as transformers
        assert out.token_ids == ref, (q, first_diff(out.token_ids, ref), out.text)  # both stop at EOS
    assert "Paris" in outs[0].text
    assert "def " in outs[1].text


@pytest.mark.slow
def test_int2_engine_equals_oscarcache_greedy(qwen25_coder_dir: Path, rotations) -> None:
    """Random rotations at sink 16, recent 32: two code prompts (256 and 96 tokens, decoded in one
    batch) are mostly INT2 when their tokens are decoded, and each token of the engine (R_V
    absorbed, its default) equals OscarCache's (R_V applied to the values)."""
    from transformers import AutoTokenizer

    path, rs = rotations
    ps = _code_prompts(AutoTokenizer.from_pretrained(qwen25_coder_dir))
    model = _hf_model(qwen25_coder_dir)
    refs = []
    for p in ps:
        cache = OscarCache.from_rotations(model, rs, spec=SPEC, backend="torch")
        refs.append(_hf_greedy(model, torch.tensor([p]), INT2_TOKENS, min_new_tokens=INT2_TOKENS,
                               past_key_values=cache))  # fmt: skip
        assert cache.memory_report()["tokens_quantized"] >= len(p) - SPEC.sink_tokens - SPEC.recent_tokens
    del model  # one copy of the weights at a time (6 GiB each)
    gc.collect()

    llm = LLM(str(qwen25_coder_dir), rotations=str(path), device="cpu", dtype="fp32", spec=SPEC,
              page_tokens=8, kv_budget_gb=0.5, max_model_len=2048, check_invariants=True)  # fmt: skip
    outs = llm.generate(ps, SamplingParams(max_tokens=INT2_TOKENS, temperature=0, ignore_eos=True))
    for p, ref, o in zip(ps, refs, outs, strict=True):
        assert o.token_ids == ref, (len(p), first_diff(o.token_ids, ref), o.text)
    assert llm.engine.stats["preemptions"] == 0


@pytest.mark.slow
def test_int2_engine_starts_and_answers_with_default_flags(qwen25_coder_dir: Path, tmp_path: Path) -> None:
    """No flags but the rotations (random, at the default spec: this checks start-up, not quality):
    the default CPU budget holds a request of the model's 32,768 positions in INT2."""
    save_rotations(random_rotation_set(LAYERS, HEAD_DIM, QuantSpec()), tmp_path / "rot")
    llm = LLM(str(qwen25_coder_dir), rotations=str(tmp_path / "rot"))
    assert llm.engine.max_model_len == 32768
    out = llm.chat([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                   SamplingParams(max_tokens=8, temperature=0))[0]  # fmt: skip
    assert out.token_ids and out.finish_reason in ("length", "stop")
