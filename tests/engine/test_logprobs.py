"""Log-probabilities of sampled tokens (``SamplingParams.logprobs``) against the model itself: the
bundled demo model's own forward over prompt + output, on the CPU, both KV dtypes' engines."""

from __future__ import annotations

import pytest
import torch

from conftest import random_rotation_set
from oscarkv import QuantSpec
from oscarkv.config.base import SpecError
from oscarkv.demo import demo_model_path
from oscarkv.engine import SamplingParams
from oscarkv.engine.llm import LLM
from oscarkv.hf.loading import load_model
from oscarkv.rotation import save_rotations

DEMO = str(demo_model_path())


@pytest.fixture(scope="module")
def rotations(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("rot")
    save_rotations(random_rotation_set(4, 128, QuantSpec(sink_tokens=16, recent_tokens=16)), d)
    return str(d)


@pytest.fixture(scope="module")
def hf():
    return load_model(DEMO, "cpu", "fp32")[0]


def test_bf16_engine_logprobs_are_the_models(hf) -> None:
    """Greedy: the chosen token is the top one; every chosen and top log-probability equals the
    log-softmax of the model's logits at that position (fp32 sums in another order: 1e-4)."""
    prompts = ["def add(a, b):", "import os\nimport sys\n"]
    with LLM(DEMO, kv_dtype="bf16", device="cpu", max_running=2) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=3))
        plain = llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))[0]
        sampled = llm.generate(
            prompts[:1], SamplingParams(max_tokens=8, temperature=1.0, seed=1, logprobs=0)
        )[0]
    assert plain.logprobs is None
    for o in [*outs, sampled]:
        ids = torch.tensor([o.prompt_token_ids + o.token_ids])
        with torch.no_grad():
            lp = hf(input_ids=ids).logits[0].float().log_softmax(-1)
        n = len(o.prompt_token_ids)
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) == 8
        for i, (tok, (chosen, top)) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            row = lp[n - 1 + i]
            assert chosen == pytest.approx(float(row[tok]), abs=1e-4)
            want = row.topk(len(top))
            assert [t for t, _ in top] == want.indices.tolist()
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    assert all(top[0][0] == tok for o in outs for tok, (_, top) in zip(o.token_ids, o.logprobs, strict=True))
    assert all(len(top) == 0 for _, top in sampled.logprobs)
    with pytest.raises(SpecError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_int2_engine_logprobs_follow_its_tokens(rotations: str) -> None:
    """INT2: one entry per kept token, through stop strings and a finish on max_tokens."""
    with LLM(DEMO, rotations=rotations, device="cpu", max_running=2) as llm:
        o = llm.generate("def add(a, b):", SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
        full = llm.generate("def add(a, b):", SamplingParams(max_tokens=30, temperature=0, logprobs=1))[0]
        stop = full.text[len(full.text) // 2 :][:2]
        cut = llm.generate(
            "def add(a, b):", SamplingParams(max_tokens=30, temperature=0, logprobs=1, stop=stop)
        )[0]
    assert len(o.logprobs) == len(o.token_ids) == 6 and all(len(t) == 2 for _, t in o.logprobs)
    assert all(c <= 0 for c, _ in o.logprobs)
    assert len(cut.logprobs) == len(cut.token_ids) and cut.logprobs == full.logprobs[: len(cut.token_ids)]


@pytest.mark.parametrize("chunk", [8192, 7])
def test_prompt_logprobs_are_the_models_at_every_position(hf, chunk: int) -> None:
    """``prompt_logprobs``: every prompt token after the first is scored by the logits of the
    position before it, in one prefill step or in chunks of 7 tokens; a repeat of the prompt is
    scored again in full (no prefix-cache hit), while a plain request still hits the cache."""
    prompt = "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n"
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=2)
    with LLM(DEMO, kv_dtype="bf16", device="cpu", max_running=2, max_batched_tokens=chunk) as llm:
        first, again = (llm.generate(prompt, params)[0] for _ in range(2))
        plain = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))[0]
    ids = first.prompt_token_ids
    with torch.no_grad():
        lp = hf(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(ids) > 16
    assert first.prompt_logprobs[0] is None and plain.prompt_logprobs is None
    for p in range(1, len(ids)):
        chosen, top = first.prompt_logprobs[p]
        assert chosen == pytest.approx(float(lp[p - 1, ids[p]]), abs=1e-4)
        want = lp[p - 1].topk(2)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    assert again.num_cached_tokens == 0 and plain.num_cached_tokens > 0
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-5)
    # the first sampled token's log-probability continues the prompt's scores
    assert first.logprobs[0][0] == pytest.approx(float(lp[-1, first.token_ids[0]]), abs=1e-4)
    with pytest.raises(SpecError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
