"""The storage layouts a step's rows live in, and one layer's pool views.

* :class:`PoolPlan`: paged pools (the engine). The INT2 pool holds ``q_pages`` pages of
  ``page_tokens`` rows; the 16-bit pool holds ``hp_pages`` pages (page 0 a dummy, then sink
  pages; in BF16 mode every page), then one ring slab of ``ring_cap`` rows per request slot.
* :class:`LayerViews`: one layer's flat tensors, whatever the layout (engine pages, vLLM's
  strided pages, ...); it satisfies ``kernels.pool_ops.FlatPools``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import RowFormat

__all__ = ["LayerViews", "PoolPlan"]


@dataclass(frozen=True)
class PoolPlan:
    """Sizes of paged pools. Page counts include the dummy page 0 (``PagePool(n, reserved=1)``);
    byte counts cover all layers, K and V."""

    int2: bool  # kv_dtype == "int2"
    page_tokens: int
    max_running: int
    sink_pages: int  # 16-bit pages of one sequence's sink (0 in bf16 mode)
    q_pages: int  # INT2 pages (0 in bf16 mode)
    hp_pages: int  # 16-bit pages (dummy + sink pages; in bf16 mode: every page)
    ring: int  # ring modulus = window_limit(spec) (0 in bf16 mode)
    ring_cap: int  # rows per ring slab: ring rounded up to whole pages (0 in bf16 mode)
    q_page_bytes: int
    hp_page_bytes: int
    total_bytes: int
    #: ``prefill_attention="invariant"``: the window block ``G`` (:mod:`.windows`); 0: fresh
    window_block: int = 0
    #: ``(recent_tokens, demote_block)`` of the decode rule that scored prompts follow
    #: (:mod:`.windows`; ``EngineConfig.prompt_scoring="decode"``); ``(0, 0)``: the prefill rule
    score_window: tuple[int, int] = (0, 0)

    @property
    def ring0(self) -> int:
        """First row of ring slab 0 in the 16-bit pool."""
        return self.hp_pages * self.page_tokens

    @property
    def hp_rows(self) -> int:
        return self.ring0 + self.max_running * self.ring_cap

    @property
    def q_rows(self) -> int:
        return self.q_pages * self.page_tokens

    def ring_base(self, slot: int) -> int:
        """First row of the ring slab of request slot ``slot``."""
        return self.ring0 + slot * self.ring_cap

    def request_bytes(self, length: int) -> int:
        """KV bytes one request of ``length`` tokens holds at most: an INT2 slot's sink pages and
        ring slab, and INT2 pages for every token past its sink; in bf16 mode 16-bit pages for all
        of its tokens."""
        ps = self.page_tokens
        if not self.int2:
            return -(-length // ps) * self.hp_page_bytes
        slot = self.sink_pages * 2 * self.hp_page_bytes + self.ring_cap * (self.hp_page_bytes // ps)
        return slot + -(-max(length - self.sink_pages * ps, 0) // ps) * self.q_page_bytes


@dataclass(frozen=True)
class LayerViews:
    """One layer's pool views (satisfies ``kernels.pool_ops.FlatPools``); contiguous in the engine,
    strided views of vLLM's pages in the vLLM plug-in.

    ``k_codes/v_codes`` uint8 ``[Nq, Hkv, packed]``, ``k_meta/v_meta`` ``[Nq, Hkv, G, 2]``,
    ``hp_k/hp_v`` ``[Nh, Hkv, d]`` in the model dtype.
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_meta: torch.Tensor
    v_meta: torch.Tensor
    hp_k: torch.Tensor
    hp_v: torch.Tensor
    k_fmt: RowFormat
    v_fmt: RowFormat
