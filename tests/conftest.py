"""Shared fixtures: the ``../shared`` directory, seeding, and a test-built OSCAR rotation pair."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"

K_NAME = "k_rotation_qqt_r_h_pbr.pt"
V_NAME = "v_rotation_sst_r_h_pbr.pt"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SHARED_DIR.is_dir():
        return
    skip = pytest.mark.skip(reason=f"needs the shared directory {SHARED_DIR}")
    for item in items:
        if "shared" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shared_dir() -> Path:
    """``<repo>/../shared`` (reference model, RotationZoo files, docs)."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"needs the shared directory {SHARED_DIR}")
    return SHARED_DIR


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)


def random_orthogonal(d: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """A random orthogonal float32 matrix (QR of a Gaussian matrix, computed in float64)."""
    q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen))
    return (q * torch.sign(torch.diagonal(r))).float()


def oscar_dict(rotations: dict, eigenvalues: dict, objective: str) -> dict:
    """A plain dict exactly as OSCAR's compute_kv_rotation.py writes it (spec §2.9)."""
    return {
        "format_version": 1,
        "objective": objective,
        "source_grouping": "layer",
        "layers": {
            lid: {"layer_id": int(lid), "rotation": rotations[lid], "eigenvalues": eigenvalues[lid]}
            for lid in rotations
        },
    }


def write_oscar_pair_files(
    out_dir: Path,
    d: int = 64,
    layer_ids: tuple[int, ...] = (3, 7),
    str_keys: bool = False,
) -> dict:
    """Write k_rotation_qqt_r_h_pbr.pt / v_rotation_sst_r_h_pbr.pt into ``out_dir``.

    Returns the tensors written: ``{"k": {id: R}, "v": {id: R}, "k_eig": ..., "v_eig": ...}``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    data: dict = {"k": {}, "v": {}, "k_eig": {}, "v_eig": {}}
    for lid in layer_ids:
        for kind in ("k", "v"):
            data[kind][lid] = random_orthogonal(d).contiguous()
            data[kind + "_eig"][lid] = torch.sort(torch.rand(d) * 10).values
    for kind, name, objective in (("k", K_NAME, "qqt_r_h_pbr"), ("v", V_NAME, "sst_r_h_pbr")):
        rot = {(str(i) if str_keys else i): data[kind][i] for i in layer_ids}
        eig = {(str(i) if str_keys else i): data[kind + "_eig"][i] for i in layer_ids}
        torch.save(oscar_dict(rot, eig, objective), out_dir / name)
    return data


@pytest.fixture
def write_oscar_pair() -> Callable[..., dict]:
    """Factory: ``write_oscar_pair(dir, d=64, layer_ids=(3, 7), str_keys=False) -> tensors``."""
    return write_oscar_pair_files


@pytest.fixture
def oscar_dir(tmp_path: Path) -> Path:
    """A directory holding a valid test-built OSCAR pair (head_dim 128, layers 3 and 7)."""
    out = tmp_path / "oscar"
    write_oscar_pair_files(out, d=128, layer_ids=(3, 7))
    return out


@pytest.fixture
def make_orthogonal() -> Callable[..., torch.Tensor]:
    """Factory: ``make_orthogonal(d) -> float32 [d, d]`` random orthogonal matrix."""
    return random_orthogonal


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (and stall badly on a loaded CI box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
