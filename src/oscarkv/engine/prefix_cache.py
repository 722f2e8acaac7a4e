"""Prefix cache: chained page hashes over the global page grid (engine.md §3.4).

Global page ``k`` covers positions ``[k·ps, (k+1)·ps)``. In INT2 mode pages ``k < S/ps`` are
16-bit sink pages and later ones INT2 pages (``q_pages[k − S/ps]``, on the grid only when the
sink is full, ``sink_len == S``); in BF16 mode every page is a 16-bit page. ``h_k =
blake2b(h_{k−1} ‖ tokens of page k)``, 16 bytes, from a root mixing the caller's ``seed`` (model
and rotation fingerprints), ``ps``, ``kv_dtype`` and the QuantSpec. The index holds no ownership:
a match increfs the pages it returns, publishing never frees or remaps.
"""

from __future__ import annotations

import struct
from hashlib import blake2b

from ..config import QuantSpec
from ..quant.tiers import TierState, plan_moves
from .pages import PagePool
from .request import Sequence

__all__ = ["UNBOUNDED_SINK", "PrefixCache", "align_down"]

#: the sink target of BF16 mode: every token goes to 16-bit pages
UNBOUNDED_SINK = 1 << 62


def align_down(x: int, ps: int) -> int:
    return x // ps * ps


def tokens_between(seq: Sequence, a: int, b: int) -> list[int]:
    """``seq.tokens[a:b]`` without concatenating the prompt and the output."""
    lp = len(seq.prompt)
    if b <= lp:
        return seq.prompt[a:b]
    if a >= lp:
        return seq.out[a - lp : b - lp]
    return seq.prompt[a:] + seq.out[: b - lp]


class PrefixCache:
    """Hashing, :meth:`match` and :meth:`publish_ready` over one ``hp`` and one ``q`` pool."""

    def __init__(
        self,
        seed: bytes,
        ps: int,
        spec: QuantSpec,
        kv_dtype: str,
        hp_pool: PagePool,
        q_pool: PagePool,
        hit_block: int = 0,
    ) -> None:
        """``hit_block``: a hit that reaches past the sink ends on a multiple of it
        (``prefill_attention="invariant"``'s window block; 0: on any page)."""
        if kv_dtype not in ("int2", "bf16"):
            raise ValueError(f"kv_dtype must be int2 or bf16; got {kv_dtype!r}")
        if hit_block % ps:
            raise ValueError(f"hit_block {hit_block} is not a multiple of the page ({ps} tokens)")
        self.ps, self.spec, self.kv_dtype, self.hit_block = ps, spec, kv_dtype, hit_block
        self.hp, self.q = hp_pool, q_pool
        self.int2 = kv_dtype == "int2"
        self.sink_pages = spec.sink_tokens // ps if self.int2 else UNBOUNDED_SINK
        mix = repr((ps, kv_dtype, spec)).encode()
        self.root = blake2b(b"oscarkv.prefix.v1\0" + bytes(seed) + b"\0" + mix, digest_size=16).digest()
        self._fmt = struct.Struct(f"<{ps}q")

    def page_hash(self, seq: Sequence, k: int) -> bytes:
        """``h_k`` of ``seq`` (page ``k`` must hold known tokens); extends ``seq.hashes``."""
        ps = self.ps
        while len(seq.hashes) <= k:
            j = len(seq.hashes)
            prev = seq.hashes[-1] if seq.hashes else self.root
            toks = tokens_between(seq, j * ps, (j + 1) * ps)
            if len(toks) != ps:
                raise AssertionError(f"page {j} of {seq.rid!r} is not full of known tokens")
            seq.hashes.append(blake2b(prev + self._fmt.pack(*toks), digest_size=16).digest())
        return seq.hashes[k]

    def cap(self, n: int, sink_len: int) -> int:
        """Most prompt tokens a match may serve for a prompt of ``n`` tokens."""
        if not self.int2:
            return align_down(n - 1, self.ps)
        cap = align_down(min(n - 1, max(sink_len, n - self.spec.recent_tokens)), self.ps)
        if self.hit_block and cap > sink_len:  # no window block starts before the hit's end
            cap = max(align_down(cap, self.hit_block), align_down(sink_len, self.ps))
        return cap

    def hit_state(self, n: int, m: int, sink_target: int) -> TierState:
        """The tiers after an ``m``-token hit on an ``n``-token prompt: the first ``m``
        positions of a fresh prefill of the whole prompt, which the cap keeps out of its ring."""
        full = plan_moves(TierState(), n, False, self.spec, sink_target=sink_target)
        if m > full.to_sink + full.to_int2:
            raise AssertionError(f"a prefix hit of {m} of {n} tokens reaches a fresh run's ring")
        n_sink = min(m, full.to_sink)
        return TierState(n_sink=n_sink, n_q=m - n_sink, started=m > 0)

    def _matchable(self, sink_len: int, k: int) -> bool:
        """Whether a fresh run with this ``sink_len`` stores page ``k`` in one fixed tier of the
        kind the pool holds (a whole sink page, or an INT2 page on the grid)."""
        if not self.int2:
            return True
        if k < self.sink_pages:
            return (k + 1) * self.ps <= sink_len
        return sink_len == self.spec.sink_tokens

    def _page_of(self, seq: Sequence, k: int) -> tuple[PagePool, int]:
        if k < self.sink_pages:
            return self.hp, seq.hp_pages[k]
        return self.q, seq.q_pages[k - self.sink_pages]

    def match(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """The longest cached prefix of ``seq.tokens`` under the cap, as (hp pages, q pages),
        each page increfed. ``seq`` must hold no pages; its ``sink_len`` must be pinned."""
        if seq.hp_pages or seq.q_pages or seq.n_computed:
            raise AssertionError(f"match on {seq.rid!r}, which already holds KV")
        assert seq.sink_len is not None
        hp: list[int] = []
        q: list[int] = []
        for k in range(self.cap(seq.num_tokens, seq.sink_len) // self.ps):
            if not self._matchable(seq.sink_len, k):
                break
            pool, dst = (self.hp, hp) if k < self.sink_pages else (self.q, q)
            p = pool.lookup(self.page_hash(seq, k))
            if p is None:
                break
            dst.append(p)
        if self.hit_block and q:  # a hit past the sink ends on a window block, whatever page missed
            keep = max(align_down((len(hp) + len(q)) * self.ps, self.hit_block), len(hp) * self.ps)
            q = q[: keep // self.ps - len(hp)]
        for p in hp:
            self.hp.incref(p)
        for p in q:
            self.q.incref(p)
        return hp, q

    def _ready(self, seq: Sequence, k: int) -> bool:
        """The publish rule: every position of page ``k`` is stored in a fixed tier."""
        end, st = (k + 1) * self.ps, seq.tiers
        if k < self.sink_pages:
            return end <= st.n_sink
        s = self.spec.sink_tokens
        return seq.sink_len == s and st.n_sink == s and end <= s + st.n_q

    def publish_ready(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly fixed pages to the index, in page order (after each step)."""
        k = seq.published
        while self._ready(seq, k):
            pool, p = self._page_of(seq, k)
            pool.publish(p, self.page_hash(seq, k))  # False: an equal page is indexed; p stays private
            k += 1
        seq.published = k
