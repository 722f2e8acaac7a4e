"""Presence, frequency and repetition penalties (vLLM's semantics): the sampler against a plain
per-token reference on a grid, and the engine on the bundled demo model: fewer repeats, the
model's own logits penalized step by step, and overlapped scheduling (a step sampled before the
last one's token is read) equal to step-by-step scheduling."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from conftest import random_rotation_set
from oscarkv import QuantSpec
from oscarkv.config.base import SpecError
from oscarkv.demo import demo_model_path
from oscarkv.engine import sampler as sampler_mod
from oscarkv.engine.llm import LLM
from oscarkv.engine.request import SamplingParams
from oscarkv.engine.sampler import Seen, make_generator, sample
from oscarkv.rotation import save_rotations

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)
DEVICES = ["cpu", CUDA]
DEMO = str(demo_model_path())
F32 = torch.float32


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=F32)


def reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row penalized token by token, in fp32 (vLLM's order: repetition over the prompt and
    the output, then frequency x count, then presence, over the output)."""
    x = row.detach().cpu().float().clone()
    counts = Counter(output)
    for t in set(prompt) | set(counts):
        x[t] = x[t] / _f32(p.repetition_penalty) if x[t] > 0 else x[t] * _f32(p.repetition_penalty)
    for t, c in counts.items():
        x[t] = x[t] - _f32(p.frequency_penalty) * _f32(c)
        x[t] = x[t] - _f32(p.presence_penalty)
    return x


def _plain(p: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)


GRID = [
    SamplingParams(temperature=t, presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp, seed=s)
    for (t, s), pp, fp, rp in itertools.product(
        [(0, None), (0.9, 11)], [0.0, 0.5, -1.5, 2.0], [0.0, 0.7, -2.0], [1.0, 1.3, 0.5, 2.0]
    )
]


def _batch(device: str, seed: int, params: list[SamplingParams], v: int = 40):
    """Logits (some exact zeros, negatives and positives), prompts and outputs drawn with repeats."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), v, generator=g) * 2
    logits[logits.abs() < 0.1] = 0.0
    prompts = [torch.randint(0, v, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in params]  # fmt: skip
    outs = [torch.randint(0, v // 2, (int(torch.randint(0, 15, (1,), generator=g)),), generator=g).tolist()
            for _ in params]  # fmt: skip
    return logits.to(device), prompts, outs


@pytest.mark.parametrize("device", DEVICES)
def test_penalized_logits_equal_the_reference_on_a_grid(device: str) -> None:
    """Every grid point, mixed with rows without penalties: the penalized rows equal the
    reference bit for bit, the others are untouched, the caller's logits are not modified."""
    for start in range(0, len(GRID), 16):
        params = [*GRID[start : start + 16], SamplingParams(temperature=0), SamplingParams(top_k=5, seed=3)]
        params.insert(3, SamplingParams(temperature=0.5))
        logits, prompts, outs = _batch(device, start, params)
        before = logits.clone()
        got = sampler_mod._penalized(logits, params, Seen(prompts, outs), copied=False)
        assert torch.equal(logits, before) and got.dtype == F32
        for i, p in enumerate(params):
            want = reference(logits[i], p, prompts[i], outs[i]) if p.penalized else logits[i].cpu()
            assert torch.equal(got[i].cpu(), want), (i, p)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_draws_from_the_penalized_logits(device: str) -> None:
    """Greedy rows take the penalized argmax; seeded rows draw what a penalty-free sampler draws
    from the reference's logits with the same seed; rows without penalties draw what they draw
    in a batch without any."""
    for start in range(0, len(GRID), 12):
        params = [
            *GRID[start : start + 12],
            SamplingParams(temperature=0),
            SamplingParams(temperature=0.7, seed=5),
        ]
        logits, prompts, outs = _batch(device, 100 + start, params)
        ref = torch.stack([reference(logits[i], p, prompts[i], outs[i]) for i, p in enumerate(params)]).to(
            device
        )

        def gens(params: list[SamplingParams] = params) -> list:
            return [make_generator(p.seed, device) if p.seed is not None else None for p in params]

        got = sample(logits, params, gens(), Seen(prompts, outs))
        assert torch.equal(got, sample(ref, [_plain(p) for p in params], gens()))
        greedy = [i for i, p in enumerate(params) if p.greedy]
        assert torch.equal(got[greedy], ref[greedy].argmax(-1))
        alone = sample(logits[-2:], params[-2:], gens()[-2:])
        assert torch.equal(got[-2:], alone)


@pytest.mark.parametrize("device", DEVICES)
def test_a_pending_token_counts_as_output(device: str) -> None:
    """``Seen.pending`` (a token sampled on the device, not read yet) counts as the last output
    token: the same result as that token in the output list; -1 and unpenalized rows add nothing."""
    params = [SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.8, seed=4, presence_penalty=1.0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=1.0)]  # fmt: skip
    logits, prompts, outs = _batch(device, 7, params)
    pend = [int(logits[0].argmax()), 3, int(logits[2].argmax()), -1]
    full = [[*o, t] if t >= 0 and p.penalized else o for o, t, p in zip(outs, pend, params, strict=True)]
    pending = torch.tensor(pend, device=device)
    a = sampler_mod._penalized(logits, params, Seen(prompts, outs, pending), copied=False)
    b = sampler_mod._penalized(logits, params, Seen(prompts, full), copied=False)
    assert torch.equal(a, b) and torch.equal(a[2], logits[2].float())
    assert a[0, pend[0]] < logits[0, pend[0]]  # the pending token is penalized

    def gens() -> list:
        return [None, make_generator(4, device), None, None]

    got = sample(logits, params, gens(), Seen(prompts, outs, pending))
    assert torch.equal(got, sample(logits, params, gens(), Seen(prompts, full)))
    assert int(got[0]) != pend[0] and int(got[2]) == pend[2]


def test_no_penalties_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch without penalties never reaches the penalty code and needs no ``seen``."""

    def boom(*a, **k):
        raise AssertionError("penalties applied to a batch without any")

    monkeypatch.setattr(sampler_mod, "_penalized", boom)
    logits = torch.randn(3, 20)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(logit_bias=((1, 2.0),)),
        SamplingParams(top_p=0.5),
    ]
    sample(logits, params, [None] * 3)
    sample(logits, params, [None] * 3, Seen([[1]] * 3, [[2]] * 3))


def test_logit_bias_comes_before_the_penalties() -> None:
    """vLLM's order: the bias is added first, so a repetition penalty scales the biased logit."""
    logits = torch.tensor([[1.75, 0.5, -1.0, 0.0]])
    p = SamplingParams(temperature=0, logit_bias=((2, 4.0),), repetition_penalty=2.0)
    got = sampler_mod._penalized(sampler_mod._biased(logits, [p]), [p], Seen([[2]], [[]]), copied=True)
    assert got[0].tolist() == [1.75, 0.5, 1.5, 0.0]  # (-1 + 4) / 2, not -1 * 2 + 4 = 2
    assert int(sample(logits, [p], [None], Seen([[2]], [[]]))[0]) == 0


def test_bad_inputs_raise() -> None:
    logits = torch.randn(2, 10)
    params = [SamplingParams(presence_penalty=1.0), SamplingParams()]
    with pytest.raises(ValueError, match="seen"):
        sample(logits, params, [None] * 2)
    with pytest.raises(ValueError, match="seen"):
        sample(logits, params, [None] * 2, Seen([[1]], [[1]]))
    with pytest.raises(ValueError, match=r"output token ids must lie in \[0, 10\)"):
        sample(logits, params, [None] * 2, Seen([[], []], [[10], []]))
    with pytest.raises(ValueError, match="prompt token ids"):
        sample(logits, params, [None] * 2, Seen([[-1], []], [[], []]))
    with pytest.raises(ValueError, match="pending"):
        sample(logits, params, [None] * 2, Seen([[], []], [[], []], torch.tensor([1])))


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.01), ("presence_penalty", -2.5), ("frequency_penalty", 3),
     ("frequency_penalty", float("nan")), ("presence_penalty", "1"), ("frequency_penalty", True),
     ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", 2.5),
     ("repetition_penalty", float("inf")), ("repetition_penalty", None)],
)  # fmt: skip
def test_sampling_params_refuse_out_of_range_penalties(field: str, value: object) -> None:
    with pytest.raises(SpecError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})


def test_sampling_params_take_the_range_ends() -> None:
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=2)
    assert p.penalized and not SamplingParams().penalized
    assert (
        SamplingParams(repetition_penalty=0.01).penalized and SamplingParams(frequency_penalty=-2).penalized
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_penalties_do_not_sync_the_host_on_cuda() -> None:
    logits = torch.randn(3, 1000, device="cuda")
    params = [SamplingParams(temperature=0, frequency_penalty=1.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, seed=2, presence_penalty=0.5), SamplingParams()]  # fmt: skip
    seen = Seen([[1, 2, 3], [4], []], [[5, 5], [], []], torch.tensor([7, 9, -1], device="cuda"))
    gens = [None, make_generator(2, "cuda"), None]
    sample(logits, params, gens, seen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, params, gens, seen)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- the engine ------------------------------------------------------------------------------
def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "Once upon a time"]


def test_engine_penalties_follow_the_models_logits(one_thread) -> None:
    """BF16 engine, greedy: each penalized request equals argmax over the model's own logits
    (transformers' forward over prompt + output) penalized by the reference, step by step; a
    strong penalty repeats fewer tokens than none."""
    from oscarkv.hf.loading import load_model

    hf = load_model(DEMO, "cpu", "fp32")[0]
    cases = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.5),
             SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                            presence_penalty=0.5)]  # fmt: skip
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(DEMO, kv_dtype="bf16", device="cpu", max_running=6) as llm:
        outs = llm.generate(PROMPTS * 2, [cases[0]] * 3 + [cases[1]] * 3)
        base = llm.generate(PROMPTS, plain)
    assert sum(map(_repeats, (o.token_ids for o in outs[:3]))) < sum(_repeats(o.token_ids) for o in base)
    assert sum(map(_repeats, (o.token_ids for o in outs[3:]))) < sum(_repeats(o.token_ids) for o in base)
    for o, p in zip(outs, [cases[0]] * 3 + [cases[1]] * 3, strict=True):
        prompt, out = list(o.prompt_token_ids), []
        with torch.no_grad():
            for _ in range(p.max_tokens):
                row = hf(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
                out.append(int(reference(row, p, prompt, out).argmax()))
        assert o.token_ids == out


@pytest.mark.parametrize(
    ("device", "kv"),
    [("cpu", "bf16"), ("cpu", "int2"),
     pytest.param("cuda", "bf16", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs a CUDA device")])],
)  # fmt: skip
def test_overlapped_penalties_equal_step_by_step(device: str, kv: str, one_thread, tmp_path) -> None:
    """With overlap on, a step is sampled before the previous step's token is read; the penalties
    count that token from the device, so greedy and seeded penalized requests (beside unpenalized
    ones, through chunked prefill) give exactly the tokens of step-by-step scheduling."""
    kw: dict = {"kv_dtype": "bf16", "kv_budget_gb": 0.25}  # on CUDA, not 90% of the card for later tests
    if kv == "int2":
        spec = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
        save_rotations(random_rotation_set(4, 128, spec), tmp_path / "rot")
        kw = {"rotations": str(tmp_path / "rot"), "spec": spec, "page_tokens": 8, "kv_budget_gb": 0.25}
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=2.0),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, presence_penalty=2.0,
                             repetition_penalty=1.5),
              SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True, frequency_penalty=1.0,
                             repetition_penalty=1.3),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True)]  # fmt: skip
    prompts = [*PROMPTS, "x = [1, 2, 3]\n" * 6, PROMPTS[0]]
    runs = {}
    for mode in ("off", "on"):
        with LLM(DEMO, device=device, max_running=5, max_batched_tokens=32, overlap=mode, check_invariants=True,
                 **kw) as llm:  # fmt: skip
            assert llm.engine.overlap == (mode == "on")
            runs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["on"] == runs["off"]
    assert all(len(t) == 30 for t in runs["on"])


def test_slot_counts_follow_the_sampled_tokens_and_reset_on_admission() -> None:
    """``PenaltyCounts``: a slot's rows are built from the host's lists at admission and then
    grow on the device by each sampled token (never from the host again); a new admission of the
    slot (another epoch) starts over. The sampler gives the lists form's result from them."""
    from oscarkv.engine.penalties import PenaltyCounts
    from oscarkv.engine.request import Sequence, StepSeq
    from oscarkv.quant.tiers import Moves, TierState

    v = 50
    pc = PenaltyCounts(2, v, torch.device("cpu"))
    p = SamplingParams(temperature=0, frequency_penalty=0.5, repetition_penalty=1.3)
    seq = Sequence("a", [1, 2, 3], p, out=[4, 4], slot=1, epoch=7)

    def item(s: Sequence) -> StepSeq:
        n = len(s.prompt) + len(s.out)
        return StepSeq(s, n - 1, 1, TierState(), Moves(to_ring=1), ends_prompt=True)

    logits = torch.randn(1, v)
    for tok in (9, 4, 9):
        seen = pc.seen([item(seq)])
        want = sampler_mod._penalized(logits, [p], Seen([seq.prompt], [seq.out]), copied=False)
        assert torch.equal(sampler_mod._penalized(logits, [p], seen, copied=False), want)
        pc.count(torch.tensor([tok]))
        seq.out.append(tok)  # the host reads it later; the device counted it already
    assert pc.out[1, 9] == 2 and pc.out[1, 4] == 3 and bool(pc.in_prompt[1, 2])
    other = Sequence("b", [5], p, slot=1, epoch=8)
    seen = pc.seen([item(other)])
    assert seen.counts.sum() == 0 and seen.in_prompt[0].nonzero().flatten().tolist() == [5]
    with pytest.raises(ValueError, match="prompt token ids"):
        pc.seen([item(Sequence("c", [v], p, slot=0, epoch=9))])


def test_penalized_requests_survive_preemption(one_thread) -> None:
    """BF16 (a recompute reproduces the K/V exactly): penalized requests preempted for lack of
    pages resume with their counts rebuilt from the host and give the tokens of a roomy run."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=1.0,
                            repetition_penalty=1.2)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (150, 140, 160, 130)]
    with LLM(DEMO, kv_dtype="bf16", device="cpu", page_tokens=8, max_running=4) as roomy:
        want = [o.token_ids for o in roomy.generate(prompts, params)]
    with LLM(DEMO, kv_dtype="bf16", device="cpu", page_tokens=8, max_running=4, decode_reserve_pages=0,
             kv_budget_gb=60 * 8 * 4096 / 2**30, check_invariants=True) as tight:  # fmt: skip
        got = [o.token_ids for o in tight.generate(prompts, params)]
        assert tight.engine.stats["preemptions"] > 0
    assert got == want
