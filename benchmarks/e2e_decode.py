"""End-to-end decode speed and KV memory: OscarCache vs BF16 DynamicCache in ``model.generate``.

A random-weight model with Qwen3-8B's configuration (speed needs no trained weights), batch 16,
32K-token prompts (``--shapes`` for others). Both caches are prefilled in 4K-token chunks (to
bound activation memory), ``model.generate`` decodes 2 tokens (warm-up), then ``--new`` more are
timed; decode tokens/s = batch × new / time. KV memory
is the ``torch.cuda.max_memory_allocated`` growth over the prefill (and, for OscarCache,
``memory_report()``). Run on the GPU machine:

    python benchmarks/e2e_decode.py [--shapes 16x32768,1x4096] [--caches bf16,oscar] [--new 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import save
from calibration_speed import QWEN3_8B

from oscarkv.calibration.fit import fixed_layer
from oscarkv.hf import OscarCache
from oscarkv.rotation import RotationSet


def prefill(model, ids: torch.Tensor, cache, chunk: int) -> None:
    with torch.inference_mode():
        for s in range(0, ids.shape[1] - 1, chunk):
            model(
                input_ids=ids[:, s : min(s + chunk, ids.shape[1] - 1)], past_key_values=cache, use_cache=True
            )


def decode(model, ids: torch.Tensor, cache, new: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def warm_kernels(batch: int, context: int, cfg) -> None:
    """Compile the Triton kernels for this shape class before timing (an engine compiles once at
    start-up; the first ``generate`` step would otherwise include it)."""
    from gpu_check import SINK_RECENT, make_pools

    from oscarkv.kernels.triton import decode_attention as tda
    from oscarkv.quant import RowFormat

    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    fmt = RowFormat(d, 2, d)
    lq = context - SINK_RECENT
    pools = make_pools(batch, lq, SINK_RECENT, hkv, d, fmt)
    q = torch.randn(batch, cfg.num_attention_heads, d, device="cuda", dtype=torch.bfloat16)
    tda.decode_attention(q, *pools, d**-0.5, fmt, fmt)
    torch.cuda.synchronize()


def run_shape(model, cfg, rots, batch: int, context: int, args) -> tuple[dict, list[str]]:
    """Prefill and decode one (batch, context) with each cache of ``args.caches``."""
    from transformers import DynamicCache

    ids = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")
    warm_kernels(batch, context, cfg)
    res = {}
    for name in args.caches.split(","):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cache = DynamicCache() if name == "bf16" else OscarCache.from_rotations(model, rots)
        t0 = time.perf_counter()
        prefill(model, ids, cache, args.chunk)
        torch.cuda.synchronize()
        t_pre = time.perf_counter() - t0
        kv_alloc = torch.cuda.memory_allocated() - base
        decode(model, ids, cache, 2)  # warm-up (allocator, first steps); then the timed decode
        dt = decode(model, torch.cat([ids, ids[:, -2:]], 1), cache, args.new)
        peak = torch.cuda.max_memory_allocated() - base
        r = {"prefill_s": round(t_pre, 1), "decode_s": round(dt, 3), "tok_per_s": batch * args.new / dt,
             "kv_bytes_allocated": kv_alloc, "peak_extra_bytes": peak}  # fmt: skip
        if name == "oscar":
            rep = cache.memory_report()
            r.update({k: rep[k] for k in ("total_bytes", "allocated_bytes", "bits_per_element")})
        res[name] = r
        print(batch, context, name, r, flush=True)
        del cache
    md = [f"batch {batch}, context {context}, {args.new} new tokens, model.generate", "",
          "| cache | decode tok/s | ms / step | KV memory (GB, allocated) | peak extra (GB) |", "|---|---|---|---|---|"]  # fmt: skip
    for n, r in res.items():
        md.append(
            f"| {n} | {r['tok_per_s']:.0f} | {1e3 * batch / r['tok_per_s']:.1f} | "
            f"{r['kv_bytes_allocated'] / 1e9:.2f} | {r['peak_extra_bytes'] / 1e9:.2f} |"
        )
    if "bf16" in res and "oscar" in res:
        ratio = res["oscar"]["tok_per_s"] / res["bf16"]["tok_per_s"]
        mem = res["oscar"]["kv_bytes_allocated"] / res["bf16"]["kv_bytes_allocated"]
        md += ["", f"speedup {ratio:.2f}x; KV memory ratio {mem:.3f} (1/{1 / mem:.1f}); "
               f"OscarCache memory_report: {res['oscar']['total_bytes'] / 1e9:.2f} GB, "
               f"{res['oscar']['bits_per_element']:.2f} bits/element"]  # fmt: skip
    return res, md


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16x32768", help="comma list of BATCHxCONTEXT")
    ap.add_argument("--caches", default="bf16,oscar", help="comma list of bf16, oscar")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--name", default="e2e_decode", help="results file name")
    ap.add_argument("--decode-config", default=None, help="gpu_check.json whose tuned decode config to use")
    args = ap.parse_args()
    if args.decode_config:
        import json

        from oscarkv.kernels.triton import decode_attention as tda

        tda.CONFIG.update(json.loads(Path(args.decode_config).read_text())["config"]["decode"])
        print("decode config:", tda.CONFIG, flush=True)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**QWEN3_8B)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    # the same RotationSet shape OSCAR uses (per-layer Hadamard here: speed does not depend on U)
    rots = RotationSet({i: fixed_layer("hadamard", 128, 8, "layer") for i in range(cfg.num_hidden_layers)})
    results, md = {}, ["End-to-end decode, random-weight Qwen3-8B config (bf16), eager model.generate", ""]
    for shape in args.shapes.split(","):
        batch, context = (int(v) for v in shape.split("x"))
        res, lines = run_shape(model, cfg, rots, batch, context, args)
        results[shape] = res
        md += [f"## {shape}", "", *lines, ""]
    print("\n".join(md))
    save(args.name, {"args": vars(args), "results": results}, "\n".join(md))


if __name__ == "__main__":
    main()
