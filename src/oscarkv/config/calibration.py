"""`CalibrationConfig`: how `oscarkv calibrate` turns a model and text into rotations."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import check_positions, field_error, help_field, is_int, is_num

__all__ = [
    "CAL_GRANULARITIES",
    "CAL_METHODS",
    "CLIP_GRID_K",
    "CLIP_GRID_V",
    "CLIP_OBJECTIVES",
    "DATA_FREE_METHODS",
    "DEFAULT_MAX_PPL_INCREASE",
    "GRANULARITY_MARGIN",
    "OFFSETS",
    "V_TARGETS",
    "CalibrationConfig",
]

CAL_METHODS = ("oscar", "hadamard", "identity", "ktk_vtv")
#: methods whose rotations are not fitted from statistics (the same matrix for every KV head)
DATA_FREE_METHODS = ("hadamard", "identity")
CAL_GRANULARITIES = ("auto", "layer", "kv_head")
#: ``granularity="auto"`` keeps per-KV-head rotations only where their held-out NLL is lower than
#: the per-layer one by more than this many nats (1% perplexity, half the default target). On the
#: reference model the difference is noise: over five calibration seeds per KV head was lower by
#: 0.004, 0.001 and higher by 0.006, 0.007, 0.013 (docs/calibration.md), so a smaller margin would
#: pick the larger artifact by chance; OSCAR's gain on Qwen3-30B-A3B (+16.6% perplexity per
#: layer, +0.35% per KV head: 0.15 nats) is fifteen times the margin
GRANULARITY_MARGIN = 0.01
V_TARGETS = ("oscar", "softmax")
CLIP_OBJECTIVES = ("attn", "nll", "kl")
OFFSETS = ("auto", "kv", "k", "none")
CLIP_GRID_K = (0.0, 0.86, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98)
CLIP_GRID_V = (0.0, 0.82, 0.84, 0.86, 0.88, 0.9, 0.92, 0.94, 0.96)


class _DefaultTarget(float):
    """The default ``max_ppl_increase``: a float that remembers it was not given, so that a fixed
    ``bits_per_element`` turns it off while an explicit target with a budget is refused."""

    def __repr__(self) -> str:
        return float.__repr__(self)


#: the quality target of a calibration without bit flags: 2% held-out perplexity over BF16
DEFAULT_MAX_PPL_INCREASE = _DefaultTarget(0.02)


@dataclass(frozen=True)
class CalibrationConfig:
    """How `oscarkv calibrate` turns a model and some text into a RotationSet."""

    tokens: int = help_field("calibration tokens used for the statistics", default=20000)
    seq_len: int = help_field("tokens per calibration sequence", default=2048)
    granularity: str = help_field(
        "one rotation per layer, or per KV head: auto (per KV head where that lowers the held-out NLL of "
        f"the fake-quantized model by more than {GRANULARITY_MARGIN} nats, else per layer) | layer | kv_head",
        default="auto",
    )
    method: str = help_field("oscar | hadamard | identity | ktk_vtv (spec §6.7 ablations)", default="oscar")
    v_target: str = help_field(
        "value target: oscar (score-energy weights, OSCAR's code) | softmax (causal VᵀSᵀSV)",
        default="oscar",
    )
    # off by default: on the reference model it lowered attention-output error but raised the
    # continuation perplexity (1.0395 vs 1.0293 x BF16, docs/calibration.md)
    clip_search: bool = help_field(
        "search per-layer K/V clip ratios on held-out tokens (minimises attention-output error)",
        default=False,
    )
    clip_objective: str = help_field(
        "what --clip-search minimises: attn (per-layer windowed attention-output error) | nll "
        "(held-out next-token loss of the fake-quantized model, global K/V clips) | kl (its KL "
        "from the exact model)",
        default="attn",
    )
    clip_per_layer: bool = help_field(
        "with --clip-objective nll|kl: after the global clips, move each layer's K/V clip one grid "
        "step where that lowers the held-out loss",
        default=False,
    )
    rotation_select: bool = help_field(
        "keep the fitted rotation or Hadamard per layer (per KV head with kv_head granularity), "
        "K and V jointly, whichever has the lower held-out attention-output error",
        default=False,
    )
    holdout_tokens: int = help_field(
        "held-out tokens (beyond --tokens) for the clip search, the rotation selection and offsets auto",
        default=4096,
    )
    offsets: str = help_field(
        "static channel offsets (calibrated means, rotated basis) subtracted from every stored key "
        "and value, exact for attention: auto (kept per KV head where they lower the held-out "
        "attention error, if that lowers the held-out NLL) | kv | k | none (OSCAR as published)",
        default="auto",
    )
    bits_per_element: float | None = help_field(
        "a bit budget per cached K/V element at --budget-context tokens (windows and metadata "
        "counted): the layers whose held-out loss suffers most from low-bit keys store keys in "
        "--high-key-bits, as many as fit; default: the spec's widths in every layer",
        default=None,
    )
    max_ppl_increase: float | None = help_field(
        "a quality target instead of a bit budget: raise key widths layer by layer (the layers whose "
        "held-out loss suffers most from low-bit keys first) until the held-out perplexity of the "
        "fake-quantized model is within this fraction of the unquantized model's (0.02: two percent), at "
        "most --max-bits-per-element; --bits-per-element turns it off (giving both is refused); none: off",
        default=DEFAULT_MAX_PPL_INCREASE,
    )
    max_bits_per_element: float = help_field(
        "the ceiling of --max-ppl-increase, in bits per element at --budget-context", default=3.5
    )
    high_key_bits: int = help_field(
        "key bits of the layers raised by --bits-per-element or --max-ppl-increase: 3 or 4", default=4
    )
    budget_context: int = help_field("context length at which --bits-per-element is counted", default=131072)
    batch_size: int = help_field("sequences per forward pass", default=1)
    seed: int = help_field("seed for corpus sampling", default=0)

    def __post_init__(self) -> None:
        name = type(self).__name__
        for f in ("tokens", "seq_len", "batch_size"):
            v = getattr(self, f)
            if not is_int(v) or v < 1:
                raise field_error(name, f, "a positive integer", v, True)
        if not is_int(self.holdout_tokens) or self.holdout_tokens < 0:
            raise field_error(name, "holdout_tokens", "an integer >= 0", self.holdout_tokens, True)
        if not is_int(self.seed):
            raise field_error(name, "seed", "an integer", self.seed, True)
        for f in ("clip_search", "clip_per_layer", "rotation_select"):
            if not isinstance(getattr(self, f), bool):
                raise field_error(name, f, "True or False", getattr(self, f), True)
        for f, allowed in (("granularity", CAL_GRANULARITIES), ("method", CAL_METHODS),
                           ("v_target", V_TARGETS), ("clip_objective", CLIP_OBJECTIVES),
                           ("offsets", OFFSETS)):  # fmt: skip
            v = getattr(self, f)
            if not isinstance(v, str) or v not in allowed:
                raise field_error(name, f, " | ".join(allowed), v, True)
        if self.clip_search and self.holdout_tokens < 1:
            raise field_error(
                name, "holdout_tokens", "> 0 when clip_search is on (or pass --no-clip-search)", 0
            )
        if self.clip_per_layer and not (self.clip_search and self.clip_objective in ("nll", "kl")):
            raise field_error(
                name,
                "clip_per_layer",
                "used only with --clip-search --clip-objective nll|kl (drop --clip-per-layer, or add those)",
                self.clip_per_layer,
            )
        if self.offsets == "auto" and self.holdout_tokens < 1:
            raise field_error(
                name, "holdout_tokens", "> 0 when offsets is auto (or pass --offsets kv|k|none)", 0
            )
        bpe = self.bits_per_element
        if bpe is not None and (not is_num(bpe) or not math.isfinite(bpe) or bpe <= 0):
            raise field_error(name, "bits_per_element", "None or a positive number", bpe, True)
        target = self.max_ppl_increase
        if (
            bpe is not None and target is DEFAULT_MAX_PPL_INCREASE
        ):  # a fixed budget replaces the default target
            object.__setattr__(self, "max_ppl_increase", None)
            target = None
        if target is not None and (not is_num(target) or not math.isfinite(target) or target <= 0):
            raise field_error(
                name, "max_ppl_increase", "None or a positive fraction (0.02: 2%)", target, True
            )
        ceiling = self.max_bits_per_element
        if not is_num(ceiling) or not math.isfinite(ceiling) or ceiling <= 0:
            raise field_error(name, "max_bits_per_element", "a positive number", ceiling, True)
        if target is not None and bpe is not None:
            raise field_error(
                name,
                "max_ppl_increase",
                "None when bits_per_element is set (a quality target or a fixed budget, not both; "
                "pass one of --max-ppl-increase and --bits-per-element)",
                target,
            )
        if target is not None and self.holdout_tokens < 1:
            raise field_error(
                name,
                "holdout_tokens",
                "> 0 with a quality target (it is measured on them; --max-ppl-increase none turns it off)",
                0,
            )
        if not is_int(self.high_key_bits) or self.high_key_bits not in (3, 4):
            raise field_error(name, "high_key_bits", "3 or 4", self.high_key_bits, True)
        if not is_int(self.budget_context) or self.budget_context < 1:
            raise field_error(name, "budget_context", "a positive integer", self.budget_context, True)
        if bpe is not None and self.holdout_tokens < 1:
            raise field_error(
                name, "holdout_tokens", "> 0 when bits_per_element is set (the layers are ranked on them)", 0
            )
        if self.rotation_select and self.holdout_tokens < 1:
            raise field_error(
                name,
                "holdout_tokens",
                "> 0 when rotation_select is on (or pass --no-rotation-select)",
                self.holdout_tokens,
            )
        if self.compares_granularity and self.holdout_tokens < 1:
            raise field_error(
                name,
                "holdout_tokens",
                "> 0 when granularity is auto (the choice is measured on them; or pass --granularity "
                "layer|kv_head)",
                0,
            )

    @property
    def num_sequences(self) -> int:
        return -(-self.tokens // self.seq_len)

    @property
    def num_holdout_sequences(self) -> int:
        held = self.clip_search or self.rotation_select or self.offsets == "auto" or self.compares_granularity
        held = held or self.bits_per_element is not None or self.max_ppl_increase is not None
        return -(-self.holdout_tokens // self.seq_len) if held else 0

    @property
    def compares_granularity(self) -> bool:
        """Whether calibration picks the granularity by held-out NLL: ``auto`` with a method fitted
        from statistics (data-free methods take ``layer``; so does a model with one KV head)."""
        return self.granularity == "auto" and self.method not in DATA_FREE_METHODS

    def check_model_positions(self, max_positions: int | None) -> None:
        """Raise :class:`SpecError` if ``seq_len`` exceeds the model's ``max_position_embeddings``
        (``None``: unknown, no check)."""
        check_positions("--seq-len", self.seq_len, max_positions)
