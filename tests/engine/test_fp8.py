"""FP8 block-scaled checkpoints (``Fp8Block``): the block convention against transformers', round
trips and row-wise requantization, the loaded FP8 decoder's logits and the engine's greedy tokens
equal those of the dequantized twin (CPU; BF16 and INT2 pages, R_V folded), tensor_parallel=2
equals TP=1, bad quantization configs and part sizes are one-line ModelErrors, missing scales are
reported as missing; on an SM90 GPU the block-scaled GEMM tracks the dequantized reference."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fp8_models import FP8_CONFIG, block_config, dequantize_hf, set_quantization_config, write_fp8_pair
from moe_models import VOCAB
from safetensors.torch import load_file, save_file

from conftest import random_orthogonal, random_rotation_set
from oscarkv import LLM, QuantSpec, SamplingParams
from oscarkv.engine.models import load_decoder
from oscarkv.engine.models.fp8 import (
    FP8,
    Fp8Block,
    block_mm,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)
from oscarkv.engine.models.linear import ColumnLinear, ConcatColumns, Linear
from oscarkv.engine.models.loader import check_model_split
from oscarkv.engine.models.quant import weight_method
from oscarkv.errors import ModelError, OscarkvWarning
from oscarkv.rotation import absorb_output_weight, save_rotations

SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
KW = dict(
    device="cpu", page_tokens=8, check_invariants=True, kv_budget_gb=0.05
)  # the CPU default is up to 2 GiB
KINDS = ("qwen3_moe", "glm4_moe", "minimax_m2")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """kind -> (FP8 checkpoint, its dequantized twin)."""
    root = tmp_path_factory.mktemp("fp8")
    return {k: write_fp8_pair(k, root) for k in KINDS}


def prompts(lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def random_fp8(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 codes and positive block scales (not from any weight: any pair is a valid checkpoint)."""
    q = (100 * torch.randn(shape, generator=g)).clamp(-448, 448).to(FP8)
    nb, kb = -(-shape[-2] // 128), -(-shape[-1] // 128)
    return q, torch.rand(*shape[:-2], nb, kb, generator=g) + 0.01


# ---- the block convention -------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (3, 256, 128)])
def test_dequantization_is_transformers_block_convention(shape) -> None:
    q, s = random_fp8(shape, torch.Generator().manual_seed(len(shape)))
    got = dequantize_blocks(q, s, torch.float32)
    assert torch.equal(got, dequantize_hf(q, s))  # scale_inv[i // 128, j // 128] * q[i, j]
    assert torch.equal(got[..., 130, 5], q[..., 130, 5].float() * s[..., 1, 0])


def test_quantize_blocks_scales_round_trip_and_agree_with_transformers() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)  # a partial block in each dim
    w[:128, :128] = 0
    q, s = quantize_blocks(w)
    assert q.dtype == FP8 and q.shape == w.shape and s.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            amax = w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].abs().max()
            assert s[i, j].item() == (amax / 448).item() if amax > 0 else s[i, j].item() == 1.0
    assert not q[:128, :128].float().any()
    back = dequantize_blocks(q, s, torch.float32)
    scale = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w).abs() <= w.abs() / 16 + scale / 1024).all()  # half an e4m3 step (3 mantissa bits)
    hq = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[128, 128], scale_fmt="float"))
    w2 = w[:256, :128]
    theirs = Fp8Quantize(hq).convert({"x.weight": w2})
    q2, s2 = quantize_blocks(w2)
    assert torch.equal(q2.float(), theirs["x.weight"].float())
    torch.testing.assert_close(s2, theirs["x.weight_scale_inv"], rtol=1e-6, atol=0)


def test_fp8_linear_rows_requantize_and_finish() -> None:
    g = torch.Generator().manual_seed(1)
    lin = Linear(256, 320, False, Fp8Block(), dtype=torch.float32, device="cpu")  # 2.5 row blocks
    assert lin.weight.dtype == FP8 and lin.weight_scale_inv.shape == (3, 4)  # 2 column blocks, padded to 4
    w = 0.02 * torch.randn(320, 256, generator=g)
    lin.method.set_dense_weight(lin, w)
    want = dequantize_blocks(*quantize_blocks(w), torch.float32)
    assert torch.equal(lin.method.dense_weight(lin), want)
    assert torch.equal(lin.method.dense_weight(lin, (128, 320)), want[128:])  # ends at the matrix end
    assert not lin.weight_scale_inv[:, 2:].any()
    for rows in ((64, 128), (0, 200), (128, 128)):
        with pytest.raises(ValueError, match="do not start and end on its 128-row blocks"):
            lin.method.dense_weight(lin, rows)
    w2 = 0.05 * torch.randn(128, 256, generator=g)
    lin.method.set_dense_weight(lin, w2, (128, 256))  # requantizes its blocks only
    got = lin.method.dense_weight(lin)
    assert torch.equal(got[128:256], dequantize_blocks(*quantize_blocks(w2), torch.float32))
    assert torch.equal(got[:128], want[:128]) and torch.equal(got[256:], want[256:])
    x = torch.randn(5, 256, generator=g)
    y = lin(x)
    torch.testing.assert_close(y, x @ got.T)
    lin.finish()  # CPU: dequantized into the model dtype, FP8 tensors freed
    assert lin.weight.dtype == torch.float32 and lin.weight_scale_inv is None
    assert torch.equal(lin.weight, got) and torch.equal(lin(x), y)


def test_block_sizes_a_method_cannot_split_raise() -> None:
    kw = dict(dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"stacked expert weights \[128, 64\].*64 is not a multiple"):
        Linear(64, 128, False, Fp8Block(), lead=(4,), **kw)
    col = ColumnLinear(128, (128, 64, 64), False, Fp8Block(), names=("q_proj", "k_proj", "v_proj"), **kw)
    with pytest.raises(ValueError, match=r"k_proj rows: 64 \(this rank's part\) is not a multiple"):
        col.checkpoint_targets("self_attn.qkv_proj")


def test_activation_quantization_is_per_token_group_and_m_major() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 320, generator=g).bfloat16()
    q, s = quantize_activations(x)
    assert q.dtype == FP8 and q.shape == (7, 320) and q.is_contiguous()
    assert s.shape == (7, 3) and s.stride() == (1, 7)  # what scaled_mm's BlockWise1x128 reads
    assert quantize_activations(x[:1])[1].stride() == (1, 1)
    groups = torch.nn.functional.pad(x.float(), (0, 64)).view(7, 3, 128)
    assert torch.equal(s, groups.abs().amax(-1) / 448)
    back = (torch.nn.functional.pad(q.float(), (0, 64)).view(7, 3, 128) * s[..., None]).view(7, -1)[:, :320]
    assert (
        (back - x.float()).abs() <= x.float().abs() / 16 + s.repeat_interleave(128, 1)[:, :320] / 1024
    ).all()


# ---- the config -----------------------------------------------------------------------------------
def _cfg(**qc) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=qc)


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq': not a quantization the engine loads"),
        ({"quant_method": "compressed-tensors"}, r"quant_method 'compressed-tensors'"),
        ({**FP8_CONFIG, "fmt": "e5m2"}, r"fmt 'e5m2': not float8 e4m3"),
        ({**FP8_CONFIG, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]: not 128x128 blocks"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"weight_block_size None: per-tensor FP8"),
        ({**FP8_CONFIG, "activation_scheme": "static"}, r"activation_scheme 'static': static activation"),
        ({**FP8_CONFIG, "scale_fmt": "ue8m0"}, r"scale_fmt 'ue8m0': only fp32 block scales"),
        (
            {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", "model.layers.0.self_attn.o_proj"]},
            r"modules_to_not_convert leaves model\.layers\.0\.self_attn\.o_proj unquantized",
        ),
        (
            {**FP8_CONFIG, "ignored_layers": ["mlp.experts"]},
            r"ignored_layers leaves mlp\.experts unquantized",
        ),
    ],
)
def test_bad_quantization_configs_are_one_line_model_errors(qc: dict, match: str) -> None:
    with pytest.raises(ModelError, match=match) as e:
        weight_method(_cfg(**qc), "model M")
    assert "\n" not in str(e.value) and str(e.value).startswith("model M: quantization_config.")
    assert "supported" in str(e.value)


def test_supported_quantization_configs() -> None:
    assert weight_method(SimpleNamespace()).name == "unquantized"
    qwen = {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.norm"]}
    minimax = {**FP8_CONFIG, "fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}  # fmt: skip
    for qc in (FP8_CONFIG, qwen, minimax, {"quant_method": "fp8", "weight_block_size": [128, 128]}):
        assert isinstance(weight_method(_cfg(**qc)), Fp8Block)


def test_a_bad_config_is_refused_at_load(pairs, tmp_path: Path) -> None:
    fp8, _ = pairs["qwen3_moe"]
    for f in fp8.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    set_quantization_config(tmp_path, {**FP8_CONFIG, "activation_scheme": "static"})
    with pytest.raises(ModelError, match=r"activation_scheme 'static'"):
        load_decoder(str(tmp_path), torch.float32, "cpu")


def test_missing_scales_are_reported_missing_never_unexpected(pairs, tmp_path: Path) -> None:
    fp8, _ = pairs["glm4_moe"]
    for f in fp8.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    t = load_file(tmp_path / "model.safetensors")
    del t["model.layers.1.self_attn.v_proj.weight_scale_inv"]
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(
        ModelError, match=r"missing 1: model\.layers\.1\.self_attn\.v_proj\.weight_scale_inv$"
    ) as e:
        load_decoder(str(tmp_path), torch.float32, "cpu")
    assert "unexpected" not in str(e.value)
    set_quantization_config(tmp_path, None)  # scales in an unquantized checkpoint are unexpected
    with pytest.raises(ModelError, match=r"unexpected \d+: .*weight_scale_inv"):
        load_decoder(str(tmp_path), torch.float32, "cpu")


def test_fp8_part_sizes_tensor_parallel_cannot_split_are_refused(pairs) -> None:
    fp8, twin = pairs["qwen3_moe"]  # expert width 128: 64 per rank under tensor_parallel=2
    check_model_split(str(twin), 2)
    with pytest.raises(ModelError, match=r"64 is not a multiple of the weight block 128") as e:
        check_model_split(str(fp8), 2)
    assert "\n" not in str(e.value) and "tensor_parallel" in e.value.hint


# ---- the decoder and the engine: FP8 == its dequantized twin (CPU) --------------------------------
def _attn(layer, q, k, v):
    """One causal sequence, GQA by repeating KV heads (HF eager's arithmetic)."""
    rep = q.shape[1] // k.shape[1]
    qs = q.transpose(0, 1)
    ks, vs = (t.repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v))
    w = (qs @ ks.transpose(1, 2)) * q.shape[-1] ** -0.5
    w = w.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (w.softmax(-1) @ vs).transpose(0, 1)


def _logits(model_dir: Path, dtype: torch.dtype, device: str, ops=None) -> tuple[torch.Tensor, object]:
    ids = torch.tensor(prompts((23,), seed=1)[0], device=device)
    dec, _ = load_decoder(str(model_dir), dtype, device, ops=ops)
    with torch.no_grad():
        return dec(ids, torch.arange(len(ids), device=device), _attn), dec


def test_a_dense_mlp_ending_inside_a_block_loads_unfused(tmp_path: Path) -> None:
    """GLM-4.5-Air's dense layer has 10944 = 85.5 x 128 gate and up rows: each part's last scale
    block is partial, so gate|up cannot share one block grid and run as two FP8 GEMMs."""
    cfg = block_config("glm4_moe")
    cfg.intermediate_size = 192  # 1.5 blocks, as 10944 is 85.5
    fp8, twin = write_fp8_pair("glm4_moe", tmp_path, config=cfg)
    got, dec = _logits(fp8, torch.float32, "cpu")
    want, _ = _logits(twin, torch.float32, "cpu")
    mlp = dec.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, ConcatColumns) and len(mlp.gate_up_proj.parts) == 2
    assert rel(got, want) < 1e-5
    with pytest.raises(ModelError, match="not a multiple of the weight block 128"):
        check_model_split(str(fp8), 2)


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_decoder_logits_equal_the_dequantized_twin(pairs, kind: str) -> None:
    fp8, twin = pairs[kind]
    got, dec = _logits(fp8, torch.float32, "cpu")
    want, _ = _logits(twin, torch.float32, "cpu")
    assert isinstance(dec.method, Fp8Block) and torch.equal(got, want)
    src = load_file(fp8.parent / f"{kind}-src" / "model.safetensors")
    w = load_file(twin / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(w, src["model.layers.0.self_attn.q_proj.weight"])  # the twin holds FP8's values


def test_r_v_folds_into_dequantized_fp8_weights_as_into_the_twin(pairs) -> None:
    """On CPU the FP8 weights are dequantized before R_V is folded in, so the folded model is
    the twin's, bit for bit (folding into FP8 and requantizing would not be)."""
    fp8, twin = pairs["glm4_moe"]
    g = torch.Generator().manual_seed(4)
    r_v = {i: torch.stack([random_orthogonal(128, g) for _ in range(2)]) for i in range(3)}
    ids = torch.tensor(prompts((23,), seed=1)[0])
    out = []
    for d in (fp8, twin):
        dec, _ = load_decoder(str(d), torch.float32, "cpu", r_v=r_v)
        with torch.no_grad():
            out.append(dec(ids, torch.arange(len(ids)), _attn))
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_engine_greedy_equals_the_twin(pairs, kind: str) -> None:
    fp8, twin = pairs[kind]
    ps = prompts((1, 9, 70), seed=2)
    got = LLM(str(fp8), kv_dtype="bf16", max_batched_tokens=64, **KW).generate(ps, GREEDY)
    want = LLM(str(twin), kv_dtype="bf16", max_batched_tokens=64, **KW).generate(ps, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.fixture(scope="module")
def rotations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fp8-rot")
    save_rotations(random_rotation_set(3, 128, SPEC), d)
    return d


@pytest.mark.parametrize("absorb", [True, False])
def test_fp8_int2_engine_with_rotations_equals_the_twin(pairs, rotations, absorb: bool) -> None:
    fp8, twin = pairs["glm4_moe"]  # v_proj biases: R_V folds into them too
    ps = prompts((30, 120), seed=6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(KW, rotations=str(rotations), spec=SPEC, absorb_v=absorb)
    got = LLM(str(fp8), **kw).generate(ps, params)
    want = LLM(str(twin), **kw).generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_dummy_weights_fp8_per_block_and_unquantized_as_before(pairs) -> None:
    fp8, twin = pairs["minimax_m2"]
    dec, _ = load_decoder(str(fp8), torch.float32, "cpu", load_format="dummy", seed=3)
    assert isinstance(dec.method, Fp8Block)
    w = dec.layers[0].self_attn.qkv_proj.weight  # dequantized at finish (CPU)
    assert w.dtype == torch.float32 and abs(float(w.std()) - 0.02) < 2e-3
    experts = dec.layers[0].mlp.experts.w13.weight
    assert experts.shape == (8, 256, 128) and abs(float(experts.std()) - 0.02) < 2e-3
    dec, _ = load_decoder(str(twin), torch.float32, "cpu", load_format="dummy", seed=3)
    gen = torch.Generator().manual_seed(3)  # unquantized: every parameter drawn in order, as always
    for name, p in dec.named_parameters():
        if name.endswith("norm.weight"):
            assert (p == 1).all(), name
        elif name.endswith("correction"):
            assert not p.any(), name
        else:
            assert torch.equal(p, torch.empty_like(p).normal_(0.0, 0.02, generator=gen)), name


def test_fp8_tensor_parallel_gives_the_tokens_of_tp1(tmp_path: Path) -> None:
    from fp8_models import block_config

    cfg = block_config("qwen3_moe")
    cfg.moe_intermediate_size = 256  # 128 per rank under tensor_parallel=2
    fp8, _ = write_fp8_pair("qwen3_moe", tmp_path, config=cfg)
    ps = prompts((6, 70), seed=11)
    kw = dict(KW, max_batched_tokens=96, max_running=4, kv_budget_gb=0.05, kv_dtype="bf16")
    with LLM(str(fp8), **kw) as one:
        want = one.generate(ps, GREEDY)
    with LLM(str(fp8), **kw, tensor_parallel=2) as two:
        got = two.generate(ps, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert not mp.active_children()


# ---- R_V folding with FP8 weights ------------------------------------------------------------------
def test_folding_r_v_then_requantizing_costs_one_fp8_step() -> None:
    """The choice engine.md records: fold ``R_Vᵀ`` into FP8 ``o_proj`` and requantize per block.
    Its error against the exactly folded weight is the plain FP8 weight's own error (one more FP8
    rounding), where keeping the fold in bf16 would be ~16x smaller."""
    g = torch.Generator().manual_seed(0)
    w0 = (0.02 * torch.randn(1024, 1024, generator=g)).bfloat16().float()
    r = torch.stack([random_orthogonal(128, g) for _ in range(8)])
    x = torch.randn(256, 1024, generator=g)
    lin = Linear(1024, 1024, False, Fp8Block(), dtype=torch.bfloat16, device="cpu")
    lin.method.set_dense_weight(lin, w0)
    w = lin.method.dense_weight(lin)
    plain = rel(x @ w.T, x @ w0.T)
    exact = absorb_output_weight(w.double(), r.double(), 128).float()
    lin.method.set_dense_weight(lin, absorb_output_weight(w, r, 128))
    folded = rel(x @ lin.method.dense_weight(lin).T, x @ exact.T)
    in_bf16 = rel(x @ exact.bfloat16().float().T, x @ exact.T)
    assert 0.02 < plain < 0.03 and abs(folded / plain - 1) < 0.05 and in_bf16 < plain / 10


# ---- CUDA (SM90): the block-scaled GEMM ------------------------------------------------------------
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _gemm_fails() -> str:
    """Why this torch build cannot run the block-scaled GEMM here ("": it can)."""
    from oscarkv.engine.models.fp8 import _block_gemm_fails

    return _block_gemm_fails(0) if _sm90() else "needs an SM90 (Hopper) GPU"


@pytest.mark.gpu
@pytest.mark.skipif(bool(_gemm_fails()), reason=_gemm_fails() if torch.cuda.is_available() else "needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 512), (1024, 1024), (384, 1408), (128, 128)])  # (out, in)
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_block_mm_tracks_the_dequantized_reference(shape, tokens: int, dtype: torch.dtype) -> None:
    """Against fp32 ``x Wᵀ`` with the dequantized weight: within 4% relative (Frobenius), the
    per-token FP8 activation rounding (2.5-2.7% measured on CPU by emulation); against that
    emulation (the same quantized activations, fp32 matmul) within 1%. ``in`` 1408: 11 column
    blocks, scales padded to 12 (a GLM-4.5-Air expert's down projection)."""
    g = torch.Generator().manual_seed(tokens)
    n, k = shape
    q, s = quantize_blocks(0.02 * torch.randn(n, k, generator=g))
    wd = dequantize_blocks(q, s, torch.float32).cuda()
    s_pad = torch.nn.functional.pad(s, (0, -s.shape[1] % 4)).cuda()
    x = torch.randn(tokens, k, generator=g).to(dtype).cuda()
    y = block_mm(x, q.cuda(), s_pad)
    assert y.dtype == dtype and y.shape == (tokens, n)
    xq, xs = quantize_activations(x)
    xd = (xq.float().view(tokens, k // 128, 128) * xs[..., None]).view(tokens, k)
    assert rel(y, x.float() @ wd.T) < 0.04
    assert rel(y, xd @ wd.T) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_linears_on_cuda_and_the_decoder_tracks_the_twin(pairs) -> None:
    """With the Triton backend every projection stays FP8, partial blocks too, and runs the
    weight-only kernel (the dequantized product within 1%); without it, cuBLAS runs whole blocks
    where it can and the rest is dequantized with a warning. The FP8 decoder (experts kept FP8)
    gives its twin's bf16 logits within cosine 0.999."""
    from oscarkv.kernels import resolve

    triton_ops = resolve("triton", "cuda")
    g = torch.Generator().manual_seed(5)
    why = _gemm_fails()
    for out, ops, fp8_kept in (
        (384, triton_ops, True),
        (320, triton_ops, True),
        (384, None, not why),
        (320, None, False),
    ):
        lin = Linear(256, out, False, Fp8Block(), dtype=torch.bfloat16, device="cuda")
        lin.method.set_dense_weight(lin, (0.02 * torch.randn(out, 256, generator=g)).cuda())
        w = lin.method.dense_weight(lin)
        if fp8_kept:
            lin.finish(ops)
        else:
            said = (
                "cannot run FP8 block-scaled GEMMs|needs an SM90"
                if why
                else r"\[320, 256\] projection is not whole"
            )
            with pytest.warns(OscarkvWarning, match=said):
                lin.finish(ops)
        assert (lin.weight.dtype == FP8) == fp8_kept
        if ops is not None:
            assert lin.kernel is triton_ops.fp8_linear
        x = torch.randn(9, 256, generator=g).to(torch.bfloat16).cuda()
        weight_only = ops is not None or not fp8_kept
        assert rel(lin(x), x.float() @ w.T) < (0.01 if weight_only else 0.04)
    fp8, twin = pairs["glm4_moe"]
    got, dec = _logits(fp8, torch.bfloat16, "cuda", triton_ops)
    want, _ = _logits(twin, torch.bfloat16, "cuda", triton_ops)
    experts = dec.layers[1].mlp.experts
    assert experts.w13.weight.dtype == FP8 and experts.fp8 is triton_ops.fp8_moe_experts
    assert (
        float(torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0))
        > 0.999
    )
