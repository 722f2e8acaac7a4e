"""Frozen, validated configuration dataclasses (the lowest layer: stdlib only).

Every knob of the library is a field here; the CLI builds its flags from these fields
(`oscarkv.cli.add_dataclass_args`), so flags and code cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["META_DTYPE_BYTES", "CalibrationConfig", "QuantSpec", "SpecError", "field_error"]

#: bytes per stored scale or zero, by ``QuantSpec.meta_dtype``
META_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
SUPPORTED_BITS = (2, 3, 4)
CODEBOOKS = ("uniform", "lloyd_max")


class SpecError(ValueError):
    """A configuration value is invalid; the message names field, allowed values and value."""


def field_error(cls: str, name: str, allowed: str, got: Any) -> SpecError:
    return SpecError(f"{cls}.{name} must be {allowed}; got {got!r}")


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes that one packed row of ``head_dim`` codes of ``bits`` bits occupies."""
    return head_dim * bits // 8


@dataclass(frozen=True)
class QuantSpec:
    """How keys and values are stored: bit widths, groups, windows, clipping, codebook.

    Defaults reproduce OSCAR's evaluated configuration (spec §3-§5) with 16-bit metadata.
    """

    key_bits: int = _help("bits per key element in the quantized tier (2, 3 or 4)", default=2)
    value_bits: int = _help("bits per value element in the quantized tier (2, 3 or 4)", default=2)
    group_size: int | None = _help(
        "elements per (scale, zero) pair along the rotated head dim; default: the head dim",
        default=None,
    )
    sink_tokens: int = _help("first prompt tokens kept in 16 bits (attention sink)", default=64)
    recent_tokens: int = _help("most recent tokens kept in 16 bits", default=256)
    demote_block: int = _help(
        "recent tokens are demoted to the quantized tier in blocks of this many", default=8
    )
    k_clip: float = _help("per-row key clip ratio in [0, 1] (0 = off)", default=0.96)
    v_clip: float = _help("per-row value clip ratio in [0, 1] (0 = off)", default=0.92)
    codebook: str = _help("uniform (min-max) or lloyd_max (OSCAR's hybrid)", default="uniform")
    meta_dtype: str = _help("dtype of the stored scale and zero: fp16, bf16 or fp32", default="fp16")

    def __post_init__(self) -> None:
        name = type(self).__name__
        for f in ("key_bits", "value_bits"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v not in SUPPORTED_BITS:
                raise field_error(name, f, "one of 2, 3, 4", v)
        gs = self.group_size
        if gs is not None and (not isinstance(gs, int) or isinstance(gs, bool) or gs < 4):
            raise field_error(name, "group_size", "None (= head dim) or an integer >= 4", gs)
        for f in ("sink_tokens", "recent_tokens"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise field_error(name, f, "an integer >= 0", v)
        db = self.demote_block
        if not isinstance(db, int) or isinstance(db, bool) or db < 1:
            raise field_error(name, "demote_block", "an integer >= 1", db)
        for f in ("k_clip", "v_clip"):
            v = getattr(self, f)
            if (
                not isinstance(v, (int, float))
                or isinstance(v, bool)
                or not math.isfinite(v)
                or not 0.0 <= v <= 1.0
            ):
                raise field_error(name, f, "a number in [0, 1] (0 disables clipping)", v)
        if self.codebook not in CODEBOOKS:
            raise field_error(name, "codebook", "one of " + ", ".join(CODEBOOKS), self.codebook)
        if self.codebook == "lloyd_max" and (self.key_bits != 2 or self.value_bits != 2):
            raise field_error(
                name,
                "codebook",
                "'uniform' when key_bits/value_bits are not 2 "
                "(OSCAR's Lloyd-Max hybrid is defined for INT2 only)",
                self.codebook,
            )
        if self.meta_dtype not in META_DTYPE_BYTES:
            raise field_error(name, "meta_dtype", "one of fp16, bf16, fp32", self.meta_dtype)

    # ---- derived quantities -------------------------------------------------------------
    def group_for(self, head_dim: int) -> int:
        """The group size for ``head_dim``; raises if it does not divide the head dim."""
        if head_dim % 4:
            raise SpecError(f"head_dim must be a multiple of 4 for packing; got {head_dim}")
        g = head_dim if self.group_size is None else self.group_size
        if head_dim % g:
            raise field_error(
                "QuantSpec", "group_size", f"a divisor of the head dim {head_dim}", self.group_size
            )
        return g

    def row_bytes(self, head_dim: int, bits: int) -> int:
        """Stored bytes of one quantized row: packed codes + (scale, zero) per group."""
        groups = head_dim // self.group_for(head_dim)
        return packed_bytes(head_dim, bits) + 2 * groups * META_DTYPE_BYTES[self.meta_dtype]

    def quantized_bits_per_element(self, head_dim: int = 128) -> float:
        """Bits per element of the quantized tier alone, K and V averaged (2.25 for INT2/fp16)."""
        total = self.row_bytes(head_dim, self.key_bits) + self.row_bytes(head_dim, self.value_bits)
        return total * 8 / (2 * head_dim)

    def bits_per_element(
        self, context_len: int | None = None, head_dim: int = 128, hp_bits: int = 16
    ) -> float:
        """Effective bits per cached K/V element at ``context_len`` tokens (spec §4.4).

        ``None`` gives the quantized tier alone. Otherwise the first ``sink_tokens`` and last
        ``recent_tokens`` tokens count at ``hp_bits`` and the rest at the quantized tier's cost
        measured from its storage sizes. Like OSCAR's formula, it ignores the up to
        ``demote_block - 1`` extra recent tokens between demotions.
        """
        q = self.quantized_bits_per_element(head_dim)
        if context_len is None:
            return q
        if context_len <= 0:
            raise field_error("bits_per_element", "context_len", "a positive integer", context_len)
        hp = min(context_len, self.sink_tokens + self.recent_tokens)
        return (hp * hp_bits + (context_len - hp) * q) / context_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"unknown QuantSpec fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


CAL_METHODS = ("oscar", "hadamard", "identity", "ktk_vtv")
V_TARGETS = ("oscar", "softmax")
CLIP_OBJECTIVES = ("attn", "nll", "kl")
CLIP_GRID_K = (0.0, 0.86, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98)
CLIP_GRID_V = (0.0, 0.82, 0.84, 0.86, 0.88, 0.9, 0.92, 0.94, 0.96)


@dataclass(frozen=True)
class CalibrationConfig:
    """How `oscarkv calibrate` turns a model and some text into a RotationSet."""

    tokens: int = _help("calibration tokens used for the statistics", default=20000)
    seq_len: int = _help("tokens per calibration sequence", default=2048)
    granularity: str = _help("one rotation per layer, or per KV head: layer | kv_head", default="layer")
    method: str = _help("oscar | hadamard | identity | ktk_vtv (spec §6.7 ablations)", default="oscar")
    v_target: str = _help(
        "value target: oscar (score-energy weights, OSCAR's code) | softmax (causal VᵀSᵀSV)",
        default="oscar",
    )
    # off by default: on the reference model it lowered attention-output error but raised the
    # continuation perplexity (1.0395 vs 1.0293 x BF16, docs/calibration.md)
    clip_search: bool = _help(
        "search per-layer K/V clip ratios on held-out tokens (minimises attention-output error)",
        default=False,
    )
    clip_objective: str = _help(
        "what --clip-search minimises: attn (per-layer windowed attention-output error) | nll "
        "(held-out next-token loss of the fake-quantized model, global K/V clips) | kl (its KL "
        "from the exact model)",
        default="attn",
    )
    clip_per_layer: bool = _help(
        "with --clip-objective nll|kl: after the global clips, move each layer's K/V clip one grid "
        "step where that lowers the held-out loss",
        default=False,
    )
    rotation_select: bool = _help(
        "keep the fitted rotation or Hadamard per layer (per KV head with kv_head granularity), "
        "K and V jointly, whichever has the lower held-out attention-output error",
        default=False,
    )
    holdout_tokens: int = _help(
        "held-out tokens (beyond --tokens) for the clip search and the rotation selection",
        default=4096,
    )
    batch_size: int = _help("sequences per forward pass", default=1)
    seed: int = _help("seed for corpus sampling", default=0)

    def __post_init__(self) -> None:
        name = type(self).__name__
        for f in ("tokens", "seq_len", "batch_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise field_error(name, f, "a positive integer", v)
        if not isinstance(self.holdout_tokens, int) or self.holdout_tokens < 0:
            raise field_error(name, "holdout_tokens", "an integer >= 0", self.holdout_tokens)
        if self.granularity not in ("layer", "kv_head"):
            raise field_error(name, "granularity", "layer or kv_head", self.granularity)
        if self.method not in CAL_METHODS:
            raise field_error(name, "method", " | ".join(CAL_METHODS), self.method)
        if self.v_target not in V_TARGETS:
            raise field_error(name, "v_target", " | ".join(V_TARGETS), self.v_target)
        if self.clip_objective not in CLIP_OBJECTIVES:
            raise field_error(name, "clip_objective", " | ".join(CLIP_OBJECTIVES), self.clip_objective)
        if self.clip_search and self.holdout_tokens < 1:
            raise field_error(
                name, "holdout_tokens", "> 0 when clip_search is on (or pass --no-clip-search)", 0
            )
        if self.rotation_select and self.holdout_tokens < 1:
            raise field_error(
                name,
                "holdout_tokens",
                "> 0 when rotation_select is on (or pass --no-rotation-select)",
                self.holdout_tokens,
            )

    @property
    def num_sequences(self) -> int:
        return -(-self.tokens // self.seq_len)

    @property
    def num_holdout_sequences(self) -> int:
        held = self.clip_search or self.rotation_select
        return -(-self.holdout_tokens // self.seq_len) if held else 0


ALL_EVAL_METHODS = "bf16,oscar,naive-int2,quarot-int2,clip-only,hadamard-int2,kivi2,turboquant-k3v3,int4"
EVAL_TASKS = ("ppl", "passkey", "niah", "attn-error")


@dataclass(frozen=True)
class EvalConfig:
    """What `oscarkv eval` runs (``quick`` shrinks every budget for CI)."""

    methods: str = _help("comma-separated methods", default=ALL_EVAL_METHODS)
    tasks: str = _help("comma-separated tasks: ppl, passkey, niah, attn-error", default=",".join(EVAL_TASKS))
    context: int = _help(
        "longest context in tokens (ppl sequence length, largest needle prompt)", default=3072
    )
    quick: bool = _help("tiny budgets (CI smoke run)", default=False)
    ppl_sequences: int = _help("perplexity sequences", default=8)
    ppl_continuation: int = _help("scored continuation tokens per sequence", default=512)
    ppl_chunk: int = _help("continuation tokens per forward", default=32)
    needle_trials: int = _help("prompts per (context length, depth) cell", default=4)
    needle_depths: int = _help("needle depths spread over [0.05, 0.95]", default=5)
    needle_lengths: int = _help("context lengths from context/N up to context", default=3)
    passkey_at_context: int = _help("extra passkey prompts at the full context (accuracy n)", default=100)
    niah_needles: int = _help("needles per prompt in the niah task", default=4)
    batch_size: int = _help(
        "ppl sequences / needle prompts run together (equal lengths, no padding)", default=16
    )
    attn_sequences: int = _help("sequences for the per-layer error metrics", default=4)
    seed: int = _help("seed for data sampling and needle prompts", default=0)

    def __post_init__(self) -> None:
        name = type(self).__name__
        tasks = [t for t in self.tasks.split(",") if t]
        bad = [t for t in tasks if t not in EVAL_TASKS]
        if bad or not tasks:
            raise field_error(
                name, "tasks", "a comma-separated subset of " + ",".join(EVAL_TASKS), self.tasks
            )
        for f in ("context", "ppl_sequences", "ppl_continuation", "ppl_chunk", "needle_trials",
                  "needle_depths", "needle_lengths", "niah_needles", "batch_size", "attn_sequences"):  # fmt: skip
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise field_error(name, f, "a positive integer", v)
        if self.context <= self.ppl_continuation + 64:
            raise field_error(
                name, "context", f"> ppl_continuation + 64 = {self.ppl_continuation + 64}", self.context
            )

    @property
    def method_list(self) -> list[str]:
        return [m for m in self.methods.split(",") if m]

    @property
    def task_list(self) -> list[str]:
        return [t for t in self.tasks.split(",") if t]

    def effective(self) -> EvalConfig:
        """The budgets actually used (``quick`` shrinks them)."""
        if not self.quick:
            return self
        return dataclasses.replace(
            self, context=min(self.context, 1024), ppl_sequences=1, ppl_continuation=128, ppl_chunk=64,
            needle_trials=1, needle_depths=2, needle_lengths=1, passkey_at_context=1, niah_needles=2,
            attn_sequences=1, quick=False,
        )  # fmt: skip
