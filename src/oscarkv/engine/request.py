"""Requests as the engine sees them: sampling parameters, sequences, batches and outputs.

A :class:`Sequence` owns nothing but page ids with a reference each (``engine/pages.py``); its
tier counts are a :class:`~oscarkv.quant.tiers.TierState`, advanced by the same rules as
``OscarCache``. A :class:`Batch` is one step: each :class:`StepSeq` carries the state *before*
the step and the tier moves of the step, so the planner can map every new token to a slot.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from ..config.base import field_error, is_int, is_num
from ..quant.tiers import Moves, TierState

__all__ = [
    "Batch",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "Sequence",
    "Status",
    "StepSeq",
    "Timing",
]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples (vLLM's names). ``temperature == 0`` is greedy; ``top_k = -1`` is off."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: ``(token_id, bias)`` pairs added to the logits before any other step (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: OpenAI's penalties on the output so far (in [-2, 2]; vLLM's semantics, applied after the
    #: logit bias): each token's logit minus ``frequency_penalty`` x its count in the output, minus
    #: ``presence_penalty`` if it occurs there at all
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: vLLM's (CTRL's) repetition penalty in (0, 2], 1 = off: the logit of every token seen in the
    #: prompt or the output is divided by it where positive, multiplied by it where negative
    repetition_penalty: float = 1.0
    #: None: no log-probabilities; k >= 0: each sampled token's log-probability under the model
    #: (raw logits: no temperature, no bias) and the k most likely tokens' (at most MAX_LOGPROBS)
    logprobs: int | None = None
    #: None: none; k >= 0: each prompt token's log-probability given the tokens before it (the
    #: first has none) and the k most likely there (raw logits). The request skips the prefix cache:
    #: every prompt position is computed.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        n = type(self).__name__
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise field_error(n, "max_tokens", "an integer >= 1", self.max_tokens)
        t = self.temperature
        if not is_num(t) or not math.isfinite(t) or not 0 <= t <= 100:
            raise field_error(n, "temperature", "a number in [0, 100] (0 = greedy)", t)
        p = self.top_p
        if not is_num(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise field_error(n, "top_p", "a number in (0, 1]", p)
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise field_error(n, "top_k", "-1 (off) or an integer >= 1", self.top_k)
        if self.seed is not None and not is_int(self.seed):
            raise field_error(n, "seed", "None or an integer", self.seed)
        stop = self.stop if not isinstance(self.stop, str) else (self.stop,)
        if any(not isinstance(s, str) or not s for s in stop):
            raise field_error(n, "stop", "non-empty strings", self.stop)
        object.__setattr__(self, "stop", tuple(stop))
        if any(not is_int(i) or i < 0 for i in self.stop_token_ids):
            raise field_error(n, "stop_token_ids", "token ids >= 0", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = tuple(tuple(x) for x in self.logit_bias)
        if any(len(x) != 2 or not is_int(x[0]) or x[0] < 0 or not is_num(x[1]) or not -100 <= x[1] <= 100
               for x in bias):  # fmt: skip
            raise field_error(n, "logit_bias", "(token id >= 0, bias in [-100, 100]) pairs", self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple((int(i), float(b)) for i, b in bias))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:  # NaN fails the range too
                raise field_error(n, name, "a number in [-2, 2] (0 = off)", v)
        r = self.repetition_penalty
        if not is_num(r) or not 0 < r <= 2:
            raise field_error(n, "repetition_penalty", "a number in (0, 2] (1 = off)", r)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise field_error(n, name, f"None or an integer in [0, {MAX_LOGPROBS}]", k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on (the sampler then counts the seen tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass
class Timing:
    """Wall-clock marks of a request (``time.perf_counter`` seconds)."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


#: the most top log-probabilities a request may ask for per token
MAX_LOGPROBS = 20
#: a sampled token's log-probability and the top ``k`` ``(token id, log-probability)`` pairs
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. Page lists are in position order; every id holds one ref."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    sink_len: int | None = None  # 16-bit sink length, pinned at first admission, kept on preemption
    n_computed: int = 0  # tokens whose K/V are stored
    n_pending: int = 0  # tokens sampled on the device and not yet read (overlapped scheduling)
    epoch: int = -1  # admission number (its page-table rows are rewritten on a new one)
    slot: int | None = None  # request slot: its ring slab (int2) and page-table row
    hp_pages: list[int] = field(default_factory=list)  # sink pages (int2) or every page (bf16)
    q_pages: list[int] = field(default_factory=list)  # INT2 pages, in INT2-list order
    tiers: TierState = field(default_factory=TierState)
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of full global pages, in order
    published: int = 0  # global pages of this sequence already offered to the prefix cache
    n_cached: int = 0  # prompt tokens served by the prefix cache at the last admission
    preemptions: int = 0
    finish_reason: FinishReason | None = None
    times: Timing = field(default_factory=Timing)
    out_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per out token (params.logprobs)
    # one per prompt token with params.prompt_logprobs (position 0: None); rewritten on recompute
    prompt_lps: list[TokenLogprob | None] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """The known tokens (prompt and output read so far)."""
        return self.prompt + self.out

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, the ones still on the device included."""
        return len(self.prompt) + len(self.out) + self.n_pending

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class StepSeq:
    """One sequence in a step: ``n_new`` tokens from position ``start``, with the tier state
    before the step (``pre``, a copy) and the step's ``moves`` (``moves.n_new == n_new``)."""

    seq: Sequence
    start: int
    n_new: int
    pre: TierState
    moves: Moves
    #: whether this step computes the sequence's last token (so it samples one); by default
    #: from the sequence at construction (the scheduler counts the sampled token as pending next)
    ends_prompt: bool = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.ends_prompt is None:
            object.__setattr__(self, "ends_prompt", self.start + self.n_new == self.seq.num_tokens)

    @property
    def n_prompt_scored(self) -> int:
        """Rows of this step whose next token is a prompt token (the rows prompt log-probabilities
        score: positions ``start .. start + n_prompt_scored - 1``)."""
        return max(min(self.start + self.n_new, len(self.seq.prompt) - 1) - self.start, 0)


@dataclass(frozen=True)
class Batch:
    """One engine step: a prefill (chunks of prompts) or a decode (one token per sequence)."""

    kind: str  # "prefill" | "decode"
    items: tuple[StepSeq, ...]

    @property
    def is_decode(self) -> bool:
        return self.kind == "decode"

    @property
    def num_tokens(self) -> int:
        return sum(i.n_new for i in self.items)


@dataclass
class RequestOutput:
    """What a caller gets back for one request (vLLM's shape, flattened: one completion)."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, with params.logprobs set
    #: one per prompt token (the first None), with params.prompt_logprobs set
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: what ``prompt_logprobs`` were scored against (``Engine.prompt_scoring``); None without them
    prompt_scoring: str | None = None
