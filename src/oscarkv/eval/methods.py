"""KV-cache methods compared by ``oscarkv eval``, behind one protocol and a name registry.

Every INT2/INT3/INT4 method except KIVI is an :class:`~oscarkv.hf.OscarCache` configuration —
so the baselines run through the same packed storage and kernels as OSCAR and differ only in
rotation, quantizer, clipping and windows:

| method | rotation | quantizer | bits | clip | windows (sink/recent) |
|---|---|---|---|---|---|
| oscar | calibrated | asymmetric | 2 | per-layer (artifact) | 64/256 |
| oscar-fp8w | calibrated | asymmetric | 2 | per-layer (artifact) | 64/256 in fp8 e4m3 |
| clip-only | identity | asymmetric | 2 | 0.96/0.92 | 64/256 |
| hadamard-int2 | Hadamard | asymmetric | 2 | 0.96/0.92 | 64/256 |
| quarot-int2 | Hadamard | asymmetric | 2 | off | none |
| naive-int2 | identity | symmetric | 2 | off | none |
| int4 | Hadamard | asymmetric | 4 | off | none |
| turboquant-k3v3 | random orthogonal | Lloyd-Max centroids | 3 | off | none |

"none" means ``sink = recent = 0`` and ``demote_block = 1``: a token is quantized from the step
after it is written. Windows are stored as the artifact's spec says (``QuantSpec.window_dtype``,
the model dtype by default); ``oscar-fp8w`` is ``oscar`` with fp8 e4m3 windows (8 bits per window
element). ``kivi2`` (:mod:`.kivi`) and ``bf16`` are separate caches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..calibration.error import fake_quant_middle
from ..calibration.fit import fixed_layer
from ..config import QuantSpec
from ..kernels import BackendError, resolve
from ..quant.window import through_window, window_torch_dtype
from ..rotation import LayerRotation, Provenance, RotationSet, rotate_heads
from .kivi import KiviCache, kivi_bits_per_element, kivi_fake_kv

__all__ = ["CALIBRATED_METHODS", "INT2_METHODS", "METHODS", "KVMethod", "get_method", "method_names"]


class KVMethod(Protocol):
    name: str

    def bits_per_element(self, context_len: int, head_dim: int) -> float: ...

    def make_cache(self, model: Any) -> Any:
        """A fresh transformers cache for one generate/forward sequence of calls."""
        ...

    def fake_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[B, H, T, d]`` as the method would store them, read back in the original basis."""
        ...


@dataclass(frozen=True)
class Recipe:
    rotation: str  # calibrated | identity | hadamard | random
    quantizer: str = "asymmetric"
    bits: int = 2
    clip: bool = True
    windows: bool = True
    #: ``QuantSpec.window_dtype`` of the windows; None: the artifact's
    window_dtype: str | None = None


RECIPES = {
    "oscar": Recipe("calibrated"),
    "oscar-fp8w": Recipe("calibrated", window_dtype="fp8_e4m3"),
    "clip-only": Recipe("identity"),
    "hadamard-int2": Recipe("hadamard"),
    "quarot-int2": Recipe("hadamard", clip=False, windows=False),
    "naive-int2": Recipe("identity", quantizer="symmetric", clip=False, windows=False),
    "int4": Recipe("hadamard", bits=4, clip=False, windows=False),
    "turboquant-k3v3": Recipe("random", quantizer="lloyd_max_centroid", bits=3, clip=False, windows=False),
}


def _random_rotations(layers: list[int], d: int, seed: int = 0) -> dict[int, LayerRotation]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in layers:
        rk = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()
        rv = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()
        out[i] = LayerRotation(rk, rv, torch.ones(d), torch.ones(d))
    return out


class CacheMethod:
    """An OscarCache configuration (see the module table)."""

    def __init__(self, name: str, recipe: Recipe, rotations: RotationSet | None, model_config: Any):
        from ..rotation import attention_layer_ids, model_head_dim

        self.name, self.recipe = name, recipe
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        d, layers = model_head_dim(cfg), attention_layer_ids(cfg)
        base = rotations.spec if rotations is not None else QuantSpec()
        w = recipe.windows
        self.spec = QuantSpec(
            key_bits=recipe.bits, value_bits=recipe.bits,
            sink_tokens=base.sink_tokens if w else 0, recent_tokens=base.recent_tokens if w else 0,
            demote_block=base.demote_block if w else 1,
            k_clip=base.k_clip if recipe.clip else 0.0, v_clip=base.v_clip if recipe.clip else 0.0,
            meta_dtype=base.meta_dtype, window_dtype=recipe.window_dtype or base.window_dtype,
        )  # fmt: skip
        if recipe.rotation == "calibrated":
            if rotations is None:
                raise ValueError(f"method {name!r} needs calibrated rotations (--rotations DIR)")
            if recipe.window_dtype is not None:  # the artifact's clips and key bits, other windows
                rotations = rotations.with_spec(replace(rotations.spec, window_dtype=recipe.window_dtype))
            self.rotations = rotations
            self.override_spec: QuantSpec | None = None  # keep the artifact's spec and per-layer clips
            self.spec = rotations.spec
        else:
            kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
            rots = (
                _random_rotations(layers, d)
                if recipe.rotation == "random"
                else {i: fixed_layer(recipe.rotation, d, kv, "layer") for i in layers}
            )
            self.rotations = RotationSet(rots, self.spec, "layer", Provenance(source=f"eval:{name}"))
            self.override_spec = self.spec
        self.quantizer = None if recipe.quantizer == "asymmetric" else recipe.quantizer

    def bits_per_element(self, context_len: int, head_dim: int) -> float:
        if self.override_spec is None:  # the artifact's per-layer key bits
            return self.rotations.bits_per_element(context_len, head_dim)
        return self.spec.bits_per_element(context_len, head_dim)

    def make_cache(self, model: Any) -> Any:
        from ..hf import OscarCache

        return OscarCache.from_rotations(
            model,
            self.rotations,
            spec=self.override_spec,
            quantizer=self.quantizer,
            backend=self._backend(next(model.parameters()).device),
        )

    def _backend(self, device: torch.device) -> str:
        """``auto`` when its kernels store and read every layer's rows, else ``torch``: eval scores
        formats (baselines' 3-bit or grouped rows too), and the torch twins give the same numbers."""
        fmts = [
            self.rotations.formats(i, self.override_spec, self.quantizer) for i in self.rotations.layer_ids
        ]
        try:
            resolve("auto", device).require_formats(fmts, "")
        except BackendError:
            return "torch"
        return "auto"

    def fake_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lr = self.rotations.layers[layer]
        kf, vf = self.rotations.formats(layer, self.override_spec, self.quantizer)
        sink, recent = self.spec.sink_tokens, self.spec.recent_tokens
        out = []
        window = window_torch_dtype(self.spec.window_dtype, torch.float32)
        for x, r, f, off in ((k, lr.k, kf, lr.k_offset), (v, lr.v, vf, lr.v_offset)):
            c = 0.0 if off is None else off.float().to(x.device)[None, :, None, :]
            x_rot = rotate_heads(x.float(), r.float()) - c  # every tier stores x − c; read back + c
            x_rot = through_window(x_rot, window)  # fp8 windows: every stored row goes through fp8
            out.append(rotate_heads(fake_quant_middle(x_rot, f, sink, recent) + c, r.float(), inverse=True))
        return out[0], out[1]


class Bf16Method:
    name = "bf16"

    def bits_per_element(self, context_len: int, head_dim: int) -> float:
        return 16.0

    def make_cache(self, model: Any) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def fake_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k.float(), v.float()


class Kivi2Method:
    """KIVI-2: per-channel keys in groups of 32 tokens, per-token values, 128-token residual."""

    name = "kivi2"

    def bits_per_element(self, context_len: int, head_dim: int) -> float:
        return kivi_bits_per_element(context_len, head_dim)

    def make_cache(self, model: Any) -> Any:
        return KiviCache()

    def fake_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kivi_fake_kv(k, v)


METHODS = ("bf16", "oscar", *[n for n in RECIPES if n != "oscar"], "kivi2")
#: the methods that read the calibrated artifact (``--rotations``)
CALIBRATED_METHODS = tuple(n for n, r in RECIPES.items() if r.rotation == "calibrated")
# the 2-bit methods OSCAR is compared with pairwise in the report (OSCAR itself included)
INT2_METHODS = (*[n for n, r in RECIPES.items() if r.bits == 2], "kivi2")


def method_names() -> tuple[str, ...]:
    return METHODS


def get_method(name: str, rotations: RotationSet | None, model_config: Any) -> KVMethod:
    """Build method ``name``; raises ``ValueError`` listing the known names."""
    if name == "bf16":
        return Bf16Method()
    if name == "kivi2":
        return Kivi2Method()
    if name in RECIPES:
        return CacheMethod(name, RECIPES[name], rotations, model_config)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
