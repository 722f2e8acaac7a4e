"""The demo's two plots: KV memory per request against context, and quality against bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..utils.files import atomic_save

__all__ = ["plot_memory", "plot_quality"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory(
    lengths: list[int], mib: dict[str, list[float]], budget_mib: float, path: Path, context: int
) -> Path:
    """KV MiB of one request at each context length, one line per engine, the budget and the
    demo's ``context`` marked (longer contexts show the storage format, past what the model saw)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, ys in mib.items():
        ax.plot(lengths, ys, marker="o", ms=3, label=name)
    ax.axhline(budget_mib, color="grey", ls="--", lw=1, label=f"the KV budget ({budget_mib:.0f} MiB)")
    ax.axvline(context, color="grey", ls=":", lw=1,
               label=f"the demo's context ({context}); past it: the storage format alone")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV cache of one request (MiB)")
    ax.set_title("KV memory per request, bundled demo model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    atomic_save(path, lambda name: fig.savefig(name, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path


def plot_quality(points: dict[str, tuple[float, float]], context: int, path: Path) -> Path:
    """Each method's perplexity ratio to BF16 (y) at its bits per element (x)."""
    plt = _pyplot()
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, (bits, ratio) in points.items():
        ax.scatter([bits], [ratio], s=36)
        ax.annotate(name, (bits, ratio), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel(f"bits per K/V element at {context} tokens (16-bit windows counted)")
    ax.set_ylabel("perplexity / BF16 perplexity (lower is better)")
    ax.set_title("Quality against storage, bundled demo model")
    ax.grid(alpha=0.3, which="both")
    atomic_save(path, lambda name: fig.savefig(name, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path
