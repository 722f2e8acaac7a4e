"""The memory roofline of an engine's decode step (bench_engine.py): the bytes one step must move,
over the device's copy bandwidth.

A decode step of ``B`` requests reads every weight once (all linear weights and norms and the LM
head; of the embedding only the ``B`` rows looked up, unless the LM head is tied to it, when the
table counts once, as the head) and every stored KV byte of the requests it decodes: INT2 rows at
``plan.q_page_bytes / page_tokens`` bytes each and 16-bit rows (sink, ring, or every row in bf16
mode) at ``plan.hp_page_bytes / page_tokens`` (both cover all layers, K and V). Of a
mixture-of-experts layer's routed experts it reads only the distinct experts its ``B`` tokens
choose: ``E·(1 − (1 − k/E)^B)`` of ``E`` in expectation when each token picks ``k`` uniformly
(random-weight routers route close to uniformly). Its roofline
time is those bytes over the bandwidth of a device-to-device copy (read + write bytes over time,
``_harness.copy_bandwidth``) measured in the same run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ROWS", "Roofline", "StepBytes", "cell", "med", "step_figures"]


def med(xs: Iterable[float | None]) -> float:
    """Median of the values that are not None (NaN if none)."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else float("nan")


@dataclass(frozen=True)
class StepBytes:
    """What one decode step reads: ``batch`` requests holding ``kv`` KV bytes."""

    batch: int
    kv: int


@dataclass(frozen=True)
class Roofline:
    """Bytes per decode step of one engine, and the copy bandwidth (bytes/s) they are timed at."""

    weights: int  # read once per step whatever the batch (the tied table counts here)
    embed_row: int  # bytes of one embedding row (0 when the LM head is tied to the table)
    q_tok: float  # bytes of one INT2 token (all layers, K and V)
    hp_tok: float  # bytes of one 16-bit token (all layers, K and V)
    int2: bool  # the pools' mode: int2 (sink + INT2 + ring) or bf16 (every token 16-bit)
    bandwidth: float  # bytes/s, read + write of a device copy
    expert_bytes: int = 0  # one routed expert's weights, summed over the MoE layers
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    top_k: int = 0

    def experts_touched(self, batch: int) -> float:
        """Expected distinct experts of one MoE layer that ``batch`` tokens choose."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.top_k / self.experts) ** batch)

    @classmethod
    def of(cls, eng: Any, bandwidth: float) -> Roofline:
        """From a running ``Engine``: its model's parameters and its pool plan."""
        model, plan = eng.runner.model, eng.runner.plan
        emb = model.embed_tokens.weight
        head = getattr(model, "lm_head", None)
        tied = head is None or head.weight is emb
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # shared ones once
        row = emb[0].numel() * emb.element_size()
        ps = plan.page_tokens
        from oscarkv.engine.models.moe import Experts

        experts = [m for m in model.modules() if isinstance(m, Experts)]
        routed = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
        n_exp = experts[0].w13.lead[0] if experts else 0
        return cls(
            weights=(nbytes if tied else nbytes - emb.numel() * emb.element_size()) - routed,
            embed_row=0 if tied else row,
            q_tok=plan.q_page_bytes / ps,
            hp_tok=plan.hp_page_bytes / ps,
            int2=plan.int2,
            bandwidth=bandwidth,
            expert_bytes=routed // n_exp if n_exp else 0,
            experts=n_exp,
            top_k=eng.runner.shape.experts_per_token if experts else 0,
        )

    def snapshot(self, running: Sequence[Any]) -> StepBytes:
        """The KV bytes of the running sequences that decode (all but the last token stored;
        prompts still being prefilled are left out), from their tier counts."""
        b, kv = 0, 0.0
        for s in running:
            if s.n_computed < s.num_tokens - 1:
                continue
            b += 1
            st = s.tiers
            kv += (
                st.n_q * self.q_tok + (st.n_sink + st.n_recent) * self.hp_tok
                if self.int2
                else s.n_computed * self.hp_tok
            )
        return StepBytes(b, round(kv))

    def step_bytes(self, s: StepBytes) -> int:
        moe = round(self.experts_touched(s.batch) * self.expert_bytes)
        return self.weights + s.batch * self.embed_row + s.kv + moe

    def step_s(self, s: StepBytes) -> float:
        """Roofline time of one decode step: its bytes over the copy bandwidth."""
        return self.step_bytes(s) / self.bandwidth


def step_figures(
    rf: Roofline, snaps: Sequence[StepBytes], step_ms: float, timings: Iterable[Any]
) -> dict[str, Any]:
    """The roofline columns of one side: medians over its decode steps. ``snaps``: the bytes of
    each decode step; ``step_ms``: the measured (wall) step time; ``timings``: the engine's
    ``StepTiming`` records (only the decode ones are used; ``gpu_s``/``gap_s`` are None off CUDA)."""
    dec = [t for t in timings if t.kind == "decode"]
    roof_ms = med(1e3 * rf.step_s(s) for s in snaps)
    batch = med(s.batch for s in snaps) if snaps else 0
    return {
        "copy_GBps": rf.bandwidth / 1e9,
        "batch_p50": batch,
        "weight_bytes": rf.weights + round(batch * rf.embed_row),
        "kv_bytes": med(s.kv for s in snaps),
        "step_bytes": med(rf.step_bytes(s) for s in snaps),
        "roofline_ms": roof_ms,
        "step_ms": step_ms,
        "gpu_ms": med(None if t.gpu_s is None else 1e3 * t.gpu_s for t in dec),
        "host_ms": med(1e3 * t.host_s for t in dec),
        "wait_ms": med(1e3 * t.wait_s for t in dec),
        "gap_ms": med(None if t.gap_s is None else 1e3 * t.gap_s for t in dec),
        "timed_steps": len(dec),
        "roofline_frac": roof_ms / step_ms if step_ms > 0 else float("nan"),  # NaN > 0 is False
    }


# table rows shared by both modes: (label, key or keys, format: see ``cell``)
ROWS: tuple[tuple[str, Any, str], ...] = (
    ("copy bandwidth GB/s (read+write)", "copy_GBps", "{:.0f}"),
    ("bytes per decode step MB: weights / KV", ("weight_bytes", "kv_bytes"), "mb"),
    ("roofline step ms", "roofline_ms", "{:.3f}"),
    ("step ms: wall / GPU", ("step_ms", "gpu_ms"), "{:.3f}"),
    ("host ms per step: all / critical path (gap)", ("host_ms", "gap_ms"), "{:.3f}"),
    ("% of roofline (roofline ÷ wall)", "roofline_frac", "pct"),
)


def cell(value: Any, fmt: str) -> str:
    """One table cell in ``fmt`` (a format string, or "mb"/"gib": bytes in MB/GiB, "pct": a
    fraction in %); "-" for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "mb":
        return f"{value / 1e6:.1f}"
    if fmt == "gib":
        return f"{value / 2**30:.2f}"
    if fmt == "pct":
        return f"{100 * value:.0f}%"
    return fmt.format(value)
