"""The ``oscarkv`` JSON header of a rotation artifact (built on save, checked whole on load)
and the file guards around it (readable inputs; atomic writes that replace only our files).

Every field is checked before any tensor is used; each failure is a :class:`RotationFileError`
naming the field, what was expected and what was found. Keys a newer writer may add (top level,
``provenance``, ``spec``) and tensors of layers outside ``layer_ids`` are dropped and reported
in one note, which :func:`~oscarkv.rotation.load_rotations` issues as an ``OscarkvWarning``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import QuantSpec, SpecError
from ..config.spec import SUPPORTED_BITS
from ..utils.files import atomic_write, enclosing_model_dir
from .rotation_set import (
    GRANULARITIES,
    LayerRotation,
    Provenance,
    RotationFileError,
    RotationSet,
    first_line,
    valid_clip,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ArtifactMeta",
    "artifact_tensors",
    "build_metadata",
    "check_readable",
    "guard_target",
    "not_an_artifact",
    "parse_metadata",
    "write_atomic",
]

FORMAT = "oscarkv.rotations"
#: version 2 adds per-layer key bits (``key_bits``); files without them are still written as 1
FORMAT_VERSION = 2
REQUIRED = ("format", "format_version", "granularity", "layer_ids", "head_dim", "clips", "spec", "provenance")
TENSOR_NAMES = ("k.rotation", "v.rotation", "k.eigenvalues", "v.eigenvalues")
#: tensors a layer may hold (static channel offsets, rotated basis)
OPTIONAL_TENSOR_NAMES = ("k.offset", "v.offset")
OVERWRITE_HINT = "pass overwrite=True (--overwrite on the command line) to replace it, or choose another path"
REMAKE = "re-create the artifact with `oscarkv calibrate` (it was damaged or edited by hand)"
_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.")


@dataclass
class ArtifactMeta:
    """The checked header: everything needed to rebuild the :class:`RotationSet`."""

    granularity: str
    layer_ids: list[int]
    head_dim: int
    clips: dict[int, tuple[float | None, float | None]]
    spec: QuantSpec
    provenance: Provenance
    key_bits: dict[int, int] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # unknown keys, dropped

    def layers(self, tensors: dict[str, torch.Tensor], src: str) -> tuple[dict[int, LayerRotation], str]:
        """The layers named by ``layer_ids`` and a note ("" if none) on everything ignored."""
        layers = {}
        for i in self.layer_ids:
            names = [f"layers.{i}.{n}" for n in TENSOR_NAMES]
            for n in names:
                if n not in tensors:
                    raise RotationFileError(
                        src,
                        f"layer {i} is missing tensor {n}",
                        "K and V rotation and eigenvalues for every listed layer",
                        fix=REMAKE,
                    )
            k, v, lk, lv = (tensors[n] for n in names)
            for kind, r in (("K", k), ("V", v)):
                if r.dim() < 2 or r.shape[-1] != self.head_dim:
                    raise RotationFileError(
                        src,
                        "metadata field 'head_dim' does not match the tensors",
                        f"rotations of size {self.head_dim} (the metadata's head_dim)",
                        f"layer {i} {kind} rotation of shape {tuple(r.shape)}",
                        REMAKE,
                    )
            kc, vc = self.clips.get(i, (None, None))
            ko, vo = (tensors.get(f"layers.{i}.{n}") for n in OPTIONAL_TENSOR_NAMES)
            layers[i] = LayerRotation(k, v, lk, lv, kc, vc, ko, vo, self.key_bits.get(i))
        known = {f"layers.{i}.{n}" for i in self.layer_ids for n in TENSOR_NAMES + OPTIONAL_TENSOR_NAMES}
        extra_layers, extra = set(), []
        for name in sorted(set(tensors) - known):
            m = _LAYER_TENSOR.match(name)
            if m and int(m.group(1)) not in self.layer_ids:
                extra_layers.add(int(m.group(1)))
            else:
                extra.append(name)
        parts = []
        if self.ignored:
            parts.append(f"unknown metadata keys {self.ignored}")
        if extra_layers:
            parts.append(f"tensors of layers {sorted(extra_layers)} not in layer_ids")
        if extra:
            parts.append(f"unknown tensors {extra[:8]}" + (" ..." if len(extra) > 8 else ""))
        note = f"{src}: written by a newer oscarkv? ignoring " + " and ".join(parts) if parts else ""
        return layers, note


def build_metadata(rs: RotationSet) -> dict[str, Any]:
    """The header written by ``save_rotations`` (``rs`` must be valid)."""
    clips = {}
    for i in rs.layer_ids:
        lr = rs.layers[i]
        clips[str(i)] = [None if c is None else float(c) for c in (lr.k_clip, lr.v_clip)]
    key_bits = {str(i): int(rs.layers[i].key_bits) for i in rs.layer_ids if rs.layers[i].key_bits is not None}
    spec = rs.spec.to_dict()
    if spec["window_dtype"] == "model":  # the default is left out: older readers note unknown keys
        del spec["window_dtype"]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if key_bits else 1,
        "granularity": rs.granularity,
        "layer_ids": [int(i) for i in rs.layer_ids],
        "head_dim": rs.head_dim,
        "clips": clips,
        **({"key_bits": key_bits} if key_bits else {}),
        "spec": spec,
        "provenance": dataclasses.asdict(rs.provenance),
    }


def artifact_tensors(rs: RotationSet) -> dict[str, torch.Tensor]:
    """The fp32 CPU tensors of ``rs`` under their artifact names (each its own copy: safetensors
    refuses tensors that share memory, as layers built from one eigenvalue tensor would)."""
    tensors = {}
    for i in rs.layer_ids:
        lr = rs.layers[i]
        for kind, r, lam in (("k", lr.k, lr.k_eigenvalues), ("v", lr.v, lr.v_eigenvalues)):
            tensors[f"layers.{i}.{kind}.rotation"] = (
                r.detach().float().cpu().clone(memory_format=torch.contiguous_format)
            )
            tensors[f"layers.{i}.{kind}.eigenvalues"] = (
                lam.detach().float().cpu().clone(memory_format=torch.contiguous_format)
            )
            off = lr.k_offset if kind == "k" else lr.v_offset
            if off is not None:
                tensors[f"layers.{i}.{kind}.offset"] = (
                    off.detach().float().cpu().clone(memory_format=torch.contiguous_format)
                )
    return tensors


def not_an_artifact(file: Path) -> str | None:
    """``None`` if ``file`` is a safetensors file with an ``oscarkv`` header, else what it is."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            header = f.metadata() or {}
    except Exception:
        return "a file that is not a readable safetensors file"
    return None if "oscarkv" in header else "a safetensors file without oscarkv metadata"


# ---- files --------------------------------------------------------------------------------
def check_readable(file: Path) -> str:
    """``str(file)``, or a :class:`RotationFileError` if it is missing, a directory or unreadable."""
    src = str(file)
    if not file.exists():
        raise RotationFileError(src, "no such file or directory")
    if file.is_dir():
        raise RotationFileError(src, "is a directory; expected a file")
    if not os.access(file, os.R_OK):
        raise RotationFileError(src, "not readable (permission denied)")
    return src


def guard_target(file: Path, overwrite: bool, not_ours: Callable[[Path], str | None]) -> None:
    """Refuse to write ``file`` if it exists, unless ``overwrite`` and it is one of our files."""
    if not file.exists() and not file.is_symlink():
        return
    if file.is_dir():
        raise RotationFileError(f"refusing to write {file}", "it is a directory", fix="choose another path")
    if not overwrite:
        raise RotationFileError(f"refusing to replace {file}", "it already exists", fix=OVERWRITE_HINT)
    found = not_ours(file)
    if found is not None:
        model = enclosing_model_dir(file)
        where = f"it lies in the model directory {model}; " if model else ""
        raise RotationFileError(
            f"refusing to replace {file}",
            "it is not an oscarkv rotation artifact",
            found=found,
            fix=f"{where}choose another output path (or move that file away yourself)",
        )


def write_atomic(file: Path, fill: Callable[[Any], None]) -> None:
    """Call ``fill(f)`` on a temporary file that then atomically replaces ``file`` (mode 0644)."""
    try:
        with atomic_write(file, "wb") as f:
            fill(f)
    except OSError as e:
        raise RotationFileError(str(file), "cannot write the file", found=first_line(e)) from e


# ---- checks -------------------------------------------------------------------------------
def _show(v: object) -> str:
    """``v`` (a decoded JSON value) and its JSON type, short and on one line."""
    kinds = {dict: "a JSON object", list: "a JSON list", str: "a string", bool: "a boolean"}
    kinds.update({int: "an integer", float: "a number", type(None): "null"})
    text = repr(v)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({kinds.get(type(v), type(v).__name__)})"


def _bad(src: str, name: str, expected: str, value: object) -> RotationFileError:
    return RotationFileError(src, f"metadata field '{name}' is invalid", expected, _show(value), REMAKE)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_metadata(text: str | None, src: str) -> ArtifactMeta:
    """Decode and check the ``oscarkv`` header string of ``src`` (``None``: no header)."""
    if text is None:
        raise RotationFileError(
            src,
            "safetensors file has no oscarkv metadata (it is not an oscarkv rotation artifact)",
            "a file written by oscarkv's save_rotations or `oscarkv calibrate`",
            "a safetensors file without the 'oscarkv' header key",
        )
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RotationFileError(src, "metadata is not valid JSON", found=first_line(e), fix=REMAKE) from e
    if not isinstance(meta, dict):
        raise RotationFileError(src, "metadata is not a JSON object", "a JSON object", _show(meta), REMAKE)
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise RotationFileError(
            src,
            f"metadata field '{missing[0]}' is missing",
            "the fields " + ", ".join(REQUIRED),
            f"only {sorted(meta)}",
            REMAKE,
        )
    ignored = sorted(k for k in meta if k not in (*REQUIRED, "key_bits"))
    version = meta["format_version"]
    if meta["format"] != FORMAT:
        raise _bad(src, "format", repr(FORMAT), meta["format"])
    if _is_int(version) and version > FORMAT_VERSION:
        raise RotationFileError(
            src,
            f"artifact format version {version} is newer than this oscarkv reads",
            f"format_version {FORMAT_VERSION}",
            str(version),
            "upgrade oscarkv (pip install -U oscarkv), or re-create the artifact with this version",
        )
    if not _is_int(version) or version not in (1, FORMAT_VERSION):
        raise _bad(src, "format_version", f"1 or {FORMAT_VERSION}", version)
    if meta["granularity"] not in GRANULARITIES:
        raise _bad(src, "granularity", " or ".join(map(repr, GRANULARITIES)), meta["granularity"])
    layer_ids = _layer_ids(meta["layer_ids"], src)
    head_dim = meta["head_dim"]
    if not _is_int(head_dim) or head_dim <= 0:
        raise _bad(src, "head_dim", "a positive integer", head_dim)
    return ArtifactMeta(
        granularity=meta["granularity"],
        layer_ids=layer_ids,
        head_dim=head_dim,
        clips=_clips(meta["clips"], layer_ids, src, ignored),
        key_bits=_key_bits(meta.get("key_bits", {}), layer_ids, src, ignored),
        spec=_spec(meta["spec"], src, ignored),
        provenance=_provenance(meta["provenance"], src, ignored),
        ignored=ignored,
    )


def _layer_ids(ids: object, src: str) -> list[int]:
    expected = "a non-empty list of unique layer ids (integers >= 0)"
    if not isinstance(ids, list) or not ids:
        raise _bad(src, "layer_ids", expected, ids)
    for i in ids:
        if not _is_int(i) or i < 0:
            raise _bad(src, "layer_ids", expected, i)
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise RotationFileError(
            src, "metadata field 'layer_ids' is invalid", expected, f"duplicates {dup}", REMAKE
        )
    return list(ids)


def _per_layer(
    raw: object, field: str, want: str, layer_ids: list[int], src: str, ignored: list[str],
    parse: Callable[[str, Any], Any],
) -> dict[int, Any]:  # fmt: skip
    """A ``{"<layer id>": value}`` header field, each value through ``parse(where, value)``; keys
    that name no listed layer are ignored (noted in ``ignored``)."""
    if not isinstance(raw, dict):
        raise _bad(src, field, f'a JSON object {{"<layer id>": {want}}}', raw)
    out = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and int(key) in layer_ids):
            ignored.append(f"{field}.{key}")
            continue
        out[int(key)] = parse(f"{field}.{key}", value)
    return out


def _clips(raw: object, layer_ids: list[int], src: str, ignored: list[str]) -> dict:
    def pair(where: str, p: Any) -> tuple[float | None, float | None]:
        if not isinstance(p, list) or len(p) != 2:
            raise _bad(src, where, "a list [k_clip, v_clip]", p)
        for name, c in zip(("k_clip", "v_clip"), p, strict=True):
            if not valid_clip(c):
                raise _bad(src, f"{where}.{name}", "null or a finite number in [0, 1]", c)
        return tuple(None if c is None else float(c) for c in p)  # type: ignore[return-value]

    return _per_layer(raw, "clips", "[k_clip, v_clip]", layer_ids, src, ignored, pair)


def _key_bits(raw: object, layer_ids: list[int], src: str, ignored: list[str]) -> dict[int, int]:
    """Per-layer key widths; whether the spec allows them is checked with the assembled set."""

    def width(where: str, b: Any) -> int:
        if not _is_int(b) or b not in SUPPORTED_BITS:
            raise _bad(src, where, "2, 3 or 4", b)
        return int(b)

    return _per_layer(raw, "key_bits", "2, 3 or 4", layer_ids, src, ignored, width)


def _spec(raw: object, src: str, ignored: list[str]) -> QuantSpec:
    if not isinstance(raw, dict):
        raise _bad(src, "spec", "a JSON object of QuantSpec fields", raw)
    known = {f.name for f in dataclasses.fields(QuantSpec)}
    ignored.extend(f"spec.{k}" for k in sorted(raw) if k not in known)
    try:
        return QuantSpec.from_dict({k: v for k, v in raw.items() if k in known})
    except (SpecError, TypeError) as e:
        raise RotationFileError(
            src, "metadata field 'spec' is invalid", "a valid QuantSpec", first_line(e), REMAKE
        ) from e


_PROV_TYPES = {k: typing.get_origin(t) or t for k, t in typing.get_type_hints(Provenance).items()}


def _provenance(raw: object, src: str, ignored: list[str]) -> Provenance:
    if not isinstance(raw, dict):
        raise _bad(src, "provenance", "a JSON object", raw)
    ignored.extend(f"provenance.{k}" for k in sorted(raw) if k not in _PROV_TYPES)
    for k, t in _PROV_TYPES.items():
        if k in raw and not isinstance(raw[k], t):
            want = "a JSON object" if t is dict else f"a {'string' if t is str else t.__name__}"
            raise _bad(src, f"provenance.{k}", want, raw[k])
    return Provenance(**{k: v for k, v in raw.items() if k in _PROV_TYPES})
