"""Hadamard, bit reversal and OSCAR's R = U·H·P (spec §2.4-2.7), checked against a reference
implementation written here from the spec (numpy / plain Python, not the library)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from oscarkv.rotation import (
    COMPOSITIONS,
    bit_reversal,
    block_size,
    compose,
    hadamard,
    importance_permutation,
)

POW2 = [2, 4, 8, 16, 32, 64, 128, 256]


# ---- independent reference (spec §2.5-2.7) ---------------------------------------------------
def ref_hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]]) * (1.0 / math.sqrt(2.0))
    return h


def ref_bit_reversal(d: int) -> list[int]:
    n = d.bit_length() - 1
    return [int(format(i, f"0{n}b")[::-1], 2) if n else 0 for i in range(d)]


def ref_perm(eigenvalues: np.ndarray) -> list[int]:
    d = len(eigenvalues)
    s = sorted(range(d), key=lambda i: -eigenvalues[i])  # descending (stable)
    br = ref_bit_reversal(d)
    perm = [0] * d
    for i in range(d):
        perm[br[i]] = s[i]
    return perm


def ref_perm_matrix(perm: list[int]) -> np.ndarray:
    return np.eye(len(perm), dtype=np.float64)[:, perm]  # P[i, j] = 1 iff i == perm[j]


def ref_compose(eigenvalues: np.ndarray, u: np.ndarray) -> np.ndarray:
    d = len(eigenvalues)
    return (u @ ref_hadamard(d)) @ ref_perm_matrix(ref_perm(eigenvalues))


def random_spd(d: int) -> torch.Tensor:
    a = torch.randn(d, d, dtype=torch.float64)
    return a @ a.T / d + 1e-3 * torch.eye(d, dtype=torch.float64)


# ---- Hadamard ------------------------------------------------------------------------------
@pytest.mark.parametrize("d", POW2)
def test_hadamard_power_of_two(d: int) -> None:
    h = hadamard(d)
    assert h.dtype == torch.float64 and h.shape == (d, d)
    assert torch.allclose(h.T @ h, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full((d, d), 1 / math.sqrt(d), dtype=torch.float64), atol=1e-15)
    expected = torch.tensor(
        [[(-1) ** bin(i & c).count("1") / math.sqrt(d) for c in range(d)] for i in range(d)],
        dtype=torch.float64,
    )
    assert torch.allclose(h, expected, atol=1e-14, rtol=0)
    assert np.array_equal(h.numpy(), ref_hadamard(d))


def test_hadamard_dtype() -> None:
    assert hadamard(16, torch.float32).dtype == torch.float32


@pytest.mark.parametrize(("d", "b"), [(80, 16), (96, 32), (48, 16), (24, 8)])
def test_hadamard_block_diagonal(d: int, b: int) -> None:
    assert block_size(d) == b
    h = hadamard(d)
    assert torch.allclose(h.T @ h, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    blocks = torch.block_diag(*[torch.from_numpy(ref_hadamard(b))] * (d // b))
    assert torch.allclose(h, blocks, atol=1e-15, rtol=0)
    mask = torch.block_diag(*[torch.ones(b, b)] * (d // b)).bool()
    assert (h[~mask] == 0).all()


@pytest.mark.parametrize("d", [3, 7, 127])
def test_hadamard_odd_raises(d: int) -> None:
    with pytest.raises(ValueError, match=f"head dim {d} is odd: no Hadamard block exists"):
        hadamard(d)


# ---- bit reversal --------------------------------------------------------------------------
def test_bit_reversal_128_prefix() -> None:
    assert bit_reversal(128)[:8].tolist() == [0, 64, 32, 96, 16, 80, 48, 112]


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
def test_bit_reversal_involution(n: int) -> None:
    br = bit_reversal(n)
    assert br.tolist() == ref_bit_reversal(n)
    assert torch.equal(br[br], torch.arange(n))


@pytest.mark.parametrize("n", [0, 3, 96, 100])
def test_bit_reversal_non_power_of_two_raises(n: int) -> None:
    with pytest.raises(ValueError, match=f"bit reversal needs a power of two; got {n}$"):
        bit_reversal(n)


# ---- compose -------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_compose_matches_reference(d: int) -> None:
    lam, u = torch.linalg.eigh(random_spd(d))
    r = compose(lam, u)
    ref = torch.from_numpy(ref_compose(lam.numpy(), u.numpy()))
    assert r.dtype == torch.float64 and r.shape == (d, d)
    assert torch.allclose(r, ref, atol=1e-12, rtol=0)
    assert torch.equal(r.float(), ref.float())  # bit for bit after the fp32 cast
    assert torch.allclose(r.T @ r, torch.eye(d, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_importance_permutation_matches_reference(d: int) -> None:
    lam = torch.randn(d, dtype=torch.float64)
    assert importance_permutation(lam).tolist() == ref_perm(lam.numpy())


@pytest.mark.parametrize("d", [4, 16, 128, 256])
def test_permutation_for_ascending_eigenvalues(d: int) -> None:
    lam = torch.linspace(0.1, 50.0, d, dtype=torch.float64)
    perm = importance_permutation(lam)
    br = ref_bit_reversal(d)
    assert perm.tolist() == [d - 1 - br[j] for j in range(d)]
    # the largest lands at 0, the 2nd at d/2, the 3rd at d/4
    assert perm[0] == d - 1 and perm[d // 2] == d - 2 and perm[d // 4] == d - 3


def test_compose_places_columns_by_importance() -> None:
    d = 16
    lam, u = torch.linalg.eigh(random_spd(d))
    uh = u @ hadamard(d)
    r = compose(lam, u)
    br = ref_bit_reversal(d)
    # column br(i) of R is column (d-1-i) of U·H (the i-th largest eigen index)
    for i in range(d):
        assert torch.equal(r[:, br[i]], uh[:, d - 1 - i])


@pytest.mark.shared
def test_rotation_zoo_reproduction(shared_dir: Path) -> None:
    obj = torch.load(shared_dir / "zoo/qwen3.5-4B/k_rotation.pt", map_location="cpu", weights_only=True)
    entry = obj["layers"][3]
    r_file = entry["rotation"].to(torch.float64)
    lam = entry["eigenvalues"].to(torch.float64)
    d = r_file.shape[0]
    assert d == 256
    assert bool((lam[1:] >= lam[:-1]).all())  # ascending, as from eigh
    h = torch.from_numpy(ref_hadamard(d))
    p = torch.from_numpy(ref_perm_matrix(ref_perm(lam.numpy())))
    u = r_file @ p.T @ h  # R = U H P  =>  U = R Pᵀ H  (H symmetric orthogonal)
    assert torch.allclose(u.T @ u, torch.eye(d, dtype=torch.float64), atol=1e-5)
    rebuilt = compose(lam, u)
    assert torch.allclose(rebuilt, r_file, atol=1e-6, rtol=0)
    # the permutation in the file is the fixed one for ascending eigenvalues
    br = ref_bit_reversal(d)
    assert importance_permutation(lam).tolist() == [d - 1 - br[j] for j in range(d)]


def _spread_spd(d: int) -> torch.Tensor:
    # A spread spectrum, nearly aligned with the coordinate axes (so the identity is bad).
    lam = 2.0 ** -torch.linspace(0, 12, d, dtype=torch.float64)
    q = torch.linalg.qr(torch.eye(d, dtype=torch.float64) + 0.01 * torch.randn(d, d, dtype=torch.float64))[0]
    return q @ torch.diag(lam) @ q.T


def test_compose_d96_orthogonal_and_flattens_importance() -> None:
    d = 96
    c = _spread_spd(d)
    lam, u = torch.linalg.eigh(c)
    r = compose(lam, u)
    assert r.shape == (96, 96)
    assert torch.allclose(r.T @ r, torch.eye(d, dtype=torch.float64), atol=1e-10, rtol=0)
    imp_r = torch.diagonal(r.T @ c @ r)
    imp_i = torch.diagonal(c)
    ratio_r = float(imp_r.max() / imp_r.mean())
    ratio_i = float(imp_i.max() / imp_i.mean())
    assert ratio_i > 5.0
    assert ratio_r < 1.5
    assert ratio_r < 0.25 * ratio_i


@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_every_composition_is_orthogonal(name: str, d: int) -> None:
    lam, u = torch.linalg.eigh(random_spd(d))
    r = compose(lam, u, name)
    assert r.shape == (d, d)
    assert torch.allclose(r.T @ r, torch.eye(d, dtype=torch.float64), atol=1e-10, rtol=0)


def test_named_compositions_match_products() -> None:
    d = 32
    lam, u = torch.linalg.eigh(random_spd(d))
    h = hadamard(d)
    p = torch.eye(d, dtype=torch.float64)[:, importance_permutation(lam)]
    expect = {"plain": u, "r_h": u @ h, "h_pbr": h @ p, "pbr": p, "br": u @ p, "h_r_pbr": h @ u @ p}
    for name, m in expect.items():
        assert torch.allclose(compose(lam, u, name), m, atol=1e-12), name


def test_unknown_composition_raises() -> None:
    lam, u = torch.linalg.eigh(random_spd(8))
    with pytest.raises(ValueError, match="composition"):
        compose(lam, u, "h_h")


def test_compose_shape_mismatch_raises() -> None:
    with pytest.raises(
        ValueError, match=r"eigenvectors must be \[8, 8\] to match eigenvalues; got \(16, 16\)"
    ):
        compose(torch.ones(8, dtype=torch.float64), torch.eye(16, dtype=torch.float64))
