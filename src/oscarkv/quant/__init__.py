"""Quantization math: clipping, quantizers, bit packing, the stored row format (pure torch).

:mod:`oscarkv.quant.tiers` holds the tier rules (sink, INT2, recent window) over plain ints,
:mod:`oscarkv.quant.window` the windows' storage dtype (the model's, or fp8).
"""

from .format import QUANTIZERS, RowFormat, dequantize_rows, fake_quantize_rows, quantize_rows
from .packing import pack, packed_dim, unpack
from .quantizer import (
    clip_index,
    clip_rows,
    clip_threshold,
    dequantize_affine,
    dequantize_codebook,
    lloyd_max_gaussian,
    quantize_asymmetric,
    quantize_lloyd_max,
    quantize_symmetric,
)

__all__ = [
    "QUANTIZERS",
    "RowFormat",
    "clip_index",
    "clip_rows",
    "clip_threshold",
    "dequantize_affine",
    "dequantize_codebook",
    "dequantize_rows",
    "fake_quantize_rows",
    "lloyd_max_gaussian",
    "pack",
    "packed_dim",
    "quantize_asymmetric",
    "quantize_lloyd_max",
    "quantize_rows",
    "quantize_symmetric",
    "unpack",
]
