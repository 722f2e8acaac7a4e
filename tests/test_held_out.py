"""The held-out NLL of calibration (``calibration/held_out.py``, ``calibration/windowed.py``) against
direct computations on tiny CPU models: the windowed attention against a dense form of its
definition; the kept cache and the replayed exact layers against one uncached pass of the whole
sequence per evaluation. Tolerances: fp32 sums in another order (1e-5 absolute on attention
outputs of order 1, 1e-6 relative on NLLs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from oscarkv.calibration.fit import fixed_layer
from oscarkv.calibration.held_out import HeldOut
from oscarkv.calibration.loss_search import LossClipSearch, _patched
from oscarkv.calibration.windowed import windowed_fake_quant_attention
from oscarkv.config import QuantSpec
from oscarkv.quant import RowFormat, fake_quantize_rows
from oscarkv.rotation import rotate_heads

D, H_Q, H_KV, LAYERS = 32, 4, 2, 4
SPEC = QuantSpec(sink_tokens=4, recent_tokens=16, group_size=D)


def _dense(q, k, v, rot, kf, vf, sink, recent, scale, window="model"):
    """The definition: scores against exact keys where a key is in a window, else against its
    stored (clipped, quantized, dequantized) form; values likewise. ``window="fp8_e4m3"``: the
    rows minus their offsets are fp8 values, in the windows and before quantization alike."""
    b, hq, tq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    qr = rotate_heads(q, rot.k).double().reshape(b, hkv, g * tq, d)
    kr, vr = rotate_heads(k, rot.k), rotate_heads(v, rot.v)  # fp32 rows: the same codes as stored
    ck = 0.0 if rot.k_offset is None else rot.k_offset[None, :, None, :]
    cv = 0.0 if rot.v_offset is None else rot.v_offset[None, :, None, :]
    if window == "fp8_e4m3":
        kr = (kr - ck).clamp(-448, 448).to(torch.float8_e4m3fn).float() + ck
        vr = (vr - cv).clamp(-448, 448).to(torch.float8_e4m3fn).float() + cv
    kq = (fake_quantize_rows(kr - ck, kf) + ck).double()
    vq = (fake_quantize_rows(vr - cv, vf) + cv).double()
    kr, vr = kr.double(), vr.double()
    i = torch.arange(t - tq, t).repeat(g)[:, None]
    j = torch.arange(t)[None, :]
    exact = (j < sink) | (i - j < recent)
    s = torch.where(exact, qr @ kr.transpose(-1, -2), qr @ kq.transpose(-1, -2)) * scale
    p = s.masked_fill(j > i, float("-inf")).softmax(-1)
    o = (p * exact) @ vr + (p * ~exact) @ vq
    o = rotate_heads(o.reshape(b, hq, tq, d), rot.v.double(), inverse=True)
    return o.transpose(1, 2)


@pytest.mark.parametrize(
    ("tq", "t", "sink", "recent"),
    [(40, 600, 4, 16), (600, 600, 4, 16), (1, 300, 64, 256), (300, 300, 64, 256), (257, 700, 0, 1),
     (513, 513, 600, 8), (5, 9, 0, 1000)],
)  # fmt: skip
@pytest.mark.parametrize("per_head", [False, True])
def test_windowed_attention_matches_its_definition(tq, t, sink, recent, per_head):
    g = torch.Generator().manual_seed(tq + t)
    rot = fixed_layer("hadamard", D, H_KV, "kv_head" if per_head else "layer")
    rot.k_offset = torch.randn(H_KV, D, generator=g) * 0.5
    rot.v_offset = torch.randn(H_KV, D, generator=g) * 0.5 if per_head else None
    kf = RowFormat.from_spec(SPEC, D, "k")
    vf = dataclasses.replace(RowFormat.from_spec(SPEC, D, "v"), clip=0.0)
    q, k, v = (torch.randn(2, h, n, D, generator=g) for h, n in ((H_Q, tq), (H_KV, t), (H_KV, t)))
    got = windowed_fake_quant_attention(q, k, v, rot, kf, vf, sink, recent, D**-0.5)
    want = _dense(q, k, v, rot, kf, vf, sink, recent, D**-0.5)
    assert got.shape == (2, tq, H_Q, D) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("tq", "t", "sink", "recent"), [(40, 600, 4, 16), (300, 300, 64, 256)])
def test_windowed_attention_with_fp8_windows_matches_its_definition(tq, t, sink, recent):
    """Calibration's held-out passes see fp8 windows as the cache stores them: window rows and the
    rows INT2 quantizes are the fp8 values (minus the offsets); they move the output."""
    g = torch.Generator().manual_seed(tq + t)
    rot = fixed_layer("hadamard", D, H_KV, "kv_head")
    rot.k_offset = torch.randn(H_KV, D, generator=g) * 0.5
    kf, vf = RowFormat.from_spec(SPEC, D, "k"), RowFormat.from_spec(SPEC, D, "v")
    q, k, v = (torch.randn(2, h, n, D, generator=g) for h, n in ((H_Q, tq), (H_KV, t), (H_KV, t)))
    got = windowed_fake_quant_attention(q, k, v, rot, kf, vf, sink, recent, D**-0.5, "fp8_e4m3")
    want = _dense(q, k, v, rot, kf, vf, sink, recent, D**-0.5, "fp8_e4m3")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    plain = windowed_fake_quant_attention(q, k, v, rot, kf, vf, sink, recent, D**-0.5)
    assert (got - plain).abs().max() > 1e-3


def _qwen3() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D,
                                   max_position_embeddings=512)  # fmt: skip
    return transformers.Qwen3ForCausalLM(cfg).float().eval()


@torch.inference_mode()
def _uncached_nll(model, rotations, batches, n: int) -> float:
    """One pass of the whole sequence per batch, the prefix exact and the last ``n + 1`` positions
    through the fake-quantized cache, every layer computed."""
    ls = LossClipSearch(model, rotations, SPEC, D, (), (), "nll")
    ls.clips = {
        i: (SPEC.k_clip if lr.k_clip is None else lr.k_clip, SPEC.v_clip) for i, lr in rotations.items()
    }
    ls.score_last = n + 1
    total = count = 0
    for ids in batches:
        with _patched(model, ls):
            lp = model(input_ids=ids, use_cache=False).logits[:, -n - 1 : -1].log_softmax(-1)
        total -= float(lp.gather(-1, ids[:, -n:, None]).sum())
        count += ids[:, -n:].numel()
    return total / count


def test_held_out_nll_equals_one_uncached_pass_per_evaluation():
    model = _qwen3()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (b, 90), generator=g) for b in (1, 2)]
    rots = {i: fixed_layer("hadamard", D, H_KV, "layer") for i in range(LAYERS)}
    rots[2] = dataclasses.replace(rots[2], key_bits=4, k_clip=0.0)
    held = HeldOut(model, batches, SPEC, D, n_score=40)
    assert held.count == 3 * 40 and all(cache is not None for cache, *_ in held._runs)  # the kept cache
    assert held.base == pytest.approx(_uncached_nll(model, {}, batches, 40), rel=1e-6)
    calls: list[int] = []
    hooks = [
        m.self_attn.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
        for i, m in enumerate(model.model.layers)
    ]
    for chosen in ([0, 1, 2, 3], [3], [1, 3], [2]):
        sub = {i: rots[i] for i in chosen}
        calls.clear()
        got = held.nll(sub)
        assert calls == list(range(min(chosen), LAYERS)) * 2  # the exact layers below are replayed
        assert got == pytest.approx(_uncached_nll(model, sub, batches, 40), rel=1e-6)
        assert got != pytest.approx(held.base, rel=1e-6)
    for h in hooks:
        h.remove()
    # the kept cache is cropped back: the same evaluation again gives the same number
    assert (
        held.nll(rots) == held.nll(rots) == pytest.approx(_uncached_nll(model, rots, batches, 40), rel=1e-6)
    )
    # sequences no longer than the scored part run whole, every position through the cache
    short = HeldOut(model, [torch.randint(0, 128, (1, 30), generator=g)], SPEC, D, n_score=40)
    assert short._runs[0][0] is None and short.count == 29


def test_held_out_runs_caches_it_cannot_crop_whole():
    """A hybrid model (linear-attention layers' caches cannot be cropped back) runs every
    evaluation over the whole sequence: the same numbers, no kept cache."""
    cls = getattr(transformers, "Qwen3_5ForCausalLM", None)
    if cls is None:
        pytest.skip("this transformers has no Qwen3.5")
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D,
                                         linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                         linear_value_head_dim=16)  # fmt: skip
    model = cls(cfg).float().eval()
    batches = [torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(1))]
    held = HeldOut(model, batches, SPEC, D, n_score=40)
    assert held._runs[0][0] is None
    rots = {3: fixed_layer("hadamard", D, H_KV, "layer")}
    assert held.base == pytest.approx(_uncached_nll(model, {}, batches, 40), rel=1e-6)
    assert held.nll(rots) == pytest.approx(_uncached_nll(model, rots, batches, 40), rel=1e-6)
