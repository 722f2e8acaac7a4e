"""Triton split-K decode attention over packed INT2 history (keys 2- or 4-bit) and 16-bit windows.

- :mod:`.tuning`: :class:`DecodeTuning`, the measured launch settings (frozen);
- :mod:`.planner`: :func:`plan` -> :class:`DecodePlan` (loop, heads per program, splits, grids);
- :mod:`.attention`: :func:`decode_attention`, the launcher;
- :mod:`.stages`: the stage-1 and merge kernels; the tile loops in :mod:`.loop_swap`,
  :mod:`.loop_words`, :mod:`.loop_bytes` (INT2) and :mod:`.loop_hp` (16-bit); their helpers in
  :mod:`.common`, :mod:`.planes` and :mod:`.padded`.
"""

from .attention import check_windows, decode_attention
from .planner import DecodePlan, plan
from .tuning import DEFAULT_TUNING, DecodeTuning

__all__ = ["DEFAULT_TUNING", "DecodePlan", "DecodeTuning", "check_windows", "decode_attention", "plan"]
