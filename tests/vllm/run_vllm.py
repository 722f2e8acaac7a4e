"""Run vLLM (CPU build) greedily and write the token ids as JSON: ``python run_vllm.py JOB.json OUT.json``.

``JOB.json``: ``{"model": DIR, "llm": {LLM keyword arguments}, "max_tokens": N, "batches":
[[prompt, ...], ...]}``, a prompt being a string or a list of token ids; each batch is one
``generate`` call, in order, on one engine. ``OUT.json``: ``{"tokens": [[ids per prompt] per
batch], "prefix_cache": {...}, "times": {...}}``.

Several engines, one after another in this one process (vLLM imported once): ``"runs": {NAME:
{LLM keyword arguments}, ...}`` in place of ``"llm"``. ``OUT.json`` is then ``{"runs": {NAME:
{"tokens", "prefix_cache", "times"}}}``, and each run's log lies between the lines ``@@run NAME``
and ``@@end NAME``. vLLM's metrics belong to the process, so only the first run's
``prefix_cache`` counts are its own.

A script, not a test: vLLM starts worker processes with ``spawn``, which re-imports ``__main__``,
and a crashed engine must not take pytest down with it.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def run(job: dict, llm_kw: dict) -> dict:
    """One engine: build it, generate every batch, return its tokens, prefix-cache counts and times."""
    from vllm import LLM, SamplingParams

    t1 = time.time()
    kw = {"max_model_len": 2048, "kv_cache_memory_bytes": 256 * 2**20, "enforce_eager": True, "seed": 0}
    llm = LLM(model=job["model"], disable_log_stats=False, **{**kw, **llm_kw})
    t2 = time.time()
    sp = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    tokens = []
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in batch]
        tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)])
    t3 = time.time()
    hits = {m.name: m.value for m in llm.get_metrics() if "prefix_cache" in m.name and hasattr(m, "value")}
    del llm
    gc.collect()  # shuts the engine's processes down before the next run starts its own
    return {"tokens": tokens, "prefix_cache": hits, "times": {"init_s": t2 - t1, "generate_s": t3 - t2}}


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    t0 = time.time()
    import vllm  # noqa: F401

    import_s = time.time() - t0
    if "llm" in job:
        res = run(job, job["llm"])
        res["times"]["import_s"] = import_s
        print(json.dumps(res["times"]), res["prefix_cache"])
    else:
        res = {"runs": {}}
        for name, llm_kw in job["runs"].items():
            print(f"@@run {name}", flush=True)
            res["runs"][name] = run(job, llm_kw)
            print(f"@@end {name}", json.dumps(res["runs"][name]["times"]), flush=True)
        print(json.dumps({"import_s": import_s, "total_s": time.time() - t0}))
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
