"""Calibration: stream attention statistics from a transformers model and fit rotations."""

from .api import calibrate
from .capture import UnsupportedModelError, attention_geometry, capture_attention
from .data import CorpusError, token_sequences
from .error import ClipSearch, WindowedError, fake_quant_middle
from .fit import fit_layer, fixed_layer
from .select import RotationSelect
from .stats import LayerStats

__all__ = [
    "ClipSearch",
    "CorpusError",
    "LayerStats",
    "RotationSelect",
    "UnsupportedModelError",
    "WindowedError",
    "attention_geometry",
    "calibrate",
    "capture_attention",
    "fake_quant_middle",
    "fit_layer",
    "fixed_layer",
    "token_sequences",
]
