"""`Engine`: requests in, tokens out, one :meth:`Engine.step` at a time (continuous batching).

``add_request`` checks and queues a request, ``abort`` ends one at the next step boundary, and
``step`` runs one batch (a prefill of prompt chunks, or a decode of every running request) and
returns a :class:`RequestOutput` for each request that gained text or finished. All pool and
page mutation happens inside ``step``, in the caller's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from ..errors import InputError
from .check import check
from .detok import IncrementalDetokenizer
from .launched import Launched, prompt_logprobs_of, token_logprobs_of, tokens_of
from .load import EngineLoad, PoolLoad
from .model_runner import ModelRunner
from .pages import PagePool
from .prefix_cache import PrefixCache
from .request import RequestOutput, SamplingParams, Sequence, TokenLogprob
from .scheduler import Scheduler
from .timing import StepTimer, StepTiming
from .tokenizer import encode_prompt

if TYPE_CHECKING:
    from .distributed import Workers

__all__ = ["Engine"]


def _overlap(cfg: EngineConfig, device: Any) -> bool:
    """Whether steps overlap: ``auto`` on CUDA with one rank (tensor-parallel workers take each
    step's input ids from rank 0's host; the config refuses ``on`` there)."""
    if cfg.overlap == "auto":
        return device.type == "cuda" and cfg.tensor_parallel == 1
    return cfg.overlap == "on"


class Engine:
    """One model on one device with its KV pools, scheduler and prefix cache; with
    ``tensor_parallel = N > 1``, on N devices (N processes; this one is rank 0). Call
    :meth:`shutdown` (or use it as a context manager) to stop the worker processes."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.workers: Workers | None = None
        if cfg.tensor_parallel > 1:
            from .distributed import launch

            self.runner, self.workers = launch(cfg)
        else:
            self.runner = ModelRunner(cfg)
        # max_running as the runner chose it where it was unset
        self.cfg = cfg = dataclasses.replace(cfg, max_running=self.runner.cfg.max_running)
        self.tokenizer = self.runner.tokenizer
        plan, spec = self.runner.plan, self.runner.spec
        self.hp = PagePool(plan.hp_pages)
        self.q = PagePool(plan.q_pages) if plan.int2 else None
        prefix = None
        if cfg.prefix_cache:
            prefix = PrefixCache(
                self.runner.fingerprint, cfg.page_tokens, spec, cfg.kv_dtype, self.hp, self.q or PagePool(1),
                hit_block=plan.window_block,
            )  # fmt: skip
        self.scheduler = Scheduler(
            cfg, self.hp, self.q, prefix, spec=spec, eos_ids=self.runner.shape.eos_token_ids,
            max_model_len=self.runner.max_model_len,
        )  # fmt: skip
        self.overlap = _overlap(cfg, self.runner.device)
        self.timer = StepTimer(self.runner.device, cfg.step_timing)
        self._in_flight: Launched | None = None  # overlap: the step whose tokens are unread
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[Sequence] = []
        self._ids = itertools.count()
        self.stats = {
            "steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "cached_tokens": 0,
            "preemptions": 0,
        }

    # ---- read-only facts and state, for front ends ------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output tokens) a request may reach."""
        return int(self.runner.max_model_len)

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold are ``0 .. vocab_size-1``."""
        return int(self.runner.shape.vocab)

    def startup_report(self) -> str:
        """One line: pool bytes, pages and tokens per tier, ``max_running``, graphs, backend."""
        return self.runner.startup_report()

    def load(self) -> EngineLoad:
        """Requests running and waiting, and each page pool's free, cached and usable pages
        (reads only: any thread may call it)."""
        pools = {"hp": PoolLoad.of(self.hp)}
        if self.q is not None:
            pools["int2"] = PoolLoad.of(self.q)
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting), pools)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, rid: str | None = None
    ) -> str:
        """Queue ``prompt`` (text or token ids); returns its request id. Raises ``InputError`` for
        a prompt that is empty, too long for ``max_model_len`` or larger than the KV pools."""
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        seq = self._sequence(prompt, params, rid)
        if seq.params.prompt_logprobs is not None:
            seq.prompt_lps = [None] * len(seq.prompt)
        self.scheduler.add(seq)
        self._detok[rid] = IncrementalDetokenizer(self.tokenizer, seq.prompt, seq.params.stop)
        return rid

    def check_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Raise the ``InputError`` :meth:`add_request` would raise for ``prompt`` and ``params``,
        queuing nothing (a front end that holds requests back checks them as they arrive)."""
        self.scheduler.check(self._sequence(prompt, params, ""))

    def _sequence(self, prompt: str | list[int], params: SamplingParams | None, rid: str) -> Sequence:
        params = params or SamplingParams()
        ids = encode_prompt(self.tokenizer, prompt, self.vocab_size)
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InputError(f"logit_bias names token {bad[0]}, outside the vocabulary of {self.vocab_size}",
                             "bias token ids in [0, vocab_size)")  # fmt: skip
        return Sequence(rid, ids, params)

    def abort(self, rid: str) -> None:
        """End ``rid`` with finish reason "abort" (its pages are freed at the step boundary)."""
        seq = self.scheduler.abort(rid)
        if seq is not None:
            self._aborted.append(seq)

    def has_unfinished(self) -> bool:
        return not self.scheduler.idle or bool(self._aborted) or self._in_flight is not None

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; outputs for the requests that gained text or finished. With overlapped
        scheduling (``overlap``) the batch is queued on the device and the outputs are those of
        the batch before it, read while this one runs. Under tensor parallelism, raises
        ``TensorParallelError`` once any rank has failed."""
        if self.workers is not None:
            self.workers.check()
        outs: list[RequestOutput] = [self._output(s, True) for s in self._drain_aborted()]
        launched = None
        batch = self.scheduler.schedule()
        if batch is not None:
            self.timer.begin(batch.kind, len(batch.items), batch.num_tokens)
            with self._guard():
                host = self.runner.plan_decode(batch) if batch.is_decode else None
                self.timer.launching()
                launched = self.runner.launch(batch, host)
            self.timer.launched()
            self.stats["steps"] += 1
            self.stats["decode_tokens" if batch.is_decode else "prefill_tokens"] += batch.num_tokens
        if self.overlap:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if done is not None:
            outs += self._process(done)
        if batch is not None:
            self.timer.end()
        if self.cfg.check_invariants:
            check(self.scheduler)
        return outs

    def _process(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's tokens and apply them: finishes, text, outputs."""
        with self.timer.waiting(), self._guard():
            toks = tokens_of(launched)
            for it, scored in prompt_logprobs_of(launched):  # idempotent on recompute
                it.seq.prompt_lps[it.start + 1 : it.start + 1 + len(scored)] = scored
        lps = {} if launched.logprobs is None else {
            it.seq.rid: lp for it, lp in zip(launched.batch.items, token_logprobs_of(launched), strict=True)
            if lp is not None
        }  # fmt: skip
        gained: dict[str, Sequence] = {}
        finished = self.scheduler.postprocess(
            launched.batch, toks, lambda seq, tok: self._on_token(seq, tok, gained, lps.get(seq.rid))
        )
        outs = [self._output(seq, False) for seq in gained.values() if seq not in finished]
        return outs + [self._output(seq, True) for seq in finished]

    def _on_token(
        self, seq: Sequence, tok: int, gained: dict[str, Sequence], lp: TokenLogprob | None
    ) -> bool:
        """A kept token (and its log-probabilities, where asked): feed the detokenizer; True when
        the text now holds a stop string."""
        gained[seq.rid] = seq
        if lp is not None:
            seq.out_logprobs.append(lp)
        det = self._detok.get(seq.rid)
        if det is None:
            return False
        det.add([tok])
        return det.stopped

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Under tensor parallelism: any failure stops all ranks and raises the rank's error."""
        if self.workers is None:
            yield
            return
        try:
            yield
        except BaseException as e:
            err = self.workers.fail(e)
            if err is e:
                raise
            raise err from e

    def step_timings(self) -> list[StepTiming]:
        """The timings of the steps whose device work has completed since the last call
        (``step_timing=True``; else empty): host time, device time, the device's idle gap."""
        return self.timer.drain()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank); idempotent."""
        if self.workers is not None:
            self.workers.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _drain_aborted(self) -> list[Sequence]:
        out, self._aborted = self._aborted, []
        return out

    def _output(self, seq: Sequence, finished: bool) -> RequestOutput:
        det = self._detok.get(seq.rid)
        text = det.text if det is not None else ""
        if finished:
            if det is not None and not det.stopped:
                det.flush()
                text = det.text
            self._detok.pop(seq.rid, None)
            self.runner.release(seq.rid)
            seq.times.finished = time.perf_counter()
            self.stats["cached_tokens"] += seq.n_cached
            self.stats["preemptions"] += seq.preemptions
        t = seq.times
        return RequestOutput(
            rid=seq.rid,
            prompt_token_ids=seq.prompt,
            token_ids=list(seq.out),
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
            num_cached_tokens=seq.n_cached,
            ttft_s=None if t.first_token is None else t.first_token - t.arrival,
            e2e_s=None if t.finished is None else t.finished - t.arrival,
            logprobs=None if seq.params.logprobs is None else list(seq.out_logprobs),
            prompt_logprobs=None if seq.params.prompt_logprobs is None else list(seq.prompt_lps),
            prompt_scoring=None if seq.params.prompt_logprobs is None else self.prompt_scoring,
        )

    @property
    def prompt_scoring(self) -> str:
        """What scored prompts attend to: ``"bf16"`` (a 16-bit store), ``"int2-decode"`` (the
        history as decoding reads it), ``"int2-fresh"`` or ``"int2-invariant"`` (the prefill rule;
        ``fresh`` scores a one-chunk prompt in 16 bits)."""
        if self.cfg.kv_dtype != "int2":
            return "bf16"
        rule = "decode" if self.cfg.prompt_scoring == "decode" else self.cfg.prefill_attention
        return f"int2-{rule}"

    def memory_report(self) -> dict[str, Any]:
        """Bytes of every KV pool as allocated, plus the page counts of each tier."""
        rep = self.runner.memory_report()
        rep["pages"] = self.scheduler.kv.stats()
        return rep
