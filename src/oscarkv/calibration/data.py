"""Calibration text -> fixed-length token sequences (seeded, deterministic, offline).

Sources are text files, folders of text or code (searched recursively), or JSONL files whose
lines hold a ``text`` field or chat ``messages`` (rendered with the tokenizer's chat template
when it has one). With no sources, the Python standard library's own sources are used: they
are on every machine, so ``oscarkv calibrate --model PATH`` needs no data arguments.
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

__all__ = [
    "CorpusError",
    "default_corpus",
    "eval_sequences",
    "iter_documents",
    "ranked_eval_files",
    "token_sequences",
]

TEXT_SUFFIXES = {
    ".txt", ".md", ".rst", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".js", ".ts", ".java",
    ".go", ".rs", ".sh", ".toml", ".yaml", ".yml", ".html", ".css", ".tex", ".jsonl",
}  # fmt: skip


class CorpusError(ValueError):
    """The calibration corpus is missing, unreadable or too small."""


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
            raise CorpusError(f"{p}: no such file or directory")
    return files


def _render_chat(messages: Any, tokenizer: Any, where: str) -> str:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise CorpusError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)


def _jsonl_documents(path: Path, tokenizer: Any) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: invalid JSON ({e.msg})") from e
            if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                yield obj["text"]
            elif isinstance(obj, dict) and "messages" in obj:
                yield _render_chat(obj["messages"], tokenizer, where)
            else:
                raise CorpusError(f"{where}: expected an object with a 'text' string or 'messages'")


def iter_documents(
    sources: Sequence[str | Path] | None, tokenizer: Any, seed: int = 0, split: str = "calib"
) -> Iterator[str]:
    """Documents from ``sources`` (or the default corpus's ``split``), files in a seeded order."""
    files = default_corpus(split) if not sources else _expand(sources)
    random.Random(seed).shuffle(files)
    for path in files:
        if path.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(path, tokenizer)
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield text


def token_sequences(
    tokenizer: Any,
    sources: Sequence[str | Path] | None,
    num_sequences: int,
    seq_len: int,
    seed: int = 0,
    split: str = "calib",
) -> torch.Tensor:
    """``num_sequences`` contiguous windows of ``seq_len`` tokens: LongTensor ``[n, seq_len]``.

    Documents are tokenized in seeded order and joined with the EOS token. Raises
    :class:`CorpusError` when the corpus holds fewer tokens than asked.
    """
    need = num_sequences * seq_len
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
            f"({num_sequences} sequences x {seq_len}); add data or lower --tokens/--holdout-tokens"
        )
    return torch.tensor(stream[:need], dtype=torch.long).view(num_sequences, seq_len)
