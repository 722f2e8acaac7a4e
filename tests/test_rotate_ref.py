"""The reference ``rotate_heads`` (decode-step rotations): the same numbers as the prefill's
float32 rotation, slot writes, and clear errors."""

from __future__ import annotations

import pytest
import torch

from oscarkv.kernels import ref
from oscarkv.rotation import rotate_heads as rotate_4d


def _rot(d: int) -> torch.Tensor:
    return torch.linalg.qr(
        torch.randn(d, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    )[0].float()


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_same_as_the_prefill_rotation_of_one_token(per_head, inverse):
    r = _rot(32)
    if per_head:
        r = torch.stack([r, r.T])
    x = torch.randn(3, 4, 32).bfloat16()
    want = rotate_4d(x[:, :, None].float(), r, inverse=inverse)[:, :, 0].to(x.dtype)
    # the same fp32 products (BLAS may order them differently for other batch shapes): one bf16 step
    torch.testing.assert_close(ref.rotate_heads(x, r, inverse).float(), want.float(), rtol=2**-7, atol=0)


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

    def one(x, r):
        return rotate_4d(x[:, :, None].float(), r)[:, :, 0].to(x.dtype)

    torch.testing.assert_close(q_rot.float(), one(q, r_k).float(), rtol=2**-7, atol=0)

    def close(a, b):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=0)

    close(k_pool[5], one(k, r_k)[0])
    close(k_pool[2], one(k, r_k)[2])
    v_want = one(v, r_v) if rotate_v else v
    close(v_pool[5], v_want[0])
    close(v_pool[2], v_want[2])
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
