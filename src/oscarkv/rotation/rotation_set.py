"""`RotationSet`: per-layer (optionally per-KV-head) K and V rotations plus spec and provenance."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from ..config import QuantSpec, SpecError
from ..errors import ArtifactMismatchWarning, OscarkvError
from ..quant import RowFormat

__all__ = [
    "GRANULARITIES",
    "ORTHO_TOL",
    "LayerRotation",
    "Provenance",
    "RotationFileError",
    "RotationSet",
    "attention_layer_ids",
    "check_spec",
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
    """A rotation artifact (or set, or its model config) is unreadable or inconsistent. ``str(e)``
    is ``"{source}: {problem}; expected {expected}; found {found}"``, ``e.hint`` the ``fix``."""

    def __init__(self, source: str, problem: str, expected: str = "", found: str = "", fix: str = ""):
        parts = [f"{source}: {problem}"] + [
            f"{w} {x}" for w, x in (("expected", expected), ("found", found)) if x
        ]
        super().__init__(one_line("; ".join(parts)), one_line(fix))


def valid_clip(c: object) -> bool:
    """Whether ``c`` is a usable per-layer clip: ``None`` or a finite real number in [0, 1]."""
    if c is None or isinstance(c, bool) or not isinstance(c, numbers.Real):
        return c is None
    return math.isfinite(float(c)) and 0.0 <= float(c) <= 1.0


def valid_key_bits(b: object, spec: QuantSpec) -> bool:
    """Whether ``b`` is a usable per-layer key width under ``spec`` (2, 3 or 4; 2 with Lloyd-Max)."""
    return _is_int(b) and b in (2,) + (() if spec.codebook == "lloyd_max" else (3, 4))


def key_bits_want(spec: QuantSpec) -> str:
    return (
        "None or 2 (the Lloyd-Max codebook is INT2 only)"
        if spec.codebook == "lloyd_max"
        else "None, 2, 3 or 4"
    )


CONFIG_HINT = "pass model.config (or AutoConfig.from_pretrained(model_dir)), or config.json as a dict"
SAME_MODEL = "use rotations calibrated for this model"
RERUN = "re-run calibration"
SHAPE_FIX = "every layer must be square with the same head dim"
ORTHO_WANT = f"max|RᵀR − I| < {ORTHO_TOL:g}"
CLIP_RANGE = "None or a finite number in [0, 1]"
ORTHO_FIX = "the file is not a rotation (or was saved in low precision)"
CLIP_FIX = "per-layer clips override the spec's; use None to keep the spec's"
BUILD_FIX = "build RotationSet({layer_id: LayerRotation(k, v, k_eigenvalues, v_eigenvalues)}, QuantSpec(...))"


def _kind(x: object) -> str:
    return type(x).__name__


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _text_config(config: Any, source: str = "model_config") -> Any:
    if isinstance(config, dict):
        return SimpleNamespace(**{str(k): v for k, v in config.items()})
    if not hasattr(config, "__dict__"):  # str, int, list, None...: not a config object
        got = f"model_config must be a transformers config or a dict; got {_kind(config)}"
        raise RotationFileError(source, got, fix=CONFIG_HINT)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _config_int(c: Any, name: str, source: str, need: bool = True) -> int | None:
    """Positive integer field ``name`` of config ``c`` (``None`` if absent and not ``need``)."""
    v, err = getattr(c, name, None), partial(RotationFileError, source, fix=CONFIG_HINT)
    if v is None and need:
        raise err(f"model config lacks {name}")
    if v is not None and (not _is_int(v) or v <= 0):
        raise err(f"model config field {name} is invalid", "a positive integer", repr(v)[:60])
    return None if v is None else int(v)


def model_head_dim(config: Any, source: str = "model_config") -> int:
    """Attention head dim of a transformers config (or a plain dict); :class:`RotationFileError`
    naming ``source`` if ``config`` is not a config or lacks the fields."""
    c = _text_config(config, source)
    names = ("head_dim", "hidden_size", "num_attention_heads")
    hd, hidden, heads = (_config_int(c, n, source, need=False) for n in names)
    if hd is None and (hidden is None or heads is None):
        need = "model config lacks head_dim / hidden_size+num_attention_heads"
        raise RotationFileError(source, need, fix=CONFIG_HINT)
    return hd or hidden // heads


def attention_layer_ids(config: Any, source: str = "model_config") -> list[int]:
    """Global ids of the softmax-attention layers (linear-attention layers of hybrids excluded)."""
    c = _text_config(config, source)
    types = getattr(c, "layer_types", None)
    if types is not None and not (isinstance(types, list | tuple) and all(isinstance(t, str) for t in types)):
        bad = "model config field layer_types is invalid"
        raise RotationFileError(source, bad, "a list of str", repr(types)[:60], CONFIG_HINT)
    if types:
        return [i for i, t in enumerate(types) if "attention" in t and "linear" not in t]
    return list(range(_config_int(c, "num_hidden_layers", source)))


def check_spec(spec: object) -> QuantSpec:
    """``spec`` if it is a :class:`QuantSpec`, else a :class:`SpecError` naming its type."""
    if not isinstance(spec, QuantSpec):
        fix = "build one with QuantSpec(key_bits=..., ...) or QuantSpec.from_dict(d)"
        raise SpecError(f"spec must be a QuantSpec; got {_kind(spec)}", fix)
    return spec


def config_fingerprint(config: Any) -> str:
    """Short hash of the config fields a rotation depends on (shapes, RoPE, layer types)."""
    c = _text_config(config)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keys += ("head_dim", "rope_theta", "rope_parameters", "layer_types")
    d = {k: getattr(c, k, None) for k in keys}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class LayerRotation:
    """One attention layer. Rotations are fp32 ``[d, d]`` (granularity ``layer``) or
    ``[H_kv, d, d]`` (``kv_head``); eigenvalues ``[d]`` / ``[H_kv, d]``, ascending as from eigh.
    ``k_clip`` / ``v_clip`` override the spec's global ratios when not ``None``. ``k_offset`` /
    ``v_offset`` (fp32 ``[H_kv, d]``, rotated basis, or ``None``) are static channel offsets that
    every stored key / value has subtracted (see :mod:`.offsets`). ``key_bits`` overrides the
    spec's key bits for this layer (mixed key precision, chosen by calibration under a bit budget)."""

    k: torch.Tensor
    v: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    k_clip: float | None = None
    v_clip: float | None = None
    k_offset: torch.Tensor | None = None
    v_offset: torch.Tensor | None = None
    key_bits: int | None = None

    def formats(
        self, spec: QuantSpec, head_dim: int, quantizer: str | None = None
    ) -> tuple[RowFormat, RowFormat]:
        """The layer's stored K and V row formats: ``spec`` with this layer's clips and key bits
        (``quantizer``: see :meth:`RowFormat.from_spec`)."""
        kc = spec.k_clip if self.k_clip is None else self.k_clip
        vc = spec.v_clip if self.v_clip is None else self.v_clip
        return (
            RowFormat.from_spec(spec, head_dim, "k", kc, quantizer, bits=self.key_bits),
            RowFormat.from_spec(spec, head_dim, "v", vc, quantizer),
        )


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

    def _first(self) -> LayerRotation:
        if not self.layers:
            raise RotationFileError("<RotationSet>", "no layers", "at least one layer", "none")
        return self.layers[self.layer_ids[0]]

    @property
    def head_dim(self) -> int:
        return int(self._first().k.shape[-1])

    @property
    def num_kv_heads(self) -> int | None:
        """KV heads per layer for ``kv_head`` granularity, ``None`` for shared per-layer matrices."""
        if self.granularity != "kv_head":
            return None
        return int(self._first().k.shape[0])

    def clips(self, layer: int) -> tuple[float, float]:
        """``(k_clip, v_clip)`` used for ``layer`` (per-layer override or the spec's)."""
        lr = self.layers[layer]
        return (
            self.spec.k_clip if lr.k_clip is None else lr.k_clip,
            self.spec.v_clip if lr.v_clip is None else lr.v_clip,
        )

    def key_bits(self, layer: int) -> int:
        """Bits per key element of ``layer``'s quantized tier (per-layer override or the spec's)."""
        b = self.layers[layer].key_bits
        return self.spec.key_bits if b is None else b

    def formats(
        self, layer: int, override: QuantSpec | None = None, quantizer: str | None = None
    ) -> tuple[RowFormat, RowFormat]:
        """``layer``'s stored K and V row formats: its clips and key bits over the spec, or with an
        ``override`` spec (one the user gave explicitly) that spec's clips and widths in every layer."""
        if override is not None:
            d = self.head_dim
            return RowFormat.from_spec(override, d, "k", None, quantizer), RowFormat.from_spec(
                override, d, "v", None, quantizer
            )
        return self.layers[layer].formats(self.spec, self.head_dim, quantizer)

    def bits_per_element(self, context_len: int | None = None, head_dim: int | None = None) -> float:
        """Effective bits per cached K/V element at ``context_len`` tokens, averaged over the layers
        (they hold equal numbers of elements); ``None``: the quantized tier alone (see
        :meth:`QuantSpec.bits_per_element`). ``head_dim`` defaults to the rotations'."""
        d = self.head_dim if head_dim is None else head_dim
        bits = [
            dataclasses.replace(self.spec, key_bits=self.key_bits(i)).bits_per_element(context_len, d)
            for i in self.layer_ids
        ]
        return sum(bits) / len(bits)

    def orthogonality_errors(self) -> dict[int, float]:
        """Per layer: max over K, V (and heads) of ``max |RᵀR − I|``, computed in float64."""
        return {i: max(_ortho_error(lr.k), _ortho_error(lr.v)) for i, lr in self.layers.items()}

    def with_spec(self, spec: QuantSpec) -> RotationSet:
        return dataclasses.replace(self, spec=check_spec(spec))

    # ---- validation -------------------------------------------------------------------------
    def validate(
        self, model_config: Any = None, source: str = "<RotationSet>", strict: bool = False
    ) -> RotationSet:
        """Check types, shapes, finiteness, orthogonality, clips and (given a config) head dim,
        coverage and recorded model fingerprint; a :class:`RotationFileError` names ``source``,
        what was expected and what was found. A ``provenance.config_hash`` other than the config's
        warns (:class:`ArtifactMismatchWarning`), or raises when ``strict``."""
        return self._validate(model_config, source, strict, stacklevel=4)

    def _validate(self, model_config: Any, source: str, strict: bool, stacklevel: int) -> RotationSet:
        """:meth:`validate`; ``stacklevel`` places the mismatch warning (4: our caller's caller)."""
        err = partial(RotationFileError, source)
        self._check_types(err)
        if self.granularity not in GRANULARITIES:
            raise err("unknown granularity", " or ".join(GRANULARITIES), repr(self.granularity))
        d, heads = self.head_dim, (self._first().k.shape[0] if self.granularity == "kv_head" else None)
        want = [d, d] if heads is None else [heads, d, d]
        for i in self.layer_ids:
            lr = self.layers[i]
            for name, r, lam in (("K", lr.k, lr.k_eigenvalues), ("V", lr.v, lr.v_eigenvalues)):
                where = f"layer {i} {name} rotation"
                if list(r.shape) != want:
                    raise err(f"{where} has the wrong shape", str(want), str(tuple(r.shape)), SHAPE_FIX)
                if list(lam.shape) != want[:-1]:
                    bad = f"layer {i} {name} eigenvalues have the wrong shape"
                    raise err(bad, str(want[:-1]), str(tuple(lam.shape)))
                for what, t in ((f"{where} contains", r), (f"layer {i} {name} eigenvalues contain", lam)):
                    if not torch.isfinite(t).all():
                        raise err(f"{what} NaN or inf", "finite values", "non-finite entries", RERUN)
                if not (e := _ortho_error(r)) < ORTHO_TOL:
                    raise err(f"{where} is not orthogonal", ORTHO_WANT, f"{e:.3g}", ORTHO_FIX)
            for name, c in (("k_clip", lr.k_clip), ("v_clip", lr.v_clip)):
                if not valid_clip(c):
                    raise err(f"layer {i} {name} is invalid", CLIP_RANGE, repr(c), CLIP_FIX)
            if lr.key_bits is not None and not valid_key_bits(lr.key_bits, self.spec):
                raise err(
                    f"layer {i} key_bits is invalid", key_bits_want(self.spec), repr(lr.key_bits), RERUN
                )
            for name, off in (("k_offset", lr.k_offset), ("v_offset", lr.v_offset)):
                if off is None:
                    continue
                if not isinstance(off, torch.Tensor) or off.dim() != 2 or off.shape[-1] != d:
                    found = tuple(off.shape) if isinstance(off, torch.Tensor) else _kind(off)
                    raise err(f"layer {i} {name} has the wrong shape", f"[H_kv, {d}]", str(found), RERUN)
                if heads is not None and off.shape[0] != heads:
                    raise err(
                        f"layer {i} {name} has the wrong shape",
                        f"[{heads}, {d}]",
                        str(tuple(off.shape)),
                        RERUN,
                    )
                if not torch.isfinite(off).all():
                    raise err(
                        f"layer {i} {name} contains NaN or inf", "finite values", "non-finite entries", RERUN
                    )
        if model_config is not None:
            self._check_model(model_config, source)
            self._check_fingerprint(model_config, source, strict, stacklevel)
        return self

    def _check_types(self, err: Callable[..., RotationFileError]) -> None:
        """Python types first, so that a malformed set fails with a message, not an IndexError."""
        for want, x, name in ((dict, self.layers, "layers"), (QuantSpec, self.spec, "spec")):
            if not isinstance(x, want):
                what = "a dict of layer id -> LayerRotation" if want is dict else "a QuantSpec"
                raise err(f"{name} must be {what}", found=_kind(x), fix=BUILD_FIX)
        if not isinstance(self.provenance, Provenance):
            raise err("provenance must be a Provenance", found=_kind(self.provenance), fix=BUILD_FIX)
        if not self.layers:
            raise err("no layers", "at least one layer", "none")
        for i, lr in self.layers.items():
            if not _is_int(i) or i < 0:
                raise err(f"layer id {i!r} is not an integer >= 0", fix=BUILD_FIX)
            if not isinstance(lr, LayerRotation):
                raise err(f"layer {i} is not a LayerRotation", found=_kind(lr), fix=BUILD_FIX)
            for name in ("k", "v", "k_eigenvalues", "v_eigenvalues"):
                t = getattr(lr, name)
                if not isinstance(t, torch.Tensor):
                    raise err(f"layer {i} {name} is not a torch.Tensor", found=_kind(t), fix=BUILD_FIX)
                if name in ("k", "v") and t.dim() < 2:
                    bad = f"layer {i} {name.upper()} rotation has the wrong shape"
                    raise err(bad, "[d, d] or [H_kv, d, d]", str(tuple(t.shape)), SHAPE_FIX)

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
        err = partial(RotationFileError, source, fix=SAME_MODEL)
        hd = model_head_dim(config, source)
        if hd != self.head_dim:
            raise err("head_dim does not match the model", f"{hd} (model)", f"{self.head_dim} (rotations)")
        want = attention_layer_ids(config, source)
        missing = [i for i in want if i not in self.layers]
        extra = [i for i in self.layer_ids if i not in want]
        if missing or extra:
            raise err(
                "layer ids do not match the model's attention layers",
                f"{len(want)} layers {want}",
                f"{len(self.layers)} layers {self.layer_ids}"
                + (f" (missing {missing})" if missing else "")
                + (f" (extra {extra})" if extra else ""),
            )
        kv = _config_int(_text_config(config, source), "num_key_value_heads", source, need=False)
        kv = kv or _config_int(_text_config(config, source), "num_attention_heads", source)
        if self.granularity == "kv_head" and kv != self.num_kv_heads:
            raise err("KV head count does not match the model", f"{kv}", f"{self.num_kv_heads}")
        for i in self.layer_ids:
            for name in ("k_offset", "v_offset"):
                off = getattr(self.layers[i], name)
                if off is not None and off.shape[0] != kv:
                    raise err(
                        f"layer {i} {name} does not match the model's KV heads", f"{kv}", f"{off.shape[0]}"
                    )


def _ortho_error(r: torch.Tensor) -> float:
    r = r.detach().to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r.transpose(-1, -2) @ r - eye).abs().max())
