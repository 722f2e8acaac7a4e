"""The comparator networks of the clip threshold (``kernels/triton/quantize_nets``), as tables on
the CPU: by the 0-1 principle a comparator network sorts (merges) every input iff it does every
0-1 input, so these checks are exhaustive. The kernels that run them: tests/interpreter."""

from __future__ import annotations

import itertools

import pytest

from oscarkv.kernels.triton import quantize_nets as nets


def _run(net, v: list[int]) -> list[int]:
    v = list(v)
    for i, j in net:
        v[i], v[j] = max(v[i], v[j]), min(v[i], v[j])
    return v


def test_sort8_sorts_every_input():
    for v in itertools.product((0, 1), repeat=8):
        assert _run(nets._SORT8.value, v) == sorted(v, reverse=True), v


@pytest.mark.parametrize("n", range(1, 17))
def test_v_sort_sorts_every_falling_then_rising_input(n):
    net, out = nets._v_sort(n)
    assert (nets._V_SORT[n - 1].value, nets._V_OUT[n - 1].value) == (net, out)
    assert sorted(out) == list(range(n))
    for fall, ones_fall, ones_rise in itertools.product(range(n + 1), repeat=3):
        if ones_fall > fall or ones_rise > n - fall:
            continue
        v = [1] * ones_fall + [0] * (n - ones_rise - ones_fall) + [1] * ones_rise
        got = _run(net, v)
        assert [got[i] for i in out] == sorted(v, reverse=True), v


def test_v_sorts_have_the_documented_sizes():
    assert [len(nets._v_sort(n)[0]) for n in (6, 12)] == [7, 20]


@pytest.mark.parametrize(("m", "k"), [(6, 6), (8, 12), (12, 12), (8, 16)])
def test_merge_keeps_the_k_largest_of_two_sorted_lists_sorted(m, k):
    """``_merge``'s recipe: ``c_i = max(a_i, b_{K-1-i})`` (one side alone past the other's end),
    then the V-sort of ``K``."""
    net, out = nets._v_sort(k)
    for x, y in itertools.product(range(m + 1), repeat=2):
        a, b = [1] * x + [0] * (m - x), [1] * y + [0] * (m - y)
        c = [
            max(a[i], b[k - 1 - i]) if i < m and k - 1 - i < m else a[i] if i < m else b[k - 1 - i]
            for i in range(k)
        ]
        got = _run(net, c)
        assert [got[i] for i in out] == sorted(a + b, reverse=True)[:k], (a, b)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("block_r", 48, "block_r must be a power of two"),
        ("num_warps", 0, "num_warps must be a power of two"),
        ("packed_rounds", 0, "packed_rounds must be an integer >= 1"),
        ("packed_maxnreg", -1, "packed_maxnreg must be an integer >= 0"),
        ("round_k", 8, "round_k must be 6 or 12"),
        ("round_k", True, "round_k must be 6 or 12"),
        ("pdl", 1, "pdl must be True or False"),
    ],
)
def test_quantize_tuning_refuses_values_the_launch_cannot_honour(field, value, match):
    import dataclasses

    from oscarkv.kernels.triton.quantize_pack import DEFAULT_TUNING

    with pytest.raises(ValueError, match=match):
        dataclasses.replace(DEFAULT_TUNING, **{field: value})
