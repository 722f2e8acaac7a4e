"""oscarkv: 2-bit KV caches for long-context LLMs with near-BF16 quality.

Importing this package is cheap: it loads torch and the quantization/rotation math only. It
never imports triton, fastapi or transformers' cache classes, and never initialises CUDA.
"""

from __future__ import annotations

from .config import QuantSpec, SpecError
from .rotation import RotationFileError, RotationSet, load_rotations, save_rotations

__version__ = "0.1.0"

__all__ = [
    "QuantSpec",
    "RotationFileError",
    "RotationSet",
    "SpecError",
    "__version__",
    "load_rotations",
    "save_rotations",
]
