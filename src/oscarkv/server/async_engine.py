"""`AsyncEngine`: one engine thread beside the asyncio loop (engine.md §6).

The thread drains a command queue (add / abort), calls :meth:`Engine.step` and hands each
:class:`RequestOutput` to its request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``.
All engine state is touched by that thread only; tokenization runs in an executor.

The choices of one HTTP request are added together, as a group: at most ``group_slots`` of them
are in the engine at a time, and the others wait in the thread (:class:`ChoiceGroups`) and go
in, in order, as earlier ones finish; so one request's fan-out never takes every running slot
from the requests beside it. Every choice counts toward ``max_queued`` from the moment its
request reserves it (:meth:`AsyncEngine.reserve`, before tokenizing) until it finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..engine.engine import Engine
from ..engine.request import RequestOutput, SamplingParams
from ..engine.tokenizer import apply_chat, encode_prompt
from ..errors import OscarkvError
from .groups import ChoiceGroups

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "Reservation"]

log = logging.getLogger("oscarkv.server")
_IDLE_WAIT_S = 0.05
#: prompts up to this many characters are tokenized on the short-prompt thread
SHORT_PROMPT_CHARS = 8192


class QueueFullError(OscarkvError):
    """More choices are live than ``max_queued`` allows (answered 503)."""


class EngineDeadError(OscarkvError):
    """The engine thread stopped after an error (answered 503)."""


@dataclass
class Reservation:
    """Places in ``max_queued`` held for one request's choices; :meth:`AsyncEngine.add` turns
    them into live choices, and leaving :meth:`AsyncEngine.reserve` frees those left."""

    places: int


class AsyncEngine:
    """Runs ``engine`` in its own thread; :meth:`add` queues one request's choices and
    :meth:`stream` yields a choice's outputs on the loop."""

    def __init__(
        self,
        engine: Engine,
        max_queued: int = 1024,
        on_finished: Callable[[RequestOutput], None] | None = None,
        tokenizer_workers: int = 4,
        request_share: float = 1.0,
    ):
        self.engine = engine
        self.max_queued = max_queued
        self.on_finished = on_finished
        #: the most choices of one request in the engine at once (a share of its running slots)
        self.group_slots = max(1, math.floor(request_share * engine.cfg.max_running))
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._reserved = 0  # places reserved for choices being tokenized or added
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._groups = ChoiceGroups(engine, self.group_slots, self._deliver)  # the engine thread's
        # long prompts share a pool; short ones (and chats) have a thread of their own, so a burst
        # of long prompts does not hold back a short request
        self._tok_pool = ThreadPoolExecutor(tokenizer_workers, thread_name_prefix="oscarkv-tokenize")
        self._tok_short = ThreadPoolExecutor(1, thread_name_prefix="oscarkv-tokenize-short")
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread, delivering to ``loop`` (default: the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="oscarkv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        self._tok_pool.shutdown(wait=False)
        self._tok_short.shutdown(wait=False)
        self.engine.shutdown()  # tensor-parallel workers (a no-op with one rank)

    @property
    def running(self) -> bool:
        """Whether :meth:`start` has started the engine thread (it may have stopped since)."""
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_live(self) -> int:
        """Choices added and not finished (held back ones included)."""
        with self._lock:
            return len(self._queues)

    def is_live(self, rid: str) -> bool:
        """Whether ``rid`` was added and has not finished (nor been given up on)."""
        with self._lock:
            return rid in self._queues

    # ---- admission ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reserve(self, places: int) -> Iterator[Reservation]:
        """Hold ``places`` of ``max_queued`` for one request's choices while its prompts are
        tokenized and added; ``QueueFullError`` if they do not fit beside the live ones now."""
        with self._lock:
            if len(self._queues) + self._reserved + places > self.max_queued:
                raise QueueFullError(
                    f"the server is busy: {self.max_queued} choices are queued (--max-queued)",
                    "retry after the time in Retry-After",
                )
            self._reserved += places
        res = Reservation(places)
        try:
            yield res
        finally:
            with self._lock:
                self._reserved -= res.places

    # ---- tokenization (off the loop) ----------------------------------------------------------
    async def encode(self, prompt: str | list[int]) -> list[int]:
        """Checked token ids of a text prompt or an id list (``InputError`` for a bad one)."""
        tok, vocab = self.engine.tokenizer, self.engine.vocab_size
        long = isinstance(prompt, str) and len(prompt) > SHORT_PROMPT_CHARS
        pool = self._tok_pool if long else self._tok_short
        return await asyncio.get_running_loop().run_in_executor(pool, encode_prompt, tok, prompt, vocab)

    async def encode_chat(self, messages: list[dict], template: str | None) -> list[int]:
        tok = self.engine.tokenizer
        chars = sum(len(m.get("content") or "") for m in messages if isinstance(m, dict))
        pool = self._tok_pool if chars > SHORT_PROMPT_CHARS else self._tok_short
        return await asyncio.get_running_loop().run_in_executor(pool, apply_chat, tok, messages, template)

    # ---- requests ---------------------------------------------------------------------------
    async def add(
        self,
        items: Sequence[tuple[list[int], SamplingParams]],
        rids: Sequence[str],
        group: str,
        reservation: Reservation | None = None,
    ) -> list[asyncio.Queue]:
        """Queue one request's choices (``items[k]`` as ``rids[k]``), all or none, and wait until
        the engine thread checked them (the first one's ``InputError`` raises here). At most
        ``group_slots`` of them run at a time; the rest wait their turn. Without a
        ``reservation`` they must fit ``max_queued`` now."""
        if not self.alive:
            raise EngineDeadError(
                "the engine thread has stopped", "restart the server; its log has the error"
            )
        qs = [asyncio.Queue() for _ in rids]
        with self._lock:
            if reservation is None and len(self._queues) + self._reserved + len(rids) > self.max_queued:
                raise QueueFullError(
                    f"the server is busy: {self.max_queued} choices are queued (--max-queued)"
                )
            taken = [r for r in rids if r in self._queues]
            if taken or len(set(rids)) != len(rids):
                raise OscarkvError(f"request id {(taken or list(rids))[0]!r} is already in use")
            self._queues.update(zip(rids, qs, strict=True))
            if reservation is not None:
                n = min(reservation.places, len(rids))
                reservation.places -= n
                self._reserved -= n
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        choices = [(rid, ids, params) for rid, (ids, params) in zip(rids, items, strict=True)]
        self._cmds.put(("add", (group, choices, accepted)))
        try:
            await accepted
        except BaseException:
            with self._lock:
                for rid in rids:
                    self._queues.pop(rid, None)
            if not accepted.done() or accepted.cancelled() or accepted.exception() is None:
                self.abort(*rids)  # cancelled while queued: the engine thread may take them later
            raise
        return qs

    async def stream(self, rid: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs of an added choice until it finishes; leaving early aborts it."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, rid: str
    ) -> AsyncIterator[RequestOutput]:
        """Add one request and yield its cumulative outputs; an unfinished request is aborted on exit."""
        (q,) = await self.add([(prompt_ids, params)], [rid], rid)
        async for out in self.stream(rid, q):
            yield out

    def abort(self, *rids: str) -> None:
        """Abort ``rids`` together at the next step boundary (thread-safe; unknown ids are
        ignored); choices still held back end at once."""
        self._cmds.put(("abort", rids))

    # ---- the engine thread --------------------------------------------------------------------
    def _deliver(self, rid: str, item: Any) -> None:
        with self._lock:
            q = self._queues.get(rid)
            if (isinstance(item, RequestOutput) and item.finished) or isinstance(item, BaseException):
                self._queues.pop(rid, None)
        assert self._loop is not None
        if q is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, item)
        if isinstance(item, RequestOutput) and item.finished:
            self._groups.finished(rid)
            if self.on_finished is not None:
                self._loop.call_soon_threadsafe(self.on_finished, item)

    def _command(self, kind: str, arg: Any) -> None:
        assert self._loop is not None
        if kind == "abort":
            self._groups.abort(arg)
        elif kind == "add":
            group, choices, fut = arg
            try:
                self._groups.add(group, choices)
            except Exception as e:  # handed to the caller
                self._loop.call_soon_threadsafe(_set, fut, e)
            else:
                self._loop.call_soon_threadsafe(_set, fut, None)

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                if not eng.has_unfinished() and not self._groups:  # nothing to run or hold: wait
                    try:
                        self._command(*self._cmds.get(timeout=_IDLE_WAIT_S))
                    except queue.Empty:
                        continue
                while True:
                    try:
                        self._command(*self._cmds.get_nowait())
                    except queue.Empty:
                        break
                self._groups.feed()  # after the commands: requests that came during the step wait first
                if eng.has_unfinished():
                    for out in eng.step():
                        self._deliver(out.rid, out)
        except BaseException as e:  # the thread must report, not vanish
            log.exception("oscarkv engine thread died")
            self.error = e
            dead = EngineDeadError(f"the engine thread stopped: {type(e).__name__}")
            with self._lock:
                rids = list(self._queues)
            for rid in rids:
                self._deliver(rid, dead)
            while True:  # adds still queued would wait forever
                try:
                    kind, arg = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if kind == "add" and self._loop is not None:
                    self._loop.call_soon_threadsafe(_set, arg[2], dead)


def _set(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
