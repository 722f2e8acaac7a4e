"""Reading and writing rotation artifacts: our safetensors format and OSCAR RotationZoo ``.pt``.

Our artifact is one file, ``rotations.safetensors``: tensors ``layers.{id}.{k|v}.rotation`` and
``layers.{id}.{k|v}.eigenvalues`` (fp32) plus JSON metadata in the safetensors header under
the key ``oscarkv`` (format version, granularity, per-layer clips, QuantSpec, provenance).
OSCAR files (spec §2.9) are plain dicts read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..config import QuantSpec, SpecError
from .rotation_set import LayerRotation, Provenance, RotationFileError, RotationSet

__all__ = [
    "ARTIFACT_NAME",
    "load_oscar_files",
    "load_rotations",
    "save_oscar_files",
    "save_rotations",
]

ARTIFACT_NAME = "rotations.safetensors"
FORMAT = "oscarkv.rotations"
FORMAT_VERSION = 1


# ---- our format ---------------------------------------------------------------------------
def save_rotations(rs: RotationSet, path: str | Path) -> Path:
    """Write ``rs`` to ``path`` (a directory, or a ``.safetensors`` file); returns the file."""
    from safetensors.torch import save_file

    rs.validate(source="RotationSet being saved")
    path = Path(path)
    file = path if path.suffix == ".safetensors" else path / ARTIFACT_NAME
    file.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    clips: dict[str, list[float | None]] = {}
    for i in rs.layer_ids:
        lr = rs.layers[i]
        for kind, r, lam in (("k", lr.k, lr.k_eigenvalues), ("v", lr.v, lr.v_eigenvalues)):
            tensors[f"layers.{i}.{kind}.rotation"] = r.detach().float().contiguous().cpu()
            tensors[f"layers.{i}.{kind}.eigenvalues"] = lam.detach().float().contiguous().cpu()
        clips[str(i)] = [lr.k_clip, lr.v_clip]
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "granularity": rs.granularity,
        "layer_ids": rs.layer_ids,
        "head_dim": rs.head_dim,
        "clips": clips,
        "spec": rs.spec.to_dict(),
        "provenance": vars(rs.provenance),
    }
    save_file(tensors, str(file), metadata={"oscarkv": json.dumps(meta)})
    return file


def _load_ours(file: Path) -> RotationSet:
    from safetensors import safe_open

    src = str(file)
    try:
        with safe_open(src, framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open API)
    except Exception as e:  # safetensors raises its own error types for truncation/corruption
        raise RotationFileError(
            src,
            "cannot read safetensors file (truncated or corrupt)",
            fix=f"re-create it with `oscarkv calibrate` ({type(e).__name__}: {e})",
        ) from e
    if "oscarkv" not in header:
        raise RotationFileError(
            src,
            "safetensors file has no oscarkv metadata",
            "a file written by oscarkv",
            f"header keys {sorted(header)}",
        )
    try:
        meta = json.loads(header["oscarkv"])
    except json.JSONDecodeError as e:
        raise RotationFileError(src, "metadata is not valid JSON", fix=str(e)) from e
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise RotationFileError(
            src,
            "unsupported artifact format",
            f"{FORMAT} v{FORMAT_VERSION}",
            f"{meta.get('format')} v{meta.get('format_version')}",
            "upgrade oscarkv or re-create the artifact",
        )
    layers = {}
    for i in meta["layer_ids"]:
        try:
            t = {
                n: tensors[f"layers.{i}.{n}"]
                for n in ("k.rotation", "v.rotation", "k.eigenvalues", "v.eigenvalues")
            }
        except KeyError as e:
            raise RotationFileError(
                src,
                f"layer {i} is missing tensor {e.args[0]}",
                "K and V rotation and eigenvalues for every listed layer",
            ) from e
        kc, vc = meta.get("clips", {}).get(str(i), [None, None])
        layers[int(i)] = LayerRotation(
            t["k.rotation"], t["v.rotation"], t["k.eigenvalues"], t["v.eigenvalues"], kc, vc
        )
    try:
        spec = QuantSpec.from_dict(meta["spec"])
    except (SpecError, TypeError) as e:
        raise RotationFileError(src, "invalid QuantSpec in metadata", fix=str(e)) from e
    return RotationSet(layers, spec, meta["granularity"], Provenance(**meta["provenance"]))


# ---- OSCAR RotationZoo format -------------------------------------------------------------
def _torch_load_plain(file: Path) -> Any:
    src = str(file)
    if not file.is_file():
        raise RotationFileError(src, "file not found")
    if not zipfile.is_zipfile(file):
        raise RotationFileError(
            src,
            "not a torch.save zip archive (truncated or corrupt)",
            fix="download or export the file again",
        )
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise RotationFileError(
            src,
            "refusing to load: the pickle holds objects other than plain tensors/dicts",
            fix="only load rotation files from sources you trust; OSCAR files never need this",
        ) from e
    except Exception as e:
        raise RotationFileError(
            src,
            "cannot read torch file (truncated or corrupt)",
            fix=f"download or export it again ({type(e).__name__}: {e})",
        ) from e


def _oscar_layers(obj: Any, src: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("layers"), dict):
        raise RotationFileError(
            src,
            "not an OSCAR rotation file",
            "a dict with a 'layers' dict (spec §2.9)",
            f"{type(obj).__name__} with keys {sorted(obj) if isinstance(obj, dict) else '-'}",
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
        lam = torch.ones(r.shape[-1]) if lam is None else lam.float()
        out[lid] = (r, lam)
    return out


def load_oscar_files(k_file: str | Path, v_file: str | Path, spec: QuantSpec | None = None) -> RotationSet:
    """Read an OSCAR ``k_rotation_*.pt`` / ``v_rotation_*.pt`` pair into a :class:`RotationSet`."""
    k_file, v_file = Path(k_file), Path(v_file)
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
            "k_objective": k_obj.get("objective", ""),
            "v_objective": v_obj.get("objective", ""),
        },
    )
    return RotationSet(layers, spec or QuantSpec(), "layer", prov)


def save_oscar_files(
    rs: RotationSet,
    out_dir: str | Path,
    k_name: str = "k_rotation_qqt_r_h_pbr",
    v_name: str = "v_rotation_sst_r_h_pbr",
) -> tuple[Path, Path]:
    """Export per-layer rotations in OSCAR's format (readable by OSCAR's SGLang fork)."""
    if rs.granularity != "layer":
        raise ValueError(
            "OSCAR files hold one matrix per layer; kv_head rotations cannot be "
            "exported (calibrate with --granularity layer)"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, name in (("k", k_name), ("v", v_name)):
        layers = {}
        for i in rs.layer_ids:
            lr = rs.layers[i]
            r, lam = (lr.k, lr.k_eigenvalues) if kind == "k" else (lr.v, lr.v_eigenvalues)
            layers[i] = {
                "layer_id": i,
                "rotation": r.float().contiguous().cpu(),
                "eigenvalues": lam.float().contiguous().cpu(),
            }
        obj = {
            "format_version": 1,
            "objective": name.split("_rotation_", 1)[-1],
            "source_grouping": "layer",
            "layers": layers,
        }
        p = out_dir / f"{name}.pt"
        torch.save(obj, p)
        paths.append(p)
    return paths[0], paths[1]


# ---- dispatch -----------------------------------------------------------------------------
def _pick(dir_: Path, pattern: str) -> Path | None:
    found = sorted(dir_.glob(pattern))
    if len(found) > 1:
        raise RotationFileError(
            str(dir_),
            f"several files match {pattern}",
            "exactly one",
            ", ".join(p.name for p in found),
            "pass the K file and v_path= explicitly",
        )
    return found[0] if found else None


def load_rotations(
    path: str | Path,
    *,
    v_path: str | Path | None = None,
    model_config: Any = None,
    spec: QuantSpec | None = None,
) -> RotationSet:
    """Load and validate rotations from our artifact or OSCAR RotationZoo files.

    Args:
        path: a directory holding ``rotations.safetensors`` or one ``k_rotation*.pt`` and one
            ``v_rotation*.pt``; or our ``.safetensors`` file; or an OSCAR K ``.pt`` file (its V
            file is ``v_path`` or the single ``v_rotation*.pt`` beside it).
        model_config: a transformers config (or dict); when given, head_dim and the attention
            layer ids must match it.
        spec: the QuantSpec to attach (OSCAR files carry none; ours keep theirs unless given).
    Raises:
        RotationFileError: naming the file, what was expected and what was found.
    """
    path = Path(path)
    if path.is_dir():
        ours = path / ARTIFACT_NAME
        if ours.is_file():
            rs, src = _load_ours(ours), str(ours)
        else:
            k, v = _pick(path, "k_rotation*.pt"), _pick(path, "v_rotation*.pt")
            if k is None or v is None:
                raise RotationFileError(
                    str(path),
                    "no rotation files in directory",
                    f"{ARTIFACT_NAME} or k_rotation*.pt + v_rotation*.pt",
                    ", ".join(p.name for p in sorted(path.iterdir())) or "empty",
                )
            rs, src = load_oscar_files(k, v, spec), f"{k} + {v}"
    elif path.suffix == ".safetensors":
        rs, src = _load_ours(path), str(path)
    elif path.suffix == ".pt":
        v = Path(v_path) if v_path is not None else _pick(path.parent, "v_rotation*.pt")
        if v is None:
            raise RotationFileError(
                str(path),
                "no V rotation file beside the K file",
                "a v_rotation*.pt in the same folder",
                "none",
                "pass v_path=",
            )
        rs, src = load_oscar_files(path, v, spec), f"{path} + {v}"
    elif not path.exists():
        raise RotationFileError(str(path), "no such file or directory")
    else:
        raise RotationFileError(
            str(path),
            "unknown rotation file type",
            "a directory, .safetensors or .pt",
            path.suffix or "no suffix",
        )
    if spec is not None:
        rs = rs.with_spec(spec)
    return rs.validate(model_config, source=src)
