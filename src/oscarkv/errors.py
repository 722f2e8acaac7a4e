"""The exception and warning types of every user-facing error (the lowest layer: stdlib only).

Each user error is a :class:`OscarkvError` (a ``ValueError``) whose message is one line naming
what was wrong, what was expected and how to fix it, plus an optional ``hint`` line. The CLI
prints exactly those lines and exits with code 2; the Python API raises the same objects.
"""

from __future__ import annotations

__all__ = [
    "ArtifactMismatchWarning",
    "InputError",
    "KVValueError",
    "ModelError",
    "OscarkvError",
    "OscarkvWarning",
]


class OscarkvError(ValueError):
    """A user error: ``str(e)`` is one line; ``e.hint`` is an optional second line ("" if none)."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class InputError(OscarkvError):
    """A path, file, prompt or argument given by the user cannot be used as it is."""


class ModelError(OscarkvError):
    """A model directory, config or architecture that oscarkv cannot load or serve."""


class KVValueError(OscarkvError):
    """Keys or values entering the cache are NaN/Inf, or too large for the stored metadata dtype."""


class OscarkvWarning(UserWarning):
    """Something worth a look that does not stop the run (the CLI prints it as one line)."""


class ArtifactMismatchWarning(OscarkvWarning):
    """A rotation artifact recorded a different model than the one it is used on."""
