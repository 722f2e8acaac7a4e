"""The engine's own decoder (Llama/Mistral, Qwen2, Qwen3) and its safetensors loader (engine.md §5.7)."""

from .decoder import AttentionFn, Decoder, ModelShape, model_shape
from .layers import SUPPORTED_MODEL_TYPES, check_config
from .loader import LOAD_FORMATS, load_decoder

__all__ = [
    "LOAD_FORMATS",
    "SUPPORTED_MODEL_TYPES",
    "AttentionFn",
    "Decoder",
    "ModelShape",
    "check_config",
    "load_decoder",
    "model_shape",
]
