"""The engine's own decoder and its safetensors loader (engine.md, the decoder): one registry entry
per architecture family (:mod:`.registry`, :mod:`.families`), built from shared parts."""

from .attention import AttentionFn
from .decoder import Decoder, ModelShape, model_shape
from .loader import LOAD_FORMATS, load_decoder
from .registry import FAMILIES, check_config, check_split, supported_model_types

__all__ = [
    "FAMILIES",
    "LOAD_FORMATS",
    "AttentionFn",
    "Decoder",
    "ModelShape",
    "check_config",
    "check_split",
    "load_decoder",
    "model_shape",
    "supported_model_types",
]
