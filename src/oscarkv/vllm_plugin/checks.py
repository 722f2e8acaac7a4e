"""Start-up decisions of one vLLM process: the options, and for INT2 the rotations and formats.

Everything here runs once per process, on the first attention layer vLLM builds (before any
weight is loaded), and raises :class:`~oscarkv.errors.OscarkvError` with a one-line message that
names the fix; vLLM prints it above "Engine core initialization failed". vLLM's
``customize_spec`` hook is a classmethod without a config, so the result is kept per process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import QuantSpec
from ..errors import InputError
from ..quant import RowFormat
from ..quant.tiers import window_limit
from ..rotation import ARTIFACT_NAME, RotationSet, load_rotations
from .layout import int2_row_bytes
from .options import PluginOptions

__all__ = ["Int2Setup", "check_model", "int2_setup", "store_capacity"]

PREFIX_FLAG = "enable_prefix_caching=False (--no-enable-prefix-caching)"
LOAD_FORMAT = "oscarkv"  # registered by .loader (which imports vLLM; this module must not)
LOAD_FLAG = f"load_format={LOAD_FORMAT!r} (--load-format {LOAD_FORMAT})"


@dataclass(frozen=True)
class Int2Setup:
    """The loaded artifact and what follows from it: every layer's ``(k_fmt, v_fmt)`` and the
    bytes of one token's INT2 row pair in a page (the widest layer's, so one page size fits all)."""

    rotations: RotationSet
    spec: QuantSpec
    fmts: tuple[tuple[RowFormat, RowFormat], ...]
    row_bytes: int

    @property
    def store_rows(self) -> int:
        """16-bit rows one request needs per layer: the sink, then the ring."""
        return self.spec.sink_tokens + window_limit(self.spec)


def check_model(vllm_config: Any, opts: PluginOptions) -> None:
    """Refuse what the plug-in cannot host, naming the flag or option to change."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    problems = []
    if getattr(mc, "use_mla", False):
        problems.append("multi-head latent attention (MLA) models")
    if getattr(mc, "is_encoder_decoder", False):
        problems.append("encoder-decoder models")
    hf = mc.hf_text_config
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        problems.append(f"sliding-window attention (sliding_window={hf.sliding_window})")
    if cc.cache_dtype != "auto":
        problems.append(f"--kv-cache-dtype {cc.cache_dtype} (leave it at auto)")
    if problems:
        raise InputError(f"oscarkv under vLLM does not support: {'; '.join(problems)}")
    if opts.kv_dtype != "int2":
        return
    if cc.enable_prefix_caching:
        raise InputError(
            "oscarkv: kv_dtype='int2' needs prefix caching disabled: a cache hit would serve INT2 "
            f"rows where a fresh run keeps the 16-bit sink and recent window; pass {PREFIX_FLAG}"
        )
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 or getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise InputError("oscarkv: kv_dtype='int2' under vLLM supports tensor_parallel_size=1 only (for now)")
    if vllm_config.speculative_config is not None:
        raise InputError("oscarkv: kv_dtype='int2' does not support speculative decoding under vLLM")
    load_format = vllm_config.load_config.load_format
    if opts.absorb_v and load_format != LOAD_FORMAT:
        raise InputError(
            f"oscarkv: absorb_v (the default with kv_dtype='int2') folds R_V into qkv_proj at load, "
            f"which needs {LOAD_FLAG}; got load_format={load_format!r}. Pass it, or set "
            "absorb_v=false in additional_config['oscarkv'] (values are then rotated on write)"
        )


def _artifact(opts: PluginOptions, model_dir: str) -> str:
    if opts.rotations is not None:
        if not Path(opts.rotations).exists():
            raise InputError(
                f"oscarkv: rotations {opts.rotations!r}: no such file or directory; pass the directory "
                "written by `oscarkv calibrate` in additional_config['oscarkv']['rotations']"
            )
        return opts.rotations
    if (Path(model_dir) / ARTIFACT_NAME).is_file():
        return model_dir
    raise InputError(
        "oscarkv: kv_dtype='int2' needs rotations: pass additional_config "
        '{"oscarkv": {"kv_dtype": "int2", "rotations": DIR}} (DIR from `oscarkv calibrate`), '
        f"or put {ARTIFACT_NAME} in the model directory {model_dir}"
    )


def int2_setup(vllm_config: Any, opts: PluginOptions) -> Int2Setup:
    """Load the artifact and check it against the model: head_dim, KV heads (per-KV-head
    artifacts), every attention layer covered. Raises ``RotationFileError``/``InputError``."""
    mc = vllm_config.model_config
    path = _artifact(opts, str(mc.model))
    rs = load_rotations(path, model_config=mc.hf_text_config)
    n_layers = int(mc.hf_text_config.num_hidden_layers)
    if rs.layer_ids != list(range(n_layers)):
        raise InputError(
            f"oscarkv: rotations {path} cover layers {rs.layer_ids}, but the model has {n_layers} "
            "attention layers; calibrate this model (`oscarkv calibrate`)"
        )
    head_dim, kv_heads = rs.head_dim, mc.get_total_num_kv_heads()
    if head_dim != mc.get_head_size():
        raise InputError(
            f"oscarkv: rotations {path} have head_dim {head_dim}, the model {mc.get_head_size()}"
        )
    if rs.num_kv_heads is not None and rs.num_kv_heads != kv_heads:
        raise InputError(f"oscarkv: rotations {path} have {rs.num_kv_heads} KV heads, the model {kv_heads}")
    if rs.spec.window_dtype != "model":  # the companion store and its pages hold model-dtype rows
        raise InputError(
            f"oscarkv: rotations {path} ask for QuantSpec.window_dtype={rs.spec.window_dtype!r}, but the "
            "vLLM plug-in keeps the sink and recent window in the model dtype; re-calibrate with "
            "--window-dtype model (or load the artifact, set window_dtype='model' with "
            "RotationSet.with_spec and save it), or serve fp8 windows with `oscarkv serve`"
        )
    fmts = tuple(rs.formats(i) for i in range(n_layers))
    row = max(int2_row_bytes(kv_heads, fk, fv) for fk, fv in fmts)
    return Int2Setup(rs, rs.spec, fmts, row)


def store_capacity(rows: int, int2_page_bytes: int, row_bytes: int) -> int:
    """The smallest per-request 16-bit capacity ``>= rows`` whose page is a whole multiple of the
    INT2 page, so vLLM unifies the two groups' page sizes by raising the INT2 block size instead
    of padding pages (``unify_kv_cache_spec_page_size``, ``vllm/v1/core/kv_cache_utils.py:1292``)."""
    step = int2_page_bytes // math.gcd(int2_page_bytes, row_bytes)
    return -(-rows // step) * step
