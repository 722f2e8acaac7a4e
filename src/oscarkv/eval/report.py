"""Evaluation outputs: ``results.json``, a markdown summary table and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..utils.files import atomic_save, atomic_write_text
from .methods import INT2_METHODS
from .tasks.agreement import agreement_markdown, agreement_summary

__all__ = [
    "REPORT_FILES",
    "log_ppl_difference",
    "paired_difference",
    "summary",
    "summary_markdown",
    "write_report",
]

#: every file `write_report` may write (an output directory holding one is an earlier run's)
REPORT_FILES = ("results.json", "results.md", "passkey_heatmap.png", "niah_heatmap.png", "layer_errors.png")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of ``a − b`` over the same units (prompts, sequences) and its standard error, the
    sample standard deviation of the differences over sqrt(n) (paired: prompts both methods get
    right or both get wrong add no noise). With one unit the standard error is undefined: NaN."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need equal, non-empty lists; got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b, strict=True)]
    m = sum(d) / len(d)
    if len(d) == 1:
        return m, math.nan
    var = sum((x - m) ** 2 for x in d) / (len(d) - 1)
    return m, (var / len(d)) ** 0.5


def _pair(d: tuple[float, float]) -> tuple[float, float | None]:
    """A paired difference for results.json: an undefined standard error (one unit) as null."""
    return d[0], None if math.isnan(d[1]) else d[1]


def log_ppl_difference(
    nll_a: list[float], tokens_a: list[int], nll_b: list[float], tokens_b: list[int]
) -> tuple[float, float]:
    """Paired difference in log-perplexity of method a minus method b on the same sequences: the
    mean over sequences of ``nll_a[i] / tokens[i] − nll_b[i] / tokens[i]`` (per-sequence mean NLL,
    nats per token) and its standard error over sequences. With equal token counts per sequence
    the mean is exactly ``log(ppl_a / ppl_b)``."""
    if list(tokens_a) != list(tokens_b):
        raise ValueError("paired perplexity needs the same sequences (per-sequence token counts differ)")
    if any(n <= 0 for n in tokens_a):
        raise ValueError(
            "paired perplexity: every sequence needs at least one scored token (context shorter than "
            "the sequence length)"
        )
    return paired_difference(
        [x / n for x, n in zip(nll_a, tokens_a, strict=True)],
        [x / n for x, n in zip(nll_b, tokens_b, strict=True)],
    )


def _ppl_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> tuple[float, float] | None:
    if not a or not b or "seq_nll" not in a or "seq_nll" not in b:
        return None
    return log_ppl_difference(a["seq_nll"], a["seq_tokens"], b["seq_nll"], b["seq_tokens"])


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: BPE, perplexity (and ratio to BF16, with the paired per-sequence
    log-perplexity difference to BF16 and its standard error), needle accuracies (with the paired
    passkey difference to BF16 and its standard error), mean errors. The other INT2 methods'
    rows also hold OSCAR's paired differences to them (``oscar_*_vs_this``, OSCAR minus this)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ppl_rows = {r["method"]: r for r in rows if r["task"] == "ppl"}
    ppl = {m: r["value"] for m, r in ppl_rows.items()}
    hits_by = {
        task: {
            r["method"]: r["hits"]
            for r in rows
            if r["task"] == task and r["metric"] == "accuracy_at_context" and r.get("hits")
        }
        for task in ("passkey", "chat-retrieval")
    }
    hits = hits_by["passkey"]
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
            d = _ppl_diff(ppl_rows[m], ppl_rows.get("bf16")) if m != "bf16" else None
            if d:
                s["ppl_dlog_vs_bf16"], s["ppl_dlog_vs_bf16_se"] = _pair(d)
        for task in ("passkey", "niah"):
            grid = [r for r in mine if r["task"] == task and r["metric"] == "accuracy"]
            if grid:
                s[f"{task}_grid"] = _mean([r["value"] for r in grid])
            at = [r for r in mine if r["task"] == task and r["metric"] == "accuracy_at_context"]
            if at:
                s[f"{task}_at_context"] = at[0]["value"]
                s[f"{task}_n"] = at[0]["n"]
                _vs_bf16(s, "passkey", m, hits)
        at = [r for r in mine if r["task"] == "chat-retrieval"]
        if at:
            s["retrieval_at_context"], s["retrieval_n"] = at[0]["value"], at[0]["n"]
            _vs_bf16(s, "retrieval", m, hits_by["chat-retrieval"])
        s.update(agreement_summary(rows, m))
        for metric in ("attn_kl", "attn_out_err", "hidden_err"):
            vals = [r["value"] for r in mine if r["task"] == "attn-error" and r["metric"] == metric]
            if vals:
                s[metric] = _mean(vals)
        if m != "oscar" and m in INT2_METHODS:
            d = _ppl_diff(ppl_rows.get("oscar"), ppl_rows.get(m))
            if d:
                s["oscar_ppl_dlog_vs_this"], s["oscar_ppl_dlog_vs_this_se"] = _pair(d)
            if "oscar" in hits and m in hits:
                s["oscar_passkey_vs_this"], s["oscar_passkey_vs_this_se"] = _pair(
                    paired_difference(hits["oscar"], hits[m])
                )
            ret = hits_by["chat-retrieval"]
            if "oscar" in ret and m in ret:
                s["oscar_retrieval_vs_this"], s["oscar_retrieval_vs_this_se"] = _pair(
                    paired_difference(ret["oscar"], ret[m])
                )
        out.append(s)
    return out


def _vs_bf16(s: dict[str, Any], key: str, method: str, hits: dict[str, list[int]]) -> None:
    """``s[key + "_vs_bf16"]`` (and ``_se``): the paired per-prompt hit difference to BF16."""
    if method != "bf16" and "bf16" in hits and method in hits:
        s[f"{key}_vs_bf16"], s[f"{key}_vs_bf16_se"] = _pair(paired_difference(hits[method], hits["bf16"]))


# a (value format, SE format) pair: a paired difference, with its standard error in key + "_se"
PAIRED = ("{:+.3f}", "{:.3f}")
PAIRED_LOG = ("{:+.4f}", "{:.4f}")

COLUMNS: list[tuple[str, str, str | tuple[str, str]]] = [
    ("method", "method", "{}"),
    ("bits_per_element", "bits/elem", "{:.2f}"),
    ("ppl", "ppl", "{:.3f}"),
    ("ppl_ratio", "ppl / BF16", "{:.4f}"),
    ("ppl_dlog_vs_bf16", "ppl Δlog vs BF16 (± SE)", PAIRED_LOG),
    ("passkey_at_context", "passkey @ctx", "{:.2f}"),
    ("passkey_vs_bf16", "Δ vs BF16 (± SE)", PAIRED),
    ("passkey_grid", "passkey grid", "{:.2f}"),
    ("niah_grid", "multi-needle grid", "{:.2f}"),
    ("retrieval_at_context", "chat retrieval @ctx", "{:.2f}"),
    ("retrieval_vs_bf16", "Δ vs BF16 (± SE)", PAIRED),
    ("exact_match", "chat agreement", "{:.2f}"),
    ("loop_rate", "loop rate", "{:.3f}"),
    ("attn_kl", "attn KL", "{:.2e}"),
    ("attn_out_err", "attn out err", "{:.2e}"),
    ("hidden_err", "hidden err", "{:.2e}"),
]


def _cell(s: dict[str, Any], col: tuple[str, str, str | tuple[str, str]]) -> str:
    key, _, fmt = col
    if key not in s:
        return "-"
    if isinstance(fmt, tuple):  # a paired difference with its standard error (None: one unit)
        se = s.get(key + "_se")
        return f"{fmt[0].format(s[key])} ± {'n/a' if se is None else fmt[1].format(se)}"
    return fmt.format(s[key])


def oscar_vs_baselines_markdown(summ: list[dict[str, Any]]) -> str:
    """The "OSCAR vs baselines" section: OSCAR minus each other INT2 method, paired (empty if
    there is nothing to compare)."""
    cols = [
        ("method", "baseline", "{}"),
        ("oscar_ppl_dlog_vs_this", "ppl Δlog, OSCAR − baseline (± SE)", PAIRED_LOG),
        ("oscar_passkey_vs_this", "passkey Δ, OSCAR − baseline (± SE)", PAIRED),
        ("oscar_retrieval_vs_this", "chat retrieval Δ, OSCAR − baseline (± SE)", PAIRED),
    ]
    base = [s for s in summ if any(c[0] in s for c in cols[1:])]
    if not base:
        return ""
    lines = ["## OSCAR vs baselines (paired, per sequence)", ""]
    lines += ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(s, c) for c in cols) + " |" for s in base]
    lines += [
        "",
        "_ppl Δlog: mean over the perplexity sequences of the per-sequence difference in mean NLL "
        "(nats/token; negative = OSCAR better); passkey and chat retrieval Δ: mean over the same "
        "prompts of the per-prompt hit difference (positive = OSCAR better); ± one standard error of the mean "
        "paired difference (sequences / prompts are the unit)._",
    ]
    return "\n".join(lines)


def summary_markdown(rows: list[dict[str, Any]], settings: dict[str, Any] | None = None) -> str:
    summ = summary(rows)
    cols = [c for c in COLUMNS if any(c[0] in s for s in summ)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for s in summ:
        lines.append("| " + " | ".join(_cell(s, c) for c in cols) + " |")
    if settings:
        n = next((s.get("passkey_n") for s in summ if s.get("passkey_n")), None)
        notes = f"context {settings.get('context')} tokens"
        n_seq = next((len(r["seq_nll"]) for r in rows if r["task"] == "ppl" and "seq_nll" in r), None)
        if n_seq:
            notes += (
                f"; ppl over {n_seq} sequences (Δlog: mean per-sequence difference in mean NLL, "
                "nats/token, ± SE over sequences)"
            )
        if n:
            notes += f"; passkey @ctx over n = {n} prompts (Δ: paired difference on the same prompts)"
        rn = next((s.get("retrieval_n") for s in summ if s.get("retrieval_n")), None)
        if rn:
            notes += f"; chat retrieval over n = {rn} prompts (Δ: paired difference on the same prompts)"
        lines.append("")
        lines.append(f"_{notes}; attn/hidden errors are means over layers (relative; KL in nats)._")
    for section in (agreement_markdown(summ), oscar_vs_baselines_markdown(summ)):
        if section:
            lines += ["", section]
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
    atomic_save(path, lambda name: fig.savefig(name, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return True


def high_key_layers(rots: Any) -> dict[int, int]:
    """Layers of a rotation set that store keys wider than its spec's, and their key bits."""
    base = rots.spec.key_bits
    return {
        i: lr.key_bits for i, lr in rots.layers.items() if lr.key_bits is not None and lr.key_bits != base
    }


def _plot_layers(rows: list[dict[str, Any]], path: Path, wide_keys: dict[int, int] | None = None) -> bool:
    """Per-layer errors of every method; ``wide_keys`` (layer -> key bits): the layers where the
    ``oscar`` rotations keep wider keys, shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("attn_kl", "attention KL"), ("attn_out_err", "attention-output rel. error"),
               ("hidden_err", "hidden-state rel. error")]  # fmt: skip
    data = [r for r in rows if r["task"] == "attn-error" and r["method"] != "bf16"]
    if not data:
        return False
    from matplotlib.ticker import LogFormatter, MaxNLocator

    bits = {r["method"]: r["bits_per_element"] for r in data if r.get("bits_per_element") is not None}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
    for ax, (metric, title) in zip(axes, metrics, strict=True):
        for m in dict.fromkeys(r["method"] for r in data):
            pts = sorted((r["layer"], r["value"]) for r in data if r["method"] == m and r["metric"] == metric)
            label = f"{m} ({bits[m]:.2f} bits/element)" if m in bits else m
            if pts:
                ax.plot([p[0] for p in pts], [max(p[1], 1e-12) for p in pts], marker="o", ms=3, label=label)
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=True))  # decades labelled, no 6x10^-1
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("KL (nats)" if metric == "attn_kl" else "relative error")
        ax.set_title(title, fontsize=10)
        for n, (layer, kb) in enumerate(sorted((wide_keys or {}).items())):
            label = f"oscar: {kb}-bit keys" if n == 0 else None
            ax.axvspan(layer - 0.4, layer + 0.4, color="tab:orange", alpha=0.15, lw=0, label=label)
    axes[0].legend(fontsize=7)
    atomic_save(path, lambda name: fig.savefig(name, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return True


def write_report(out: str | Path, rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[Path]:
    """Write ``results.json``, ``results.md`` and the plots into ``out``; returns the files written.

    Each file is written atomically, the JSON first: a plot that fails leaves the numbers saved.
    """
    out = Path(out)
    files = [out / "results.json", out / "results.md"]
    doc = {"settings": settings, "summary": summary(rows), "rows": rows}
    atomic_write_text(files[0], json.dumps(doc, indent=1))
    atomic_write_text(files[1], summary_markdown(rows, settings) + "\n")
    for task in ("passkey", "niah"):
        if _plot_needles(rows, task, out / f"{task}_heatmap.png"):
            files.append(out / f"{task}_heatmap.png")
    wide = {int(k): int(v) for k, v in (settings.get("wide_key_layers") or {}).items()}
    if _plot_layers(rows, out / "layer_errors.png", wide):
        files.append(out / "layer_errors.png")
    return files
