"""Static channel offsets: calibrated, saved and loaded, exact for attention in every path (HF cache,
engine, evaluation), and lower 2-bit error where keys have a channel mean."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from oscarkv import LLM, SamplingParams, calibrate, save_rotations
from oscarkv.calibration.data import eval_sequences
from oscarkv.config import CalibrationConfig, SpecError
from oscarkv.demo import demo_model_path
from oscarkv.eval.methods import get_method
from oscarkv.eval.tasks.attn_error import attention_metrics
from oscarkv.hf import OscarCache
from oscarkv.hf.loading import load_model
from oscarkv.rotation import LayerShift, RotationFileError, RotationSet, load_rotations, rotated_offset

DEMO = str(demo_model_path())


@pytest.fixture(scope="module")
def rotations() -> RotationSet:
    model, tok = load_model(DEMO, "cpu", "fp32")
    return calibrate(model, tok, CalibrationConfig(tokens=1024, seq_len=512, offsets="kv"))


def _without(rs: RotationSet) -> RotationSet:
    layers = {i: dataclasses.replace(lr, k_offset=None, v_offset=None) for i, lr in rs.layers.items()}
    return RotationSet(layers, rs.spec, rs.granularity, rs.provenance)


def test_calibration_measures_offsets_in_the_rotated_basis(
    rotations: RotationSet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_model(DEMO, "cpu", "fp32")[0].config
    hkv = cfg.num_key_value_heads
    for lr in rotations.layers.values():
        assert lr.k_offset is not None and lr.v_offset is not None
        assert lr.k_offset.shape == (hkv, rotations.head_dim) == lr.v_offset.shape
    assert rotations.provenance.recipe["offsets"] == "kv"
    # the demo model's keys carry a channel mean far above its values'
    assert rotations.layers[0].k_offset.norm() > 5 * rotations.layers[0].v_offset.norm()
    back = load_rotations(save_rotations(rotations, tmp_path))
    from oscarkv.cli import main

    assert main(["info", str(tmp_path)]) == 0
    n = len(rotations.layer_ids) * hkv
    assert f"kv: K in {n} of {n}, V in {n} of {n}" in capsys.readouterr().out
    for i, lr in rotations.layers.items():
        assert torch.equal(back.layers[i].k_offset, lr.k_offset)
        assert torch.equal(back.layers[i].v_offset, lr.v_offset)


def test_offsets_follow_the_config() -> None:
    model, tok = load_model(DEMO, "cpu", "fp32")
    only_k = calibrate(model, tok, CalibrationConfig(tokens=512, seq_len=512, offsets="k"))
    none = calibrate(
        model, tok, CalibrationConfig(tokens=512, seq_len=512, offsets="none", method="hadamard")
    )
    assert all(lr.k_offset is not None and lr.v_offset is None for lr in only_k.layers.values())
    assert all(lr.k_offset is None and lr.v_offset is None for lr in none.layers.values())
    with pytest.raises(SpecError, match="offsets"):
        CalibrationConfig(offsets="q")


def test_bad_offsets_are_refused(rotations: RotationSet, tmp_path: Path) -> None:
    lr = rotations.layers[0]
    bad = dict(rotations.layers)
    bad[0] = dataclasses.replace(lr, k_offset=torch.zeros(lr.k_offset.shape[0], 7))
    with pytest.raises(RotationFileError, match="k_offset has the wrong shape"):
        RotationSet(bad, rotations.spec, rotations.granularity, rotations.provenance).validate()
    bad[0] = dataclasses.replace(lr, v_offset=torch.full_like(lr.v_offset, float("nan")))
    with pytest.raises(RotationFileError, match="NaN"):
        RotationSet(bad, rotations.spec, rotations.granularity, rotations.provenance).validate()
    cfg = load_model(DEMO, "cpu", "fp32")[0].config
    bad[0] = dataclasses.replace(lr, v_offset=torch.zeros(lr.v_offset.shape[0] + 1, lr.v_offset.shape[1]))
    if rotations.granularity == "layer":
        with pytest.raises(RotationFileError, match="KV heads"):
            RotationSet(bad, rotations.spec, rotations.granularity, rotations.provenance).validate(cfg)


def test_rotated_offset_and_shift_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    r = torch.linalg.qr(torch.randn(2, 8, 8, generator=g, dtype=torch.float64))[0].float()
    mean = torch.randn(2, 8, generator=g)
    from oscarkv.rotation import LayerRotation

    off = rotated_offset(mean, r)
    lr = LayerRotation(r, r, torch.ones(2, 8), torch.ones(2, 8), k_offset=off, v_offset=off)
    sh = LayerShift.build(lr, 6, False, "cpu", torch.float32)
    assert sh is not None and torch.allclose(sh.k, mean, atol=1e-5) and torch.allclose(sh.v, mean, atol=1e-5)
    assert torch.allclose(sh.v_out, mean.repeat_interleave(3, 0), atol=1e-5)
    pre = LayerShift.build(lr, 6, True, "cpu", torch.float32)
    assert pre is not None and torch.allclose(pre.v, off)  # absorbed R_V: values arrive rotated
    x = torch.zeros(1, 2, 5, 8)
    k, _ = sh.inputs(x, x, head_axis=1)
    assert torch.allclose(k[0, :, 3], -mean, atol=1e-5)


def _logits(rs: RotationSet, ids: torch.Tensor, absorb_v: bool) -> torch.Tensor:
    model, _ = load_model(DEMO, "cpu", "fp32")
    cache = OscarCache.from_rotations(model, rs, absorb_v=absorb_v, quantize=False)
    with torch.inference_mode():
        first = model(ids[:, :-8], past_key_values=cache).logits
        rest = [
            model(ids[:, j : j + 1], past_key_values=cache).logits
            for j in range(ids.shape[1] - 8, ids.shape[1])
        ]
    return torch.cat([first, *rest], 1)


@pytest.mark.parametrize("absorb_v", [False, True])
def test_offsets_are_exact_for_attention(rotations: RotationSet, absorb_v: bool) -> None:
    """16-bit passthrough: the offsets change what is stored, not what attention computes."""
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(1))
    a, b = _logits(rotations, ids, absorb_v), _logits(_without(rotations), ids, absorb_v)
    assert (a - b).abs().max() < 1e-3 * b.abs().max()


def test_engine_offsets_are_exact_in_16_bit(rotations: RotationSet, tmp_path: Path) -> None:
    """Prompts shorter than the windows stay 16-bit: greedy tokens with and without offsets agree."""
    with_dir, without_dir = tmp_path / "with", tmp_path / "without"
    save_rotations(rotations, with_dir)
    save_rotations(_without(rotations), without_dir)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (20, 45)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = [
        [
            o.token_ids
            for o in LLM(DEMO, rotations=str(d), device="cpu", dtype="fp32").generate(prompts, params)
        ]
        for d in (with_dir, without_dir)
    ]
    assert outs[0] == outs[1]


def _attn_err(model, tok, methods: dict, n: int = 2) -> dict[str, float]:
    am = attention_metrics(model, methods, eval_sequences(tok, n, 1024, seed=3))
    return {m: sum(v["attn_out_err"] for v in am[m].values()) / len(am[m]) for m in methods}


def test_auto_keeps_offsets_only_where_the_held_out_error_drops() -> None:
    model, tok = load_model(DEMO, "cpu", "fp32")
    rs = calibrate(model, tok, CalibrationConfig(tokens=1024, seq_len=512, holdout_tokens=1024))
    rec = rs.provenance.recipe["offsets"]["choice"]
    choice = rec["heads"]
    assert set(choice) == {str(i) for i in rs.layer_ids}
    # the per-head choice stands only where it lowers the held-out NLL; else no offsets at all
    assert rec["kept"] == (rec["nll_with"] < rec["nll_without"])
    if not rec["kept"]:
        assert all(lr.k_offset is None and lr.v_offset is None for lr in rs.layers.values())
    for i, c in choice.items():
        assert c["err_chosen"] <= min(c["err_none"], c["err_both"]) + 1e-12
        if not rec["kept"]:
            continue
        lr = rs.layers[int(i)]
        for kind in ("k", "v"):
            off = getattr(lr, f"{kind}_offset")
            kept = [bool(x) for x in c[kind]]
            assert (off is not None) == any(kept)
            if off is not None:  # dropped heads hold a zero row
                assert [bool(row.abs().sum() > 0) for row in off] == kept
    with pytest.raises(SpecError, match="holdout_tokens"):
        CalibrationConfig(holdout_tokens=0)
    fixed = dict(offsets="kv", max_ppl_increase=None, granularity="layer")  # auto would read held-out tokens
    assert CalibrationConfig(holdout_tokens=0, **fixed).num_holdout_sequences == 0


def test_offsets_lower_the_two_bit_attention_error_on_smollm2(smollm2_dir: Path) -> None:
    """SmolLM2's post-RoPE keys have large channel means: 2-bit keys lose much less without them."""
    model, tok = load_model(str(smollm2_dir), "cpu", "fp32")
    rs = calibrate(
        model, tok, CalibrationConfig(tokens=4096, seq_len=1024, offsets="kv", granularity="kv_head")
    )
    methods = {
        "with": get_method("oscar", rs, model.config),
        "without": get_method("oscar", _without(rs), model.config),
    }
    err = _attn_err(model, tok, methods)
    assert err["with"] < 0.8 * err["without"], err
