"""`EngineConfig`: how `oscarkv.LLM` / `Engine` store KV, batch and schedule (engine.md §5.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .base import field_error, help_field, is_int, is_num
from .spec import WINDOW_DTYPES, QuantSpec

__all__ = ["KV_DTYPES", "LOAD_FORMATS", "PREFILL_ATTENTION", "PROMPT_SCORING", "EngineConfig"]

KV_DTYPES = ("int2", "bf16")
LOAD_FORMATS = ("safetensors", "dummy")
PREFILL_ATTENTION = ("fresh", "invariant")
PROMPT_SCORING = ("decode", "prefill")
#: the KV budget on CPU when ``kv_budget_gb`` is unset: this share of the host's available memory
#: (on CUDA: ``memory_fraction`` of the device's free memory) ...
CPU_BUDGET_FRACTION = 0.25
#: ... at most this many GiB (split over the ranks of a tensor-parallel engine, which share the host)
CPU_BUDGET_CAP_GB = 2.0
#: the CPU default where the available memory cannot be read
CPU_FALLBACK_BUDGET_GB = 0.25
#: the shortest max_model_len the engine lowers an unset one to; a budget that holds no request
#: this long is refused
MIN_AUTO_MODEL_LEN = 256
#: the most request slots the engine takes when ``max_running`` is unset
AUTO_MAX_RUNNING = 64


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine's knobs. ``spec`` (a QuantSpec overriding the artifact's) is Python-only."""

    model: str = help_field("model directory: config.json, *.safetensors, tokenizer", default="")
    rotations: str | None = help_field("rotation artifact (required with --kv-dtype int2)", default=None)
    kv_dtype: str = help_field("int2 (OSCAR tiers) | bf16 (every token in 16-bit pages)", default="int2")
    dtype: str = help_field(
        "model dtype: auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32", default="auto"
    )
    device: str = help_field("cpu, cuda, cuda:N or auto", default="auto")
    backend: str = help_field("kernel backend: auto | torch | triton", default="auto")
    kv_budget_gb: float | None = help_field(
        f"bytes for all KV pools, in GiB (unset: on CPU {CPU_BUDGET_FRACTION:.0%} of the available "
        f"memory, at most {CPU_BUDGET_CAP_GB:g} GiB; on CUDA --memory-fraction of free memory)",
        default=None,
    )
    memory_fraction: float = help_field(
        "share of free GPU memory for the KV pools when no budget is set", default=0.9
    )
    page_tokens: int = help_field("tokens per KV page (both tiers)", default=16)
    max_running: int | None = help_field(
        "most requests decoding at once (ring slabs allocated up front; unset: as many requests of "
        f"max_model_len tokens as the KV budget holds, at most {AUTO_MAX_RUNNING})",
        default=None,
    )
    max_batched_tokens: int = help_field(
        "most prompt tokens computed in one step (chunked prefill)", default=8192
    )
    max_model_len: int | None = help_field(
        "longest prompt + output (unset: the model's positions, lowered with a warning to the longest "
        "request the KV budget holds)",
        default=None,
    )
    prefix_cache: bool = help_field("reuse full KV pages of identical prompt prefixes", default=True)
    prefill_attention: str = help_field(
        "what prompt tokens attend to (int2): fresh (the step's own tokens in 16-bit, earlier chunks "
        "and prefix hits as stored, so outputs depend on cache state) | invariant (16-bit only in "
        "the sink and the token's own window block of the recent window rounded to pages, INT2 "
        "before it: outputs independent of prefix hits, chunking and batch; prefix hits end on "
        "a block)",
        default="fresh",
    )
    prompt_scoring: str = help_field(
        "what a scored prompt (prompt log-probabilities: echo + logprobs) attends to with int2: "
        "decode (what decoding reads: 16-bit K/V in the sink and in the recent window as the ring "
        "keeps it, INT2 before; such requests skip the prefix cache) | prefill (the "
        "prefill_attention rule: fresh scores a one-chunk prompt in 16 bits)",
        default="decode",
    )
    window_dtype: str | None = help_field(
        "storage of the sink and recent window with int2 (overrides the artifact's "
        "QuantSpec.window_dtype): model (the model's dtype) | fp8_e4m3 (float8_e4m3fn, no scale, "
        "saturating at ±448: half the bytes in bf16); unset: the artifact's",
        default=None,
    )
    absorb_v: bool = help_field("fold R_V into v_proj and R_V^T into o_proj at load (int2)", default=True)
    decode_reserve_pages: int = help_field("pages kept free per running request at admission", default=1)
    tensor_parallel: int = help_field(
        "ranks (processes, one device each) the model is split over, on this host", default=1
    )
    seed: int = help_field("seed for dummy weights and unseeded sampling", default=0)
    load_format: str = help_field("safetensors | dummy (random weights, speed runs)", default="safetensors")
    cuda_graphs: str = help_field(
        "capture decode steps in CUDA graphs: auto (on CUDA with the triton backend) | on | off",
        default="auto",
    )
    graph_capture: str = help_field(
        "when decode graphs are captured: lazy (a step's first use of its shape) | startup (every "
        "batch and length bucket up to max_running and max_model_len, before the first request)",
        default="lazy",
    )
    overlap: str = help_field(
        "overlapped scheduling: the host plans step N+1 while the device runs step N: auto (on "
        "CUDA with one rank) | on | off",
        default="auto",
    )
    step_timing: bool = help_field(
        "record each step's host time, device time and the device's idle gap (benchmarks)", default=False
    )
    check_invariants: bool = help_field("check page accounting after every step (tests)", default=False)
    spec: QuantSpec | None = field(default=None, metadata={"help": "QuantSpec override", "cli": False})

    def __post_init__(self) -> None:
        n = type(self).__name__
        if not isinstance(self.model, str):
            raise field_error(n, "model", "a model directory", self.model)
        if self.kv_dtype not in KV_DTYPES:
            raise field_error(n, "kv_dtype", " | ".join(KV_DTYPES), self.kv_dtype, True)
        if self.load_format not in LOAD_FORMATS:
            raise field_error(n, "load_format", " | ".join(LOAD_FORMATS), self.load_format, True)
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise field_error(n, "dtype", "auto | bf16 | fp16 | fp32", self.dtype, True)
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise field_error(n, "cuda_graphs", "auto | on | off", self.cuda_graphs, True)
        if self.graph_capture not in ("lazy", "startup"):
            raise field_error(n, "graph_capture", "lazy | startup", self.graph_capture, True)
        if self.overlap not in ("auto", "on", "off"):
            raise field_error(n, "overlap", "auto | on | off", self.overlap, True)
        if self.overlap == "on" and self.tensor_parallel > 1:  # workers take input ids from the host
            raise field_error(n, "overlap", "auto or off with tensor_parallel > 1", self.overlap, True)
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise field_error(
                n, "prefill_attention", " | ".join(PREFILL_ATTENTION), self.prefill_attention, True
            )
        if self.prefill_attention == "invariant" and self.kv_dtype != "int2":  # bf16 stores no INT2
            raise field_error(
                n, "prefill_attention", "fresh with kv_dtype bf16 (invariant needs int2)",
                self.prefill_attention, "drop --prefill-attention invariant, or use --kv-dtype int2",
            )  # fmt: skip
        wd = self.window_dtype
        if wd is not None and wd not in WINDOW_DTYPES:
            raise field_error(n, "window_dtype", "unset or one of " + ", ".join(WINDOW_DTYPES), wd, True)
        if wd == "fp8_e4m3" and self.kv_dtype != "int2":  # bf16 mode has no windows
            raise field_error(
                n, "window_dtype", "unset or model with kv_dtype bf16 (fp8 windows need int2)", wd,
                "drop --window-dtype, or use --kv-dtype int2",
            )  # fmt: skip
        if self.prompt_scoring not in PROMPT_SCORING:
            raise field_error(n, "prompt_scoring", " | ".join(PROMPT_SCORING), self.prompt_scoring, True)
        if self.backend not in ("auto", "torch", "triton"):
            raise field_error(n, "backend", "auto | torch | triton", self.backend, True)
        b = self.kv_budget_gb
        if b is not None and (not is_num(b) or not math.isfinite(b) or b <= 0):
            raise field_error(n, "kv_budget_gb", "a positive number of GiB", b, True)
        f = self.memory_fraction
        if not is_num(f) or not 0 < f <= 1:
            raise field_error(n, "memory_fraction", "a number in (0, 1]", f, True)
        for name, lo in (
            ("page_tokens", 1),
            ("max_batched_tokens", 1),
            ("decode_reserve_pages", 0),
            ("tensor_parallel", 1),
        ):
            v = getattr(self, name)
            if not is_int(v) or v < lo:
                raise field_error(n, name, f"an integer >= {lo}", v, True)
        if self.max_running is not None and (not is_int(self.max_running) or self.max_running < 1):
            raise field_error(n, "max_running", "unset or an integer >= 1", self.max_running, True)
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 2):
            raise field_error(n, "max_model_len", "unset or an integer >= 2", self.max_model_len, True)
        if not is_int(self.seed):
            raise field_error(n, "seed", "an integer", self.seed, True)
        if self.spec is not None and not isinstance(self.spec, QuantSpec):
            raise field_error(n, "spec", "None or a QuantSpec", self.spec)

    def check_spec(self, spec: QuantSpec) -> None:
        """The page layout's requirements on the spec in use (engine.md §0): the sink is whole
        pages and one demotion needs at most one new INT2 page."""
        n = type(self).__name__
        if spec.sink_tokens % self.page_tokens:
            raise field_error(
                n, "page_tokens", f"a divisor of sink_tokens ({spec.sink_tokens})", self.page_tokens, True
            )
        if spec.demote_block > self.page_tokens:
            raise field_error(
                n, "page_tokens", f">= demote_block ({spec.demote_block})", self.page_tokens, True
            )
        if self.prefill_attention == "invariant" and spec.recent_tokens < self.page_tokens:
            raise field_error(
                n, "page_tokens", f"<= recent_tokens ({spec.recent_tokens}) with prefill_attention=invariant",
                self.page_tokens, True,
            )  # fmt: skip
