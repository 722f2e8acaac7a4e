"""Rotations: Hadamard, bit reversal, OSCAR's ``U·H·P`` composition and rotation artifacts."""

from .apply import absorb_output_weight, absorb_value_weight, rotate_heads
from .compose import (
    COMPOSITIONS,
    bit_reversal,
    block_size,
    compose,
    hadamard,
    importance_permutation,
    is_power_of_two,
)
from .io import ARTIFACT_NAME, load_oscar_files, load_rotations, save_oscar_files, save_rotations
from .offsets import LayerShift, rotated_offset
from .rotation_set import (
    GRANULARITIES,
    ORTHO_TOL,
    LayerRotation,
    Provenance,
    RotationFileError,
    RotationSet,
    attention_layer_ids,
    config_fingerprint,
    model_head_dim,
)

__all__ = [
    "ARTIFACT_NAME",
    "COMPOSITIONS",
    "GRANULARITIES",
    "ORTHO_TOL",
    "LayerRotation",
    "LayerShift",
    "Provenance",
    "RotationFileError",
    "RotationSet",
    "absorb_output_weight",
    "absorb_value_weight",
    "attention_layer_ids",
    "bit_reversal",
    "block_size",
    "compose",
    "config_fingerprint",
    "hadamard",
    "importance_permutation",
    "is_power_of_two",
    "load_oscar_files",
    "load_rotations",
    "model_head_dim",
    "rotate_heads",
    "rotated_offset",
    "save_oscar_files",
    "save_rotations",
]
