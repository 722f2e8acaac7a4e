"""Overlapped scheduling (``overlap="on"``) against step-by-step scheduling on CPU: the same
greedy tokens and finishes with stop strings, stop ids, EOS, aborts, preemption, chunked prefill
and prefix hits in the mix, page accounting checked after every step; the token of a step run
past a finish is dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import random_rotation_set
from oscarkv import LLM, QuantSpec, SamplingParams
from oscarkv.config import EngineConfig
from oscarkv.demo import demo_model_path
from oscarkv.engine import Engine
from oscarkv.errors import OscarkvError
from oscarkv.rotation import save_rotations

SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
VOCAB = 2048


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(lens: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def _drive(eng: Engine, jobs: list[tuple[list[int], SamplingParams]], abort_after: dict[int, int]) -> tuple:
    """Submit ``jobs`` in two waves (the second once the first is done, so prefix hits do not
    depend on timing); abort job ``i`` once it has ``abort_after[i]`` tokens. Returns the
    outputs by job and the in-flight count seen after each step."""
    outs: dict[int, object] = {}
    seen: list[int] = []
    half = len(jobs) // 2
    for wave in (range(half), range(half, len(jobs))):
        rids = {eng.add_request(jobs[i][0], jobs[i][1], rid=f"j{i}"): i for i in wave}
        while eng.has_unfinished():
            for o in eng.step():
                i = rids[o.rid]
                if o.finished:
                    outs[i] = o
                elif i in abort_after and len(o.token_ids) >= abort_after[i]:
                    eng.abort(o.rid)
            seen.append(eng.scheduler.in_flight)
    return outs, seen


def _jobs(llm: LLM) -> list[tuple[list[int], SamplingParams]]:
    free = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stem = _prompts((64,), seed=1)[0]
    tail = _prompts((40, 70, 25, 90, 50), seed=2)
    greedy = SamplingParams(max_tokens=36, temperature=0, ignore_eos=True)
    tok = llm.tokenizer.encode("def add(a, b):")
    return [
        (stem + tail[0], greedy),
        (tok, SamplingParams(max_tokens=40, temperature=0, stop=[free.text[10:13]])),
        (tok, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[free.token_ids[5]])),
        (_prompts((120,), seed=3)[0], SamplingParams(max_tokens=30, temperature=0)),  # EOS may end it
        (stem + tail[1], greedy),  # a prefix hit on job 0's pages
        (stem + tail[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
        (tail[3], greedy),  # aborted midway
        (stem + tail[4], SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)),
    ]


def _compare(make) -> list[int]:
    """Run :func:`_jobs` both ways and compare; returns the preemptions of each run."""
    runs, stop_id, preempted = {}, set(), []
    for mode in ("off", "on"):
        llm = make(mode)
        jobs = _jobs(llm)
        stop_id.add(jobs[2][1].stop_token_ids[0])
        runs[mode] = _drive(llm.engine, jobs, abort_after={6: 9})
        eng = llm.engine
        assert eng.scheduler.idle and eng.hp.n_free == eng.hp.capacity
        assert eng.q is None or eng.q.n_free == eng.q.capacity
        preempted.append(eng.stats["preemptions"])
    (off, seen_off), (on, seen_on) = runs["off"], runs["on"]
    assert max(seen_off) == 0 and max(seen_on) == 1  # steps did overlap
    for i, a in off.items():
        b = on[i]
        assert a.finish_reason == b.finish_reason, i
        if a.finish_reason == "abort":  # lands a step later with overlap: a longer prefix
            n = min(len(a.token_ids), len(b.token_ids))
            assert a.token_ids[:n] == b.token_ids[:n] and n >= 9
        else:
            assert (a.token_ids, a.text) == (b.token_ids, b.text), i
    assert off[1].finish_reason == "stop" and [off[2].token_ids[-1]] == list(stop_id)
    assert on[4].num_cached_tokens == off[4].num_cached_tokens == 64
    return preempted


def test_overlap_equals_step_by_step_bf16_with_preemption(tmp_path: Path) -> None:
    """BF16: a recompute reproduces its tokens exactly, so preemption joins the mix (a budget of
    30 pages of 8 tokens for 4 slots)."""

    def make(mode: str) -> LLM:
        return LLM(str(demo_model_path()), kv_dtype="bf16", device="cpu", page_tokens=8, max_running=4,
                   kv_budget_gb=30 * 8 * 4096 / 2**30, decode_reserve_pages=0, max_batched_tokens=64,
                   overlap=mode, check_invariants=True)  # fmt: skip

    assert min(_compare(make)) > 0


def test_overlap_equals_step_by_step_int2(tmp_path: Path) -> None:
    rs = random_rotation_set(4, 128, SPEC)
    save_rotations(rs, tmp_path / "rot")

    def make(mode: str) -> LLM:
        return LLM(str(demo_model_path()), rotations=str(tmp_path / "rot"), device="cpu", page_tokens=8,
                   spec=SPEC, max_batched_tokens=64, overlap=mode, check_invariants=True)  # fmt: skip

    _compare(make)


def test_overlap_on_refuses_tensor_parallel() -> None:
    with pytest.raises(OscarkvError, match="overlap"):
        EngineConfig(model=str(demo_model_path()), tensor_parallel=2, overlap="on")
