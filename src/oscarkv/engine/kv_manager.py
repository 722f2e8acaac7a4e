"""The KV pages of every request, in one place: the scheduler asks, this module counts (engine.md §5.4).

:class:`KVManager` owns both tiers' :class:`~.pages.PagePool` (16-bit pages for the sink, or every
row in bf16 mode; INT2 pages for the quantized history) and the prefix cache. The scheduler asks it
whether a request fits (:meth:`fits`), whether a prompt can be admitted (:meth:`can_allocate`, after
:meth:`match` has taken a prefix hit), for the pages a step writes (:meth:`allocate`, all or
nothing) and to release a request's pages (:meth:`free`). Pure Python over ints.
"""

from __future__ import annotations

from ..config import QuantSpec
from ..errors import InputError
from ..quant.tiers import Moves, TierState, plan_moves
from ..store.windows import decode_chunk_ok
from .pages import OutOfPages, PagePool
from .prefix_cache import UNBOUNDED_SINK, PrefixCache
from .request import Sequence

__all__ = ["KVManager"]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    """Pages of ``page_tokens`` tokens in ``hp`` (16-bit) and ``q`` (INT2; a 1-page dummy in bf16
    mode); ``decode_reserve`` pages per running request are kept free at admission on the tier
    decodes grow (INT2 in int2 mode, 16-bit in bf16 mode). ``decode_scoring``: scored prompts
    follow the decode rule (``prompt_scoring="decode"``, int2; :mod:`oscarkv.store.windows`)."""

    def __init__(self, spec: QuantSpec, int2: bool, page_tokens: int, hp: PagePool, q: PagePool | None = None,
                 prefix: PrefixCache | None = None, decode_reserve: int = 0,
                 decode_scoring: bool = False) -> None:  # fmt: skip
        self.spec, self.int2, self.ps = spec, int2, page_tokens
        self.hp, self.q = hp, q if q is not None else PagePool(1)
        self.prefix = prefix
        self.decode_reserve = decode_reserve
        self.decode_scoring = decode_scoring and int2

    def decode_scored(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a scored prompt under the decode rule: its chunks end where
        :meth:`chunk` allows and its pages are never offered to the prefix cache (their K/V
        were computed under another rule than the prefills that would reuse them)."""
        return self.decode_scoring and seq.params.prompt_logprobs is not None

    def sink_target(self, seq: Sequence) -> int:
        """The sink ``seq`` fills: its ``sink_len`` in INT2 mode; every row in bf16 mode."""
        assert seq.sink_len is not None
        return seq.sink_len if self.int2 else UNBOUNDED_SINK

    def pages_for(self, n: int, sink_len: int) -> tuple[int, int]:
        """(16-bit, INT2) pages after a fresh prefill of ``n`` tokens: the most a request with
        ``n`` computed tokens ever holds (decode keeps at least as many in the ring)."""
        m = plan_moves(
            TierState(), n, False, self.spec, sink_target=sink_len if self.int2 else UNBOUNDED_SINK
        )
        return _ceil(m.to_sink, self.ps), _ceil(m.to_int2, self.ps)

    def chunk(self, seq: Sequence, n: int, prompt_end: int, whole_budget: bool = False) -> int:
        """The tokens of ``seq``'s next prefill chunk given at most ``n``: ``n`` itself, except
        that a decode-rule chunk that does not end the prompt ends where the ring holds every
        16-bit key the next chunk's queries read (such ends come at least every
        ``demote_block`` tokens). None fits in ``n``: 0, or with ``whole_budget`` (``n`` is
        the step's whole budget, below ``demote_block``) the next end beyond ``n``."""
        start = seq.n_computed
        if not self.decode_scored(seq) or start + n >= prompt_end:
            return n
        sink, r, db = self.sink_target(seq), self.spec.recent_tokens, self.spec.demote_block
        c = start + n
        while c > start and not decode_chunk_ok(c, sink, r, db):
            c -= 1
        if c == start and whole_budget:
            c = start + n
            while c < prompt_end and not decode_chunk_ok(c, sink, r, db):
                c += 1
        return c - start

    def fits(self, n_prompt: int, max_tokens: int, sink_len: int) -> None:
        """Raise :class:`InputError` if a request of ``n_prompt + max_tokens`` tokens needs more
        pages than a pool has."""
        need_h, need_q = self.pages_for(n_prompt + max_tokens - 1, sink_len)
        for need, pool, kind in ((need_q, self.q, "INT2"), (need_h, self.hp, "16-bit")):
            if need > pool.capacity:
                raise InputError(f"prompt of {n_prompt} tokens with max_tokens {max_tokens} needs {need} "
                                 f"{kind} pages of {self.ps} tokens; the pool has {pool.capacity}",
                                 "raise --kv-budget-gb or lower max_tokens")  # fmt: skip

    def match(self, seq: Sequence) -> None:
        """Take ``seq``'s prefix hit, if any: the matched pages (one more owner each), the tokens
        they hold as computed, and the tiers of that state. Scoring requests (prompt log-probs)
        compute every row and match nothing."""
        if self.prefix is None or seq.params.prompt_logprobs is not None:
            return
        seq.hp_pages, seq.q_pages = self.prefix.match(seq)
        seq.published = len(seq.hp_pages) + len(seq.q_pages)
        seq.n_computed = seq.published * self.ps
        seq.tiers = self.prefix.hit_state(seq.num_tokens, seq.n_computed, self.sink_target(seq))

    def can_allocate(self, seq: Sequence, running: int) -> bool:
        """Whether the pages ``seq``'s whole prompt still needs (beyond what it holds) are free,
        leaving the decode reserve of ``running`` requests on the growing tier."""
        assert seq.sink_len is not None
        need_h, need_q = self.pages_for(seq.num_tokens, seq.sink_len)
        reserve = self.decode_reserve * running
        need_h += (not self.int2) * reserve - len(seq.hp_pages)
        need_q += self.int2 * reserve - len(seq.q_pages)
        return need_h <= self.hp.n_free and need_q <= self.q.n_free

    def allocate(self, seq: Sequence, m: Moves) -> None:
        """The pages the moves ``m`` write (all or nothing); raises :class:`OutOfPages`."""
        st = seq.tiers
        need_h = _ceil(st.n_sink + m.to_sink, self.ps) - len(seq.hp_pages)
        need_q = _ceil(st.n_q + m.demote + m.to_int2, self.ps) - len(seq.q_pages)
        if need_h > self.hp.n_free or need_q > self.q.n_free:
            raise OutOfPages(f"{seq.rid!r} needs {need_h} 16-bit and {need_q} INT2 pages")
        seq.hp_pages += self.hp.alloc(max(need_h, 0))
        seq.q_pages += self.q.alloc(max(need_q, 0))

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s pages, in reverse order so that tails are evicted first."""
        for p in reversed(seq.q_pages):
            self.q.decref(p)
        for p in reversed(seq.hp_pages):
            self.hp.decref(p)
        seq.hp_pages, seq.q_pages = [], []

    def publish_ready(self, seq: Sequence) -> None:
        """Publish ``seq``'s full pages to the prefix cache (none without one, or for a
        decode-rule scored prompt)."""
        if self.prefix is not None and not self.decode_scored(seq):
            self.prefix.publish_ready(seq)

    @property
    def in_use(self) -> bool:
        """Whether any page has an owner."""
        return any(self.hp.ref) or any(self.q.ref)

    def stats(self) -> dict[str, int]:
        """Free and cached pages per tier (cached: free pages a prefix match can revive)."""
        out = {"hp_free": self.hp.n_free, "hp_cached": self.hp.n_cached}
        if self.int2:
            out.update(q_free=self.q.n_free, q_cached=self.q.n_cached)
        return out
