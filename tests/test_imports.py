"""Importing oscarkv stays cheap: no triton, fastapi, transformers cache classes or CUDA init."""

from __future__ import annotations

import subprocess
import sys

CODE = (
    "import oscarkv, sys; import torch; "
    "print('triton' in sys.modules, 'fastapi' in sys.modules, "
    "'transformers.cache_utils' in sys.modules, torch.cuda.is_initialized())"
)


def test_import_is_light() -> None:
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False", "False", "False"]


def test_version_matches_metadata() -> None:
    from importlib.metadata import version

    import oscarkv

    assert oscarkv.__version__ == version("oscarkv")
