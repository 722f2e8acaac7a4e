"""A request's fields as the engine's :class:`SamplingParams`: defaults, per-choice seeds, and
token ids checked against the vocabulary (each bad value a 400 naming its field)."""

from __future__ import annotations

import re
from typing import Any

from ..config.base import SpecError
from ..engine.request import SamplingParams
from .protocol import ApiError

__all__ = ["DEFAULT_MAX_TOKENS", "sampling_params", "spec_param"]

#: max_tokens when a request sets none (capped to what fits in max_model_len)
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}


def spec_param(msg: str) -> str | None:
    """The field a ``SpecError`` message names (``Cls.field must ...``)."""
    m = re.match(r"\w+\.(\w+) must", msg)
    return m.group(1) if m else None


#: the longest decimal string a ``logit_bias`` key may be (a token id; longer ones are refused)
MAX_ID_DIGITS = 12


def sampling_params(
    req: Any, n_prompt: int, max_tokens: int | None, kind: str, max_len: int, vocab: int, choice: int = 0
) -> SamplingParams:
    """SamplingParams of a request's ``choice``-th choice of a prompt (a default ``max_tokens``
    that fits; with a ``seed``, choice ``j`` samples with ``seed + j``); 400 for a bad value,
    naming the field (token ids of ``logit_bias`` and ``stop_token_ids`` below ``vocab``)."""
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS[kind], max_len - n_prompt))
    kw: dict[str, Any] = {"max_tokens": max_tokens, "stop": req.stops(), "ignore_eos": req.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if "seed" in kw:
        kw["seed"] += choice
    if req.stop_token_ids:
        bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"stop_token_ids holds {_short(bad[0])}, not a token id of this model's "
                           f"vocabulary [0, {vocab})", "stop_token_ids")  # fmt: skip
        kw["stop_token_ids"] = tuple(req.stop_token_ids)
    kw["logprobs"] = req.logprob_count()
    if getattr(req, "echo", False):  # the prompt comes back with its tokens' log-probabilities
        kw["prompt_logprobs"] = kw["logprobs"]
    if req.logit_bias:
        kw["logit_bias"] = _logit_bias(req.logit_bias, vocab)
    try:
        return SamplingParams(**kw)
    except SpecError as e:
        raise ApiError(400, str(e), spec_param(str(e))) from None


def _logit_bias(bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: keys are decimal token ids below ``vocab``."""
    out = []
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit() and len(k) <= MAX_ID_DIGITS):  # "²" is a digit, not an id
            raise ApiError(400, f"logit_bias keys must be token ids (decimal strings); got {_short(k)!r}",
                           "logit_bias")  # fmt: skip
        if int(k) >= vocab:
            raise ApiError(400, f"logit_bias names token {int(k)}, outside this model's vocabulary [0, {vocab})",
                           "logit_bias")  # fmt: skip
        out.append((int(k), v))
    return tuple(out)


def _short(v: Any, limit: int = 40) -> str:
    """``v`` as text, cut to ``limit`` characters."""
    s = str(v)
    return s if len(s) <= limit else s[:limit] + "..."
