"""oscarkv: 2-bit KV caches for long-context LLMs with near-BF16 quality.

Importing this package is cheap: it loads torch and the quantization/rotation math only. It
never imports triton, fastapi or transformers' cache classes, and never initialises CUDA.
"""

from __future__ import annotations

from typing import Any

from .config import CalibrationConfig, EngineConfig, QuantSpec, SpecError
from .engine.request import SamplingParams
from .rotation import RotationFileError, RotationSet, load_rotations, save_rotations
from .version import __version__


def calibrate(model: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> RotationSet:
    """Fit rotations for a transformers causal LM; see :func:`oscarkv.calibration.calibrate`.

    (Imported lazily so that ``import oscarkv`` stays free of transformers.)
    """
    from .calibration import calibrate as _calibrate

    return _calibrate(model, tokenizer, *args, **kwargs)


def __getattr__(name: str) -> Any:
    # OscarCache subclasses transformers' Cache: import it only when asked for.
    if name == "OscarCache":
        from .hf import OscarCache

        return OscarCache
    if name in ("LLM", "Engine"):  # the engine imports transformers for configs and tokenizers
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'oscarkv' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CalibrationConfig",
    "Engine",
    "EngineConfig",
    "OscarCache",
    "QuantSpec",
    "RotationFileError",
    "RotationSet",
    "SamplingParams",
    "SpecError",
    "__version__",
    "calibrate",
    "load_rotations",
    "save_rotations",
]
