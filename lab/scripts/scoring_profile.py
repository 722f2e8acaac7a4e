"""One scored request (echo + logprobs: ``prompt_logprobs``) through the engine on the CPU, timed
and profiled under a prompt-scoring rule (#54 item 3): ``--context`` tokens of ``--data`` text,
after a short warm-up request; prints the wall time and cProfile's top functions by total time.

    python lab/scripts/scoring_profile.py --model M --rotations R --data FILE --rule decode
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rotations", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rule", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--context", type=int, default=1100)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--no-profile", action="store_true", help="wall time only")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from oscarkv import LLM, SamplingParams

    ids = AutoTokenizer.from_pretrained(args.model).encode(
        Path(args.data).read_text(), add_special_tokens=False
    )
    prompt = ids[1000 : 1000 + args.context]
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    with LLM(args.model, rotations=args.rotations, device="cpu", prompt_scoring=args.rule) as llm:
        llm.generate([ids[:64]], score)  # warm-up
        prof = None if args.no_profile else cProfile.Profile()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        out = llm.generate([prompt], score)[0]
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
    print(f"rule {args.rule} ({out.prompt_scoring}): {len(prompt)} tokens, {wall:.2f} s")
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
