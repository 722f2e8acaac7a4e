"""QuantSpec: defaults, validation messages, group sizes and bits per element (spec §4.4)."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

import oscarkv
from oscarkv import QuantSpec, SpecError


def test_defaults() -> None:
    s = QuantSpec()
    assert (s.key_bits, s.value_bits) == (2, 2)
    assert s.group_size is None
    assert (s.sink_tokens, s.recent_tokens, s.demote_block) == (64, 256, 8)
    assert (s.k_clip, s.v_clip) == (0.96, 0.92)
    assert s.codebook == "uniform"
    assert s.meta_dtype == "fp16"


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'key_bits'"):
        QuantSpec().key_bits = 4  # type: ignore[misc]


def test_spec_error_is_value_error() -> None:
    assert issubclass(oscarkv.SpecError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"key_bits": 5}, "key_bits", "5"),
        ({"value_bits": "2"}, "value_bits", "'2'"),
        ({"key_bits": True}, "key_bits", "True"),
        ({"group_size": 3}, "group_size", "3"),
        ({"sink_tokens": -1}, "sink_tokens", "-1"),
        ({"recent_tokens": -5}, "recent_tokens", "-5"),
        ({"demote_block": 0}, "demote_block", "0"),
        ({"k_clip": 1.5}, "k_clip", "1.5"),
        ({"v_clip": math.nan}, "v_clip", "nan"),
        ({"codebook": "foo"}, "codebook", "'foo'"),
        ({"meta_dtype": "fp8"}, "meta_dtype", "'fp8'"),
        ({"codebook": "lloyd_max", "key_bits": 3}, "codebook", "'lloyd_max'"),
    ],
)
def test_invalid_field_raises(kwargs: dict, field: str, shown: str) -> None:
    with pytest.raises(SpecError, match=rf"^QuantSpec\.{field} must be .*; got {re.escape(shown)}$") as ei:
        QuantSpec(**kwargs)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert field in msg
    assert shown in msg


def test_lloyd_max_with_3_bits_mentions_bits() -> None:
    with pytest.raises(SpecError, match="key_bits"):
        QuantSpec(codebook="lloyd_max", key_bits=3)
    # and it is accepted for INT2
    assert QuantSpec(codebook="lloyd_max").codebook == "lloyd_max"


def test_group_for() -> None:
    assert QuantSpec().group_for(128) == 128
    assert QuantSpec().group_for(96) == 96
    assert QuantSpec(group_size=32).group_for(128) == 32
    with pytest.raises(SpecError, match="group_size") as ei:
        QuantSpec(group_size=48).group_for(128)
    assert "48" in str(ei.value)


def test_bits_per_element_tier_default_is_exactly_2_25() -> None:
    assert QuantSpec().bits_per_element(None) == 2.25


def test_bits_per_element_128k() -> None:
    bpe = QuantSpec().bits_per_element(131072)
    assert round(bpe, 2) == 2.28
    assert bpe == (5120 + 130752 * 2.25) / 131072


def test_bits_per_element_32k() -> None:
    assert QuantSpec().bits_per_element(32768) == pytest.approx(2.384, abs=1e-3)
    assert QuantSpec().bits_per_element(32768) == pytest.approx((5120 + 32448 * 2.25) / 32768, rel=1e-12)


def test_bits_per_element_short_context_is_all_high_precision() -> None:
    assert QuantSpec().bits_per_element(100) == 16.0


def test_bits_per_element_hp_bits_and_windows() -> None:
    assert QuantSpec().bits_per_element(131072, hp_bits=8) == (320 * 8 + 130752 * 2.25) / 131072
    s = QuantSpec(sink_tokens=0, recent_tokens=1024)
    assert s.bits_per_element(4096) == (1024 * 16 + 3072 * 2.25) / 4096
    assert QuantSpec(group_size=32).bits_per_element(None) == 2 + 4 * 32 / 128


def test_bits_per_element_fp32_meta() -> None:
    assert QuantSpec(meta_dtype="fp32").bits_per_element(None) == 2.5


def test_bits_per_element_int4() -> None:
    assert QuantSpec(key_bits=4, value_bits=4).bits_per_element(None) == 4.25


def test_bits_per_element_mixed_bits() -> None:
    assert QuantSpec(key_bits=2, value_bits=4).bits_per_element(None) == (2.25 + 4.25) / 2


def test_bits_per_element_rejects_nonpositive_context() -> None:
    with pytest.raises(SpecError, match="context_len"):
        QuantSpec().bits_per_element(0)


def test_dict_round_trip() -> None:
    s = QuantSpec(key_bits=3, value_bits=4, group_size=32, k_clip=0.9, v_clip=0.0, meta_dtype="bf16")
    d = s.to_dict()
    assert d["key_bits"] == 3 and d["group_size"] == 32 and d["meta_dtype"] == "bf16"
    assert QuantSpec.from_dict(d) == s
    assert QuantSpec.from_dict(QuantSpec().to_dict()) == QuantSpec()


def test_from_dict_unknown_key_raises() -> None:
    d = QuantSpec().to_dict()
    d["kv_bits"] = 2
    with pytest.raises(SpecError, match="kv_bits"):
        QuantSpec.from_dict(d)


def test_from_dict_validates_values() -> None:
    d = QuantSpec().to_dict()
    d["key_bits"] = 7
    with pytest.raises(SpecError, match="key_bits"):
        QuantSpec.from_dict(d)
