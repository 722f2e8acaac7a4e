"""The tiered KV store that every host shares: a step's spans and rows, page tables, and one
layer's attention over the tiers.

* :mod:`.rows`: tier moves (``quant.tiers``) as index spans, and the spans as rows of a storage
  layout (contiguous regions, vLLM's block tables, pages);
* :mod:`.paged`: a batch's rows over paged pools as segment tables; :mod:`.csr`: the tables
  and the per-sequence lists (:class:`Csr`) they expand to;
* :mod:`.page_table`: each request slot's page ids on the host and the device, and the decode
  lists expanded from them on the device;
* :mod:`.layout`: the paged pools' sizes (:class:`PoolPlan`) and one layer's views
  (:class:`LayerViews`); :mod:`.steps`: a step's tensors;
* :mod:`.attention`: :class:`TierAttention`, one layer's attention over the tiers.
"""

from .attention import TierAttention
from .csr import Csr, PageList, Segments
from .layout import LayerViews, PoolPlan
from .page_table import PagedSeq, PageTables, expand_lists
from .paged import PagedStep, paged_decode_rows
from .rows import (
    HeldSpans,
    PagedRows,
    PositionRows,
    RegionRows,
    RowMap,
    Span,
    StepSpans,
    WriteRows,
    held_rows,
    held_spans,
    page_row,
    post_state,
    step_spans,
)
from .steps import DecodeTensors, PrefillTensors

__all__ = [
    "Csr",
    "DecodeTensors",
    "HeldSpans",
    "LayerViews",
    "PageList",
    "PageTables",
    "PagedRows",
    "PagedSeq",
    "PagedStep",
    "PoolPlan",
    "PositionRows",
    "PrefillTensors",
    "RegionRows",
    "RowMap",
    "Segments",
    "Span",
    "StepSpans",
    "TierAttention",
    "WriteRows",
    "expand_lists",
    "held_rows",
    "held_spans",
    "page_row",
    "paged_decode_rows",
    "post_state",
    "step_spans",
]
