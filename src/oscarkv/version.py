"""The package version (layer 0: stdlib only; ``pyproject.toml`` reads it from here)."""

__version__ = "0.1.0"
