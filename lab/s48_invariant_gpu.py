"""Stop 48: how far prefill_attention=invariant makes INT2 outputs independent of cache state on
CUDA (Triton backend): per mode and model dtype, whether a repeat (prefix hit) and a 64-token-chunk
run give the first run's greedy tokens, the first differing position, and the largest prompt
log-probability difference. Demo model, random rotations, default spec."""

from __future__ import annotations

import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from conftest import random_rotation_set
from oscarkv import LLM, SamplingParams
from oscarkv.demo import demo_model_path
from oscarkv.rotation import save_rotations

rot = tempfile.mkdtemp()
save_rotations(random_rotation_set(4, 128), rot)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (300, 700, 1500, 1100)]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
PLAIN = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def llm(mode: str, dtype: str, **kw) -> LLM:
    return LLM(str(demo_model_path()), rotations=rot, device="cuda", dtype=dtype, kv_budget_gb=1, max_running=16,
               prefill_attention=mode, **kw)  # fmt: skip


def diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), -1)


print(
    "| mode | dtype | repeat same (first diff) | chunked same (first diff) | hits | max |dlogprob| chunked |"
)
print("|---|---|---|---|---|---|")
for dtype in ("bf16", "fp32"):
    for mode in ("fresh", "invariant"):
        one = llm(mode, dtype)
        first = one.generate(prompts, PLAIN)
        again = one.generate(prompts, PLAIN)
        ch = llm(mode, dtype, max_batched_tokens=64, prefix_cache=False)
        chunk = ch.generate(prompts, PLAIN)
        s1 = llm(mode, dtype, prefix_cache=False).generate(prompts, GREEDY)
        s2 = llm(mode, dtype, prefix_cache=False, max_batched_tokens=64).generate(prompts, GREEDY)
        dl = max(abs(x[0] - y[0]) for a, b in zip(s1, s2, strict=True)
                 for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True))  # fmt: skip
        rep = [diff(a.token_ids, b.token_ids) for a, b in zip(first, again, strict=True)]
        chk = [diff(a.token_ids, b.token_ids) for a, b in zip(first, chunk, strict=True)]
        print(
            f"| {mode} | {dtype} | {sum(r < 0 for r in rep)}/4 {rep} | {sum(c < 0 for c in chk)}/4 {chk} | "
            f"{[o.num_cached_tokens for o in again]} | {dl:.2e} |"
        )
