"""Run vLLM (CPU build) greedily on the reference model and print the token ids as JSON.

``python tests/vllm/run_vllm.py MODEL_DIR OUT.json [--oscarkv] [--chunk N] [--no-prefix-cache]``.
A script, not a test: vLLM starts worker processes with ``spawn``, which re-imports ``__main__``.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "def add(a, b):",
    "import os\nimport sys\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    # a long prompt (several 128-token blocks) that shares its start with the next one
    "import json\n\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40)),
    "import json\n\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40)) + "def g(",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--oscarkv", action="store_true", help="opt in: additional_config oscarkv bf16")
    ap.add_argument("--chunk", type=int, default=0, help="max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: eager)")
    ap.add_argument("--hp-store", action="store_true", help="also allocate the 16-bit store (prototype)")
    a = ap.parse_args()
    t0 = time.time()
    from vllm import LLM, SamplingParams

    kw: dict = {}
    if a.oscarkv:
        kw["additional_config"] = {"oscarkv": {"kv_dtype": "bf16", "hp_store": a.hp_store}}
    if a.chunk:
        kw["max_num_batched_tokens"] = a.chunk
    t1 = time.time()
    llm = LLM(
        model=a.model,
        dtype="bfloat16",
        max_model_len=4096,
        kv_cache_memory_bytes=256 * 2**20,
        enforce_eager=not a.compile,
        disable_log_stats=False,
        seed=0,
        enable_prefix_caching=not a.no_prefix_cache,
        **kw,
    )
    t2 = time.time()
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    outs = llm.generate(PROMPTS[:4], sp)  # first pass
    outs += llm.generate(PROMPTS[4:], sp)  # second pass: prefix-cache hits on the long prompts
    outs += llm.generate(PROMPTS[4:5], sp)  # a full repeat
    t3 = time.time()
    hits = {m.name: m.value for m in llm.get_metrics() if "prefix_cache" in m.name and hasattr(m, "value")}
    res = {
        "prefix_cache": hits,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "times": {"import_s": t1 - t0, "init_s": t2 - t1, "generate_s": t3 - t2},
        "prompt_lens": [len(o.prompt_token_ids) for o in outs],
    }
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(json.dumps(res["times"]), res["prompt_lens"], res["prefix_cache"])


if __name__ == "__main__":
    main()
