"""KVManager: the page counts the scheduler asks for (admission with the decode reserve, all-or-
nothing growth, release, capacity errors), on tiny pools."""

from __future__ import annotations

import re

import pytest
import torch

from oscarkv import QuantSpec
from oscarkv.engine.kv_manager import KVManager
from oscarkv.engine.pages import OutOfPages, PagePool
from oscarkv.engine.request import SamplingParams, Sequence
from oscarkv.errors import InputError
from oscarkv.quant.tiers import plan_moves

SPEC = QuantSpec(sink_tokens=8, recent_tokens=8, demote_block=4)
PS = 4


def seq(n: int, rid: str = "a") -> Sequence:
    s = Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))
    s.sink_len = min(n, SPEC.sink_tokens)
    return s


def test_admission_counts_the_whole_prompt_and_the_decode_reserve() -> None:
    kv = KVManager(SPEC, True, PS, PagePool(1 + 4), PagePool(1 + 5), decode_reserve=1)
    a = seq(40)  # sink 8 (2 pages); 40 - 8 - 8 = 24 quantized rows after prefill: 6 INT2 pages
    assert kv.pages_for(40, 8) == (2, 6)
    assert not kv.can_allocate(a, running=0)  # 6 INT2 pages, 5 free
    b = seq(36)  # 20 quantized rows: 5 pages
    assert kv.can_allocate(b, running=0) and not kv.can_allocate(b, running=1)  # 1 page kept per runner


def test_allocate_is_all_or_nothing_and_free_returns_every_page() -> None:
    hp, q = PagePool(1 + 4), PagePool(1 + 3)
    kv = KVManager(SPEC, True, PS, hp, q)
    a = seq(36)
    moves = plan_moves(a.tiers, 36, False, SPEC, sink_target=kv.sink_target(a))
    with pytest.raises(OutOfPages, match="needs 2 16-bit and 5 INT2 pages"):
        kv.allocate(a, moves)
    assert hp.n_free == 4 and q.n_free == 3 and not a.hp_pages and not kv.in_use
    b = seq(20, "b")  # sink 8, 4 quantized rows: 2 + 1 pages
    kv.allocate(b, plan_moves(b.tiers, 20, False, SPEC, sink_target=kv.sink_target(b)))
    assert (len(b.hp_pages), len(b.q_pages)) == (2, 1) and kv.in_use
    assert kv.stats() == {"hp_free": 2, "hp_cached": 0, "q_free": 2, "q_cached": 0}
    kv.free(b)
    assert not b.hp_pages and not b.q_pages and not kv.in_use and hp.n_free == 4 and q.n_free == 3


def test_bf16_mode_keeps_every_row_in_16_bit_pages() -> None:
    kv = KVManager(SPEC, False, PS, PagePool(1 + 10), decode_reserve=2)
    a = seq(30)
    assert kv.pages_for(30, 8) == (8, 0) and kv.sink_target(a) > 30
    assert kv.can_allocate(a, running=1) and not kv.can_allocate(a, running=2)  # 8 + 2·reserve > 10
    assert "q_free" not in kv.stats()


def test_a_request_larger_than_a_pool_is_an_input_error() -> None:
    kv = KVManager(SPEC, True, PS, PagePool(1 + 4), PagePool(1 + 3))
    kv.fits(20, 4, 8)  # 23 tokens: 7 rows past the windows, 2 INT2 pages; 33 tokens: 17 rows, 5 pages
    with pytest.raises(InputError, match="needs 5 INT2 pages of 4 tokens; the pool has 3"):
        kv.fits(30, 4, 8)


@pytest.mark.parametrize(
    "dtype,named", [(torch.float32, "fp32 (4 bytes per element)"), (torch.bfloat16, "bf16 (2 bytes")]
)
def test_a_budget_error_names_the_dtype_the_rows_are_stored_in(dtype: torch.dtype, named: str) -> None:
    """On a CPU the "16-bit" rows are the model's fp32: the error says so instead of calling them bf16."""
    from oscarkv.config import EngineConfig
    from oscarkv.engine.kv_pool import plan_pools

    cfg = EngineConfig(kv_dtype="bf16", page_tokens=PS)
    with pytest.raises(InputError, match=re.escape(f"its unquantized rows stored as {named}")):
        plan_pools(cfg, None, 2, 2, 64, dtype, 1 << 16, max_model_len=4096)


def test_a_budget_error_names_fp8_windows() -> None:
    """With fp8 windows the unquantized rows are fp8 e4m3 whatever the model dtype."""
    from dataclasses import replace

    from oscarkv.config import EngineConfig
    from oscarkv.engine.kv_pool import plan_pools

    cfg = EngineConfig(page_tokens=PS)
    spec = replace(SPEC, window_dtype="fp8_e4m3")
    with pytest.raises(InputError, match=re.escape("its unquantized rows stored as fp8 e4m3 (1 bytes per")):
        plan_pools(cfg, spec, 2, 2, 64, torch.float32, 1 << 12, max_model_len=4096)
