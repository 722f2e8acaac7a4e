"""The tensors of one step over the tiered store, as :class:`~.attention.TierAttention` reads them.

Row ids are flat rows of one layer's pools (:class:`~.layout.LayerViews`), whatever the layout
that produced them (engine pages, vLLM's pages, per-sequence regions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .csr import Csr

__all__ = ["DecodeTensors", "PrefillTensors"]


@dataclass(frozen=True)
class PrefillTensors:
    """A prefill step over ``n`` sequences, ``T`` tokens flat (sequence after sequence).

    ``pre_q``/``pre_hp``: each sequence's stored rows *before* the step (INT2 / 16-bit ids; the
    prefix is fully visible, so their order is free). Writes: new token ``q_tok[i]`` goes to INT2
    row ``q_dst[i]``, token ``hp_tok[i]`` to 16-bit row ``hp_dst[i]`` (sink rows, then ring rows;
    BF16: page rows); the 16-bit rows ``demote_src`` move to INT2 rows ``demote_dst`` first.
    All long on the device unless stated.
    """

    positions: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # int32 [n+1]
    cu_host: tuple[int, ...]  # host copy of cu_seqlens
    last_idx: torch.Tensor  # [n_last]: last token row of each sequence whose prompt ends here
    pre_q: Csr
    pre_hp: Csr
    q_tok: torch.Tensor
    q_dst: torch.Tensor
    hp_tok: torch.Tensor
    hp_dst: torch.Tensor
    demote_src: torch.Tensor
    demote_dst: torch.Tensor
    #: rows whose logits score the next prompt token (prompt log-probabilities), that token
    #: (long ``[n_lp]`` each), and how many top log-probabilities to keep; None: no such rows
    lp_idx: torch.Tensor | None = None
    lp_target: torch.Tensor | None = None
    lp_k: int = 0
    #: ``prefill_attention="invariant"`` (:mod:`.windows`): each (sequence, window block)'s key
    #: rows in the layer's key bank (long), int32 ``[2, pieces+1]`` query/key offsets, host
    #: ``(longest query run, longest key list)``; None: the fresh rule (new rows in 16 bits)
    win_idx: torch.Tensor | None = None
    win_cu: torch.Tensor | None = None
    win_max: tuple[int, int] = (0, 0)
    #: host runs of pieces attended by one call each (bounding the gathered key rows)
    win_groups: tuple[tuple[int, int, int, int, int, int], ...] = ()
    #: the masked form (CPU, :mod:`.masked_pieces`): each piece's bool ``[queries, keys]`` mask,
    #: flat in piece order (one group per piece); None: the varlen form (bottom-right causal)
    win_mask: torch.Tensor | None = None
    #: the key bank also holds the step's new rows as computed, which fresh sequences of a step
    #: with decode-rule ones read (the rules read them as the windows will hold them)
    win_raw: bool = False


@dataclass(frozen=True)
class DecodeTensors:
    """A decode step over ``B`` sequences (``B_pad`` rows with padding), one token each.

    ``ids [B_pad]``: the input token of each row where the host knows it, else ``-1`` (the token
    the last step sampled for that request slot, still on the device: overlapped scheduling).
    ``decode_dst [B_pad]``: the 16-bit row of each new token (ring row; BF16: page row; ``-1`` on
    padding). ``demote_src/dst``: 16-bit rows → INT2 rows demoted before the write (padded to
    ``B_pad·demote_block`` with the dummy rows 0 → 0 when ``bs_pad`` is given). ``slots``,
    ``n_sink``, ``head`` (int32 ``[B_pad]``): each row's request slot, sink rows and ring head
    (BF16: ``n_sink`` = its list length), from which :func:`~.page_table.expand_lists` fills the
    *post-step* lists ``q``/``hp`` on the device (padding rows empty). ``lens_hint``: host ints ≥
    the longest lists. Hosts that list rows themselves (the vLLM plug-in) fill ``q``/``hp``
    directly and leave ``ids``, ``slots``, ``n_sink`` and ``head`` empty.
    """

    ids: torch.Tensor  # long [B_pad]
    positions: torch.Tensor  # long [B_pad]
    decode_dst: torch.Tensor  # long [B_pad]
    demote_src: torch.Tensor
    demote_dst: torch.Tensor
    slots: torch.Tensor  # int32 [B_pad]
    n_sink: torch.Tensor  # int32 [B_pad]
    head: torch.Tensor  # int32 [B_pad]
    q: Csr
    hp: Csr
    lens_hint: tuple[int, int]
