"""Bit packing: round trips and the exact byte layouts (spec §4.2, packing module docstring)."""

from __future__ import annotations

import pytest
import torch

from oscarkv.quant import pack, packed_dim, unpack


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [8, 64, 128, 256])
@pytest.mark.parametrize("lead", [(), (5,), (2, 3)])
def test_round_trip(bits: int, d: int, lead: tuple[int, ...]) -> None:
    codes = torch.randint(0, 1 << bits, (*lead, d), dtype=torch.int64)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, d * bits // 8)
    assert packed_dim(d, bits) == d * bits // 8
    out = unpack(packed, bits, d)
    assert out.shape == codes.shape
    assert torch.equal(out.long(), codes)
    assert torch.equal(unpack(packed, bits).long(), codes)  # d inferred


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_any_integer_dtype(dtype: torch.dtype) -> None:
    codes = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0], dtype=dtype)
    assert pack(codes, 2).tolist() == [120, 45]


def test_2bit_quartered_hand_example() -> None:
    # d = 8: byte j holds elements j, j+2, j+4, j+6 in bits 1:0, 3:2, 5:4, 7:6.
    # byte0 = 0 | 2<<2 | 3<<4 | 1<<6 = 0 + 8 + 48 + 64 = 120
    # byte1 = 1 | 3<<2 | 2<<4 | 0<<6 = 1 + 12 + 32 + 0 = 45
    codes = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [120, 45]
    assert unpack(torch.tensor([120, 45], dtype=torch.uint8), 2, 8).tolist() == [0, 1, 2, 3, 3, 2, 1, 0]


def test_2bit_quartered_d128_python_ints() -> None:
    q = torch.randint(0, 4, (128,)).tolist()
    expected = [q[j] | q[j + 32] << 2 | q[j + 64] << 4 | q[j + 96] << 6 for j in range(32)]
    assert pack(torch.tensor(q), 2).tolist() == expected


def test_4bit_halved_hand_example() -> None:
    # d = 4: byte j holds elements j and j+2 in bits 3:0 and 7:4.
    # byte0 = 1 | 15<<4 = 241 ; byte1 = 10 | 3<<4 = 58
    codes = torch.tensor([1, 10, 15, 3])
    assert pack(codes, 4).tolist() == [241, 58]
    assert unpack(torch.tensor([241, 58], dtype=torch.uint8), 4, 4).tolist() == [1, 10, 15, 3]


def test_4bit_halved_d128_python_ints() -> None:
    q = torch.randint(0, 16, (128,)).tolist()
    expected = [q[j] | q[j + 64] << 4 for j in range(64)]
    assert pack(torch.tensor(q), 4).tolist() == expected


def test_3bit_hand_example() -> None:
    # d = 8 codes 7,0,5,2,4,1,6,3.
    # low bits 3,0,1,2,0,1,2,3 in the quartered layout (d/4 = 2 bytes):
    #   byte0 = 3 | 1<<2 | 0<<4 | 2<<6 = 3 + 4 + 0 + 128 = 135
    #   byte1 = 0 | 2<<2 | 1<<4 | 3<<6 = 0 + 8 + 16 + 192 = 216
    # high bits 1,0,1,0,1,0,1,0 in the eighthed plane (d/8 = 1 byte, bit i = element i):
    #   byte2 = 1 + 4 + 16 + 64 = 85
    codes = torch.tensor([7, 0, 5, 2, 4, 1, 6, 3])
    assert pack(codes, 3).tolist() == [135, 216, 85]
    assert unpack(torch.tensor([135, 216, 85], dtype=torch.uint8), 3, 8).tolist() == codes.tolist()


@pytest.mark.parametrize("d", [16, 64, 128])
def test_3bit_layout_python_ints(d: int) -> None:
    q = torch.randint(0, 8, (d,)).tolist()
    a, e = d // 4, d // 8
    low = [
        (q[j] & 3) | (q[j + a] & 3) << 2 | (q[j + 2 * a] & 3) << 4 | (q[j + 3 * a] & 3) << 6 for j in range(a)
    ]
    high = [sum(((q[j + i * e] >> 2) & 1) << i for i in range(8)) for j in range(e)]
    assert pack(torch.tensor(q), 3).tolist() == low + high


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_codes_raise_type_error(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=f"codes must be an integer tensor; got {dtype}"):
        pack(torch.zeros(8, dtype=dtype), 2)


def test_unpack_needs_uint8() -> None:
    with pytest.raises(TypeError, match=r"packed codes must be uint8; got torch\.int32"):
        unpack(torch.zeros(2, dtype=torch.int32), 2, 8)


@pytest.mark.parametrize(("bits", "d"), [(2, 6), (4, 10), (3, 12), (3, 4)])
def test_bad_last_dim_raises(bits: int, d: int) -> None:
    with pytest.raises(ValueError, match="multiple"):
        pack(torch.zeros(d, dtype=torch.uint8), bits)


@pytest.mark.parametrize("bits", [1, 5, 8])
def test_unsupported_bits_raise(bits: int) -> None:
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match=f"bits must be 2, 3 or 4; got {bits}"):
        packed_dim(8, bits)


def test_unpack_wrong_d_raises() -> None:
    packed = pack(torch.zeros(16, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="4 packed bytes do not hold 32 codes of 2 bits"):
        unpack(packed, 2, 32)
