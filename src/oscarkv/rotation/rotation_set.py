"""`RotationSet`: per-layer (optionally per-KV-head) K and V rotations plus spec and provenance."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import QuantSpec
from ..errors import ArtifactMismatchWarning, OscarkvError

__all__ = [
    "GRANULARITIES",
    "ORTHO_TOL",
    "LayerRotation",
    "Provenance",
    "RotationFileError",
    "RotationSet",
    "attention_layer_ids",
    "config_fingerprint",
    "model_head_dim",
]

GRANULARITIES = ("layer", "kv_head")
#: max |RᵀR − I| accepted on load (fp32 files; OSCAR's runtime uses BF16 copies, ~1e-3)
ORTHO_TOL = 1e-3


def one_line(text: object) -> str:
    """``text`` with its lines joined by spaces (messages and hints are single lines)."""
    return " ".join(s.strip() for s in str(text).splitlines() if s.strip())


def first_line(e: BaseException) -> str:
    """``"Type: first line of the message"`` of an exception, for embedding in a message."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


class RotationFileError(OscarkvError):
    """A rotation artifact is unreadable or inconsistent.

    ``str(e)`` is one line: ``"{source}: {problem}; expected {expected}; found {found}"``;
    ``e.hint`` holds ``fix`` (the next step), also one line.
    """

    def __init__(self, source: str, problem: str, expected: str = "", found: str = "", fix: str = ""):
        parts = [f"{source}: {problem}"]
        if expected:
            parts.append(f"expected {expected}")
        if found:
            parts.append(f"found {found}")
        super().__init__(one_line("; ".join(parts)), one_line(fix))


def valid_clip(c: object) -> bool:
    """Whether ``c`` is a usable per-layer clip: ``None`` or a finite real number in [0, 1]."""
    if c is None:
        return True
    if isinstance(c, bool) or not isinstance(c, numbers.Real):
        return False
    return math.isfinite(float(c)) and 0.0 <= float(c) <= 1.0


def _text_config(config: Any) -> Any:
    if isinstance(config, dict):
        from types import SimpleNamespace

        config = SimpleNamespace(**config)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def model_head_dim(config: Any) -> int:
    """Attention head dim of a transformers config (or a plain dict)."""
    c = _text_config(config)
    hd = getattr(c, "head_dim", None)
    return int(hd) if hd else int(c.hidden_size // c.num_attention_heads)


def attention_layer_ids(config: Any) -> list[int]:
    """Global ids of the softmax-attention layers (linear-attention layers of hybrids excluded)."""
    c = _text_config(config)
    types = getattr(c, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if "attention" in t and "linear" not in t]
    return list(range(int(c.num_hidden_layers)))


def config_fingerprint(config: Any) -> str:
    """Short hash of the config fields a rotation depends on (shapes, RoPE, layer types)."""
    c = _text_config(config)
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "rope_parameters",
        "layer_types",
    )
    d = {k: getattr(c, k, None) for k in keys}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class LayerRotation:
    """One attention layer. Rotations are fp32 ``[d, d]`` (granularity ``layer``) or
    ``[H_kv, d, d]`` (``kv_head``); eigenvalues ``[d]`` / ``[H_kv, d]``, ascending as from eigh.
    ``k_clip`` / ``v_clip`` override the spec's global ratios when not ``None``."""

    k: torch.Tensor
    v: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    k_clip: float | None = None
    v_clip: float | None = None


@dataclass
class Provenance:
    """Where a rotation set came from."""

    source: str = "oscarkv"  # or "oscar-rotationzoo"
    model_name: str = ""
    config_hash: str = ""
    recipe: dict[str, Any] = field(default_factory=dict)
    library_version: str = ""
    created: str = ""


@dataclass
class RotationSet:
    """K and V rotations for every attention layer of one model, with the spec they target."""

    layers: dict[int, LayerRotation]
    spec: QuantSpec = field(default_factory=QuantSpec)
    granularity: str = "layer"
    provenance: Provenance = field(default_factory=Provenance)

    # ---- shape facts ----------------------------------------------------------------------
    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.layers)

    @property
    def head_dim(self) -> int:
        return int(self.layers[self.layer_ids[0]].k.shape[-1])

    @property
    def num_kv_heads(self) -> int | None:
        """KV heads per layer for ``kv_head`` granularity, ``None`` for shared per-layer matrices."""
        if self.granularity != "kv_head":
            return None
        return int(self.layers[self.layer_ids[0]].k.shape[0])

    def clips(self, layer: int) -> tuple[float, float]:
        """``(k_clip, v_clip)`` used for ``layer`` (per-layer override or the spec's)."""
        lr = self.layers[layer]
        k = self.spec.k_clip if lr.k_clip is None else lr.k_clip
        v = self.spec.v_clip if lr.v_clip is None else lr.v_clip
        return k, v

    def orthogonality_errors(self) -> dict[int, float]:
        """Per layer: max over K, V (and heads) of ``max |RᵀR − I|``, computed in float64."""
        out = {}
        for i, lr in self.layers.items():
            errs = [_ortho_error(r) for r in (lr.k, lr.v)]
            out[i] = max(errs)
        return out

    def with_spec(self, spec: QuantSpec) -> RotationSet:
        return dataclasses.replace(self, spec=spec)

    # ---- validation -------------------------------------------------------------------------
    def validate(
        self, model_config: Any = None, source: str = "<RotationSet>", strict: bool = False
    ) -> RotationSet:
        """Check shapes, finiteness, orthogonality, clips and (given a config) head dim, coverage
        and the recorded model fingerprint.

        Raises :class:`RotationFileError` naming ``source``, what was expected and what was found.
        A ``provenance.config_hash`` that differs from ``config_fingerprint(model_config)`` gives
        an :class:`ArtifactMismatchWarning`, or a :class:`RotationFileError` when ``strict``.
        """
        return self._validate(model_config, source, strict, stacklevel=4)

    def _validate(self, model_config: Any, source: str, strict: bool, stacklevel: int) -> RotationSet:
        """:meth:`validate`; ``stacklevel`` places the mismatch warning (4: our caller's caller)."""
        if self.granularity not in GRANULARITIES:
            raise RotationFileError(
                source, "unknown granularity", " or ".join(GRANULARITIES), repr(self.granularity)
            )
        if not self.layers:
            raise RotationFileError(source, "no layers", "at least one layer", "none")
        d = self.head_dim
        want_rank = 2 if self.granularity == "layer" else 3
        heads = self.layers[self.layer_ids[0]].k.shape[0] if want_rank == 3 else None
        for i in self.layer_ids:
            lr = self.layers[i]
            for name, r, lam in (("K", lr.k, lr.k_eigenvalues), ("V", lr.v, lr.v_eigenvalues)):
                where = f"layer {i} {name} rotation"
                shape = tuple(r.shape)
                ok = r.dim() == want_rank and shape[-2:] == (d, d)
                if ok and want_rank == 3:
                    ok = shape[0] == heads
                if not ok:
                    exp = f"[{d}, {d}]" if want_rank == 2 else f"[{heads}, {d}, {d}]"
                    raise RotationFileError(
                        source,
                        f"{where} has the wrong shape",
                        exp,
                        str(shape),
                        "every layer must be square with the same head dim",
                    )
                if tuple(lam.shape) != shape[:-1]:
                    raise RotationFileError(
                        source,
                        f"layer {i} {name} eigenvalues have the wrong shape",
                        str(list(shape[:-1])),
                        str(tuple(lam.shape)),
                    )
                if not torch.isfinite(r).all():
                    raise RotationFileError(
                        source,
                        f"{where} contains NaN or inf",
                        "finite values",
                        "non-finite entries",
                        "re-run calibration",
                    )
                err = _ortho_error(r)
                if not err < ORTHO_TOL:
                    raise RotationFileError(
                        source,
                        f"{where} is not orthogonal",
                        f"max|RᵀR − I| < {ORTHO_TOL:g}",
                        f"{err:.3g}",
                        "the file is not a rotation (or was saved in low precision)",
                    )
            for name, c in (("k_clip", lr.k_clip), ("v_clip", lr.v_clip)):
                if not valid_clip(c):
                    raise RotationFileError(
                        source,
                        f"layer {i} {name} is invalid",
                        "None or a finite number in [0, 1]",
                        repr(c),
                        "per-layer clips override the spec's; use None to keep the spec's",
                    )
        if model_config is not None:
            self._check_model(model_config, source)
            self._check_fingerprint(model_config, source, strict, stacklevel)
        return self

    def _check_fingerprint(self, config: Any, source: str, strict: bool, stacklevel: int) -> None:
        recorded = self.provenance.config_hash
        if not recorded:  # OSCAR files and hand-built sets carry no fingerprint
            return
        current = config_fingerprint(config)
        if recorded == current:
            return
        model = self.provenance.model_name or "an unnamed model"
        if strict:
            raise RotationFileError(
                source,
                f"rotations were calibrated for a different model ({model})",
                f"config hash {current} (this model)",
                f"config hash {recorded} (recorded in the artifact)",
                "re-calibrate for this model, or leave out --strict (strict=False) to use them anyway",
            )
        warnings.warn(
            one_line(
                f"{source}: rotations were calibrated for {model} (config hash {recorded}), "
                f"not this model (config hash {current}); re-calibrate for this model, "
                "or pass --strict to make this an error"
            ),
            ArtifactMismatchWarning,
            stacklevel=stacklevel,
        )

    def _check_model(self, config: Any, source: str) -> None:
        hd = model_head_dim(config)
        if hd != self.head_dim:
            raise RotationFileError(
                source,
                "head_dim does not match the model",
                f"{hd} (model)",
                f"{self.head_dim} (rotations)",
                "use rotations calibrated for this model",
            )
        want = attention_layer_ids(config)
        missing = [i for i in want if i not in self.layers]
        extra = [i for i in self.layer_ids if i not in want]
        if missing or extra:
            raise RotationFileError(
                source,
                "layer ids do not match the model's attention layers",
                f"{len(want)} layers {want}",
                f"{len(self.layers)} layers {self.layer_ids}"
                + (f" (missing {missing})" if missing else "")
                + (f" (extra {extra})" if extra else ""),
                "use rotations calibrated for this model",
            )
        if self.granularity == "kv_head":
            kv = int(_text_config(config).num_key_value_heads)
            if kv != self.num_kv_heads:
                raise RotationFileError(
                    source,
                    "KV head count does not match the model",
                    f"{kv}",
                    f"{self.num_kv_heads}",
                )


def _ortho_error(r: torch.Tensor) -> float:
    r = r.detach().to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r.transpose(-1, -2) @ r - eye).abs().max())
