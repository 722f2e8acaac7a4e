"""The demo's serving comparison, its tables (rich: they fit the terminal) and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from .plots import plot_memory, plot_quality
from .serving import serve_side

__all__ = ["compare_serving", "demo_plots", "example_table", "quality_table", "serving_table"]

MIB = 1 << 20


def _per_token(model_dir: str) -> int:
    """Bytes of one token's 16-bit K and V over all layers (bf16)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * d * 2


def compare_serving(
    model_dir: str, rot_dir: str, prompts: list[list[int]], rots: Any, context: int, gen: int, bf16_held: int
) -> dict[str, Any]:
    """BF16 and INT2 engines at the budget where BF16 holds ``bf16_held`` requests of
    ``context`` tokens; both run ``prompts`` greedily (``gen`` tokens each). A JSON-ready record."""
    page = 16 * _per_token(model_dir)  # the engine's default page_tokens
    budget = bf16_held * -(-context // 16) * page + page  # + the dummy page
    gb = budget / (1 << 30)
    bf16 = serve_side(model_dir, "bf16", None, gb, context, prompts, gen)
    int2 = serve_side(model_dir, "int2", rot_dir, gb, context, prompts, gen)
    same = [a == b for a, b in zip(bf16.tokens, int2.tokens, strict=True)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
             for a, b in zip(bf16.tokens, int2.tokens, strict=True)]  # fmt: skip
    lengths = [256 << i for i in range(8)]  # 256 .. 32K: the storage format, past the demo's 1K
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    i = min(range(len(first)), key=lambda j: (first[j] == gen, first[j]))  # an example that differs, if any
    return {
        "context": context, "budget_mib": budget / MIB, "prompts": len(prompts), "generated": gen,
        "held": {"bf16": bf16.held, "int2": int2.held},
        "request_mib": {"bf16": bf16.plan.request_bytes(context) / MIB, "int2": int2.plan.request_bytes(context) / MIB},
        "bits_per_element": {"bf16": 16.0, "int2": rots.bits_per_element(context)},
        "greedy_identical": sum(same), "greedy_equal_prefix": sum(first) / len(first),
        "example": {"prompt_tail": tok.decode(prompts[i][-48:]), "same_tokens": first[i],
                    "bf16": tok.decode(bf16.tokens[i]), "int2": tok.decode(int2.tokens[i])},
        "tok_s": {"bf16": bf16.tok_s, "int2": int2.tok_s},
        "request_mib_by_length": {"lengths": lengths, "bf16": [bf16.plan.request_bytes(n) / MIB for n in lengths],
                                  "int2": [int2.plan.request_bytes(n) / MIB for n in lengths]},
    }  # fmt: skip


def quality_table(summ: dict[str, dict[str, Any]], context: int) -> Table:
    t = Table(title=f"Quality on held-out text at {context} tokens", title_justify="left")
    t.add_column("method")
    t.add_column("bits / element", justify="right")
    t.add_column("perplexity / BF16", justify="right")
    for m, s in summ.items():
        ratio = s.get("ppl_ratio")
        t.add_row(m, f"{s['bits_per_element']:.2f}", "-" if ratio is None else f"{ratio:.4f}")
    return t


def serving_table(r: dict[str, Any]) -> Table:
    held, mib, bits, tps = r["held"], r["request_mib"], r["bits_per_element"], r["tok_s"]
    t = Table(title=f"The engine at one KV budget ({r['budget_mib']:.1f} MiB), {r['prompts']} prompts of "
              f"{r['context'] - r['generated']} + {r['generated']} tokens", title_justify="left")  # fmt: skip
    for col, just in (("", "left"), ("BF16", "right"), ("INT2", "right"), ("INT2 / BF16", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    t.add_row(
        "requests held at once", str(held["bf16"]), str(held["int2"]), f"{held['int2'] / held['bf16']:.1f}x"
    )
    t.add_row(f"KV MiB per {r['context']}-token request", f"{mib['bf16']:.2f}", f"{mib['int2']:.2f}",
              f"{mib['int2'] / mib['bf16']:.2f}")  # fmt: skip
    t.add_row("bits per K/V element", f"{bits['bf16']:.1f}", f"{bits['int2']:.2f}", "")
    t.add_row("greedy continuations identical", "", f"{r['greedy_identical']} / {r['prompts']}",
              f"equal for {r['greedy_equal_prefix']:.1f} of {r['generated']} tokens on average")  # fmt: skip
    t.add_row(
        "tokens/s on this CPU",
        f"{tps['bf16']:.0f}",
        f"{tps['int2']:.0f}",
        f"{tps['int2'] / tps['bf16']:.2f}x",
    )
    return t


def example_table(r: dict[str, Any]) -> Table:
    """One prompt's greedy continuation from each engine, side by side (the first whose tokens differ)."""
    ex = r["example"]
    t = Table(title=f"One prompt's continuation ({r['generated']} greedy tokens; the first "
              f"{ex['same_tokens']} equal)", title_justify="left")  # fmt: skip
    t.add_column("prompt ends with", overflow="fold", ratio=1)
    t.add_column("BF16", overflow="fold", ratio=1)
    t.add_column("INT2", overflow="fold", ratio=1)
    t.add_row(*(ex[k].replace("\n", "⏎") for k in ("prompt_tail", "bf16", "int2")))
    return t


def demo_plots(out: Path, summ: dict[str, dict[str, Any]], r: dict[str, Any], rots: Any) -> list[Path]:
    """``memory.png`` (KV MiB per request against context, the budget marked) and
    ``quality.png`` (perplexity ratio against bits per element)."""
    by = r["request_mib_by_length"]
    ctx = r["context"]
    mib = {
        "BF16": by["bf16"],
        f"INT2: {rots.bits_per_element(None):.2f} bits/element past the 16-bit windows "
        f"({rots.bits_per_element(ctx):.2f} at {ctx} with them)": by["int2"],
    }
    points = {m: (s["bits_per_element"], s["ppl_ratio"]) for m, s in summ.items() if s.get("ppl_ratio")}
    return [
        plot_memory(by["lengths"], mib, r["budget_mib"], out / "memory.png", ctx),
        plot_quality(points, r["context"], out / "quality.png"),
    ]
