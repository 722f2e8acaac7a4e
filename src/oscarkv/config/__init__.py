"""Frozen, validated configuration dataclasses (the lowest layer: stdlib only).

Every knob of the library is a field of one of these; the CLI builds its flags from the fields
(`oscarkv.cli.add_dataclass_args`), so flags and code cannot drift apart. Invalid values raise
:class:`SpecError` with a one-line message naming the field, what is allowed and what was given.
"""

from .base import SpecError, field_error, packed_bytes
from .calibration import CLIP_GRID_K, CLIP_GRID_V, CalibrationConfig
from .engine import EngineConfig
from .run import ALL_EVAL_METHODS, EVAL_TASKS, EvalConfig, GenerateConfig
from .server import ServerConfig
from .spec import (
    MAX_DEMOTE_BLOCK,
    MAX_GROUP_SIZE,
    MAX_WINDOW_TOKENS,
    META_DTYPE_BYTES,
    WINDOW_DTYPES,
    QuantSpec,
)

__all__ = [
    "ALL_EVAL_METHODS",
    "CLIP_GRID_K",
    "CLIP_GRID_V",
    "EVAL_TASKS",
    "MAX_DEMOTE_BLOCK",
    "MAX_GROUP_SIZE",
    "MAX_WINDOW_TOKENS",
    "META_DTYPE_BYTES",
    "WINDOW_DTYPES",
    "CalibrationConfig",
    "EngineConfig",
    "EvalConfig",
    "GenerateConfig",
    "QuantSpec",
    "ServerConfig",
    "SpecError",
    "field_error",
    "packed_bytes",
]
