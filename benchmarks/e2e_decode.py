"""End-to-end decode speed and KV memory: OscarCache vs BF16 DynamicCache in ``model.generate``.

A random-weight model with Qwen3-8B's configuration (speed needs no trained weights), batch 16,
32K-token prompts (``--shapes`` for others). Both caches are prefilled in 4K-token chunks (to
bound activation memory) and kept; ``model.generate`` decodes 2 tokens (warm-up) with each, then
``--repeats`` rounds of ``--new`` timed steps alternate between the caches (the eager step is
host-bound, and the host's speed drifts between and within GPU calls); decode tokens/s = batch ×
1000 / the median ms per step. KV memory
is the ``torch.cuda.max_memory_allocated`` growth over the prefill (and, for OscarCache,
``memory_report()``). Run on the GPU machine:

    python benchmarks/e2e_decode.py [--shapes 16x32768,1x4096] [--caches bf16,oscar] [--new 32] [--repeats 3]
    python benchmarks/e2e_decode.py --arch qwen3-30b-a3b --shapes 8x8192   # a bench_engine.py shape
    python benchmarks/e2e_decode.py --arch glm-4.5-air-fp8 --layers 10       # fewer layers, bf16 weights

and as a CPU smoke run (tests/test_benchmarks.py): ``--device cpu --tiny --shapes 2x300 --chunk 128``.
"""

from __future__ import annotations

import argparse
import statistics
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

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)  # fmt: skip


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def prefill(model, ids: torch.Tensor, cache, chunk: int) -> None:
    """Every token of ``ids`` but the last into ``cache``, ``chunk`` tokens per forward (logits of
    the last position only: a chunk's full logits, 18.5 GiB at batch 16 × 4096 for Qwen3-8B's
    vocabulary, would not fit beside both caches of the ``--repeats`` mode)."""
    with torch.inference_mode():
        for s in range(0, ids.shape[1] - 1, chunk):
            model(
                input_ids=ids[:, s : min(s + chunk, ids.shape[1] - 1)], past_key_values=cache, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip


def decode(model, ids: torch.Tensor, cache, new: int) -> float:
    """Seconds for ``model.generate`` to decode ``new`` tokens after ``ids`` (all but the last token
    already in ``cache``); the cache grows by ``new`` tokens."""
    device = ids.device.type
    _sync(device)
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
    _sync(device)
    return time.perf_counter() - t0


def warm_kernels(batch: int, context: int, cfg) -> None:
    """Compile the Triton kernels for this shape class before timing (an engine compiles once at
    start-up; the first ``generate`` step would otherwise include it)."""
    from gpu_check import SINK_RECENT, make_pools

    from oscarkv.kernels.triton.decode import decode_attention
    from oscarkv.quant import RowFormat

    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    fmt = RowFormat(d, 2, d)
    lq = context - SINK_RECENT
    pools = make_pools(batch, lq, SINK_RECENT, hkv, d, fmt)
    q = torch.randn(batch, cfg.num_attention_heads, d, device="cuda", dtype=torch.bfloat16)
    decode_attention(q, *pools, d**-0.5, fmt, fmt)
    torch.cuda.synchronize()


def run_shape(model, cfg, rots, batch: int, context: int, args) -> tuple[dict, list[str]]:
    """Prefill one (batch, context) into each cache of ``args.caches`` (all kept), then time
    ``args.repeats`` rounds of ``args.new`` decode steps per cache, alternating the order of the
    caches between rounds, so that a drift of the host's speed during the call hits both sides."""
    from transformers import DynamicCache

    device = args.device
    names = args.caches.split(",")
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device=device)
    if device == "cuda":
        warm_kernels(batch, context, cfg)
    caches: dict[str, list] = {}
    res: dict[str, dict] = {}
    for name in sorted(names, key=lambda n: n != "oscar"):  # the small cache first: lower peak memory
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = _allocated(device)
        cache = DynamicCache() if name == "bf16" else OscarCache.from_rotations(model, rots)
        t0 = time.perf_counter()
        prefill(model, ids, cache, args.chunk)
        _sync(device)
        r = {"prefill_s": round(time.perf_counter() - t0, 1), "kv_bytes_allocated": _allocated(device) - base}
        if device == "cuda":
            r["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
        decode(model, ids, cache, 2)  # warm-up (allocator, first steps): the cache now holds context + 1
        if name == "oscar":
            rep = cache.memory_report()
            r.update({k: rep[k] for k in ("total_bytes", "allocated_bytes", "bits_per_element")})
        caches[name], res[name] = [cache, context + 1], r
        print(batch, context, name, r, flush=True)
    steps: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(args.repeats):
        for name in names if rnd % 2 == 0 else names[::-1]:
            cache, held = caches[name]
            x = torch.cat([ids, ids[:, -1:].expand(batch, held + 1 - context)], 1)  # uncached: the last one
            steps[name].append(1e3 * decode(model, x, cache, args.new) / args.new)
            caches[name][1] = held + args.new
    for name in names:
        cache, held = caches[name]
        if cache.get_seq_length() != held:  # each round must decode exactly one new token per step
            raise RuntimeError(f"{name}: the cache holds {cache.get_seq_length()} tokens, expected {held}")
        res[name]["tokens_cached"] = held
        ms = statistics.median(steps[name])
        res[name].update(
            {"ms_per_step": ms, "ms_per_step_rounds": steps[name], "tok_per_s": 1e3 * batch / ms}
        )
    md = [f"batch {batch}, context {context}: {args.repeats} rounds of {args.new} decode steps per cache "
          "(order alternating), eager model.generate; median ms per step", "",
          "| cache | decode tok/s | ms / step (median) | rounds (ms / step) | KV memory (GB, allocated) |",
          "|---|---|---|---|---|"]  # fmt: skip
    for n in names:
        r = res[n]
        rounds = ", ".join(f"{v:.1f}" for v in r["ms_per_step_rounds"])
        md.append(
            f"| {n} | {r['tok_per_s']:.0f} | {r['ms_per_step']:.1f} | {rounds} | {r['kv_bytes_allocated'] / 1e9:.2f} |"
        )
    if "bf16" in res and "oscar" in res:
        ratio = res["bf16"]["ms_per_step"] / res["oscar"]["ms_per_step"]
        line = f"speedup {ratio:.2f}x (ratio of the medians)"
        if res["bf16"]["kv_bytes_allocated"]:
            mem = res["oscar"]["kv_bytes_allocated"] / res["bf16"]["kv_bytes_allocated"]
            line += f"; KV memory ratio {mem:.3f} (1/{1 / mem:.1f})"
        md += ["", line + f"; OscarCache memory_report: {res['oscar']['total_bytes'] / 1e9:.2f} GB, "
               f"{res['oscar']['bits_per_element']:.2f} bits/element"]  # fmt: skip
    return res, md


def headline(payload: dict) -> list[tuple[str, str, float]]:
    """The figures for the CSV history, per ``BATCHxCONTEXT``: each cache's median ms per step,
    decode tok/s and KV bytes, and the BF16 / OscarCache ratio of the medians."""
    out = []
    for shape, res in payload["results"].items():
        for name, r in res.items():
            out += [(shape, f"{name}_ms_per_step", r["ms_per_step"]), (shape, f"{name}_tok_per_s", r["tok_per_s"]),
                    (shape, f"{name}_kv_bytes", r["kv_bytes_allocated"])]  # fmt: skip
        if "bf16" in res and "oscar" in res:
            out.append((shape, "speedup", res["bf16"]["ms_per_step"] / res["oscar"]["ms_per_step"]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16x32768", help="comma list of BATCHxCONTEXT")
    ap.add_argument("--caches", default="bf16,oscar", help="comma list of bf16, oscar")
    ap.add_argument("--new", type=int, default=32, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per cache, order alternating")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--name", default="e2e_decode", help="results file name")
    ap.add_argument("--device", default="cuda", help="cuda; cpu with --tiny for a smoke run")
    ap.add_argument(
        "--tiny", action="store_true", help="a 2-layer model instead of Qwen3-8B's config (smoke run)"
    )
    ap.add_argument(
        "--arch", help="a bench_engine.py shape (e.g. qwen3-30b-a3b) instead of Qwen3-8B's config"
    )
    ap.add_argument(
        "--layers", type=int, help="with --arch: this many layers (a shape too big for the GPU in bf16)"
    )
    args = ap.parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    if args.arch:
        from bench_engine import SHAPES

        # bf16 weights: transformers builds random FP8 weights only by loading a checkpoint
        drop = ("architectures", "model_type", "quantization_config")
        spec = {k: v for k, v in SHAPES[args.arch].items() if k not in drop}
        if args.layers:
            spec["num_hidden_layers"] = args.layers
        cfg = AutoConfig.for_model(SHAPES[args.arch]["model_type"], **spec)
    else:
        cfg = Qwen3Config(**(TINY if args.tiny else QWEN3_8B))
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    # the same RotationSet shape OSCAR uses (per-layer Hadamard here: speed does not depend on U)
    rot = fixed_layer("hadamard", cfg.head_dim, cfg.num_key_value_heads, "layer")
    rots = RotationSet({i: rot for i in range(cfg.num_hidden_layers)})
    label = "tiny 2-layer model" if args.tiny else f"random-weight {args.arch or 'Qwen3-8B'} config"
    if args.arch and args.layers:
        label += f" with {args.layers} layers"
    results, md = {}, [f"End-to-end decode, {label} (bf16), eager model.generate", ""]
    for shape in args.shapes.split(","):
        batch, context = (int(v) for v in shape.split("x"))
        res, lines = run_shape(model, cfg, rots, batch, context, args)
        results[shape] = res
        md += [f"## {shape}", "", *lines, ""]
    print("\n".join(md))
    payload = {"args": vars(args), "results": results}
    save(args.name, payload, "\n".join(md), history=headline(payload))


if __name__ == "__main__":
    main()
