"""An independent oracle for the quantized ``OscarCache``: per-layer attention outputs, tight tolerance.

The cache's own tests check passthrough against ``DynamicCache`` and the quantized mode against
itself. Here each layer's attention output is recomputed from first principles and compared at
fp32 round-off:

* capture: ``OscarCacheLayer.attend`` is wrapped (``monkeypatch``) to record exactly what the cache
  receives (``q/k/v`` after RoPE and the q/k norms) and what it returns (the attention output before
  ``o_proj``);
* tiers: :func:`step_tiers` labels every stored token of a sequence sink / INT2 / 16-bit window
  from the spec's words alone (no ``quant/tiers.py``, no ``hf/slots.py``);
* storage: rows rotated in fp32 (``x @ R``, rounded once to the fp32 model dtype); INT2 rows are
  fake-quantized with the format functions ``quantize_rows`` -> ``dequantize_rows`` (the only code
  shared with the cache);
* attention: a plain fp64 einsum softmax in the rotated basis, rotated back with ``R_Vᵀ``. A prefill
  reads the stored prefix as stored and its own new tokens in full precision, causally; a decode
  token reads everything stored after the step's demotion and its own write.

Tolerance: the largest ``|cache − oracle|`` over a step's valid tokens, relative to the largest
``|oracle|`` of that (layer, step), must stay below ``REL_TOL = 1e-5``. Both sides quantize
bit-identical rows (the spec's fp32 ``x @ R`` of the same step tensors, then per-row format
functions), so the only differences are fp32 rounding in the cache's attention sums and
back-rotation: measured at most 6e-7 in every case. (Rows rotated another way, e.g. in fp64, differ
by an ulp, which flips an occasional INT2 code or fp16 scale: measured up to 3.4e-4, which is why
the oracle keeps the spec's fp32 rotation.) A wrong tier moves outputs by a 2-bit quantization
error instead: each error planted into the oracle (:data:`PLANTS`, one window token read as INT2,
a sink one token short, a decode demotion one token late) measured 0.13-0.47 wherever it applies,
over 10⁴x the tolerance (``test_planted_tier_errors_are_caught``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import Qwen3ForCausalLM

from conftest import random_orthogonal, tiny_lm_config
from oscarkv import QuantSpec
from oscarkv.hf import OscarCache
from oscarkv.hf.cache import OscarCacheLayer
from oscarkv.quant import RowFormat, dequantize_rows, quantize_rows
from oscarkv.rotation import LayerRotation, RotationSet

SPEC = QuantSpec(sink_tokens=4, recent_tokens=8, demote_block=3)
VOCAB, LAYERS, HQ, HKV, D = 128, 2, 4, 2, 64
REL_TOL = 1e-5
#: deliberate oracle errors: one window token read as INT2, a sink one token short, a decode
#: demotion one token late
PLANTS = ("window_short", "sink_short", "late_demotion")

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- model, rotations, capture ------------------------------------------------------------------
def make_model(seed: int = 0) -> Qwen3ForCausalLM:
    """A 2-layer fp32 Qwen3 (q/k norms, GQA 2:1, head dim 64) with random weights."""
    torch.manual_seed(seed)
    cfg = tiny_lm_config(vocab=VOCAB, layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, positions=512)
    return Qwen3ForCausalLM(cfg).eval()


def make_rotations(granularity: str, seed: int = 1) -> RotationSet:
    """Random orthogonal ``R_K``/``R_V`` per layer (``[d, d]``) or per KV head (``[Hkv, d, d]``)."""
    gen = torch.Generator().manual_seed(seed)

    def rot() -> torch.Tensor:
        if granularity == "layer":
            return random_orthogonal(D, gen)
        return torch.stack([random_orthogonal(D, gen) for _ in range(HKV)])

    layers = {}
    for i in range(LAYERS):
        rk, rv = rot(), rot()
        layers[i] = LayerRotation(rk, rv, torch.ones(rk.shape[:-1]), torch.ones(rv.shape[:-1]))
    return RotationSet(layers, SPEC, granularity)


@dataclass
class Call:
    """One ``attend`` call: the new ``q [B, Hq, T, d]``, ``k/v [B, Hkv, T, d]`` and ``out [B, T, Hq, d]``."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


def run_cache(
    model: Qwen3ForCausalLM,
    rotations: RotationSet,
    ids: torch.Tensor,
    mask: torch.Tensor,
    schedule: list[int],
) -> list[list[Call]]:
    """Feed ``ids [B, N]`` in forwards of ``schedule`` tokens (1 = a decode step) through a quantized
    ``OscarCache`` (torch backend); returns each forward's calls, one per layer."""
    calls: list[Call] = []
    attend = OscarCacheLayer.attend

    def recording(
        self: OscarCacheLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask4: torch.Tensor | None,
        scaling: float | None,
    ) -> torch.Tensor:
        out = attend(self, query, key, value, mask4, scaling)
        calls.append(Call(self.layer_idx, query.clone(), key.clone(), value.clone(), out.clone()))
        return out

    cache = OscarCache.from_rotations(model, rotations, spec=SPEC, backend="torch")
    pos = 0
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(OscarCacheLayer, "attend", recording)
        for n in schedule:
            model(
                input_ids=ids[:, pos : pos + n],
                attention_mask=mask[:, : pos + n],
                past_key_values=cache,
                use_cache=True,
            )
            pos += n
    assert pos == ids.shape[1] and len(calls) == LAYERS * len(schedule)
    steps = [calls[i : i + LAYERS] for i in range(0, len(calls), LAYERS)]
    assert all([c.layer for c in s] == list(range(LAYERS)) for s in steps)
    return steps


# ---- the oracle ---------------------------------------------------------------------------------
def step_tiers(
    tiers: list[str], n_new: int, decode: bool, spec: QuantSpec, plant: str | None = None
) -> list[str]:
    """A sequence's tiers after a step that stores ``n_new`` tokens: ``"S"`` sink, ``"Q"`` INT2,
    ``"H"`` 16-bit window, one label per stored token in token order. From the spec's words:
    the sink is the first ``min(n, S)`` tokens of the first write; a prefill leaves the last ``R``
    non-sink tokens in the window and the rest in INT2; a decode step first demotes the ``db``
    oldest window tokens if the window already holds ``R + db − 1``."""
    s, r, db = spec.sink_tokens, spec.recent_tokens, spec.demote_block
    out = list(tiers)
    n_sink = min(n_new, s) - (plant == "sink_short") if not tiers else 0
    if decode:
        window = [i for i, x in enumerate(out) if x == "H"]
        if len(window) >= max(r + db - 1, 1) + (plant == "late_demotion"):
            for i in window[:db]:
                out[i] = "Q"
    out += ["S"] * n_sink + ["H"] * (n_new - n_sink)
    if not decode:
        window = [i for i, x in enumerate(out) if x == "H"]
        keep = r - (plant == "window_short")
        for i in window[: max(len(window) - keep, 0)]:
            out[i] = "Q"
    return out


def rotate(x: torch.Tensor, r: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x [B, H, T, d] @ R`` (``Rᵀ`` if ``inverse``) in ``r``'s dtype; a ``[Hkv, d, d]`` ``r`` serves
    its contiguous group of ``H / Hkv`` heads."""
    r = r.transpose(-1, -2) if inverse else r
    if r.dim() == 3:
        r = r.repeat_interleave(x.shape[1] // r.shape[0], dim=0)[None]
    return x.to(r.dtype) @ r


def oracle_layer(
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    r_k: torch.Tensor,
    r_v: torch.Tensor,
    k_fmt: RowFormat,
    v_fmt: RowFormat,
    spec: QuantSpec,
    plant: str | None = None,
) -> list[torch.Tensor]:
    """One layer's attention outputs, step by step, from the new ``(q, k, v, valid [B, T])`` of each
    step; returns fp64 ``[B, T, Hq, d]`` per step (zeros at pads, which are stored nowhere)."""
    bsz, hq = steps[0][0].shape[:2]
    g, scale = hq // steps[0][1].shape[1], D**-0.5
    keys: list[list[torch.Tensor]] = [[] for _ in range(bsz)]  # rotated fp32 rows [Hkv, d] per token
    vals: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
    tiers: list[list[str]] = [[] for _ in range(bsz)]
    outs = []
    for q, k, v, valid in steps:
        t = q.shape[2]
        decode = t == 1
        # fp32 rotations, rounded once (fp32 model): the rows the cache stores and quantizes
        qr, kr, vr = rotate(q, r_k), rotate(k, r_k), rotate(v, r_v)
        out = torch.zeros(bsz, t, hq, D, dtype=torch.float64)
        for b in range(bsz):
            new = torch.nonzero(valid[b]).flatten().tolist()
            if not new:
                continue
            prev = len(keys[b])
            keys[b] += [kr[b, :, i] for i in new]
            vals[b] += [vr[b, :, i] for i in new]
            if decode:
                tiers[b] = step_tiers(tiers[b], len(new), True, spec, plant)
                n_read = len(tiers[b])  # everything stored, the new token included
            else:
                n_read = prev  # the cached prefix as stored; the new tokens in full precision
            labels = tiers[b][:n_read] + ["new"] * (len(keys[b]) - n_read)
            ks, vs = torch.stack(keys[b]), torch.stack(vals[b])  # [N, Hkv, d]
            kq = dequantize_rows(*quantize_rows(ks, k_fmt), k_fmt)
            vq = dequantize_rows(*quantize_rows(vs, v_fmt), v_fmt)
            int2 = torch.tensor([x == "Q" for x in labels])[:, None, None]
            ks = torch.where(int2, kq, ks).double().repeat_interleave(g, dim=1)  # [N, Hq, d]
            vs = torch.where(int2, vq, vs).double().repeat_interleave(g, dim=1)
            qb = qr[b, :, new].double()  # [Hq, n, d]
            s = torch.einsum("hnd,mhd->hnm", qb, ks) * scale
            # causal among the new tokens: new token j sees positions < prev + j + 1
            seen = torch.arange(len(keys[b]))[None, :] < torch.arange(prev + 1, len(keys[b]) + 1)[:, None]
            o = torch.einsum("hnm,mhd->hnd", s.masked_fill(~seen, float("-inf")).softmax(-1), vs)
            out[b, new] = rotate(o[None], r_v.double(), inverse=True)[0].transpose(0, 1)
            if not decode:
                tiers[b] = step_tiers(tiers[b], len(new), False, spec, plant)
        outs.append(out)
    return outs


def formats(spec: QuantSpec) -> tuple[RowFormat, RowFormat]:
    """The K and V row formats, written out from the spec's fields."""
    group = spec.group_size or D
    kw = dict(head_dim=D, group=group, meta_dtype=spec.meta_dtype)
    return (
        RowFormat(bits=spec.key_bits, clip=spec.k_clip, **kw),
        RowFormat(bits=spec.value_bits, clip=spec.v_clip, **kw),
    )


def errors(
    steps: list[list[Call]],
    mask: torch.Tensor,
    schedule: list[int],
    rotations: RotationSet,
    plant: str | None = None,
) -> torch.Tensor:
    """``max |cache − oracle| / max |oracle|`` over each step's valid tokens: ``[layers, steps]``."""
    k_fmt, v_fmt = formats(SPEC)
    bounds = torch.tensor([0, *schedule]).cumsum(0).tolist()
    valid = [mask[:, a:z].bool() for a, z in itertools.pairwise(bounds)]
    err = torch.zeros(LAYERS, len(steps), dtype=torch.float64)
    for layer in range(LAYERS):
        lr = rotations.layers[layer]
        inputs = [(s[layer].q, s[layer].k, s[layer].v, m) for s, m in zip(steps, valid, strict=True)]
        want = oracle_layer(inputs, lr.k.float(), lr.v.float(), k_fmt, v_fmt, SPEC, plant)
        for i, (s, w, m) in enumerate(zip(steps, want, valid, strict=True)):
            got = s[layer].out.double()
            err[layer, i] = (got - w)[m].abs().max() / w[m].abs().max()
    return err


def stream(lengths: list[int], n_total: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random ids ``[B, n_total]`` and their mask: sequence ``b`` holds ``lengths[b]``
    real tokens at the right end."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), n_total), generator=gen)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, n_total - n :] = 1
    return ids * mask, mask


DECODE = [40, *[1] * 20]  # a 40-token prompt, then 20 decode steps: 6 demotions of 3 tokens
#: name -> (forward sizes, real tokens per sequence; None: one unpadded sequence)
CASES: dict[str, tuple[list[int], list[int] | None]] = {
    "single_prefill": ([40], None),
    "chunks_3_10_11_16": ([3, 10, 11, 16], None),  # a first chunk shorter than the sink: the sink is 3
    # chunk edges inside the first S tokens (the sink is the first write: 2 tokens) and inside
    # the window; the 5- and 7-token chunks each demote part of the previous window
    "chunks_2_2_5_7_24": ([2, 2, 5, 7, 24], None),
    "chunks_6_9_25": ([6, 9, 25], None),  # a full sink, then chunks that straddle the window
    "decode": (DECODE, None),
    # chunks after decode steps (window partly above R), two of them 2 tokens long
    "mixed": ([13, *[1] * 7, 9, *[1] * 12, 6, 2, *[1] * 4, 2], None),
    # prompts of 40, 21 and 3 tokens, left-padded, prefilled in chunks of 16 + 24 (the first chunk
    # is all pads for the 2nd and 3rd: their first write, hence their sink, comes with the 2nd
    # chunk), then 20 decode steps; pads are stored nowhere
    "padded_batch": ([16, 24, *[1] * 20], [60, 41, 23]),
}


@dataclass
class Run:
    schedule: list[int]
    mask: torch.Tensor
    rotations: RotationSet
    steps: list[list[Call]]


@pytest.fixture(scope="module")
def runs() -> Callable[[str, str], Run]:
    """``runs(case, granularity)``: the recorded cache run of a case (each run once per module)."""
    model = make_model()
    done: dict[tuple[str, str], Run] = {}

    def get(case: str, granularity: str) -> Run:
        if (case, granularity) not in done:
            schedule, lengths = CASES[case]
            ids, mask = stream(lengths or [sum(schedule)], sum(schedule))
            rotations = make_rotations(granularity)
            steps = run_cache(model, rotations, ids, mask, schedule)
            done[case, granularity] = Run(schedule, mask, rotations, steps)
        return done[case, granularity]

    return get


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
@pytest.mark.parametrize("case", list(CASES))
def test_cache_matches_oracle(runs: Callable[[str, str], Run], case: str, granularity: str) -> None:
    r = runs(case, granularity)
    err = errors(r.steps, r.mask, r.schedule, r.rotations)
    assert float(err.max()) < REL_TOL, err


@pytest.mark.parametrize("plant", PLANTS)
def test_planted_tier_errors_are_caught(runs: Callable[[str, str], Run], plant: str) -> None:
    """The comparison can fail: an oracle with one wrong tier rule misses the run that matches the
    correct oracle (``test_cache_matches_oracle[mixed-layer]``) by over 1000x the tolerance."""
    r = runs("mixed", "layer")
    assert float(errors(r.steps, r.mask, r.schedule, r.rotations, plant).max()) > 1000 * REL_TOL
