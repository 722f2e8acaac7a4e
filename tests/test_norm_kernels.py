"""RMSNorm (with the fused residual add), SiLU-and-mul and the q/k norm + RoPE: the torch twins
against the eager math they replace, the Triton kernels against the twins.

The ``triton_vs_twin`` tests run under Triton's CPU interpreter, in a fresh process that
``test_triton_kernels_under_the_interpreter`` starts with ``TRITON_INTERPRET=1`` (the switch must
be set before any kernel is defined); the ``gpu`` ones on a CUDA device. The interpreter casts fp32
to bf16 by truncation where the GPU rounds to nearest even, so that lane patches the cast to round.
Tolerances: the new residual is bit-exact; 16-bit outputs within two steps of their dtype (rtol
2^-6 bf16, 2^-9 fp16: a step where the fp32 value before a rounding point lands across a rounding
boundary, as ``exp``/``rsqrt`` rounding and summation order move it, and a step at the output),
fp32 within rtol 1e-5. RoPE without the norm keeps every rounding point of the twin: bit-exact under
the interpreter; on the GPU the compiler may fuse a product and its difference (one rounding
instead of two), which moves an output where the difference cancels by a step of the products'
scale: within those steps absolutely (2^-6 bf16, 2^-9 fp16) as well as relatively.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import run_under_the_interpreter, tiny_lm_config
from oscarkv.engine.models.decoder import Decoder, model_shape
from oscarkv.kernels import Backend, KernelOps, ref, resolve

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
RTOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 1e-5}
#: RoPE on the GPU: where ``x1·c − x2·s`` cancels, one step of the products' scale (inputs ~N(0, 4))
ROPE_ATOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 1e-5}
interpreted = pytest.mark.skipif(not INTERPRET, reason="run by test_triton_kernels_under_the_interpreter")


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The engine's ``RMSNorm.forward`` before the kernels (HF's ``LlamaRMSNorm``)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def eager_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def inputs(rows: int, n: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """``(x, residual, weight)``: ``x`` about 3x the residual's scale, as an attention output is."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype).to(device)
    res = torch.randn(rows, n, generator=g).to(dtype).to(device)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype).to(device)
    return x, res, w


def assert_steps(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=RTOL[want.dtype], atol=1e-6)


# ---- the twins against today's eager math -----------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576])
def test_twin_is_the_eager_rms_norm_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x, res, w = inputs(7, n, dtype)
    assert torch.equal(ref.rms_norm(x, w, EPS), eager_rms_norm(x, w, EPS))
    out, new_res = ref.rms_norm(x, w, EPS, res)
    h = res + x  # the decoder's h = h + attn(...)
    assert torch.equal(new_res, h) and torch.equal(out, eager_rms_norm(h, w, EPS))
    hf = Qwen3RMSNorm(n, eps=EPS).to(dtype)
    hf.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(ref.rms_norm(x, w, EPS), hf(x))
    heads = x.view(7, -1, 32)[:, 1::2]  # strided per-head rows
    assert torch.equal(ref.rms_norm(heads, w[:32], EPS), eager_rms_norm(heads, w[:32], EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_is_the_eager_silu_and_mul_bit_for_bit(dtype: torch.dtype) -> None:
    x = (torch.randn(5, 2 * 288) * 4).to(dtype)
    assert torch.equal(ref.silu_and_mul(x), eager_silu_and_mul(x))


def test_kernel_ops_carry_the_norm_ops() -> None:
    ops = resolve(Backend.TORCH, "cpu")
    assert ops.rms_norm is ref.rms_norm and ops.silu_and_mul is ref.silu_and_mul
    bare = KernelOps(Backend.TORCH, *[None] * 7)  # callers that predate the norm ops
    assert bare.rms_norm is ref.rms_norm and bare.silu_and_mul is ref.silu_and_mul


def test_triton_kernel_ops_hold_the_triton_kernels() -> None:
    """The Triton backend's ops table (built at import, which needs no GPU): every field its kernel."""
    from oscarkv.kernels.triton import norm, ops, quantize_pack, rope

    k = ops.KERNEL_OPS
    assert k.backend is Backend.TRITON and k.check_formats is ops.check_formats
    assert k.rms_norm is norm.rms_norm and k.qk_norm_rope is rope.qk_norm_rope
    assert k.quantize_pack_into is quantize_pack.quantize_pack_into


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)


def tiny_decoder(kind: str, dtype: torch.dtype, ops: KernelOps | None = None) -> Decoder:
    cfg = tiny_lm_config(kind, vocab=101, layers=2, heads=4, kv_heads=2, head_dim=32)
    dec = Decoder(cfg, model_shape(cfg), dtype=dtype, device="cpu", ops=ops).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            init = (
                torch.rand(p.shape, generator=g) + 0.5
                if "norm" in name
                else torch.randn(p.shape, generator=g) * 0.1
            )
            p.copy_(init)
    return dec


def unfused_logits(
    dec: Decoder, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor | None = None
) -> torch.Tensor:
    """The decoder's forward as it was: separate residual adds, eager norms and activation."""
    h = dec.embed_tokens(ids)
    cos, sin = dec.rotary(pos)
    for layer in dec.layers:
        a = layer.input_layernorm
        h = h + layer.self_attn(eager_rms_norm(h, a.weight, a.eps), cos, sin, causal_attention)
        p, mlp = layer.post_attention_layernorm, layer.mlp
        h = h + mlp.down_proj(eager_silu_and_mul(mlp.gate_up_proj(eager_rms_norm(h, p.weight, p.eps))))
    weight = dec.embed_tokens.weight if dec.lm_head is None else dec.lm_head.weight
    h = h if last is None else h[last]
    return F.linear(eager_rms_norm(h, dec.norm.weight, dec.norm.eps), weight).float()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_decoder_equals_the_unfused_one_bit_for_bit(kind: str, dtype: torch.dtype) -> None:
    dec = tiny_decoder(kind, dtype)
    ids, pos = torch.randint(0, 101, (9,)), torch.arange(9)
    last = torch.tensor([2, 8])
    with torch.no_grad():
        want = unfused_logits(dec, ids, pos)
        assert torch.equal(dec(ids, pos, causal_attention), want)
        assert torch.equal(dec(ids, pos, causal_attention, last), unfused_logits(dec, ids, pos, last))
        assert torch.equal(dec.logits(dec.hidden_states(ids, pos, causal_attention)), want)


# ---- Triton against the twins, under the interpreter ---------------------------------------------
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter lane itself")
def test_triton_kernels_under_the_interpreter() -> None:
    run_under_the_interpreter(__file__, "-k", "triton_vs_twin")


@pytest.fixture
def rounding_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's fp32 -> bf16 cast rounded to nearest even, as the GPU's ``cvt.rn``."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    plain = interpreter.InterpreterBuilder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return plain(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast)


def check_rms_norm(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None) -> None:
    from oscarkv.kernels.triton import norm

    if res is None:
        assert_steps(norm.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))
        return
    out, new_res = norm.rms_norm(x, w, EPS, res)
    want, want_res = ref.rms_norm(x, w, EPS, res)
    assert torch.equal(new_res, want_res)
    assert_steps(out, want)


@interpreted
@pytest.mark.usefixtures("rounding_cast")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("n", [64, 576, 4096])
@pytest.mark.parametrize("fused", [False, True])
def test_triton_vs_twin_rms_norm(n: int, rows: int, dtype: torch.dtype, fused: bool) -> None:
    x, res, w = inputs(rows, n, dtype, seed=n + rows)
    check_rms_norm(x, w, res if fused else None)


@interpreted
@pytest.mark.usefixtures("rounding_cast")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_vs_twin_rms_norm_strided_rows(dtype: torch.dtype) -> None:
    t, hq, hkv, d = 5, 4, 2, 64
    qkv, _, w = inputs(t, (hq + 2 * hkv) * d, dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # as Attention's per-head q/k norms see them
    check_rms_norm(q.view(t, hq, d), w[:d], None)
    check_rms_norm(k.view(t, hkv, d), w[d : 2 * d], None)
    wide, wide_res, _ = inputs(t, 3 * d, dtype, seed=1)
    check_rms_norm(wide[:, d : 2 * d], w[:d], wide_res[:, :d])  # 2D views with row strides


@interpreted
@pytest.mark.usefixtures("rounding_cast")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [576, 4096])
def test_triton_vs_twin_rms_norm_two_passes(
    monkeypatch: pytest.MonkeyPatch, n: int, dtype: torch.dtype
) -> None:
    from oscarkv.kernels.triton import norm

    monkeypatch.setattr(norm, "MAX_BLOCK", 256)  # rows longer than a block: statistics, then scale
    x, res, w = inputs(3, n, dtype)
    check_rms_norm(x, w, None)
    check_rms_norm(x, w, res)


@interpreted
@pytest.mark.usefixtures("rounding_cast")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("inter", [32, 288, 2048])
def test_triton_vs_twin_silu_and_mul(inter: int, rows: int, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton import norm

    x = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    assert_steps(norm.silu_and_mul(x), ref.silu_and_mul(x))
    wide = (torch.randn(rows, 2 * inter + 16) * 4).to(dtype)[:, 16:]  # a row stride
    assert_steps(norm.silu_and_mul(wide), ref.silu_and_mul(wide))


def qk_inputs(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str = "cpu", r: int = 0):
    """``(q, k, cos, sin, w_q, w_k)``: ``q``/``k`` strided views of a fused ``qkv`` projection,
    ``cos``/``sin`` ``[t, r/2]`` halves of one fp32 cache row as ``RotaryEmbedding`` gives them
    (rotary width ``r``, the whole head ``d`` when 0)."""
    r = r or d
    g = torch.Generator().manual_seed(t * 7 + d)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype).to(device)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ang = torch.rand(t, r // 2, generator=g) * 100
    cos, sin = torch.cat([ang.cos(), ang.sin()], -1).to(device).chunk(2, dim=-1)
    w = (torch.rand(2, d, generator=g) + 0.5).to(dtype).to(device)
    return q.view(t, hq, d), k.view(t, hkv, d), cos, sin, w[0], w[1]


def check_qk_norm_rope(
    t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, device: str, r: int = 0
) -> None:
    from oscarkv.kernels.triton import rope

    q, k, cos, sin, wq, wk = qk_inputs(t, hq, hkv, d, dtype, device, r)
    args = (q, k, cos, sin, *((wq, wk) if norm else (None, None)), EPS)
    got, want = rope.qk_norm_rope(*args), ref.qk_norm_rope(*args)
    for g, w, x in zip(got, want, (q, k), strict=True):
        assert g.is_contiguous() and g.shape == w.shape
        if device != "cpu":  # a difference of products rounded once: a step at the inputs' scale
            torch.testing.assert_close(g, w, rtol=RTOL[dtype], atol=ROPE_ATOL[dtype])
        elif norm:
            assert_steps(g, w)
        else:
            assert torch.equal(g, w)
        if r and not norm:  # the dims past the rotary width come out as they went in
            assert torch.equal(g[..., r:], x[..., r:])


#: ``(t, hq, hkv, d, r)``: full rotary (``r == d``) and partial, GLM's half (128/64), a quarter
#: (128/32, 64/16), ``r/2`` and ``d - r`` both off a power of two (80/40), and an odd head (65/32)
QK_SHAPES = [
    (1, 4, 2, 64, 64),
    (5, 6, 3, 128, 128),
    (3, 8, 8, 80, 80),
    (2, 32, 8, 128, 128),
    (5, 6, 3, 128, 64),
    (2, 12, 2, 128, 64),
    (3, 8, 8, 128, 32),
    (1, 4, 2, 64, 32),
    (4, 6, 1, 64, 16),
    (3, 4, 4, 80, 40),
    (2, 4, 2, 65, 32),
]


@interpreted
@pytest.mark.usefixtures("rounding_cast")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hkv", "d", "r"), QK_SHAPES)
@pytest.mark.parametrize("norm", [False, True])
def test_triton_vs_twin_qk_norm_rope(
    t: int, hq: int, hkv: int, d: int, r: int, dtype: torch.dtype, norm: bool
) -> None:
    check_qk_norm_rope(t, hq, hkv, d, dtype, norm, "cpu", r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "r"), [(128, 128), (64, 64), (128, 64), (128, 32), (64, 32)])
@pytest.mark.parametrize("norm", [False, True])
def test_twin_is_glm4_moe_rotary_bit_for_bit(d: int, r: int, dtype: torch.dtype, norm: bool) -> None:
    """The twin against GLM-4.x MoE's attention in transformers: q/k norms over the whole head
    (``use_qk_norm``), then ``apply_rotary_pos_emb`` with the cos/sin of ``Glm4MoeRotaryEmbedding``
    for ``partial_rotary_factor = r/d``, on ``[B, H, T, d]``."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    t, hq, hkv = 9, 6, 2
    cfg = Glm4MoeConfig(
        hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": r / d},
    )  # fmt: skip
    rotary = glm.Glm4MoeRotaryEmbedding(cfg)
    pos = torch.arange(100, 100 + t)
    hf_cos, hf_sin = rotary(torch.zeros(1, t, 1, dtype=dtype), pos[None])  # [1, T, r] in dtype
    assert hf_cos.shape == (1, t, r)
    freqs = pos[:, None].float() * rotary.inv_freq[None, :]  # the engine's fp32 [T, r/2] halves
    cos, sin = freqs.cos(), freqs.sin()
    half = r // 2
    assert torch.equal(cos.to(dtype), hf_cos[0, :, :half]) and torch.equal(sin.to(dtype), hf_sin[0, :, half:])

    q, k, _, _, wq, wk = qk_inputs(t, hq, hkv, d, dtype)
    weights = (wq, wk) if norm else (None, None)
    got_q, got_k = ref.qk_norm_rope(q, k, cos, sin, *weights, EPS)
    hq_, hk_ = q[None], k[None]  # [B, T, H, d], as Glm4MoeAttention holds them before the norms
    if norm:
        q_norm, k_norm = glm.Glm4MoeRMSNorm(d, eps=EPS).to(dtype), glm.Glm4MoeRMSNorm(d, eps=EPS).to(dtype)
        q_norm.weight.data.copy_(wq)
        k_norm.weight.data.copy_(wk)
        with torch.no_grad():
            hq_, hk_ = q_norm(hq_), k_norm(hk_)
    want_q, want_k = glm.apply_rotary_pos_emb(hq_.transpose(1, 2), hk_.transpose(1, 2), hf_cos, hf_sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    if not norm:
        assert torch.equal(ref.apply_rotary(q, cos, sin), want_q[0].transpose(0, 1))


def test_qk_norm_rope_refuses_half_a_norm_and_odd_shapes() -> None:
    from oscarkv.kernels.triton import rope  # the shape checks run before any launch: no GPU needed

    q, k, cos, sin, wq, _ = qk_inputs(2, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="both given"):
        ref.qk_norm_rope(q, k, cos, sin, wq, None, EPS)
    with pytest.raises(ValueError, match="both given"):
        rope.qk_norm_rope(q, k, cos, sin, wq, None, EPS)
    _, _, wide_cos, wide_sin, _, _ = qk_inputs(2, 4, 2, 66, torch.float32)  # r = 66 > d = 64
    q65, k65, cos33, sin33, _, _ = qk_inputs(2, 4, 2, 65, torch.float32, r=66)  # odd d fully rotated
    bad = {
        "r > d": (q, k, wide_cos, wide_sin),
        "r = 0": (q, k, cos[:, :0], sin[:, :0]),
        "odd d, r = d + 1": (q65, k65, cos33, sin33),
        "sin unlike cos": (q, k, cos, sin[:, :16]),
        "HF's full-width rows": (q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)),
    }
    for what, (q_, k_, c, s) in bad.items():
        for op in (ref.qk_norm_rope, rope.qk_norm_rope):
            with pytest.raises(ValueError, match=r"cos/sin \[T, r/2\]"):
                op(q_, k_, c, s, None, None, EPS)
                pytest.fail(f"{op.__module__}.qk_norm_rope took {what}")
        with pytest.raises(ValueError, match="2 <= r <= d"):
            ref.apply_rotary(q_, c, s)
    with pytest.raises(ValueError, match=r"cos/sin \[T, r/2\]"):  # a cos row per token
        rope.qk_norm_rope(q, k, cos[:1], sin[:1], None, None, EPS)


@interpreted
@pytest.mark.usefixtures("rounding_cast")
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_vs_twin_decoder(kind: str, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton import norm, rope

    ops = dataclasses.replace(
        resolve(Backend.TORCH, "cpu"),
        rms_norm=norm.rms_norm,
        silu_and_mul=norm.silu_and_mul,
        qk_norm_rope=rope.qk_norm_rope,
    )
    want_dec = tiny_decoder(kind, dtype)
    dec = tiny_decoder(kind, dtype, ops)
    ids, pos = torch.randint(0, 101, (9,)), torch.arange(9)
    with torch.no_grad():
        got, want = dec(ids, pos, causal_attention), want_dec(ids, pos, causal_attention)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 if dtype == torch.float32 else 2e-2)


# ---- Triton against the twins, on a GPU -----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 24, 33, 4096])
@pytest.mark.parametrize("n", [64, 128, 576, 4096, 5120, 8192, 20000])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_rms_norm(n: int, rows: int, dtype: torch.dtype, fused: bool) -> None:
    x, res, w = inputs(rows, n, dtype, "cuda", seed=n + rows)
    check_rms_norm(x, w, res if fused else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_rms_norm_qwen3_8b_heads(dtype: torch.dtype) -> None:
    t, hq, hkv, d = 24, 32, 8, 128
    qkv, _, w = inputs(t, (hq + 2 * hkv) * d, dtype, "cuda")
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    check_rms_norm(q.view(t, hq, d), w[:d], None)
    check_rms_norm(k.view(t, hkv, d), w[d : 2 * d], None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 24, 4096])
@pytest.mark.parametrize("inter", [32, 288, 12288, 28672])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_silu_and_mul(inter: int, rows: int, dtype: torch.dtype) -> None:
    from oscarkv.kernels.triton import norm

    x = (torch.randn(rows, 2 * inter, device="cuda") * 4).to(dtype)
    assert_steps(norm.silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 24, 4096])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "r"),
    [(32, 8, 128, 128), (9, 3, 64, 64), (16, 8, 256, 256), (96, 8, 128, 64), (32, 8, 128, 32), (9, 3, 64, 32)],
)  # fmt: skip
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_qk_norm_rope(t: int, hq: int, hkv: int, d: int, r: int, dtype: torch.dtype, norm: bool) -> None:
    check_qk_norm_rope(t, hq, hkv, d, dtype, norm, "cuda", r)
