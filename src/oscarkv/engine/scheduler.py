"""Admission, chunked prefill, decode batches, preemption, aborts, finishing (engine.md §5.4).

Pure Python over ints. :meth:`Scheduler.schedule` allocates every page and slot a step writes
and advances its sequences (each :class:`StepSeq` carries the tiers before and the moves);
:meth:`Scheduler.postprocess` appends sampled tokens and decides every finish (EOS, stop ids,
length, and the caller's stop-string check), then publishes and releases. Prefill first (the
partial prompt, then FCFS); decode otherwise; when the growing tier runs out the newest running
sequence is preempted by recompute.

Overlapped scheduling: the next batch may be scheduled while the last one is in flight (its
tokens not read yet: ``Sequence.n_pending``). A request never runs past ``max_tokens`` or
``max_model_len`` that way (those finishes are known in advance); one that ends on EOS, a stop
id or a stop string in step N may already be in step N+1, whose token is then dropped. Its KV
rows are released with the rest of its pages (the device runs the steps in order).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace

from ..config import EngineConfig, QuantSpec
from ..errors import InputError
from ..quant.tiers import TierState, apply_moves, plan_moves, window_limit
from .check import check
from .kv_manager import KVManager
from .pages import OutOfPages, PagePool
from .prefix_cache import PrefixCache
from .request import Batch, FinishReason, Sequence, Status, StepSeq

__all__ = ["Scheduler"]


class Scheduler:
    """Owns the waiting queue, the running list (admission order, newest last) and request slots;
    asks :class:`KVManager` (``self.kv``) for pages."""

    def __init__(self, cfg: EngineConfig, hp: PagePool, q: PagePool | None = None,
                 prefix: PrefixCache | None = None, *, spec: QuantSpec | None = None,
                 eos_ids: Iterable[int] = (), max_model_len: int | None = None) -> None:  # fmt: skip
        spec = spec if spec is not None else cfg.spec
        if spec is None:
            raise ValueError("Scheduler needs the QuantSpec in use (spec= or cfg.spec)")
        self.int2 = cfg.kv_dtype == "int2"
        if self.int2:
            cfg.check_spec(spec)
        self.cfg, self.spec, self.ps = cfg, spec, cfg.page_tokens
        self.kv = KVManager(spec, self.int2, cfg.page_tokens, hp, q, prefix, cfg.decode_reserve_pages,
                            decode_scoring=cfg.prompt_scoring == "decode")  # fmt: skip
        self.ring = window_limit(spec)  # ring modulus of every request slot
        self.max_model_len = max_model_len if max_model_len is not None else cfg.max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # holds pages and a slot; includes the partial prefill
        self.free_slots: list[int] = list(range(cfg.max_running))  # a heap
        self.live: dict[str, Sequence] = {}
        self.prompt_end: dict[str, int] = {}  # rid -> tokens to prefill since its last admission
        # rid -> [("admit", n), ("hit", m)?, ("prefill"|"decode", n_new), ...] (check_invariants)
        self.trace: dict[str, list[tuple[str, int]]] | None = {} if cfg.check_invariants else None
        self._inflight: deque[Batch] = deque()  # scheduled, tokens not read yet (oldest first)
        self._pending: dict[str, FinishReason] = {}
        self._epochs = itertools.count()

    @property
    def hp(self) -> PagePool:
        """The 16-bit pages (owned by ``self.kv``)."""
        return self.kv.hp

    @property
    def q(self) -> PagePool:
        """The INT2 pages (owned by ``self.kv``; a 1-page dummy in bf16 mode)."""
        return self.kv.q

    @property
    def prefix(self) -> PrefixCache | None:
        return self.kv.prefix

    # ---- requests -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raises :class:`InputError` for one that can never run (:meth:`check`)."""
        if seq.rid in self.live:
            raise InputError(f"request id {seq.rid!r} is already in use", "give each request its own id")
        if seq.status is not Status.WAITING or seq.out or seq.n_computed or seq.hp_pages or seq.q_pages:
            raise ValueError(f"Scheduler.add needs a new sequence; {seq.rid!r} has state")
        self.check(seq)
        self.live[seq.rid] = seq
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise :class:`InputError` if ``seq`` can never run (an empty prompt, one too long for
        ``max_model_len``, or more pages than a pool has); queues nothing."""
        n, mt, mml = len(seq.prompt), seq.params.max_tokens, self.max_model_len
        if n == 0:
            raise InputError("prompt must have at least one token; got an empty prompt")
        if mml is not None and n >= mml:
            raise InputError(f"prompt of {n} tokens must be shorter than max_model_len ({mml})",
                             "shorten the prompt or raise --max-model-len")  # fmt: skip
        if mml is not None and n + mt > mml:
            raise InputError(f"prompt ({n} tokens) + max_tokens ({mt}) must be <= max_model_len ({mml})",
                             "lower max_tokens or raise --max-model-len")  # fmt: skip
        self.kv.fits(n, mt, seq.sink_len if seq.sink_len is not None else min(n, self.spec.sink_tokens))

    def abort(self, rid: str) -> Sequence | None:
        """Finish ``rid`` with "abort"; returns it, or None if unknown or deferred (see finish)."""
        seq = self.live.get(rid)
        return seq if seq is not None and self.finish(seq, FinishReason.ABORT) else None

    def finish(self, seq: Sequence, reason: FinishReason) -> bool:
        """Finish ``seq`` now (True), or, while a batch is in flight, at the step boundary: it
        then comes back from :meth:`postprocess`. The engine calls this for stop strings."""
        if seq.rid in self.live and self._inflight:
            self._pending.setdefault(seq.rid, reason)
        elif seq.rid in self.live:
            self._finish(seq, reason)
            return True
        return False

    def preempt_newest(self) -> Sequence | None:
        """Preempt the newest running sequence by recompute (at a step boundary)."""
        assert not self._inflight, "preempt at a step boundary only"
        seq = self.running[-1] if self.running else None
        if seq is not None:
            self._preempt(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """The next batch (None when there is nothing to run); pages are allocated already. The
        batches scheduled before it may still be in flight (their tokens not yet postprocessed)."""
        batch = self._prefill() or self._decode()
        if batch is not None:
            for it in batch.items:
                if it.ends_prompt:
                    it.seq.n_pending += 1
            self._inflight.append(batch)
        if self.cfg.check_invariants:
            check(self)
        return batch

    @property
    def in_flight(self) -> int:
        """Batches scheduled whose tokens are not postprocessed yet."""
        return len(self._inflight)

    def postprocess(
        self,
        batch: Batch,
        sampled: list[int | None],
        on_token: Callable[[Sequence, int], bool] | None = None,
    ) -> list[Sequence]:
        """Apply the oldest in-flight step's sampled tokens (None for chunks that do not end a
        prompt); returns the sequences that finished, their pages and slots already released.
        ``on_token(seq, tok)`` sees every token kept and returns True when the text it completes
        holds a stop string (the request then finishes with "stop"). Tokens of requests that
        finished earlier (a step run past EOS or a stop, or an abort) are dropped."""
        if not self._inflight or batch is not self._inflight[0]:
            raise AssertionError("postprocess() of a batch that is not the oldest in flight")
        self._inflight.popleft()
        done = []
        for item, tok in zip(batch.items, sampled, strict=True):
            seq, reason = item.seq, None
            if (tok is None) == item.ends_prompt:
                raise ValueError(f"{seq.rid!r}: sample a token exactly when a step ends the prompt")
            if tok is not None:
                seq.n_pending -= 1
                if seq.status is Status.FINISHED or seq.rid in self._pending:
                    continue
                seq.out.append(tok)
                if seq.times.first_token is None:
                    seq.times.first_token = time.perf_counter()
                reason = self._stop_reason(seq, tok)
                if on_token is not None and on_token(seq, tok) and reason is None:
                    reason = FinishReason.STOP
            if seq.status is Status.FINISHED:
                continue
            if seq.status is Status.RUNNING:
                self.kv.publish_ready(seq)
            if reason is not None:
                self._finish(seq, reason)
                done.append(seq)
        for rid, reason in self._pending.items():  # aborts and finishes deferred to this boundary
            if rid in self.live:
                done.append(self.live[rid])
                self._finish(done[-1], reason)
        self._pending.clear()
        if self.cfg.check_invariants:
            check(self)
        return done

    # ---- internals ------------------------------------------------------------------------
    def _stop_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return FinishReason.STOP
        if self._at_length(seq, len(seq.out)):
            return FinishReason.LENGTH
        return None

    def _at_length(self, seq: Sequence, n_out: int) -> bool:
        """Whether ``n_out`` output tokens reach ``max_tokens`` or ``max_model_len``."""
        mml = self.max_model_len
        return n_out >= seq.params.max_tokens or bool(mml and len(seq.prompt) + n_out >= mml)

    def _decodes(self, seq: Sequence) -> bool:
        """Whether ``seq`` takes a decode step: its prompt is done, its next token may still be
        wanted (the tokens in flight do not reach a length limit) and no finish is pending."""
        return (
            seq.status is Status.RUNNING
            and not self._prefilling(seq)
            and not self._at_length(seq, len(seq.out) + seq.n_pending)
            and seq.rid not in self._pending
        )

    def _prefilling(self, seq: Sequence) -> bool:
        return seq.n_computed < self.prompt_end[seq.rid]

    def _prefill(self) -> Batch | None:
        """A partial chunk uses up the budget (a decode-rule chunk may end a few tokens short of
        it, or beyond a budget below ``demote_block``: ``KVManager.chunk``), so it is the last of
        its batch (at most one)."""
        budget, items = self.cfg.max_batched_tokens, []
        for seq in [s for s in self.running if self._prefilling(s)]:
            end = self.prompt_end[seq.rid]
            full = budget == self.cfg.max_batched_tokens
            n = self.kv.chunk(seq, min(end - seq.n_computed, budget), end, whole_budget=full)
            item = self._step(seq, n, False) if n else None
            if item is None:  # no pages (rare): wait for decodes to free some, admit nobody
                return Batch("prefill", tuple(items)) if items else None
            items.append(item)
            budget = budget - n if item.ends_prompt else 0
        while budget > 0 and self.waiting and (item := self._admit(self.waiting[0], budget)):
            items.append(item)
            budget = budget - item.n_new if item.ends_prompt else 0
        return Batch("prefill", tuple(items)) if items else None

    def _decode(self) -> Batch | None:
        ready = [s for s in self.running if self._decodes(s)]  # oldest first: victims come later
        items = [i for s in ready if s.status is Status.RUNNING and (i := self._step(s, 1, True, True))]
        return Batch("decode", tuple(items)) if items else None

    def _admit(self, seq: Sequence, budget: int) -> StepSeq | None:
        if not self.free_slots or seq.n_pending:  # a preempted request's last token is in flight
            return None
        if seq.sink_len is None:
            seq.sink_len = min(len(seq.prompt), self.spec.sink_tokens)
        n = seq.num_tokens
        full = budget == self.cfg.max_batched_tokens
        if self.kv.chunk(seq, min(n - seq.n_computed, budget), n, whole_budget=full) == 0:
            return None  # a decode-rule chunk that needs a larger budget: the next step's
        self.kv.match(seq)
        if not self.kv.can_allocate(seq, len(self.running)):
            self._release(seq, reset=True)  # undo the match
            return None
        self.running.append(self.waiting.popleft())
        seq.status, seq.slot, seq.n_cached = Status.RUNNING, heapq.heappop(self.free_slots), seq.n_computed
        seq.epoch = next(self._epochs)
        self.prompt_end[seq.rid] = n
        seq.times.first_scheduled = seq.times.first_scheduled or time.perf_counter()
        if self.trace is not None:
            self.trace[seq.rid] = [("admit", n)] + [("hit", seq.n_computed)] * (seq.n_computed > 0)
        take = self.kv.chunk(seq, min(n - seq.n_computed, budget), n, whole_budget=full)  # after the hit
        item = self._step(seq, take, False)
        assert item is not None, "admission checked the pages of the whole prompt"
        return item

    def _step(self, seq: Sequence, n: int, decode: bool, preempt: bool = False) -> StepSeq | None:
        """Allocate and advance one step of ``seq``; None if it cannot get its pages (with
        ``preempt``: after preempting newer sequences, ``seq`` itself last)."""
        while True:
            moves = plan_moves(seq.tiers, n, decode, self.spec, sink_target=self.kv.sink_target(seq))
            try:
                self.kv.allocate(seq, moves)
                break
            except OutOfPages:
                if not preempt:
                    return None
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return None
        item = StepSeq(seq, seq.n_computed, n, replace(seq.tiers), moves)
        apply_moves(seq.tiers, moves, self.ring)
        seq.n_computed += n
        if self.trace is not None:
            self.trace[seq.rid].append(("decode" if decode else "prefill", n))
        return item

    def _release(self, seq: Sequence, reset: bool) -> None:
        """Drop ``seq``'s pages and its slot."""
        self.kv.free(seq)
        if seq.slot is not None:
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = None
        if reset:
            seq.tiers, seq.n_computed, seq.published = TierState(), 0, 0

    def _leave_running(self, seq: Sequence, reset: bool) -> None:
        self._release(seq, reset)
        self.running.remove(seq)
        self.prompt_end.pop(seq.rid)
        (self.trace or {}).pop(seq.rid, None)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: keep ``prompt + out`` and ``sink_len``; first in the waiting queue."""
        self._leave_running(seq, reset=True)
        seq.hashes, seq.status = [], Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is Status.RUNNING:
            self._leave_running(seq, reset=False)  # tiers stay readable after the finish
        else:
            self.waiting.remove(seq)
        del self.live[seq.rid]
        seq.status, seq.finish_reason, seq.times.finished = Status.FINISHED, reason, time.perf_counter()
