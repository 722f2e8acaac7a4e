"""Start vLLM with each of several bad configurations in turn: ``python start_fail.py CASES.json``.

``CASES.json``: ``{"NAME": {"model": DIR, "llm": {LLM keyword arguments}}, ...}``. For each case
it prints (to stdout) ``@@case NAME``, tries to build ``vllm.LLM`` and prints ``@@end NAME started`` or
``@@end NAME failed``. vLLM writes its logs (with the root cause) to the same output, so
the caller reads each case's messages between its two markers. One process for all cases saves
vLLM's import per case.
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        cases = json.load(f)
    from vllm import LLM

    base = {"max_model_len": 1024, "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True}
    for name, case in cases.items():
        print(f"@@case {name}", flush=True)
        try:
            llm = LLM(model=case["model"], **{**base, **case["llm"]})
        except Exception as e:  # any failure to start is what we look for
            print(f"{type(e).__name__}: {e}", flush=True)
            print(f"@@end {name} failed", flush=True)
            continue
        del llm
        print(f"@@end {name} started", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
