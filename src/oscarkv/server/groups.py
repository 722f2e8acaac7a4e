"""`ChoiceGroups`: the engine thread's share limit. The choices of one HTTP request form a group;
at most ``slots`` of a group are in the engine at a time, and the others wait here (checked,
holding no pages) and go in, in order, as earlier ones finish. Used by the engine thread only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import Engine
from ..engine.request import RequestOutput, SamplingParams

__all__ = ["ChoiceGroups"]

log = logging.getLogger("oscarkv.server")

#: one choice: its request id, prompt ids and params
Choice = tuple[str, list[int], SamplingParams]


@dataclass
class _Group:
    """One request's choices: how many are in the engine, and the held ones (id -> prompt ids
    and params, in order)."""

    in_engine: int = 0
    held: dict[str, tuple[list[int], SamplingParams]] = field(default_factory=dict)
    deferred: bool = False  # its refill waited a step for requests waiting in the engine


class ChoiceGroups:
    """Groups of choices over ``engine``; ``deliver(rid, item)`` hands a held choice's abort
    (a finished ``RequestOutput``) or a failed submission's error to its caller."""

    def __init__(self, engine: Engine, slots: int, deliver: Callable[[str, Any], None]):
        self.engine, self.slots, self.deliver = engine, slots, deliver
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}

    def __bool__(self) -> bool:
        """Whether any group has a choice in the engine or held back."""
        return bool(self._groups)

    def add(self, group: str, choices: list[Choice]) -> None:
        """Check every choice (the first ``InputError`` raises, nothing added), then queue the
        first ``slots`` in the engine and hold the rest back."""
        for _, ids, params in choices:
            self.engine.check_request(ids, params)
        g = self._groups.setdefault(group, _Group())
        for rid, ids, params in choices:
            self._group_of[rid] = group
            if g.in_engine < self.slots and not g.held:
                self._submit(rid, ids, params, g)
            else:
                g.held[rid] = (ids, params)

    def abort(self, rids: tuple[str, ...]) -> None:
        """Held choices end at once (finish reason "abort"); the others are aborted in the engine."""
        for rid in rids:
            g = self._groups.get(self._group_of.get(rid, ""))
            if g is not None and rid in g.held:
                ids, _ = g.held[rid]
                self.deliver(rid, RequestOutput(rid, ids, [], "", True, "abort", e2e_s=0.0))
            else:
                self.engine.abort(rid)

    def finished(self, rid: str) -> None:
        """``rid`` left the engine (or its hold): its group has one choice fewer."""
        name = self._group_of.pop(rid, None)
        g = self._groups.get(name) if name is not None else None
        if g is None:
            return
        if rid in g.held:
            del g.held[rid]
        else:
            g.in_engine -= 1
        if not g.held and g.in_engine <= 0:
            del self._groups[name]

    def feed(self) -> None:
        """Held choices go in while their group has fewer than ``slots`` in the engine; when
        other requests wait in the engine, one step later (a request that arrived meanwhile is
        admitted before another request's later choices, and no group waits longer)."""
        others_wait = None
        for name, g in list(self._groups.items()):
            if not g.held or g.in_engine >= self.slots:
                continue
            if not g.deferred:
                if others_wait is None:
                    others_wait = self.engine.load().waiting > 0
                if others_wait:
                    g.deferred = True
                    continue
            g.deferred = False
            while g.held and g.in_engine < self.slots:
                rid = next(iter(g.held))
                ids, params = g.held.pop(rid)
                self._submit(rid, ids, params, g)
            if not g.held and g.in_engine <= 0:
                del self._groups[name]

    def _submit(self, rid: str, ids: list[int], params: SamplingParams, g: _Group) -> None:
        try:
            self.engine.add_request(ids, params, rid)
        except Exception as e:  # checked on arrival, so not expected: the choice ends with the error
            log.exception("a held-back choice could not be added")
            self._group_of.pop(rid, None)
            self.deliver(rid, e)
        else:
            g.in_engine += 1
