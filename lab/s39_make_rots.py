"""Rotation artifacts for the retrieval diagnostics (SmolLM2): ra30 rebuilt from the s38 ranking
(offsets-auto + 4-bit unclipped keys in its 14 layers), 4-bit keys everywhere, and 4-bit values on
top of the budget-3.0 recipe.

    python lab/s39_make_rots.py ROT_DIR(with rot-auto, rot-b30) RANK_JSON
"""

import dataclasses
import json
import sys
from pathlib import Path

from oscarkv.rotation import RotationSet, load_rotations, save_rotations

root, rank = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())


def k4(lr):
    return dataclasses.replace(lr, key_bits=4, k_clip=0.0)


auto, b30 = load_rotations(f"{root}/rot-auto"), load_rotations(f"{root}/rot-b30")
ra = set(rank["ra30"]["layers"])
sets = {
    "ra30": RotationSet({i: k4(lr) if i in ra else lr for i, lr in auto.layers.items()}, auto.spec,
                        auto.granularity, auto.provenance),
    "k4all": RotationSet({i: k4(lr) for i, lr in auto.layers.items()}, auto.spec, auto.granularity, auto.provenance),
    "b30v4": RotationSet(dict(b30.layers), dataclasses.replace(b30.spec, value_bits=4), b30.granularity,
                         b30.provenance),
}  # fmt: skip
for name, rs in sets.items():
    save_rotations(rs, f"{root}/rot-{name}", overwrite=True)
    print(name, sorted(i for i, lr in rs.layers.items() if lr.key_bits == 4), rs.spec.value_bits)
