"""A real pretrained model (SmolLM2-135M-Instruct: Llama, head_dim 64, 9 query / 3 KV heads, a
chat template): the BF16 engine's greedy answers equal transformers' greedy answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oscarkv import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Name three colors.",
]


@pytest.mark.slow
def test_bf16_engine_answers_like_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smollm2_dir), kv_dtype="bf16", device="cpu", dtype="fp32", check_invariants=True)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = llm.chat(chats, params)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for chat, out in zip(chats, outs, strict=True):
        ids = llm.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        ref_ids = ref[0, ids.shape[1] :].tolist()
        assert out.token_ids == ref_ids[: len(out.token_ids)], (chat, out.text)
    assert "Paris" in outs[0].text
