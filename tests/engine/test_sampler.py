"""The engine sampler: greedy, temperature, top-k, top-p, and seeded rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from oscarkv.config.base import SpecError
from oscarkv.engine.request import SamplingParams
from oscarkv.engine.sampler import _filter, make_generator, sample

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)
DEVICES = ["cpu", CUDA]
CHI2_7DOF_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001
LOGITS8 = [0.5, -1.0, 2.0, 0.0, 1.0, -0.5, 1.5, -2.0]


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the drawn ``tokens`` against ``probs`` (over the tokens with p > 0)."""
    n = tokens.numel()
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    exp = probs.double().cpu() * n
    keep = exp > 0
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def draws(device: str, p: SamplingParams, n: int = 20_000) -> torch.Tensor:
    logits = torch.tensor(LOGITS8, device=device).expand(n, -1).contiguous()
    return sample(logits, [p] * n, [None] * n)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_are_argmax(device: str) -> None:
    logits = torch.randn(6, 50, device=device)
    params = [SamplingParams(temperature=0)] * 6
    assert torch.equal(sample(logits, params, [None] * 6), logits.argmax(-1))
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=2.0)] * 3
    for _ in range(5):
        got = sample(logits, mixed, [None] * 6)
        assert torch.equal(got[::2], logits[::2].argmax(-1))
        assert got.dtype == torch.long and got.shape == (6,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [SamplingParams(temperature=1.5, top_k=1), SamplingParams(top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_are_greedy(device: str, p: SamplingParams) -> None:
    logits = torch.randn(32, 100, device=device) * 0.3  # flat rows: plain sampling would differ
    for _ in range(3):
        assert torch.equal(sample(logits, [p] * 32, [None] * 32), logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1e-20, 1e-38, 1e-45, 1e-300])
def test_a_vanishing_temperature_is_its_limit_not_nan(device: str, temperature: float) -> None:
    """``logits / T`` overflows fp32 (and below 1.4e-45, T itself rounds to 0): the draw must be
    the limit, each row's most likely token, not NaN's token 0."""
    logits = torch.randn(16, 300, device=device) * 8
    logits[:, 0] = -50.0  # token 0 is the least likely: NaN's argmax would pick it
    p = SamplingParams(temperature=temperature, top_p=0.9, top_k=50)
    for _ in range(3):
        assert torch.equal(sample(logits, [p] * 16, [None] * 16), logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_a_vanishing_repetition_penalty_does_not_overflow(device: str) -> None:
    """``repetition_penalty`` 1e-300 (0 in fp32) divides a seen positive logit by ~0: it is held
    at fp32's largest, so the draw falls among the seen tokens, greedy or sampled, never on NaN."""
    from oscarkv.engine.sampler import Seen

    logits = torch.full((4, 64), -1.0, device=device)
    logits[:, [3, 9]] = torch.tensor([2.0, 1.0], device=device)  # 3 and 9 are seen (the prompt)
    logits[:, 40] = 5.0  # the most likely, not seen
    seen = Seen(prompt=[[3, 9]] * 4, output=[[]] * 4)
    for t in (0.0, 1.0, 1e-30):
        p = SamplingParams(temperature=t, repetition_penalty=1e-300)
        got = sample(logits, [p] * 4, [None] * 4, seen)
        assert set(got.tolist()) <= {3, 9}, (t, got)


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_matches_softmax(device: str) -> None:
    got = draws(device, SamplingParams(temperature=0.7))
    logits = torch.tensor(LOGITS8)
    assert chi2(got, (logits / 0.7).softmax(-1)) < CHI2_7DOF_P001
    assert chi2(got, logits.softmax(-1)) > 10 * CHI2_7DOF_P001  # the check tells temperatures apart


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_keep_only_their_tokens(device: str) -> None:
    logits = torch.tensor(LOGITS8)
    got = draws(device, SamplingParams(top_k=3))
    kept = torch.zeros(8, dtype=torch.bool)
    kept[logits.topk(3).indices] = True
    assert kept[got.cpu()].all()
    assert chi2(got, logits.masked_fill(~kept, float("-inf")).softmax(-1)) < CHI2_7DOF_P001
    # top_p 0.8: the smallest most-likely set whose mass reaches 0.8
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    n_keep = int((probs[order].cumsum(0) < 0.8).sum()) + 1
    kept = torch.zeros(8, dtype=torch.bool)
    kept[order[:n_keep]] = True
    got = draws(device, SamplingParams(top_p=0.8))
    assert 1 < n_keep < 8 and kept[got.cpu()].all()
    assert set(got.unique().tolist()) == set(order[:n_keep].tolist())
    assert chi2(got, probs.masked_fill(~kept, 0) / probs[kept].sum()) < CHI2_7DOF_P001


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_match_softmax(device: str) -> None:
    gens = [make_generator(s, device) for s in range(20)]
    p = SamplingParams(temperature=1.3, seed=0)
    logits = torch.tensor(LOGITS8, device=device).expand(20, -1)
    got = torch.cat([sample(logits, [p] * 20, gens) for _ in range(500)])
    assert chi2(got, (torch.tensor(LOGITS8) / 1.3).softmax(-1)) < CHI2_7DOF_P001


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_does_not_depend_on_its_batch(device: str) -> None:
    v, steps = 64, 8
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    mine_logits = [torch.randn(v, device=device) for _ in range(steps)]
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=5, seed=7),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=2.0, seed=99),
    ]

    def run(n_others: int, pos: int) -> list[int]:
        gen = make_generator(mine.seed, device)
        other_gens = {i: make_generator(p.seed, device) for i, p in enumerate(others) if p.seed is not None}
        out = []
        for t in range(steps):
            torch.rand(7 * n_others + 1, device=device)  # the default generator moves between runs
            rows = [(p, other_gens.get(i), torch.randn(v, device=device)) for i, p in enumerate(others)]
            rows = rows[:n_others]
            rows.insert(pos, (mine, gen, mine_logits[t]))
            params, gens, logits = zip(*rows, strict=True)
            out.append(int(sample(torch.stack(logits), list(params), list(gens))[pos]))
        return out

    alone = run(0, 0)
    assert len(set(alone)) > 1  # it samples rather than repeating the argmax
    for n_others, pos in [(1, 0), (1, 1), (3, 2), (5, 0), (5, 5), (4, 3)]:
        assert run(n_others, pos) == alone, (n_others, pos)
    other_seed = make_generator(4321, device)
    assert [int(sample(lg[None], [mine], [other_seed])[0]) for lg in mine_logits] != alone


def test_rows_without_top_p_stay_whole_in_a_top_p_batch() -> None:
    # fp32 cumsum of a peaked 32k-token softmax passes 1.0 before its tail: a top_p = 1 row
    # batched with a top-p row must not lose that tail
    x = torch.randn(2, 32_000) * 3
    got = _filter(x.clone(), [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)])
    assert torch.equal(got[0], x[0])
    assert torch.isinf(got[1]).any()


def test_make_generator_is_reproducible() -> None:
    a = torch.rand(5, generator=make_generator(3, "cpu"))
    assert torch.equal(a, torch.rand(5, generator=make_generator(3, "cpu")))
    assert not torch.equal(a, torch.rand(5, generator=make_generator(4, "cpu")))
    for seed in (-1, 2**70):  # any Python int is accepted
        make_generator(seed, "cpu")


def test_logits_are_not_modified() -> None:
    logits = torch.randn(4, 16)
    before = logits.clone()
    p = SamplingParams(temperature=0.5, top_k=3, top_p=0.7)
    sample(logits, [p] * 4, [None, make_generator(1, "cpu"), None, None])
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "logits, n_params, n_gens",
    [
        (torch.randn(8), 8, 8),  # 1-D
        (torch.randn(2, 3, 8), 2, 2),  # 3-D
        (torch.randn(0, 8), 0, 0),  # empty batch
        (torch.randn(2, 0), 2, 2),  # empty vocabulary
        (torch.randn(3, 8), 2, 3),  # params shorter than the batch
        (torch.randn(3, 8), 3, 4),  # generators longer than the batch
        (torch.randint(0, 5, (3, 8)), 3, 3),  # integer logits
    ],
)
def test_invalid_inputs_raise(logits: torch.Tensor, n_params: int, n_gens: int) -> None:
    with pytest.raises(ValueError, match="sample:"):
        sample(logits, [SamplingParams()] * n_params, [None] * n_gens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_no_host_sync_on_cuda() -> None:
    logits = torch.randn(4, 1000, device="cuda")
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(top_p=0.9, seed=3),
        SamplingParams(),
    ]
    gens = [None, None, make_generator(3, "cuda"), None]
    sample(logits, params, gens)  # warm-up (allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, params, gens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device.type == "cuda" and out[0] == logits[0].argmax()


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_shifts_only_its_rows_tokens(device: str) -> None:
    """A +100 bias makes its token the greedy choice, -100 bans the argmax; rows without a bias
    draw exactly what they draw alone (same seed), and the caller's logits stay as they were."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g).to(device)
    before = logits.clone()
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0, logit_bias=((7, 100.0),)),
              SamplingParams(temperature=0, logit_bias=((int(top[1]), -100.0),)),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=3)]  # fmt: skip
    gens = [None, None, None, make_generator(3, device)]
    got = sample(logits, params, gens)
    assert int(got[0]) == 7 and int(got[1]) != int(top[1]) and int(got[2]) == int(top[2])
    alone = sample(logits[3:], params[3:], [make_generator(3, device)])
    assert int(got[3]) == int(alone[0]) and torch.equal(logits, before)
    sampled = [SamplingParams(temperature=1.0, seed=s, logit_bias=((11, 100.0),)) for s in range(20)]
    toks = sample(
        logits[:1].expand(20, -1).contiguous(), sampled, [make_generator(s, device) for s in range(20)]
    )
    assert set(toks.tolist()) == {11}  # a +100 bias holds all the mass
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(logits, [SamplingParams(logit_bias=((50, 1.0),))] * 4, [None] * 4)
    for bad in (((1, 101.0),), ((-1, 1.0),), ((1,),)):
        with pytest.raises(SpecError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
