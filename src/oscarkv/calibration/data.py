"""Calibration text -> fixed-length token sequences (seeded, deterministic, offline).

Sources are text files, folders of text or code (searched recursively), or JSONL files whose
lines hold a ``text`` field or chat ``messages`` (rendered with the tokenizer's chat template
when it has one). With no sources, the Python standard library's own sources are used: they
are on every machine, so ``oscarkv calibrate --model PATH`` needs no data arguments.

User files are decoded strictly as UTF-8 (binary, UTF-16 and latin-1 files are refused with a
one-line :class:`CorpusError` naming the file and the fix); :func:`check_sources` checks them
before any model loads. The bundled corpora (the standard library) decode with replacement.
"""

from __future__ import annotations

import json
import random
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..utils.files import check_input_file, decode_text
from ..utils.models import quiet_length_warning

__all__ = [
    "CorpusError",
    "check_sources",
    "default_corpus",
    "eval_sequences",
    "iter_documents",
    "quiet_length_warning",
    "ranked_eval_files",
    "token_sequences",
]

TEXT_SUFFIXES = {
    ".txt", ".md", ".rst", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".js", ".ts", ".java",
    ".go", ".rs", ".sh", ".toml", ".yaml", ".yml", ".html", ".css", ".tex", ".jsonl",
}  # fmt: skip


class CorpusError(InputError):
    """The calibration corpus is missing, unreadable, not UTF-8 text or too small (one line,
    plus an optional ``hint``; an :class:`~oscarkv.errors.OscarkvError` and a ``ValueError``)."""


#: how much of each file :func:`check_sources` decodes up front
CHECK_BYTES = 64 * 1024


def _decode(data: bytes, path: Path, line: int | None = None) -> str:
    """``data`` (from ``path``, or its line ``line``) as UTF-8, or a one-line :class:`CorpusError`."""
    try:
        return decode_text(data, str(path))
    except InputError as e:
        msg = str(e)
        if line is not None:  # "PATH: ..." -> "PATH:LINE: ..."
            msg = f"{path}:{line}{msg[len(str(path)) :]}"
        raise CorpusError(msg, e.hint) from None


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror or e})") from None
    return _decode(data, path)


def _utf8_head(data: bytes) -> bytes:
    """``data`` without a multi-byte UTF-8 character cut off at its end."""
    for i in range(1, min(4, len(data)) + 1):
        c = data[-i]
        if c & 0xC0 == 0x80:  # a continuation byte: look further back for the lead byte
            continue
        if c >= 0xC0:  # lead byte of a 2-, 3- or 4-byte character
            size = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return data[:-i] if size > i else data
        return data
    return data


SPLITS = ("calib", "eval")


def default_corpus(split: str = "calib") -> list[Path]:
    """The Python standard library's ``.py`` files (sorted; shuffled later with the seed).

    ``split="calib"`` and ``split="eval"`` are disjoint (a stable hash of the relative path puts
    one file in ten into ``eval``), so evaluation never scores text the rotations were fit on.
    """
    if split not in SPLITS:
        raise CorpusError(f"split must be one of {SPLITS}; got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _split_files(root, split)
    if not files:
        raise CorpusError(f"no Python sources under {root}; pass --data")
    return files


def _split_files(root: Path, split: str) -> list[Path]:
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "site-packages" in rel.parts:
            continue
        in_eval = zlib.crc32(rel.as_posix().encode()) % 10 == 0
        if in_eval == (split == "eval"):
            files.append(p)
    return files


def _stable_key(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


def ranked_eval_files(seed: int = 0, root: str | Path | None = None) -> tuple[Path, list[Path]]:
    """The standard library root and its ``eval``-split files ranked by a stable hash of
    ``seed`` and the relative path (a file's rank does not depend on which other files exist)."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = _split_files(base, "eval")
    if not files:
        raise CorpusError(f"no Python sources under {base}")
    return base, sorted(files, key=lambda p: (_stable_key(seed, p.relative_to(base).as_posix()), str(p)))


def eval_sequences(
    tokenizer: Any, num_sequences: int, seq_len: int, seed: int = 0, root: str | Path | None = None
) -> torch.Tensor:
    """Evaluation windows from the default corpus's ``eval`` split, one document per window.

    Files are ranked by a stable hash of ``seed`` and their path relative to the standard library
    (not by shuffling the file list), and the first ``num_sequences`` files with at least
    ``seq_len`` tokens each give one window, at an offset from the same hash. So which modules are
    scored does not depend on the rest of the file set (another Python version adds or drops
    files without moving the others), the text spans ``num_sequences`` different modules instead
    of the few that fill a concatenated stream, and nothing is downloaded. The module contents
    still follow the installed Python version, which the evaluation results record.
    ``root`` overrides the standard library's location (tests). Returns LongTensor ``[n, seq_len]``.
    """
    base, ranked = ranked_eval_files(seed, root)
    quiet_length_warning(tokenizer)
    out: list[list[int]] = []
    for path in ranked:
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)[
            "input_ids"
        ]
        if len(ids) < seq_len:
            continue
        off = _stable_key(seed + 1, path.relative_to(base).as_posix()) % (len(ids) - seq_len + 1)
        out.append(ids[off : off + seq_len])
        if len(out) == num_sequences:
            return torch.tensor(out, dtype=torch.long)
    raise CorpusError(
        f"the eval split under {base} has {len(out)} files of >= {seq_len} tokens, fewer than the "
        f"{num_sequences} sequences asked; lower the context or the number of sequences"
    )


def _expand(sources: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise CorpusError(f"{p}: no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise CorpusError(f"{p}: no such file or directory", "pass existing files or folders to --data")
    return files


def check_sources(sources: Sequence[str | Path] | None) -> list[Path]:
    """Check ``sources`` before any model loads; returns the files (folders expanded, sorted).

    Every file must exist and be readable, its first 64 KiB must decode as UTF-8 text, and the
    first record of a ``.jsonl`` file must be an object with a ``text`` string or ``messages``
    list. Raises :class:`CorpusError` (one line) otherwise. ``None`` or empty: the default corpus,
    nothing to check (returns ``[]``).
    """
    if not sources:
        return []
    files = _expand(sources)
    for path in files:
        try:
            check_input_file(path, "--data")
        except InputError as e:
            raise CorpusError(str(e), e.hint) from None
        try:
            with path.open("rb") as f:
                head = f.read(CHECK_BYTES + 1)
        except OSError as e:
            raise CorpusError(f"{path}: cannot be read ({e.strerror or e})") from None
        whole = len(head) <= CHECK_BYTES
        head = head if whole else head[:CHECK_BYTES]
        if path.suffix.lower() == ".jsonl":
            _check_jsonl_head(head, whole, path)
        else:
            text = _decode(head if whole else _utf8_head(head), path)
            if whole and not text.strip():
                raise CorpusError(
                    f"{path}: holds no text (it is empty or only whitespace)",
                    "pass files with text to --data",
                )
    return files


def _check_jsonl_head(head: bytes, whole: bool, path: Path) -> None:
    """Decode each line of ``head`` (the start of a JSONL file, all of it if ``whole``) and parse
    its first record."""
    parsed = False
    raw_lines = head.split(b"\n")  # JSON strings may hold other line separators (U+2028, ...)
    for n, raw in enumerate(raw_lines, 1):
        complete = whole or n < len(raw_lines)
        line = _decode(raw if complete else _utf8_head(raw), path, n)
        if complete and line.strip():  # every complete record of the first 64 KiB
            _check_record(_parse_line(line, f"{path}:{n}"), f"{path}:{n}")
            parsed = True
    if whole and not parsed:
        raise CorpusError(f"{path}: holds no JSON records", "pass files with text to --data")


def _parse_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: invalid JSON ({e.msg})") from None


def _check_record(obj: Any, where: str) -> None:
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return
    if isinstance(obj, dict) and "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise CorpusError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return
    raise CorpusError(f"{where}: expected an object with a 'text' string or 'messages'")


def _render_chat(messages: Any, tokenizer: Any) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)


def _jsonl_documents(path: Path, tokenizer: Any) -> Iterator[str]:
    """The records of a JSONL file, read line by line (strict UTF-8 per line)."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror or e})") from None
    with f:
        for n, raw in enumerate(f, 1):
            line = _decode(raw, path, n)
            if not line.strip():
                continue
            where = f"{path}:{n}"
            obj = _parse_line(line, where)
            _check_record(obj, where)
            yield (
                obj["text"] if isinstance(obj.get("text"), str) else _render_chat(obj["messages"], tokenizer)
            )


def iter_documents(
    sources: Sequence[str | Path] | None, tokenizer: Any, seed: int = 0, split: str = "calib"
) -> Iterator[str]:
    """Documents from ``sources`` (or the default corpus's ``split``), files in a seeded order.

    Files from ``sources`` are decoded strictly (:class:`CorpusError` for binary or non-UTF-8
    files); the default corpus with replacement characters (deterministic)."""
    quiet_length_warning(tokenizer)
    files = default_corpus(split) if not sources else _expand(sources)
    random.Random(seed).shuffle(files)
    for path in files:
        if sources and path.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(path, tokenizer)
            continue
        text = _read_text(path) if sources else path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def token_sequences(
    tokenizer: Any,
    sources: Sequence[str | Path] | None,
    num_sequences: int,
    seq_len: int,
    seed: int = 0,
    split: str = "calib",
    lower: str = "--tokens/--holdout-tokens",
) -> torch.Tensor:
    """``num_sequences`` contiguous windows of ``seq_len`` tokens: LongTensor ``[n, seq_len]``.

    Documents are tokenized in seeded order and joined with the EOS token. Raises
    :class:`CorpusError` when the corpus holds fewer tokens than asked (its hint: add data or
    lower the flags named by ``lower``).
    """
    need = num_sequences * seq_len
    quiet_length_warning(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for doc in iter_documents(sources, tokenizer, seed, split):
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"]
        if eos is not None:
            stream.append(int(eos))
        if len(stream) >= need:
            break
    if len(stream) < need:
        where = "the default corpus" if not sources else ", ".join(map(str, sources))
        raise CorpusError(
            f"{where} has {len(stream)} tokens, fewer than the {need} asked "
            f"({num_sequences} sequences x {seq_len}); add data or lower {lower}"
        )
    return torch.tensor(stream[:need], dtype=torch.long).view(num_sequences, seq_len)
