"""Hadamard matrices, the bit-reversal permutation and OSCAR's ``R = U · H · P`` (spec §2.4-2.7).

Row-vector convention everywhere: a stored key is ``k @ R_K``, a query ``q @ R_K``, a stored
value ``v @ R_V`` and the attention output is mapped back with ``o_rot @ R_V.T``.

Head dims that are not powers of two (80, 96, ...) use a documented block fallback that OSCAR
does not have (docs/rotations.md): with ``d = m · b`` (``b`` the largest power of two dividing
``d``), ``H = I_m ⊗ H_b``, the eigenvectors are dealt round-robin by importance into the ``m``
blocks so every block mixes large and small directions, and ``P`` interleaves ranks across
blocks and bit-reverses within a block.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "COMPOSITIONS",
    "bit_reversal",
    "block_size",
    "compose",
    "hadamard",
    "importance_permutation",
    "is_power_of_two",
]

#: OSCAR's ``--composition`` names (spec §2.7); letters are right-multiplied in order.
COMPOSITIONS = {
    "plain": "U",
    "pbr": "P",
    "br": "UP",
    "br_h128": "UPH",
    "r_h": "UH",
    "h_pbr": "HP",
    "h_r_pbr": "HUP",
    "h_pbr_r": "HPU",
    "r_h_pbr": "UHP",
}


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def block_size(d: int) -> int:
    """Largest power of two dividing ``d`` (``d`` itself when ``d`` is a power of two)."""
    if d <= 0:
        raise ValueError(f"dimension must be positive; got {d}")
    return d & -d


def _sylvester(n: int) -> torch.Tensor:
    # Normalised at every doubling step, exactly like OSCAR's build_hadamard (float64).
    h = torch.ones(1, 1, dtype=torch.float64)
    inv = 1.0 / math.sqrt(2.0)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0) * inv
    return h


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal Hadamard ``[d, d]``: Sylvester ``H_d`` for powers of two (natural order,
    symmetric, entries ±1/√d), else block-diagonal ``I_m ⊗ H_b`` with ``b = block_size(d)``."""
    b = block_size(d)
    if b < 2 and d > 1:
        raise ValueError(f"head dim {d} is odd: no Hadamard block exists")
    h = _sylvester(b)
    if b != d:
        h = torch.block_diag(*([h] * (d // b)))
    return h.to(dtype)


def bit_reversal(n: int) -> torch.Tensor:
    """``br[i]`` = ``i`` with its log2(n)-bit binary representation reversed (an involution)."""
    if not is_power_of_two(n):
        raise ValueError(f"bit reversal needs a power of two; got {n}")
    bits = n.bit_length() - 1
    idx = torch.arange(n)
    out = torch.zeros_like(idx)
    for b in range(bits):
        out |= ((idx >> b) & 1) << (bits - 1 - b)
    return out


def _positions(d: int) -> torch.Tensor:
    """Output position of the importance rank ``i`` (bit reversal, or the block interleave)."""
    if is_power_of_two(d):
        return bit_reversal(d)
    b = block_size(d)
    m = d // b
    r = torch.arange(d)
    return (r % m) * b + bit_reversal(b)[r // m]


def importance_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """``perm`` with ``perm[pos(i)] = s[i]``, ``s`` the descending argsort of the eigenvalues.

    ``P = I[:, perm]``, so ``(M @ P)[:, j] = M[:, perm[j]]``: the i-th most important column
    lands at position ``br(i)`` (spec §2.6).
    """
    d = eigenvalues.shape[-1]
    s = torch.argsort(eigenvalues, descending=True, stable=True)
    perm = torch.empty_like(s)
    perm[_positions(d)] = s
    return perm


def _deal_into_blocks(eigenvalues: torch.Tensor, eigenvectors: torch.Tensor) -> torch.Tensor:
    # Non-power-of-two fallback: rank r goes to block r % m, slot r // m, so each block of the
    # block-diagonal Hadamard mixes an even share of large and small eigen-directions.
    d = eigenvalues.shape[-1]
    b = block_size(d)
    m = d // b
    s = torch.argsort(eigenvalues, descending=True, stable=True)
    r = torch.arange(d)
    order = torch.empty_like(s)
    order[(r % m) * b + r // m] = s
    return eigenvectors[:, order]


def compose(
    eigenvalues: torch.Tensor,
    eigenvectors: torch.Tensor,
    composition: str = "r_h_pbr",
) -> torch.Tensor:
    """Build OSCAR's rotation from an eigendecomposition, in float64.

    Args:
        eigenvalues: ``[d]`` as returned by ``torch.linalg.eigh`` (ascending).
        eigenvectors: ``[d, d]``, eigenvectors in the columns (``U``).
        composition: a key of :data:`COMPOSITIONS`; default ``r_h_pbr`` = ``U · H · P``.
    Returns:
        float64 ``[d, d]`` orthogonal matrix. For power-of-two ``d`` and the same inputs it is
        OSCAR's matrix bit for bit (the permutation is applied by column selection, which is
        exactly what multiplying by a permutation matrix computes).
    """
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {sorted(COMPOSITIONS)}; got {composition!r}")
    lam = eigenvalues.to(torch.float64)
    u = eigenvectors.to(torch.float64)
    d = lam.shape[-1]
    if u.shape != (d, d):
        raise ValueError(f"eigenvectors must be [{d}, {d}] to match eigenvalues; got {tuple(u.shape)}")
    if not is_power_of_two(d):
        u = _deal_into_blocks(lam, u)
    perm = importance_permutation(lam)
    r: torch.Tensor | None = None
    for letter in COMPOSITIONS[composition]:
        if letter == "P":
            r = torch.eye(d, dtype=torch.float64)[:, perm] if r is None else r[:, perm]
        else:
            m = u if letter == "U" else hadamard(d)
            r = m.clone() if r is None else r @ m
    assert r is not None
    return r
