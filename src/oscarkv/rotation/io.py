"""Reading and writing rotation artifacts: our safetensors format and OSCAR RotationZoo ``.pt``.

Our artifact is one file, ``rotations.safetensors``: tensors ``layers.{id}.{k|v}.rotation`` and
``layers.{id}.{k|v}.eigenvalues`` (fp32) plus JSON metadata in the safetensors header under
the key ``oscarkv`` (format version, granularity, per-layer clips, QuantSpec, provenance; checked
whole on load by :mod:`.metadata`). OSCAR files (spec §2.9) are plain dicts read with
``torch.load(weights_only=True)``.

Writes are atomic (a temporary file renamed into place, mode 0644) and never replace a file
that is not a rotation artifact; an existing artifact is replaced only with ``overwrite=True``.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..config import QuantSpec
from ..errors import OscarkvWarning
from ..utils.files import enclosing_model_dir
from .metadata import (
    FORMAT,
    FORMAT_VERSION,
    artifact_tensors,
    build_metadata,
    check_readable,
    guard_target,
    not_an_artifact,
    parse_metadata,
    write_atomic,
)
from .rotation_set import LayerRotation, Provenance, RotationFileError, RotationSet, check_spec, first_line

__all__ = [
    "ARTIFACT_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "load_oscar_files",
    "load_rotations",
    "save_oscar_files",
    "save_rotations",
]

ARTIFACT_NAME = "rotations.safetensors"
SAVE_FIX = f"pass a directory (the artifact goes in it as {ARTIFACT_NAME}) or a path ending in .safetensors"
OUTSIDE_MODEL_FIX = (
    "write rotations outside the model directory (e.g. next to it); model files stay untouched"
)
V_FILE_HINT = (
    "pass a directory holding exactly one k_rotation*.pt and one v_rotation*.pt "
    "(or v_path= in Python; `oscarkv info` has --v-path)"
)


# ---- our format ---------------------------------------------------------------------------
def _as_path(p: object, what: str, fn: str) -> Path:
    if isinstance(p, str | os.PathLike) and isinstance(os.fspath(p), str):
        return Path(p)
    fix = "pass a path such as 'rotations/' or Path('rotations.safetensors')"
    raise RotationFileError(fn, f"{what} must be a str or os.PathLike; got {type(p).__name__}", fix=fix)


def save_rotations(rs: RotationSet, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``rs`` to ``path`` (a directory, or a ``.safetensors`` file); returns the file.

    The write is atomic. An existing file is refused unless ``overwrite``, and even then only an
    oscarkv artifact is replaced (never, say, a model's ``model.safetensors``); a path inside a
    model directory or with a suffix other than ``.safetensors`` (unless a directory) is refused.
    """
    from safetensors.torch import save

    path = _as_path(path, "path", "save_rotations")
    rs.validate(source="RotationSet being saved")
    if path.suffix != ".safetensors" and not path.is_dir():
        err = partial(RotationFileError, str(path), fix=SAVE_FIX)
        if path.exists():
            raise err("is an existing file; expected a directory or a .safetensors path")
        if path.suffix:
            raise err(f"save_rotations writes a directory or a .safetensors file; got {path.name}")
    file = path if path.suffix == ".safetensors" else path / ARTIFACT_NAME
    guard_target(file, overwrite, not_an_artifact)
    if (model := enclosing_model_dir(file)) is not None:
        inside = f"it lies inside the model directory {model}"
        raise RotationFileError(f"refusing to write {file}", inside, fix=OUTSIDE_MODEL_FIX)
    data = save(artifact_tensors(rs), metadata={"oscarkv": json.dumps(build_metadata(rs))})
    write_atomic(file, lambda f: f.write(data))
    return file


def _load_ours(file: Path) -> tuple[RotationSet, str]:
    """The set in ``file`` and a note ("" if none) on unknown keys or tensors it ignored."""
    from safetensors import safe_open

    src = check_readable(file)
    try:
        with safe_open(src, framework="pt") as f:
            meta = parse_metadata((f.metadata() or {}).get("oscarkv"), src)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open API)
    except RotationFileError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncation/corruption
        raise RotationFileError(
            src,
            "cannot read safetensors file (truncated or corrupt)",
            found=first_line(e),
            fix="copy the file again or re-create it with `oscarkv calibrate`",
        ) from e
    layers, note = meta.layers(tensors, src)
    return RotationSet(layers, meta.spec, meta.granularity, meta.provenance), note


# ---- OSCAR RotationZoo format -------------------------------------------------------------
def _torch_load_plain(file: Path) -> Any:
    src = check_readable(file)
    if not zipfile.is_zipfile(file):
        bad = "not a torch.save zip archive (truncated or corrupt)"
        raise RotationFileError(src, bad, fix="download or export the file again")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise RotationFileError(
            src,
            "refusing to load: the pickle holds objects other than plain tensors/dicts",
            fix="only load rotation files from sources you trust; OSCAR files never need this",
        ) from e
    except Exception as e:
        bad = "cannot read torch file (truncated or corrupt)"
        raise RotationFileError(src, bad, found=first_line(e), fix="download or export it again") from e


def _oscar_layers(obj: Any, src: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("layers"), dict):
        raise RotationFileError(
            src,
            "not an OSCAR rotation file",
            "a dict with a 'layers' dict (spec §2.9)",
            f"{type(obj).__name__} with keys {sorted(map(str, obj)) if isinstance(obj, dict) else '-'}",
        )
    if obj.get("format_version", 1) != 1:
        raise RotationFileError(src, "unsupported OSCAR format_version", "1", repr(obj.get("format_version")))
    grouping = obj.get("source_grouping", "layer")
    if grouping != "layer":
        raise RotationFileError(src, "unsupported source_grouping", "'layer'", repr(grouping))
    out = {}
    for key, entry in obj["layers"].items():
        try:
            lid = int(key)
        except (TypeError, ValueError) as e:
            raise RotationFileError(src, "layer key is not an integer", "int or str(int)", repr(key)) from e
        if not isinstance(entry, dict) or not isinstance(entry.get("rotation"), torch.Tensor):
            raise RotationFileError(
                src,
                f"layer {lid} has no 'rotation' tensor",
                "{'rotation': Tensor[d, d], 'eigenvalues': Tensor[d]}",
                repr(type(entry).__name__),
            )
        r = entry["rotation"].float()
        lam = entry.get("eigenvalues")
        lam = torch.ones(r.shape[-1]) if not isinstance(lam, torch.Tensor) else lam.float()
        out[lid] = (r, lam)
    return out


def _not_oscar(file: Path) -> str | None:
    try:
        _oscar_layers(_torch_load_plain(file), str(file))
    except RotationFileError:
        return "a file that is not an OSCAR rotation dict"
    return None


def load_oscar_files(k_file: str | Path, v_file: str | Path, spec: QuantSpec | None = None) -> RotationSet:
    """Read an OSCAR ``k_rotation_*.pt`` / ``v_rotation_*.pt`` pair into a :class:`RotationSet`."""
    k_file, v_file = Path(k_file), Path(v_file)
    check_readable(k_file), check_readable(v_file)
    if os.path.samefile(k_file, v_file):
        same = "the V file is the K file"
        raise RotationFileError(f"{k_file} + {v_file}", same, "a separate v_rotation*.pt", fix=V_FILE_HINT)
    k_obj, v_obj = _torch_load_plain(k_file), _torch_load_plain(v_file)
    k, v = _oscar_layers(k_obj, str(k_file)), _oscar_layers(v_obj, str(v_file))
    if sorted(k) != sorted(v):
        only_k, only_v = sorted(set(k) - set(v)), sorted(set(v) - set(k))
        raise RotationFileError(
            f"{k_file} + {v_file}",
            "K and V files cover different layers",
            "the same layer ids in both",
            f"only in K: {only_k}, only in V: {only_v}",
        )
    layers = {i: LayerRotation(k[i][0], v[i][0], k[i][1], v[i][1]) for i in k}
    prov = Provenance(
        source="oscar-rotationzoo",
        recipe={
            "k_file": k_file.name,
            "v_file": v_file.name,
            "k_objective": str(k_obj.get("objective", "")),
            "v_objective": str(v_obj.get("objective", "")),
        },
    )
    return RotationSet(layers, spec or QuantSpec(), "layer", prov)


def save_oscar_files(
    rs: RotationSet,
    out_dir: str | Path,
    k_name: str = "k_rotation_qqt_r_h_pbr",
    v_name: str = "v_rotation_sst_r_h_pbr",
    *,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """Export per-layer rotations in OSCAR's format (readable by OSCAR's SGLang fork).

    Each file is written atomically. Existing files are refused unless ``overwrite``, and even
    then only OSCAR rotation files are replaced; both targets are checked before either is written.
    """
    if rs.granularity != "layer":
        raise RotationFileError(
            "RotationSet being exported",
            "OSCAR files hold one matrix per layer; kv_head rotations cannot be exported",
            fix="calibrate with --granularity layer",
        )
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RotationFileError(str(out_dir), "is an existing file; expected a directory")
    paths = [out_dir / f"{name}.pt" for name in (k_name, v_name)]
    for p in paths:
        guard_target(p, overwrite, _not_oscar)
    for kind, name, p in (("k", k_name, paths[0]), ("v", v_name, paths[1])):
        layers = {}
        for i in rs.layer_ids:
            lr = rs.layers[i]
            r, lam = (lr.k, lr.k_eigenvalues) if kind == "k" else (lr.v, lr.v_eigenvalues)
            layers[i] = {
                "layer_id": i,
                "rotation": r.detach().float().contiguous().cpu(),
                "eigenvalues": lam.detach().float().contiguous().cpu(),
            }
        obj = {
            "format_version": 1,
            "objective": name.split("_rotation_", 1)[-1],
            "source_grouping": "layer",
            "layers": layers,
        }
        write_atomic(p, lambda f, obj=obj: torch.save(obj, f))
    return paths[0], paths[1]


# ---- dispatch -----------------------------------------------------------------------------
def _pick(dir_: Path, pattern: str) -> Path | None:
    found = sorted(dir_.glob(pattern))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise RotationFileError(
            str(dir_), f"several files match {pattern}", "exactly one", names, V_FILE_HINT
        )
    return found[0] if found else None


def load_rotations(
    path: str | Path,
    *,
    v_path: str | Path | None = None,
    model_config: Any = None,
    spec: QuantSpec | None = None,
    strict: bool = False,
) -> RotationSet:
    """Load and validate rotations from our artifact or OSCAR RotationZoo files.

    Args:
        path: a directory holding ``rotations.safetensors`` or one ``k_rotation*.pt`` and one
            ``v_rotation*.pt``; or our ``.safetensors`` file; or an OSCAR K ``.pt`` file (its V
            file is ``v_path`` or the single ``v_rotation*.pt`` beside it).
        v_path: the OSCAR V file (for a K ``.pt`` file or a directory of ``.pt`` files).
        model_config: a transformers config (or dict); when given, head_dim and the attention
            layer ids must match it, and a different recorded config hash warns.
        spec: the QuantSpec to attach (OSCAR files carry none; ours keep theirs unless given).
        strict: make a config-hash mismatch an error instead of an ``ArtifactMismatchWarning``.
    Raises:
        RotationFileError: naming the file, what was expected and what was found.
    Warns:
        OscarkvWarning: the artifact holds metadata keys or tensors this version does not know.
    """
    path = _as_path(path, "path", "load_rotations")
    v_path = None if v_path is None else _as_path(v_path, "v_path", "load_rotations")
    if spec is not None:
        check_spec(spec)
    note = ""
    if not path.exists():
        raise RotationFileError(str(path), "no such file or directory")
    if path.is_dir():
        ours = path / ARTIFACT_NAME
        if ours.is_file() and v_path is None:
            (rs, note), src = _load_ours(ours), str(ours)
        else:
            k = _pick(path, "k_rotation*.pt")
            v = Path(v_path) if v_path is not None else _pick(path, "v_rotation*.pt")
            if k is None or v is None:
                raise RotationFileError(
                    str(path),
                    "no rotation files in directory",
                    f"{ARTIFACT_NAME} or k_rotation*.pt + v_rotation*.pt",
                    ", ".join(p.name for p in sorted(path.iterdir())) or "empty",
                )
            rs, src = load_oscar_files(k, v, spec), f"{k} + {v}"
    elif path.suffix == ".safetensors":
        (rs, note), src = _load_ours(path), str(path)
    elif path.suffix == ".pt":
        v = Path(v_path) if v_path is not None else _pick(path.parent, "v_rotation*.pt")
        if v is None:
            raise RotationFileError(
                str(path), "no V rotation file beside the K file", "a v_rotation*.pt in the same folder",
                "none", V_FILE_HINT,
            )  # fmt: skip
        rs, src = load_oscar_files(path, v, spec), f"{path} + {v}"
    else:
        kind = path.suffix or "no suffix"
        raise RotationFileError(
            str(path), "unknown rotation file type", "a directory, .safetensors or .pt", kind
        )
    if note:
        warnings.warn(note, OscarkvWarning, stacklevel=2)
    if spec is not None:
        rs = rs.with_spec(spec)
    return rs._validate(model_config, src, strict, stacklevel=4)
