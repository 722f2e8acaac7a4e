"""Checked reads and atomic writes: inputs are validated before work starts, outputs never
half-written and never replace what a user gave us.

* :func:`check_output_dir` runs before any model loads: the output directory must be writable,
  must not be an existing file or lie inside a model directory, and must not already hold the
  files it would receive (unless ``overwrite``).
* :func:`atomic_write` writes through a temporary file in the same directory and renames it into
  place (mode 0644), so an interrupted run leaves the old file or none, never a torn one.
* :func:`read_text` decodes UTF-8 strictly and names binary, UTF-16 and other encodings.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

from ..errors import InputError

__all__ = [
    "atomic_save",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_input_file",
    "check_output_dir",
    "check_output_file",
    "decode_text",
    "enclosing_model_dir",
    "read_text",
]

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")


def _is_model_dir(d: Path) -> bool:
    if not (d / "config.json").is_file():
        return False
    return any(next(d.glob(g), None) is not None for g in _WEIGHT_GLOBS)


def enclosing_model_dir(path: str | Path) -> Path | None:
    """The model directory (config.json + weights) that is ``path`` or contains it, if any."""
    p = Path(path).expanduser().resolve()
    for d in (p, *p.parents):
        if d.is_dir() and _is_model_dir(d):
            return d
    return None


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _can_create_in(d: Path) -> bool:
    """Whether a file can be created in ``d`` (tried: permission bits do not tell for root, /proc, ...)."""
    try:
        fd, name = tempfile.mkstemp(dir=d, prefix=".oscarkv-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def check_output_dir(
    path: str | Path, produces: Iterable[str], *, overwrite: bool = False, flag: str = "--out"
) -> Path:
    """Check, before any work, that ``path`` can receive the files named in ``produces``.

    Refuses (:class:`InputError`): an existing file; a directory inside a model directory; an
    unwritable location; and, unless ``overwrite``, a directory already holding any of
    ``produces`` (other files in it are never touched). Leaves nothing behind. Returns the path.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise InputError(
            f"{flag} {path}: is an existing file; expected a directory for " + ", ".join(produces),
            f"pass a new or empty directory, e.g. {flag} {p.with_suffix('')}-out",
        )
    model = enclosing_model_dir(p)
    if model is not None:
        raise InputError(
            f"{flag} {path}: lies inside the model directory {model}; writing there could "
            "replace or shadow the model's files",
            f"pass a directory outside the model, e.g. {flag} {model.name}-oscarkv",
        )
    base = _nearest_existing(p.resolve())
    if not base.is_dir() or not _can_create_in(base):
        raise InputError(
            f"{flag} {path}: cannot write there ({base} is not a writable directory)",
            "pass a directory you can write to",
        )
    if p.is_dir():
        dirs = sorted(n for n in produces if "." in n and (p / n).is_dir())
        if dirs:
            raise InputError(
                f"{flag} {path}: {', '.join(dirs)} there is a directory, not a file this command wrote"
            )
    if p.is_dir() and not overwrite:
        taken = sorted(n for n in produces if (p / n).exists())
        if taken:
            raise InputError(
                f"{flag} {path}: already holds {', '.join(taken)} from an earlier run",
                "pass a new directory, or add --overwrite to replace those files",
            )
    return p


def check_output_file(path: str | Path, *, overwrite: bool = False, flag: str = "--out") -> Path:
    """Check, before any work, that the file ``path`` may be written: not a directory, not an
    existing file unless ``overwrite``, in a writable directory. Leaves nothing behind."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise InputError(f"{flag} {path}: is a directory; expected a file name")
    if p.exists() and not overwrite:
        raise InputError(f"{flag} {path}: already exists", "pass a new file name, or add --overwrite")
    base = _nearest_existing(p.resolve().parent)
    if not base.is_dir() or not _can_create_in(base):
        raise InputError(f"{flag} {path}: cannot write there ({base} is not a writable directory)")
    return p


def check_input_file(path: str | Path, what: str) -> Path:
    """``path`` as a readable regular file, or an :class:`InputError` naming ``what`` it is."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"{what} {path}: no such file")
    if p.is_dir():
        raise InputError(f"{what} {path}: is a directory; expected a file")
    if not os.access(p, os.R_OK):
        raise InputError(f"{what} {path}: not readable (permission denied)")
    return p


def decode_text(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8 (a BOM is dropped), or an :class:`InputError` naming the problem."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise InputError(
            f"{where}: is UTF-16 text; expected UTF-8",
            f"convert it: iconv -f UTF-16 -t UTF-8 {where} > converted.txt",
        )
    if b"\x00" in data[:65536]:
        raise InputError(f"{where}: is a binary file (it holds NUL bytes); expected UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: is not UTF-8 (invalid byte 0x{data[e.start]:02x} at offset {e.start})",
            f"convert it, e.g. iconv -f latin1 -t UTF-8 {where} > converted.txt",
        ) from None


def read_text(path: str | Path, what: str = "file") -> str:
    """The text of a UTF-8 file; :class:`InputError` for missing, binary or non-UTF-8 files."""
    p = check_input_file(path, what)
    return decode_text(p.read_bytes(), f"{what} {path}")


@contextlib.contextmanager
def _temp_beside(dst: Path) -> Iterator[str]:
    """A temporary file name beside ``dst``; on success it replaces ``dst`` (mode 0644), on an
    exception it is removed and ``dst`` is left as it was."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path`` (mode 0644).

    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    with _temp_beside(Path(path)) as tmp, open(tmp, mode) as f:
        yield f


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save(path: str | Path, save: Callable[[str], None]) -> Path:
    """Run ``save(tmp_name)`` (a library writer taking a file name) and rename into ``path``."""
    with _temp_beside(Path(path)) as tmp:
        save(tmp)
    return Path(path)
