"""The reference ``rotate_heads`` / ``rotate_new_rows`` (decode-step rotations) against a float64
einsum oracle (not the prefill's ``oscarkv.rotation.rotate_heads``, which the reference calls),
slot writes, and clear errors."""

from __future__ import annotations

import pytest
import torch

from oscarkv.kernels import ref


def _rot(d: int) -> torch.Tensor:
    return torch.linalg.qr(
        torch.randn(d, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    )[0].float()


def _rotated(x: torch.Tensor, r: torch.Tensor | None, inverse: bool = False) -> torch.Tensor:
    """The oracle, in float64 and rounded once to ``x.dtype``: row ``x[b, h]`` times head ``h``'s
    matrix (``r`` itself, or ``r[h // (H / H_r)]`` for per-head ``[H_r, d, d]``), transposed for the
    inverse: ``y[b, h, e] = Σ_d x[b, h, d] · M_h[d, e]``."""
    if r is None:
        return x.clone()
    h = x.shape[1]
    mats = (
        r.double()[None].expand(h, -1, -1)
        if r.dim() == 2
        else r.double()[[i * r.shape[0] // h for i in range(h)]]
    )
    eq = "bhd,hed->bhe" if inverse else "bhd,hde->bhe"
    return torch.einsum(eq, x.double(), mats).to(x.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 products against float64 ones, each rounded once to bf16: at most one bf16 step apart
    (relative 2^-7); the absolute slack covers outputs near 0."""
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotation_is_the_row_times_its_heads_matrix(per_head, inverse):
    r = _rot(32)
    if per_head:
        r = torch.stack([r, r.T])  # heads 0, 1 read r; heads 2, 3 read rᵀ
    x = torch.randn(3, 4, 32).bfloat16()
    _close(ref.rotate_heads(x, r, inverse), _rotated(x, r, inverse))
    # and by hand for one element: row (b=2, h=3) reads the last shared matrix, column 5
    m = r if r.dim() == 2 else r[1]
    col = m[5] if inverse else m[:, 5]
    want = (x[2, 3].double() * col.double()).sum()
    torch.testing.assert_close(ref.rotate_heads(x, r, inverse)[2, 3, 5].double(), want, rtol=2**-7, atol=1e-5)


def test_rows_go_to_their_slots_and_negative_slots_are_skipped():
    x = torch.randn(3, 2, 16)
    pool = torch.zeros(5, 2, 16, dtype=torch.bfloat16)
    out = ref.rotate_heads(x, None, False, pool, torch.tensor([4, -1, 1]))
    assert out is pool
    assert torch.equal(pool[4], x[0].bfloat16()) and torch.equal(pool[1], x[2].bfloat16())
    assert not pool[torch.tensor([0, 2, 3])].any()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.zeros(2, 16)}, r"x must be \[B, H, d\]"),
        ({"r": torch.eye(8)}, r"r must be float32 \[16, 16\]"),
        ({"r": torch.eye(16).repeat(3, 1, 1)}, "4 heads cannot share 3"),
        ({"out": torch.zeros(2, 4, 16)}, "out and dst go together"),
        (
            {"out": torch.zeros(2, 3, 16), "dst": torch.zeros(2, dtype=torch.long)},
            r"out must be \[N, 4, 16\]",
        ),
        (
            {"out": torch.zeros(2, 4, 16), "dst": torch.zeros(3, dtype=torch.long)},
            r"dst must be int32/int64 \[2\]",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {"x": torch.zeros(2, 4, 16), "r": None, "out": None, "dst": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        ref.rotate_heads(args["x"], args["r"], False, args["out"], args["dst"])


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rotate_v", [True, False])
def test_new_rows_are_the_prefill_rotations_of_one_token(per_head, rotate_v):
    r_k, r_v = _rot(32), _rot(32).T.contiguous()
    if per_head:
        r_k, r_v = torch.stack([r_k, r_v]), torch.stack([r_v, r_k])
    q, k, v = (
        torch.randn(3, 4, 32).bfloat16(),
        torch.randn(3, 2, 32).bfloat16(),
        torch.randn(3, 2, 32).bfloat16(),
    )
    k_pool, v_pool = torch.zeros(6, 2, 32, dtype=torch.bfloat16), torch.zeros(6, 2, 32, dtype=torch.bfloat16)
    dst = torch.tensor([5, -1, 2])
    q_rot = ref.rotate_new_rows(q, k, v, r_k, r_v if rotate_v else None, k_pool, v_pool, dst)

    _close(q_rot, _rotated(q, r_k))
    k_want, v_want = _rotated(k, r_k), _rotated(v, r_v if rotate_v else None)
    _close(k_pool[5], k_want[0])
    _close(k_pool[2], k_want[2])
    _close(v_pool[5], v_want[0])
    _close(v_pool[2], v_want[2])
    assert not k_pool[torch.tensor([0, 1, 3, 4])].any() and not v_pool[torch.tensor([0, 1, 3, 4])].any()


def test_new_rows_refuse_mismatched_shapes():
    q, kv = torch.zeros(2, 4, 16), torch.zeros(2, 3, 16)
    pool, dst = torch.zeros(4, 3, 16), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3"):
        ref.rotate_new_rows(q, kv, kv, torch.eye(16), None, pool, pool, dst)
    with pytest.raises(ValueError, match="r_k is required"):
        ref.rotate_new_rows(q, q, q, None, None, pool, pool, dst)
    with pytest.raises(ValueError, match="must share B and d"):
        ref.rotate_new_rows(torch.zeros(3, 6, 16), kv, kv, torch.eye(16), None, pool, pool, dst)
