"""Evaluation outputs: ``results.json``, a markdown summary table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["paired_difference", "summary", "summary_markdown", "write_report"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def paired_difference(a: list[int], b: list[int]) -> tuple[float, float]:
    """Mean of ``a − b`` over the same prompts and its standard error (paired: prompts both
    methods get right or both get wrong add no noise)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired hits need equal, non-empty lists; got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b, strict=True)]
    m = sum(d) / len(d)
    var = sum((x - m) ** 2 for x in d) / max(len(d) - 1, 1)
    return m, (var / len(d)) ** 0.5


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: BPE, perplexity (and ratio to BF16), needle accuracies (with the paired
    passkey difference to BF16 and its standard error), mean errors."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ppl = {r["method"]: r["value"] for r in rows if r["task"] == "ppl"}
    ref_hits = next(
        (r.get("hits") for r in rows if r["method"] == "bf16" and r["metric"] == "accuracy_at_context"
         and r["task"] == "passkey"),
        None,
    )  # fmt: skip
    out = []
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        s: dict[str, Any] = {"method": m}
        # the cost at the longest context evaluated (the ppl / passkey-at-context rows)
        longest = max(mine, key=lambda r: r.get("context_len", 0))
        s["bits_per_element"] = longest["bits_per_element"]
        if m in ppl:
            s["ppl"] = ppl[m]
            if "bf16" in ppl:
                s["ppl_ratio"] = ppl[m] / ppl["bf16"]
        for task in ("passkey", "niah"):
            grid = [r for r in mine if r["task"] == task and r["metric"] == "accuracy"]
            if grid:
                s[f"{task}_grid"] = _mean([r["value"] for r in grid])
            at = [r for r in mine if r["task"] == task and r["metric"] == "accuracy_at_context"]
            if at:
                s[f"{task}_at_context"] = at[0]["value"]
                s[f"{task}_n"] = at[0]["n"]
                if task == "passkey" and ref_hits and at[0].get("hits") and m != "bf16":
                    s["passkey_vs_bf16"], s["passkey_vs_bf16_se"] = paired_difference(at[0]["hits"], ref_hits)
        for metric in ("attn_kl", "attn_out_err", "hidden_err"):
            vals = [r["value"] for r in mine if r["task"] == "attn-error" and r["metric"] == metric]
            if vals:
                s[metric] = _mean(vals)
        out.append(s)
    return out


COLUMNS = [
    ("method", "method", "{}"),
    ("bits_per_element", "bits/elem", "{:.2f}"),
    ("ppl", "ppl", "{:.3f}"),
    ("ppl_ratio", "ppl / BF16", "{:.4f}"),
    ("passkey_at_context", "passkey @ctx", "{:.2f}"),
    ("passkey_vs_bf16", "Δ vs BF16 (± SE)", None),
    ("passkey_grid", "passkey grid", "{:.2f}"),
    ("niah_grid", "multi-needle grid", "{:.2f}"),
    ("attn_kl", "attn KL", "{:.2e}"),
    ("attn_out_err", "attn out err", "{:.2e}"),
    ("hidden_err", "hidden err", "{:.2e}"),
]


def _cell(s: dict[str, Any], col: tuple[str, str, str | None]) -> str:
    key, _, fmt = col
    if key not in s:
        return "-"
    if fmt is None:  # a paired difference with its standard error
        return f"{s[key]:+.3f} ± {s[key + '_se']:.3f}"
    return fmt.format(s[key])


def summary_markdown(rows: list[dict[str, Any]], settings: dict[str, Any] | None = None) -> str:
    summ = summary(rows)
    cols = [c for c in COLUMNS if any(c[0] in s for s in summ)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for s in summ:
        lines.append("| " + " | ".join(_cell(s, c) for c in cols) + " |")
    if settings:
        n = next((s.get("passkey_n") for s in summ if s.get("passkey_n")), None)
        notes = f"context {settings.get('context')} tokens"
        if n:
            notes += f"; passkey @ctx over n = {n} prompts (Δ: paired difference on the same prompts)"
        lines.append("")
        lines.append(f"_{notes}; attn/hidden errors are means over layers (relative; KL in nats)._")
    return "\n".join(lines)


def _plot_needles(rows: list[dict[str, Any]], task: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [r for r in rows if r["task"] == task and r["metric"] == "accuracy"]
    if not cells:
        return False
    methods = list(dict.fromkeys(r["method"] for r in cells))
    lengths = sorted({r["context_len"] for r in cells})
    depths = sorted({r["depth"] for r in cells})
    fig, axes = plt.subplots(1, len(methods), figsize=(2.2 * len(methods) + 1, 2.8), squeeze=False)
    for ax, m in zip(axes[0], methods, strict=True):
        grid = [
            [
                next(
                    (
                        r["value"]
                        for r in cells
                        if r["method"] == m and r["context_len"] == n and r["depth"] == dp
                    ),
                    float("nan"),
                )
                for n in lengths
            ]
            for dp in depths
        ]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_title(m, fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_xlabel("context", fontsize=8)
    axes[0][0].set_ylabel("needle depth", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(f"{task} retrieval accuracy", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def _plot_layers(rows: list[dict[str, Any]], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("attn_kl", "attention KL"), ("attn_out_err", "attention-output rel. error"),
               ("hidden_err", "hidden-state rel. error")]  # fmt: skip
    data = [r for r in rows if r["task"] == "attn-error" and r["method"] != "bf16"]
    if not data:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (metric, title) in zip(axes, metrics, strict=True):
        for m in dict.fromkeys(r["method"] for r in data):
            pts = sorted((r["layer"], r["value"]) for r in data if r["method"] == m and r["metric"] == metric)
            if pts:
                ax.plot([p[0] for p in pts], [max(p[1], 1e-12) for p in pts], marker="o", ms=3, label=m)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def write_report(out: str | Path, rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[Path]:
    """Write ``results.json``, ``results.md`` and the plots into ``out``; returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "results.md"]
    files[0].write_text(json.dumps({"settings": settings, "summary": summary(rows), "rows": rows}, indent=1))
    files[1].write_text(summary_markdown(rows, settings) + "\n")
    for task in ("passkey", "niah"):
        if _plot_needles(rows, task, out / f"{task}_heatmap.png"):
            files.append(out / f"{task}_heatmap.png")
    if _plot_layers(rows, out / "layer_errors.png"):
        files.append(out / "layer_errors.png")
    return files
