"""The masked form of the prefill rules' key lists (``store/masked_pieces.py``, the CPU engine's):
for every query, its piece's mask selects exactly the keys its rule reads (16-bit or INT2 form,
each once). Layer outputs in each form against per-query masks: ``tests/engine`` (tier_steps.FORMS)."""

from __future__ import annotations

import pytest
import torch

from oscarkv.store.masked_pieces import merge_runs, piece_keys, piece_mask
from oscarkv.store.windows import SeqWindow, _runs, decode_window_start

INT2 = 1 << 20  # row ids of the INT2 forms: INT2 + position (16-bit forms: the position)


def _wanted(t: int, lo: int, sink: int) -> list[int]:
    """The rule: 16-bit key ``s <= t`` iff ``s < sink`` or ``s >= lo``; INT2 key iff ``sink <= s < lo``."""
    return sorted([s for s in range(t + 1) if s < sink or s >= lo] + [INT2 + s for s in range(sink, lo)])


def _check(w: SeqWindow, block: int, score: tuple[int, int], cap: int, lo_of) -> int:
    """Every query of ``w``'s pieces (runs merged up to ``cap`` queries) reads what ``lo_of(t)``
    says; returns the number of pieces."""
    e = w.start + w.n_new
    pos16, pos2 = torch.arange(e), INT2 + torch.arange(e)
    runs = list(_runs(w, block, score))
    pieces = merge_runs(runs, cap)
    assert [r for p in pieces for r in p] == runs
    for p in pieces:
        assert len(p) == 1 or p[-1][1] - p[0][0] <= cap
        keys, mask = piece_keys(pos16, pos2, w.sink_len, p), piece_mask(w.sink_len, p)
        assert mask.shape == (p[-1][1] - p[0][0], len(keys))
        for i, t in enumerate(range(p[0][0], p[-1][1])):
            assert sorted(keys[mask[i]].tolist()) == _wanted(t, lo_of(t), w.sink_len), (p, t)
    return len(pieces)


@pytest.mark.parametrize(("sink", "recent", "db"), [(16, 32, 8), (4, 10, 8), (0, 5, 3), (8, 0, 8),
                                                    (8, 0, 1), (3, 1, 8), (5, 7, 1), (2, 0, 2)])  # fmt: skip
@pytest.mark.parametrize("cap", [0, 7, 40, 128])
def test_decode_rule_masks_select_its_keys(sink: int, recent: int, db: int, cap: int) -> None:
    """Chunks inside the windows, across their end and past them, pieces of one run up to whole chunks."""
    n = sink + recent + 6 * db + 30
    for start in (0, 1, sink + recent - 1, sink + recent + db + 3, n - 9):
        w = SeqWindow(0, 0, 0, start, n - start, sink, True)
        k = _check(w, 0, (recent, db), cap, lambda t: decode_window_start(t, sink, recent, db))
        assert cap < 128 or k == 1 or n - start > 128


@pytest.mark.parametrize("cap", [0, 128])
def test_invariant_and_as_stored_masks_select_their_keys(cap: int) -> None:
    """The invariant rule (window block 12) and a sequence under neither rule (every key as stored)."""
    for start in (0, 5, 12, 29):
        w = SeqWindow(0, 0, 0, start, 70 - start, 8, False)
        _check(w, 12, (0, 0), cap, lambda t: t // 12 * 12)
        _check(w, 0, (14, 4), cap, lambda t: -1)
