"""Calibration subsystem on tiny CPU models: capture, statistics, fitting, clip search, data, CLI.

Every expectation is recomputed here from the spec formulas (oscar-spec.md §1.2, §2.1-2.3, §2.8,
§3, §8 items 1-3) on tensors this file captures itself; the code under test is only compared
against them. Tiny Llama / Qwen3 models (float32, random weights) and a character tokenizer keep
everything offline.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import oscarkv
from oscarkv import CalibrationConfig, QuantSpec, RotationFileError, SpecError
from oscarkv.calibration import (
    ClipSearch,
    CorpusError,
    LayerStats,
    UnsupportedModelError,
    WindowedError,
    calibrate,
    capture_attention,
    token_sequences,
)
from oscarkv.calibration.data import iter_documents
from oscarkv.calibration.granularity import choose_granularity
from oscarkv.calibration.held_out import HeldOut
from oscarkv.calibration.report import attention_errors, summary_rows
from oscarkv.calibration.select import RotationSelect
from oscarkv.config import CLIP_GRID_K, CLIP_GRID_V
from oscarkv.config.calibration import GRANULARITY_MARGIN
from oscarkv.demo import DEMO_SPEC, demo_model_path
from oscarkv.hf.loading import load_model
from oscarkv.quant import RowFormat
from oscarkv.rotation import LayerRotation, compose, load_rotations, save_rotations

D = 32  # head dim of the tiny models
H_Q, H_KV = 4, 2
G = H_Q // H_KV
N_LAYERS = 2
SPEC = QuantSpec(sink_tokens=4, recent_tokens=16)


# ---- tiny models, tokenizer and corpus -------------------------------------------------------
class CharTokenizer:
    """Character-level tokenizer: no files, no downloads."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 128 for c in text]}


class ChatTokenizer(CharTokenizer):
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize=False):
        assert tokenize is False
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)


def _config_kwargs(**over):
    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=H_Q,
        num_key_value_heads=H_KV,
        head_dim=D,
        max_position_embeddings=512,
    )
    kw.update(over)
    return kw


def make_llama(seed: int = 0, **over) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_config_kwargs(**over)))
    return model.float().eval()


def make_qwen3(seed: int = 1, **over) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_config_kwargs(**over)))
    # non-trivial QK-norm weights, so "post-QK-norm" is really checked
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model.float().eval()


MAKERS = {"llama": make_llama, "qwen3": make_qwen3}

WORDS_TEXT = (
    "the of and to in is that for it as with was on be by at this from or an are which "
    "attention key value query rotation quantization cache token layer head matrix vector "
    "Hadamard eigenvalue clip window sink recent def return class import self None True "
    "0 1 2 3 4 5 6 7 8 9 ( ) [ ] { } = + - * / , . : ; ' \" #"
)
WORDS = WORDS_TEXT.split()


def _random_text(rng: random.Random, n_words: int) -> str:
    out = []
    for i in range(n_words):
        w = rng.choice(WORDS)
        if rng.random() < 0.1:
            w = w.upper()
        out.append(w)
        out.append("\n" if i % rng.randint(7, 15) == 0 else " ")
    return "".join(out)


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Four text files of different content (about 1.5-3 K characters each)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    files = []
    for i in range(4):
        p = root / f"doc{i}.txt"
        p.write_text(f"# document {i}\n" + _random_text(rng, 300 + 100 * i))
        files.append(p)
    return files


@pytest.fixture(scope="module")
def models() -> dict[str, transformers.PreTrainedModel]:
    return {name: make() for name, make in MAKERS.items()}


# ---- independent reference computations ------------------------------------------------------
def capture_all(model, seqs: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``seqs`` one at a time; per layer, float64 rows ``q [N, H_q, d]``, ``k, v [N, H_kv, d]``
    and ``o [N, H_q, d]`` concatenated over all tokens of all sequences."""
    got: dict[int, dict[str, list[torch.Tensor]]] = {}

    def cb(layer, q, k, v, o):
        rows = got.setdefault(layer, {"q": [], "k": [], "v": [], "o": []})
        rows["q"].append(q[0].transpose(0, 1).double().clone())
        rows["k"].append(k[0].transpose(0, 1).double().clone())
        rows["v"].append(v[0].transpose(0, 1).double().clone())
        rows["o"].append(o[0].double().clone())

    with capture_attention(model, cb), torch.inference_mode():
        for s in seqs:
            model(input_ids=s.reshape(1, -1), use_cache=False)
    return {i: {n: torch.cat(t) for n, t in d.items()} for i, d in got.items()}


def calibration_chunks(tok, data, cfg: CalibrationConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The statistics chunks (first ``cfg.tokens`` tokens) and held-out sequences ``calibrate``
    should use, rebuilt from ``token_sequences`` as documented."""
    n_cal = math.ceil(cfg.tokens / cfg.seq_len)
    held = cfg.clip_search or cfg.rotation_select
    n_hold = math.ceil(cfg.holdout_tokens / cfg.seq_len) if held else 0
    ids = token_sequences(tok, data, n_cal + n_hold, cfg.seq_len, cfg.seed)
    flat = ids[:n_cal].reshape(-1)[: cfg.tokens]
    cal = [flat[s : s + cfg.seq_len] for s in range(0, cfg.tokens, cfg.seq_len)]
    return cal, list(ids[n_cal:])


def c_q_heads(q: torch.Tensor) -> torch.Tensor:
    """Spec §2.2: per KV head, ``Q_hᵀQ_h / (N g)`` over the group's query heads (contiguous)."""
    out = []
    for h in range(H_KV):
        rows = q[:, h * G : (h + 1) * G].reshape(-1, q.shape[-1])
        out.append(rows.T @ rows / rows.shape[0])
    return torch.stack(out)


def c_v_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Spec §2.3: ``w_t = k_t C_Q k_tᵀ``, ``w̃ = w N / Σw``, ``C_V = Σ w̃_t v_tᵀ v_t / N``."""
    cq = c_q_heads(q)
    n = k.shape[0]
    out = []
    for h in range(H_KV):
        kh, vh = k[:, h], v[:, h]
        w = torch.stack([kh[t] @ cq[h] @ kh[t] for t in range(n)])
        wt = w * n / max(float(w.sum()), 1e-12)
        out.append(sum(wt[t] * torch.outer(vh[t], vh[t]) for t in range(n)) / n)
    return torch.stack(out)


def sym(c: torch.Tensor) -> torch.Tensor:
    return (c + c.T) / 2


def assert_rotation_matches(r: torch.Tensor, lam_stored: torch.Tensor, target: torch.Tensor) -> None:
    """Stored (R, λ) equal ``compose(eigh(target))``, up to the sign of each eigenvector."""
    lam, u = torch.linalg.eigh(target)
    torch.testing.assert_close(lam_stored.double(), lam, rtol=1e-6, atol=1e-12)
    # U implied by the stored R (R = U·(H·P), and H·P is compose with U = I)
    hp = compose(lam, torch.eye(lam.shape[0], dtype=torch.float64))
    u_theirs = r.double() @ hp.T
    dots = (u * u_theirs).sum(0)
    assert dots.abs().min() > 0.999, f"stored R is not built from target eigenvectors: {dots}"
    expected = compose(lam, u * torch.sign(dots))
    torch.testing.assert_close(r.double(), expected, rtol=0, atol=1e-5)


def hadamard_ref(d: int) -> torch.Tensor:
    """Spec §2.5: ``H[i, c] = (−1)^popcount(i & c) / √d``."""
    pc = torch.tensor([[bin(a & b).count("1") for b in range(d)] for a in range(d)], dtype=torch.float64)
    return (-1.0) ** pc / math.sqrt(d)


def rope_ref(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Default RoPE (rotate-half convention) on ``x [B, H, T, d]`` at positions 0..T-1."""
    d, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q kᵀ/√d + causal) v`` with contiguous GQA; q ``[B, H_q, T, d]`` -> ``[B, T, H_q, d]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    t = q.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


# ---- 1. capture ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_capture_sees_post_norm_post_rope_qkv_and_is_transparent(models, name):
    model = models[name]
    cfg = model.config
    theta = cfg.rope_parameters["rope_theta"]
    assert cfg.rope_parameters.get("rope_type", "default") == "default"
    ids = torch.randint(1, 128, (2, 40))

    with torch.inference_mode():
        ref_logits = model(input_ids=ids, use_cache=False).logits
    assert cfg._attn_implementation == "sdpa"

    inputs: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def pre(mod, args, kwargs, i=i):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).double()

        hooks.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))

    calls: list[int] = []
    checked: list[int] = []

    def cb(layer, q, k, v, o):
        calls.append(layer)
        b, t = ids.shape
        assert q.shape == (b, H_Q, t, D) and k.shape == (b, H_KV, t, D) and v.shape == (b, H_KV, t, D)
        assert o.shape == (b, t, H_Q, D)
        # q/k/v/o are the inputs and output of causal GQA attention
        torch.testing.assert_close(
            o.double(), causal_attention_ref(q.double(), k.double(), v.double()), atol=1e-4, rtol=0
        )
        # ... and q/k are post-QK-norm, post-RoPE projections of the layer input; v is raw
        attn = model.model.layers[layer].self_attn
        h = inputs[layer]
        with torch.no_grad():
            qp = (h @ attn.q_proj.weight.double().T).view(b, t, H_Q, D)
            kp = (h @ attn.k_proj.weight.double().T).view(b, t, H_KV, D)
            vp = (h @ attn.v_proj.weight.double().T).view(b, t, H_KV, D)
            if hasattr(attn, "q_norm"):
                qp = rms_ref(qp, attn.q_norm.weight, cfg.rms_norm_eps)
                kp = rms_ref(kp, attn.k_norm.weight, cfg.rms_norm_eps)
        torch.testing.assert_close(q.double(), rope_ref(qp.transpose(1, 2), theta), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k.double(), rope_ref(kp.transpose(1, 2), theta), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.double(), vp.transpose(1, 2), atol=1e-5, rtol=1e-5)
        checked.append(layer)

    try:
        with capture_attention(model, cb) as seen, torch.inference_mode():
            assert cfg._attn_implementation != "sdpa"
            logits = model(input_ids=ids, use_cache=False).logits
            assert seen == set(range(N_LAYERS))
    finally:
        for hk in hooks:
            hk.remove()
    assert calls == list(range(N_LAYERS))
    assert checked == list(range(N_LAYERS))
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)
    assert cfg._attn_implementation == "sdpa"
    # the model still runs normally afterwards, and nothing is captured any more
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, ref_logits)
    assert len(calls) == N_LAYERS


def test_capture_restores_previous_implementation_even_on_error():
    model = make_llama(attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(1, 128, (1, 12))
    with torch.inference_mode():
        ref = model(input_ids=ids, use_cache=False).logits

    def boom(layer, q, k, v, o):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"), capture_attention(model, boom):
        model(input_ids=ids, use_cache=False)
    assert model.config._attn_implementation == "eager"

    # nested captures: the innermost callback receives the calls, the outer one resumes after
    outer, inner = [], []
    with capture_attention(model, lambda i, *a: outer.append(i)), torch.inference_mode():
        with capture_attention(model, lambda i, *a: inner.append(i)):
            model(input_ids=ids, use_cache=False)
        model(input_ids=ids, use_cache=False)
    assert inner == [0, 1] and outer == [0, 1]
    assert model.config._attn_implementation == "eager"
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, ref)


def test_nested_captures_of_two_models_route_to_their_own_callbacks():
    """Each model's attention calls go to the callback registered for *that* model."""
    a, b = make_llama(seed=0), make_llama(seed=1)
    calls_a: list[int] = []
    calls_b: list[int] = []
    ids = torch.randint(1, 128, (1, 8))
    with (
        capture_attention(a, lambda i, *x: calls_a.append(i)),
        capture_attention(b, lambda i, *x: calls_b.append(i)),
        torch.inference_mode(),
    ):
        a(input_ids=ids, use_cache=False)
    assert calls_a == [0, 1], "model A's layers were not delivered to A's callback"
    assert calls_b == [], "model B's callback received model A's layers"


def test_calibrate_with_progress_bar(models, tok, corpus, capsys):
    """Every pass shows progress, the held-out passes of the choices too (they ran silently for
    minutes on a real model): their line counts the forwards run."""
    cfg = CalibrationConfig(tokens=128, seq_len=128, holdout_tokens=128)
    rs = calibrate(models["llama"], tok, cfg, SPEC, data=corpus, progress=True)
    assert rs.layer_ids == [0, 1] and rs.provenance.recipe["tokens"] == 128
    out = capsys.readouterr().out
    assert "statistics" in out and "held-out passes" in out
    assert int(out.split("held-out passes")[-1].split(" forwards")[0].split()[-1]) >= 3


# ---- 2./3. K and V targets through calibrate -------------------------------------------------
@pytest.fixture(scope="module")
def oscar_run(models, tok, corpus):
    """calibrate() on Qwen3 with the clip search on; tokens not a multiple of seq_len."""
    cfg = CalibrationConfig(
        tokens=320, seq_len=128, holdout_tokens=128, clip_search=True, seed=0, granularity="layer"
    )
    rs = calibrate(models["qwen3"], tok, cfg, SPEC, data=corpus, progress=False)
    return cfg, rs


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_k_and_v_targets_match_spec_formulas(models, tok, corpus, name):
    model = models[name]
    cfg = CalibrationConfig(tokens=320, seq_len=128, clip_search=False, seed=0, granularity="layer")
    rs = calibrate(model, tok, cfg, SPEC, data=corpus, progress=False)
    cal, hold = calibration_chunks(tok, corpus, cfg)
    assert [c.numel() for c in cal] == [128, 128, 64] and hold == []
    cap = capture_all(model, cal)
    assert rs.layer_ids == list(range(N_LAYERS))
    assert rs.granularity == "layer" and rs.provenance.recipe["tokens"] == 320
    for i in rs.layer_ids:
        q, k, v = cap[i]["q"], cap[i]["k"], cap[i]["v"]
        assert q.shape == (320, H_Q, D)
        # §2.2: plain mean of qᵀq over every (token, query head) row; K does not enter it
        rows = q.reshape(-1, D)
        sigma_k = sym(rows.T @ rows / rows.shape[0])
        torch.testing.assert_close(c_q_heads(q).mean(0), sigma_k, rtol=1e-10, atol=1e-12)
        lr = rs.layers[i]
        assert lr.k.shape == (D, D) and lr.k.dtype == torch.float32
        assert_rotation_matches(lr.k, lr.k_eigenvalues, sigma_k)
        # §2.3: score-energy-weighted value second moment, per KV head with its own C_Q
        sigma_v = sym(c_v_heads(q, k, v).mean(0))
        assert_rotation_matches(lr.v, lr.v_eigenvalues, sigma_v)
        assert lr.k_clip is None and lr.v_clip is None


def test_clip_search_run_uses_holdout_only_for_clips(models, tok, corpus, oscar_run):
    cfg, rs = oscar_run
    cal, hold = calibration_chunks(tok, corpus, cfg)
    assert len(hold) == 1 and hold[0].numel() == 128
    # the statistics come from the first `tokens` tokens only, not from the held-out sequence
    cap = capture_all(models["qwen3"], cal)
    for i in rs.layer_ids:
        rows = cap[i]["q"].reshape(-1, D)
        torch.testing.assert_close(
            rs.layers[i].k_eigenvalues.double(),
            torch.linalg.eigvalsh(rows.T @ rows / rows.shape[0]),
            rtol=1e-6,
            atol=1e-12,
        )
        assert rs.layers[i].k_clip in set(CLIP_GRID_K) | {SPEC.k_clip}
        assert rs.layers[i].v_clip in set(CLIP_GRID_V) | {SPEC.v_clip}
    recipe = rs.provenance.recipe
    assert recipe["holdout_tokens"] == 128 and recipe["tokens"] == 320
    search = recipe["clip_search"]
    for i in rs.layer_ids:
        s = search[str(i)]
        assert (rs.layers[i].k_clip, rs.layers[i].v_clip) == (s["k_clip"], s["v_clip"])
        assert s["k_err_best"] <= s["k_err_global"] and s["v_err_best"] <= s["v_err_global"]
        # both searches start from the same (global K, global V) point
        assert s["k_err_global"] == pytest.approx(s["v_err_global"], rel=1e-9)

    # attention_errors at the global clips reproduces the search's global error on the same
    # held-out sequence (same windows, same relative-error definition)
    plain = replace(rs, layers={i: replace(lr, k_clip=None, v_clip=None) for i, lr in rs.layers.items()})
    errs = attention_errors(models["qwen3"], torch.stack(hold), {"global": plain, "chosen": rs})
    for i in rs.layer_ids:
        assert errs["global"][i] == pytest.approx(search[str(i)]["k_err_global"], rel=1e-5)
        assert 0 < errs["chosen"][i] < 1
    rows = summary_rows(rs)
    assert [r["layer"] for r in rows] == rs.layer_ids
    for r in rows:
        s = search[str(r["layer"])]
        assert r["err_global"] == pytest.approx(s["k_err_global"])
        assert r["k_gain"] == pytest.approx(1 - s["k_err_best"] / s["k_err_global"])
        assert r["ortho"] < 1e-5


def test_attention_errors_zero_when_nothing_is_quantized(models, tok, corpus, oscar_run):
    _, rs = oscar_run
    seqs = token_sequences(tok, corpus, 1, 64, seed=3)
    exact = rs.with_spec(QuantSpec(sink_tokens=32, recent_tokens=32))  # sink + recent covers T
    errs = attention_errors(models["qwen3"], seqs, {"exact": exact, "int2": rs})
    assert errs["exact"] == {0: 0.0, 1: 0.0}
    assert all(e > 0 for e in errs["int2"].values())


def test_batch_size_does_not_change_statistics(models, tok, corpus):
    cfg = CalibrationConfig(tokens=320, seq_len=128, clip_search=False, granularity="layer")
    a = calibrate(models["llama"], tok, cfg, SPEC, data=corpus)
    b = calibrate(models["llama"], tok, replace(cfg, batch_size=2), SPEC, data=corpus)
    for i in a.layer_ids:
        for attr in ("k_eigenvalues", "v_eigenvalues"):
            torch.testing.assert_close(
                getattr(a.layers[i], attr), getattr(b.layers[i], attr), rtol=1e-5, atol=0
            )


# ---- LayerStats directly -------------------------------------------------------------------------
def _random_batches(seed: int, shapes=((2, 5), (1, 3))):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b, t in shapes:
        q = torch.randn(b, H_Q, t, 8, generator=gen)
        k = torch.randn(b, H_KV, t, 8, generator=gen) * torch.linspace(0.2, 3, 8)
        v = torch.randn(b, H_KV, t, 8, generator=gen) + 0.5
        o = causal_attention_ref(q, k, v)
        out.append((q, k, v, o))
    return out


def _rows(batches, idx, heads):
    # [B, H, T, d] (or [B, T, H, d] for o) -> [N, H, d]
    parts = []
    for b in batches:
        x = b[idx]
        x = x if idx == 3 else x.transpose(1, 2)
        parts.append(x.reshape(-1, heads, x.shape[-1]).double())
    return torch.cat(parts)


def test_layer_stats_oscar_targets_on_random_tensors():
    batches = _random_batches(0)
    st = LayerStats(H_Q, H_KV, 8, {"qq", "kv_buffer"})
    for b in batches:
        st.update(*b)
    assert st.tokens == 2 * 5 + 3
    q, k, v = _rows(batches, 0, H_Q), _rows(batches, 1, H_KV), _rows(batches, 2, H_KV)
    torch.testing.assert_close(st.c_q(), c_q_heads(q), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.c_v_oscar(), c_v_heads(q, k, v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.c_v_oscar(chunk=2), c_v_heads(q, k, v), rtol=1e-12, atol=1e-12)
    ck, cv = st.targets("oscar", "oscar")
    torch.testing.assert_close(ck, c_q_heads(q), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cv, c_v_heads(q, k, v), rtol=1e-12, atol=1e-12)
    # the head grouping is contiguous: swapping query heads across groups changes C_Q
    assert not torch.allclose(c_q_heads(q[:, [0, 2, 1, 3]]), st.c_q())
    with pytest.raises(ValueError, match="query heads"):
        st.update(
            q=torch.zeros(1, 3, 2, 8),
            k=torch.zeros(1, 2, 2, 8),
            v=torch.zeros(1, 2, 2, 8),
            o=torch.zeros(1, 2, 3, 8),
        )


def test_layer_stats_softmax_target_is_output_second_moment():
    batches = _random_batches(1)
    st = LayerStats(H_Q, H_KV, 8, {"qq", "oo"})
    for b in batches:
        st.update(*b)
    o = _rows(batches, 3, H_Q)
    _, cv = st.targets("oscar", "softmax")
    for h in range(H_KV):
        rows = o[:, h * G : (h + 1) * G].reshape(-1, 8)
        torch.testing.assert_close(cv[h], rows.T @ rows / rows.shape[0], rtol=1e-12, atol=1e-12)
    assert st.k_buf == [] and st.kk is None  # nothing buffered for the softmax target

    # the paper's VᵀSᵀSV with the causal softmax S equals OᵀO for the SDPA output O = S V
    gen = torch.Generator().manual_seed(2)
    t, d = 7, 8
    q, k, v = (torch.randn(t, d, generator=gen, dtype=torch.float64) for _ in range(3))
    s = (q @ k.T / math.sqrt(d)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    s = s.softmax(-1)
    o_sdpa = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    torch.testing.assert_close(v.T @ s.T @ s @ v, o_sdpa.T @ o_sdpa, rtol=1e-10, atol=1e-12)


def test_layer_stats_ktk_vtv_and_needs():
    batches = _random_batches(3)
    st = LayerStats(H_Q, H_KV, 8, LayerStats.needs_for("ktk_vtv", "oscar"))
    for b in batches:
        st.update(*b)
    k, v = _rows(batches, 1, H_KV), _rows(batches, 2, H_KV)
    ck, cv = st.targets("ktk_vtv", "oscar")
    n = k.shape[0]
    for h in range(H_KV):
        torch.testing.assert_close(ck[h], k[:, h].T @ k[:, h] / n, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cv[h], v[:, h].T @ v[:, h] / n, rtol=1e-12, atol=1e-12)
    assert LayerStats.needs_for("hadamard", "oscar") == set()
    assert LayerStats.needs_for("identity", "softmax") == set()
    assert LayerStats.needs_for("oscar", "oscar") == {"qq", "kv_buffer"}
    assert LayerStats.needs_for("oscar", "softmax") == {"qq", "oo"}


def test_softmax_v_target_through_calibrate(models, tok, corpus):
    model = models["qwen3"]
    cfg = CalibrationConfig(
        tokens=256, seq_len=128, clip_search=False, v_target="softmax", granularity="layer"
    )
    rs = calibrate(model, tok, cfg, SPEC, data=corpus)
    cap = capture_all(model, calibration_chunks(tok, corpus, cfg)[0])
    for i in rs.layer_ids:
        o = cap[i]["o"].reshape(-1, D)
        assert_rotation_matches(rs.layers[i].v, rs.layers[i].v_eigenvalues, sym(o.T @ o / o.shape[0]))
        q = cap[i]["q"].reshape(-1, D)
        assert_rotation_matches(rs.layers[i].k, rs.layers[i].k_eigenvalues, sym(q.T @ q / q.shape[0]))


# ---- 5. kv_head granularity ----------------------------------------------------------------------
def test_kv_head_granularity(models, tok, corpus, tmp_path):
    model = models["llama"]
    cfg = CalibrationConfig(
        tokens=256, seq_len=128, holdout_tokens=128, granularity="kv_head", clip_search=True
    )
    rs = calibrate(model, tok, cfg, SPEC, data=corpus)
    assert rs.granularity == "kv_head" and rs.num_kv_heads == H_KV
    cap = capture_all(model, calibration_chunks(tok, corpus, cfg)[0])
    eye = torch.eye(D, dtype=torch.float64)
    for i in rs.layer_ids:
        lr = rs.layers[i]
        assert lr.k.shape == lr.v.shape == (H_KV, D, D)
        assert lr.k_eigenvalues.shape == lr.v_eigenvalues.shape == (H_KV, D)
        cq, cv = c_q_heads(cap[i]["q"]), c_v_heads(cap[i]["q"], cap[i]["k"], cap[i]["v"])
        for h in range(H_KV):
            for r in (lr.k[h], lr.v[h]):
                torch.testing.assert_close(r.double().T @ r.double(), eye, atol=1e-5, rtol=0)
            assert_rotation_matches(lr.k[h], lr.k_eigenvalues[h], sym(cq[h]))
            assert_rotation_matches(lr.v[h], lr.v_eigenvalues[h], sym(cv[h]))
        assert not torch.allclose(lr.k[0], lr.k[1])  # really one matrix per head
        assert lr.k_clip is not None and lr.v_clip is not None
    out = tmp_path / "art"
    save_rotations(rs, out)
    back = load_rotations(out, model_config=model.config)
    assert back.granularity == "kv_head" and back.num_kv_heads == H_KV
    for i in rs.layer_ids:
        assert torch.equal(back.layers[i].k, rs.layers[i].k)
        assert torch.equal(back.layers[i].v_eigenvalues, rs.layers[i].v_eigenvalues)
        assert back.clips(i) == rs.clips(i)
    wrong = transformers.LlamaConfig(**_config_kwargs(num_key_value_heads=1))
    with pytest.raises(RotationFileError, match="KV head"):
        load_rotations(out, model_config=wrong)


# ---- 5b. granularity auto -----------------------------------------------------------------------
def _two_kv_heads(outlier: float) -> tuple[transformers.PreTrainedModel, Any]:
    """The bundled demo model (trained: 2 query heads on 1 KV head, head dim 128) rebuilt as 4 query
    heads on 2 copies of its KV head, the same function. Each copy's values are then stretched by
    ``outlier`` along a direction of its own (45 degrees apart), ``o_proj`` dividing it out: still
    the same function, with value outliers that one per-layer rotation cannot align for both heads.
    ``outlier=1``: two identical KV heads."""
    model, tok = load_model(str(demo_model_path()), "cpu", "fp32")
    cfg = model.config
    d, hq = cfg.head_dim, cfg.num_attention_heads
    assert cfg.num_key_value_heads == 1
    wide = transformers.Qwen3Config(
        **{**cfg.to_dict(), "num_attention_heads": 2 * hq, "num_key_value_heads": 2}
    )
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for name in ("q_proj", "k_proj", "v_proj"):
            sd[p + name + ".weight"] = sd[p + name + ".weight"].repeat(2, 1)
        sd[p + "o_proj.weight"] = sd[p + "o_proj.weight"].repeat(1, 2) / 2  # each copy half the output
        for h in range(2):
            u = torch.zeros(d)
            u[0], u[1] = 1.0, float(h)
            uu = torch.outer(u, u) / u.dot(u)
            grow, shrink = torch.eye(d) + (outlier - 1) * uu, torch.eye(d) + (1 / outlier - 1) * uu
            rows, cols = slice(h * d, (h + 1) * d), slice(h * hq * d, (h + 1) * hq * d)
            sd[p + "v_proj.weight"][rows] = grow @ sd[p + "v_proj.weight"][rows]
            o = sd[p + "o_proj.weight"]
            o[:, cols] = o[:, cols] @ torch.block_diag(*[shrink] * hq)
    two = transformers.Qwen3ForCausalLM(wide).float().eval()
    two.load_state_dict(sd)
    ids = torch.arange(40)[None] * 7
    with torch.inference_mode():
        torch.testing.assert_close(two(ids).logits, model(ids).logits, atol=1e-3, rtol=0)
    return two, tok


#: Python the demo model reads well (it was trained on the standard library)
AUTO_DATA = [Path(json.__file__).parent]
AUTO_BASE = dict(tokens=512, seq_len=256, holdout_tokens=512, max_ppl_increase=None, offsets="none")


def _held_out_batches(tok, cfg: CalibrationConfig) -> list[torch.Tensor]:
    """The held-out sequences ``calibrate`` scores, one per batch (batch_size 1)."""
    ids = token_sequences(
        tok, AUTO_DATA, cfg.num_sequences + cfg.num_holdout_sequences, cfg.seq_len, cfg.seed
    )
    return [s[None] for s in ids[cfg.num_sequences :]]


def test_auto_granularity_keeps_per_kv_head_where_it_clearly_lowers_the_held_out_nll(tmp_path):
    model, tok = _two_kv_heads(100.0)
    cfg = CalibrationConfig(**AUTO_BASE)
    assert cfg.granularity == "auto"  # the default
    rs = calibrate(model, tok, cfg, DEMO_SPEC, data=AUTO_DATA)
    recipe = rs.provenance.recipe
    ch = recipe["granularity_choice"]
    assert rs.granularity == recipe["granularity"] == ch["chosen"] == "kv_head" and rs.num_kv_heads == 2
    assert ch["mode"] == "auto" and ch["margin"] == GRANULARITY_MARGIN
    assert ch["nll_layer"] - ch["nll_kv_head"] > 10 * GRANULARITY_MARGIN  # measured 0.68 nats
    # explicit granularities: as before (no comparison, nothing recorded); auto kept kv_head's fit
    by = {
        g: calibrate(model, tok, CalibrationConfig(**AUTO_BASE, granularity=g), DEMO_SPEC, data=AUTO_DATA)
        for g in ("layer", "kv_head")
    }
    for g, r in by.items():
        assert r.granularity == r.provenance.recipe["granularity"] == g
        assert "granularity_choice" not in r.provenance.recipe
    for i in rs.layer_ids:
        assert torch.equal(rs.layers[i].k, by["kv_head"].layers[i].k)
        assert torch.equal(rs.layers[i].v, by["kv_head"].layers[i].v)
    # the recorded NLLs are the held-out NLLs of the two sets on calibration's held-out sequences
    held = HeldOut(model, _held_out_batches(tok, cfg), DEMO_SPEC, 128)
    assert held.base == pytest.approx(ch["nll_unquantized"], rel=1e-6)
    assert held.nll(by["layer"].layers) == pytest.approx(ch["nll_layer"], rel=1e-6)
    assert held.nll(by["kv_head"].layers) == pytest.approx(ch["nll_kv_head"], rel=1e-6)
    save_rotations(rs, tmp_path)  # the artifact is an ordinary kv_head one, the record kept
    back = load_rotations(tmp_path, model_config=model.config)
    assert back.granularity == "kv_head" and back.provenance.recipe["granularity_choice"] == ch


def test_auto_granularity_keeps_per_layer_without_a_clear_gain(tok, corpus):
    # two identical KV heads: the per-head targets are the per-layer one, and so are the NLLs
    model, demo_tok = _two_kv_heads(1.0)
    rs = calibrate(model, demo_tok, CalibrationConfig(**AUTO_BASE), DEMO_SPEC, data=AUTO_DATA)
    ch = rs.provenance.recipe["granularity_choice"]
    assert rs.granularity == rs.provenance.recipe["granularity"] == ch["chosen"] == "layer"
    assert ch["nll_kv_head"] == pytest.approx(ch["nll_layer"], abs=1e-5)
    assert all(lr.k.shape == (128, 128) for lr in rs.layers.values())
    # one KV head: per layer, no comparison
    one = make_qwen3(num_key_value_heads=1)
    cfg = CalibrationConfig(
        tokens=256, seq_len=128, holdout_tokens=128, max_ppl_increase=None, offsets="none"
    )
    rs = calibrate(one, tok, cfg, SPEC, data=corpus)
    assert rs.granularity == "layer"
    want = {"mode": "auto", "chosen": "layer", "reason": "one KV head"}
    assert rs.provenance.recipe["granularity_choice"] == want
    # data-free methods: the same matrix for every head, so per layer (no held-out tokens needed)
    cfg = CalibrationConfig(tokens=128, seq_len=128, holdout_tokens=0, method="hadamard", offsets="none",
                            max_ppl_increase=None)  # fmt: skip
    rs = calibrate(make_llama(), tok, cfg, SPEC, data=corpus)
    assert rs.granularity == "layer" and rs.layers[0].k.shape == (D, D)
    assert rs.provenance.recipe["granularity_choice"]["reason"] == "hadamard is not fitted per KV head"


def _original_basis(off: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Offsets ``[H, d]`` stored in the basis of ``r`` (``[d, d]`` or ``[H, d, d]``) -> the means."""
    return off @ r.T if r.dim() == 2 else torch.einsum("he,hde->hd", off, r)


def test_auto_granularity_compares_both_sets_with_their_offsets(models, tok, corpus, monkeypatch):
    """The comparison sees each candidate as the artifact would store it: with the channel offsets
    in its own basis (#53: Qwen2.5-Coder's key biases make large key offsets, which a comparison
    without them leaves out); the recorded NLLs are those of the sets as stored."""
    import oscarkv.calibration.api as api

    seen = []

    def spy(held, by_layer, by_head, margin):
        seen.append((held, by_layer, by_head))
        return choose_granularity(held, by_layer, by_head, margin)

    monkeypatch.setattr(api, "choose_granularity", spy)
    base = dict(tokens=256, seq_len=128, holdout_tokens=128, max_ppl_increase=None, offsets="kv")
    rs = calibrate(models["qwen3"], tok, CalibrationConfig(**base), SPEC, data=corpus)
    ch = rs.provenance.recipe["granularity_choice"]
    ((held, by_layer, by_head),) = seen
    for i in rs.layer_ids:  # the same means, each in its set's basis
        for kind in ("k", "v"):
            a, b = (getattr(s[i], f"{kind}_offset") for s in (by_layer, by_head))
            assert a is not None and b is not None and b.shape == a.shape == (H_KV, D)
            torch.testing.assert_close(
                _original_basis(a, getattr(by_layer[i], kind)), _original_basis(b, getattr(by_head[i], kind))
            )
    # the recorded NLLs are the held-out NLLs of the sets with their offsets, not without them
    for g, cand in (("layer", by_layer), ("kv_head", by_head)):
        assert ch[f"nll_{g}"] == pytest.approx(held.nll(cand), rel=1e-6)
        bare = {i: replace(lr, k_offset=None, v_offset=None) for i, lr in cand.items()}
        assert held.nll(bare) != pytest.approx(ch[f"nll_{g}"], rel=1e-6)  # the offsets count here
    kept = by_layer if ch["chosen"] == "layer" else by_head
    assert rs.granularity == ch["chosen"]
    for i in rs.layer_ids:  # the artifact holds the compared set, its offsets attached once
        for f in ("k", "v", "k_offset", "v_offset"):
            assert torch.equal(getattr(rs.layers[i], f), getattr(kept[i], f))


def test_held_out_passes_are_shared_and_not_repeated(models, tok, corpus, monkeypatch):
    """One exact pass serves the granularity's choice, the offsets' verdict and the key widths;
    an NLL a step has measured for the rotations as they stand is not measured again."""
    import oscarkv.calibration.api as api

    made, passes = [], []

    class Counted(HeldOut):
        def __init__(self, *a, **k):
            made.append(1)
            super().__init__(*a, **k)

        def nll(self, rotations):
            passes.append(1)
            return super().nll(rotations)

    monkeypatch.setattr(api, "HeldOut", Counted)
    base = dict(tokens=256, seq_len=128, holdout_tokens=128)
    lo, hi = (replace(SPEC, key_bits=b).bits_per_element(131072, D) for b in (2, 4))
    cfg = CalibrationConfig(**base, bits_per_element=(lo + hi) / 2)  # one layer of two raised
    rs = calibrate(models["qwen3"], tok, cfg, SPEC, data=corpus)
    recipe = rs.provenance.recipe
    assert "nll_layer" in recipe["granularity_choice"] and recipe["offsets"]["mode"] == "auto"
    assert len(recipe["key_bits"]["nll_alone"]) == 2 and len(made) == 1
    # auto, offsets auto: both granularities with every offset, then the offsets' verdict, which
    # measures the NLL without them and reuses the chosen one's where every head kept its offsets
    made.clear()
    passes.clear()
    rs = calibrate(models["qwen3"], tok, CalibrationConfig(**base, max_ppl_increase=None), SPEC, data=corpus)
    ch, off = rs.provenance.recipe["granularity_choice"], rs.provenance.recipe["offsets"]["choice"]
    every = all(all(h["k"]) and all(h["v"]) for h in off["heads"].values())
    assert (len(made), len(passes)) == (1, 3 if every else 4)
    assert (off["nll_with"] == ch[f"nll_{ch['chosen']}"]) or not every
    # a target met at the spec's widths: the offsets' verdict measured the rotations it starts from
    made.clear()
    passes.clear()
    cfg = CalibrationConfig(**base, granularity="layer", max_ppl_increase=10.0)
    kb = calibrate(models["qwen3"], tok, cfg, SPEC, data=corpus).provenance.recipe["key_bits"]
    assert kb["met"] and kb["layers"] == [] and (len(made), len(passes)) == (1, 2)


def test_auto_granularity_config():
    assert CalibrationConfig().granularity == "auto"
    with pytest.raises(SpecError, match=r"holdout_tokens.*granularity is auto.*--granularity layer\|kv_head"):
        CalibrationConfig(holdout_tokens=0, offsets="none", max_ppl_increase=None)
    off = dict(tokens=300, seq_len=128, holdout_tokens=129, offsets="none", max_ppl_increase=None)
    assert CalibrationConfig(**off).num_holdout_sequences == 2  # auto reads the held-out tokens
    assert CalibrationConfig(**off, granularity="layer").num_holdout_sequences == 0
    assert CalibrationConfig(**off, method="identity").num_holdout_sequences == 0


# ---- 6. methods ------------------------------------------------------------------------------------
def test_hadamard_and_identity_methods(models, tok, corpus):
    h = hadamard_ref(D)
    torch.testing.assert_close(h @ h.T, torch.eye(D, dtype=torch.float64))
    for method, expected in (("hadamard", h), ("identity", torch.eye(D, dtype=torch.float64))):
        cfg = CalibrationConfig(tokens=256, seq_len=128, method=method, clip_search=False, offsets="none")
        rs = calibrate(models["llama"], tok, cfg, SPEC, data=corpus)
        assert rs.layer_ids == list(range(N_LAYERS))
        assert rs.provenance.recipe["tokens"] == 0  # data-free: no statistics pass
        for i in rs.layer_ids:
            lr = rs.layers[i]
            torch.testing.assert_close(lr.k.double(), expected, atol=1e-7, rtol=0)
            torch.testing.assert_close(lr.v.double(), expected, atol=1e-7, rtol=0)
            assert torch.equal(lr.k_eigenvalues, torch.ones(D))
            assert torch.equal(lr.v_eigenvalues, torch.ones(D))
    # kv_head granularity: the same matrix for every head
    cfg = CalibrationConfig(
        tokens=256, seq_len=128, method="hadamard", granularity="kv_head", clip_search=False
    )
    rs = calibrate(models["llama"], tok, cfg, SPEC, data=corpus)
    for lr in rs.layers.values():
        assert lr.k.shape == (H_KV, D, D)
        for r in lr.k:
            torch.testing.assert_close(r.double(), h, atol=1e-7, rtol=0)


def test_ktk_vtv_method(models, tok, corpus):
    model = models["qwen3"]
    cfg = CalibrationConfig(tokens=256, seq_len=128, method="ktk_vtv", clip_search=False, granularity="layer")
    rs = calibrate(model, tok, cfg, SPEC, data=corpus)
    cap = capture_all(model, calibration_chunks(tok, corpus, cfg)[0])
    for i in rs.layer_ids:
        k, v = cap[i]["k"].reshape(-1, D), cap[i]["v"].reshape(-1, D)  # all heads flattened
        assert_rotation_matches(rs.layers[i].k, rs.layers[i].k_eigenvalues, sym(k.T @ k / k.shape[0]))
        assert_rotation_matches(rs.layers[i].v, rs.layers[i].v_eigenvalues, sym(v.T @ v / v.shape[0]))


# ---- 7. clip search on constructed data --------------------------------------------------------
def my_fake_quant(x: torch.Tensor, ratio: float, sink: int, recent: int) -> torch.Tensor:
    """Independent §3 + §4.1: clip each middle row to sorted|x|[⌊ratio·d⌋], asymmetric INT2."""
    x = x.double().clone()
    t, d = x.shape[2], x.shape[3]
    lo = min(sink, t)
    hi = max(lo, t - recent)
    mid = x[:, :, lo:hi]
    if ratio > 0:
        c = min(math.floor(ratio * d), d - 1)
        tau = mid.abs().sort(-1).values[..., c : c + 1]
        mid = torch.minimum(torch.maximum(mid, -tau), tau)
    m, big = mid.amin(-1, keepdim=True), mid.amax(-1, keepdim=True)
    s = (big - m).clamp_min(1e-8) / 3
    z = -m / s
    qc = torch.floor(mid / s + z + 0.5).clamp(0, 3)
    x[:, :, lo:hi] = (qc - z) * s
    return x


def my_window_error(q, k, v, k_hat, v_hat, nq):
    """Squared output error of the last ``nq`` queries (identity rotations) and ``Σ‖o‖²``."""
    t = k.shape[2]

    def out(kk, vv):
        return causal_attention_ref(q.double(), kk.double(), vv.double())[:, t - nq :]

    ref = out(k, v)
    return float((out(k_hat, v_hat) - ref).square().sum()), float(ref.square().sum())


def _clip_case(helpful: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    b, t, d = 1, 64, D
    q = torch.randn(b, 2, t, d, generator=gen) * 2
    k = torch.randn(b, 1, t, d, generator=gen)
    v = torch.randn(b, 1, t, d, generator=gen)
    if helpful:
        # huge key outliers in coordinates no query looks at: clipping them only helps
        q[..., [3, 17]] = 0
        sign = torch.where(torch.rand(b, 1, t, 2, generator=gen) < 0.5, -1.0, 1.0)
        k[..., [3, 17]] = 40 * sign
    else:
        # the queries only look at coordinate 5, where each key's largest entry carries the score
        q.zero_()
        q[..., 5] = 3.0
        k = k * 0.1
        k[..., 5] = torch.randn(b, 1, t, generator=gen).abs() * 4 + 1
    return q, k, v


@pytest.mark.parametrize("helpful", [True, False])
def test_clip_search_picks_the_brute_force_minimiser(helpful):
    spec = QuantSpec(sink_tokens=4, recent_tokens=8, k_clip=0.0, v_clip=0.0, meta_dtype="fp32")
    eye = torch.eye(D)
    rot = LayerRotation(eye, eye.clone(), torch.ones(D), torch.ones(D))
    nq = 16
    cs = ClipSearch({5: rot}, spec, D, CLIP_GRID_K, CLIP_GRID_V, n_queries=nq)
    assert cs.k_grid == tuple(sorted(set(CLIP_GRID_K))) and 0.0 in cs.v_grid
    cases = [_clip_case(helpful, seed) for seed in (10, 11)]
    for q, k, v in cases:
        cs.update(5, q, k, v)
    res = cs.result()[5]

    # brute force with WindowedError (the same evaluator, one grid value at a time)
    kf, vf = RowFormat.from_spec(spec, D, "k"), RowFormat.from_spec(spec, D, "v")
    we_err = torch.zeros(len(cs.k_grid), dtype=torch.float64)
    ref_total = 0.0
    for q, k, v in cases:
        we = WindowedError(q, k, v, rot, spec.sink_tokens, spec.recent_tokens, nq)
        v_def = we.quantized_v(vf)
        for j, c in enumerate(cs.k_grid):
            we_err[j] += we.error(we.quantized_k(replace(kf, clip=c)), v_def)
        ref_total += we.ref_sq
    assert res["k_clip"] == cs.k_grid[int(we_err.argmin())]
    assert res["k_err_best"] == pytest.approx(float(we_err.min()) / ref_total, rel=1e-9)

    # independent fake quantization and attention (float64): same minimiser, same errors
    mine = torch.zeros(len(cs.k_grid), dtype=torch.float64)
    my_ref = 0.0
    mine_v = torch.zeros(len(cs.v_grid), dtype=torch.float64)
    for q, k, v in cases:
        v_hat0 = my_fake_quant(v, 0.0, spec.sink_tokens, spec.recent_tokens)
        k_hat0 = my_fake_quant(k, 0.0, spec.sink_tokens, spec.recent_tokens)
        for j, c in enumerate(cs.k_grid):
            k_hat = my_fake_quant(k, c, spec.sink_tokens, spec.recent_tokens)
            e, r = my_window_error(q, k, v, k_hat, v_hat0, nq)
            mine[j] += e
        for j, c in enumerate(cs.v_grid):
            v_hat = my_fake_quant(v, c, spec.sink_tokens, spec.recent_tokens)
            mine_v[j] += my_window_error(q, k, v, k_hat0, v_hat, nq)[0]
        my_ref += r
    chosen = cs.k_grid.index(res["k_clip"])
    assert float(mine[chosen]) <= float(mine.min()) * (1 + 1e-3)
    assert res["k_err_best"] == pytest.approx(float(mine.min()) / my_ref, rel=1e-3)
    assert res["k_err_global"] == pytest.approx(float(mine[0]) / my_ref, rel=1e-3)
    assert float(mine_v[cs.v_grid.index(res["v_clip"])]) <= float(mine_v.min()) * (1 + 1e-3)
    assert res["v_err_best"] == pytest.approx(float(mine_v.min()) / my_ref, rel=1e-3)

    assert res["k_err_best"] <= res["k_err_global"]
    assert res["v_err_best"] <= res["v_err_global"]
    if helpful:
        # clipping the two outliers (ratio ≤ 0.92 at d = 32) is far better than no clipping
        assert 0 < res["k_clip"] <= 0.92
        assert res["k_err_best"] < 0.2 * res["k_err_global"]
    else:
        # every ratio that clamps anything hurts; at d = 32, 0.98 clamps nothing (⌊0.98·32⌋ = 31)
        assert res["k_clip"] in (0.0, 0.98)
        assert res["k_err_best"] == pytest.approx(res["k_err_global"], rel=1e-12)
        assert mine[cs.k_grid.index(0.9)] > 2 * mine[0]


# ---- 8. determinism --------------------------------------------------------------------------------
# ---- 7b. rotation selection (fitted vs Hadamard) on constructed data ----------------------------
SEL_SPEC = QuantSpec(sink_tokens=4, recent_tokens=8)


def _outlier_rows(gen: torch.Generator, t: int, in_hadamard_basis: bool) -> torch.Tensor:
    """``[t, D]`` rows with one ±30 outlier channel over noise: in the original basis (identity
    quantizes them badly, Hadamard spreads the outlier) or in the Hadamard basis (the reverse)."""
    x = torch.randn(t, D, generator=gen) * 0.5
    x[:, 7] = 30 * torch.where(torch.rand(t, generator=gen) < 0.5, -1.0, 1.0)
    return (x.double() @ hadamard_ref(D)).float() if in_hadamard_basis else x


def _select_case(seed: int, k_had_better: list[bool], v_had_better: list[bool]):
    """q ``[1, H_q, T, D]``, k, v ``[1, H_KV, T, D]``; per KV head, which candidate should win."""
    gen = torch.Generator().manual_seed(seed)
    t = 48
    q = torch.randn(1, H_Q, t, D, generator=gen) * 0.3
    k = torch.stack([_outlier_rows(gen, t, not hb) for hb in k_had_better])[None]
    v = torch.stack([_outlier_rows(gen, t, not hb) for hb in v_had_better])[None]
    return q, k, v


def _brute_head_errors(cases, spec: QuantSpec, nq: int) -> torch.Tensor:
    """Independent float64 errors ``[2 (K cand), 2 (V cand), H_KV]`` with fitted = identity."""
    h = hadamard_ref(D)
    out = torch.zeros(2, 2, H_KV, dtype=torch.float64)

    def roundtrip(x, r, ratio):
        return my_fake_quant(x.double() @ r, ratio, spec.sink_tokens, spec.recent_tokens) @ r.T

    eye = torch.eye(D, dtype=torch.float64)
    for q, k, v in cases:
        for head in range(H_KV):
            qh, kh, vh = q[:, head * G : (head + 1) * G], k[:, head : head + 1], v[:, head : head + 1]
            for i, rk in enumerate((eye, h)):
                for j, rv in enumerate((eye, h)):
                    k_hat, v_hat = roundtrip(kh, rk, spec.k_clip), roundtrip(vh, rv, spec.v_clip)
                    out[i, j, head] += my_window_error(qh, kh, vh, k_hat, v_hat, nq)[0]
    return out


def _identity_rotations(heads: int | None) -> LayerRotation:
    eye, lam = torch.eye(D), torch.arange(1.0, D + 1)
    if heads:
        eye, lam = eye.expand(heads, D, D).clone(), lam.expand(heads, D).clone()
    return LayerRotation(eye, eye.clone(), lam, lam.clone())


def test_rotation_select_per_kv_head_picks_the_clearly_better_candidate():
    # head 0: K favours Hadamard, V favours the fitted (identity) rotation; head 1: the reverse
    cases = [_select_case(s, [True, False], [False, True]) for s in (20, 21)]
    nq = 24
    sel = RotationSelect({3: _identity_rotations(H_KV)}, SEL_SPEC, D, "kv_head", n_queries=nq)
    for q, k, v in cases:
        sel.update(3, q, k, v)
    ck, cv = sel.choices()[3]
    assert ck.tolist() == [1, 0] and cv.tolist() == [0, 1]

    brute = _brute_head_errors(cases, SEL_SPEC, nq)
    torch.testing.assert_close(sel.err[3], brute, rtol=1e-2, atol=0)  # fp32 vs fp64 codes
    for head in range(H_KV):
        best = int(brute[..., head].reshape(-1).argmin())
        assert (int(ck[head]), int(cv[head])) == (best // 2, best % 2)
        # the case is clear-cut: the chosen pair beats both uniform choices by a wide margin
        chosen = brute[ck[head], cv[head], head]
        assert chosen * 3 < min(brute[0, 0, head], brute[1, 1, head])

    rots, record = sel.apply()
    lr, h = rots[3], hadamard_ref(D).float()
    torch.testing.assert_close(lr.k[0], h)
    torch.testing.assert_close(lr.v[1], h)
    assert torch.equal(lr.k[1], torch.eye(D)) and torch.equal(lr.v[0], torch.eye(D))
    assert torch.equal(lr.k_eigenvalues[0], torch.ones(D))  # Hadamard parts: eigenvalues 1
    assert torch.equal(lr.k_eigenvalues[1], torch.arange(1.0, D + 1))
    r = record["3"]
    assert r["k"] == ["hadamard", "fitted"] and r["v"] == ["fitted", "hadamard"]
    ref = sum(my_window_error(q, k, v, k, v, nq)[1] for q, k, v in cases)
    chosen_total = float(brute[ck, cv, torch.arange(H_KV)].sum())
    assert r["err_chosen"] == pytest.approx(chosen_total / ref, rel=1e-2)
    assert r["err_chosen"] * 3 < min(r["err_fitted"], r["err_hadamard"])
    json.dumps(record)  # provenance must stay JSON-serialisable


@pytest.mark.parametrize("k_had", [True, False])
def test_rotation_select_per_layer_picks_the_clearly_better_candidate(k_had):
    cases = [_select_case(s, [k_had] * H_KV, [not k_had] * H_KV) for s in (30, 31)]
    sel = RotationSelect({0: _identity_rotations(None)}, SEL_SPEC, D, "layer", n_queries=24)
    for q, k, v in cases:
        sel.update(0, q, k, v)
    ck, cv = sel.choices()[0]
    assert ck.tolist() == [int(k_had)] * H_KV and cv.tolist() == [int(not k_had)] * H_KV
    brute = _brute_head_errors(cases, SEL_SPEC, 24).sum(-1)
    assert int(brute.reshape(-1).argmin()) == 2 * int(k_had) + int(not k_had)
    rots, record = sel.apply()
    names = ("fitted", "hadamard")
    assert (record["0"]["k"], record["0"]["v"]) == (names[k_had], names[not k_had])
    h = hadamard_ref(D).float()
    torch.testing.assert_close(rots[0].k, h if k_had else torch.eye(D))
    torch.testing.assert_close(rots[0].v, torch.eye(D) if k_had else h)


def test_rotation_select_tie_keeps_the_fitted_rotation():
    h = hadamard_ref(D).float()
    fitted = LayerRotation(h.clone(), h.clone(), torch.arange(1.0, D + 1), torch.arange(1.0, D + 1))
    sel = RotationSelect({0: fitted}, SEL_SPEC, D, "layer", n_queries=24)
    sel.update(0, *_select_case(40, [True, False], [False, True]))
    rots, record = sel.apply()
    assert (record["0"]["k"], record["0"]["v"]) == ("fitted", "fitted")
    assert torch.equal(rots[0].k_eigenvalues, fitted.k_eigenvalues)


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
def test_rotation_select_through_calibrate(models, tok, corpus, granularity, tmp_path):
    model = models["qwen3"]
    base = dict(tokens=256, seq_len=128, holdout_tokens=128, granularity=granularity)
    plain = calibrate(model, tok, CalibrationConfig(**base), SPEC, data=corpus)
    cfg = CalibrationConfig(**base, rotation_select=True)
    rs = calibrate(model, tok, cfg, SPEC, data=corpus)
    assert plain.provenance.recipe["rotation_select"] == "off"
    record = rs.provenance.recipe["rotation_select"]
    assert sorted(record) == [str(i) for i in rs.layer_ids]
    h = hadamard_ref(D).float()
    for i in rs.layer_ids:
        r, lr, lp = record[str(i)], rs.layers[i], plain.layers[i]
        assert lr.k_clip is None and lr.v_clip is None  # no clip search: global clips
        for kind in ("k", "v"):
            names = [r[kind]] if granularity == "layer" else r[kind]
            got, fit = getattr(lr, kind), getattr(lp, kind)
            for hd, name in enumerate(names):
                g = got if granularity == "layer" else got[hd]
                f = fit if granularity == "layer" else fit[hd]
                torch.testing.assert_close(g, h if name == "hadamard" else f, rtol=0, atol=1e-7)
        assert r["err_chosen"] <= min(r["err_fitted"], r["err_hadamard"]) * (1 + 1e-9)
    # the recorded errors are the evaluator's errors on the held-out sequence
    hold = calibration_chunks(tok, corpus, cfg)[1]
    had = calibrate(model, tok, CalibrationConfig(**base, method="hadamard"), SPEC, data=corpus)
    errs = attention_errors(model, torch.stack(hold), {"plain": plain, "sel": rs, "had": had})
    for i in rs.layer_ids:
        r = record[str(i)]
        assert errs["plain"][i] == pytest.approx(r["err_fitted"], rel=1e-4)
        assert errs["had"][i] == pytest.approx(r["err_hadamard"], rel=1e-4)
        assert errs["sel"][i] == pytest.approx(r["err_chosen"], rel=1e-4)
    save_rotations(rs, tmp_path / "sel")  # the record survives the artifact round trip
    back = load_rotations(tmp_path / "sel", model_config=model.config)
    assert back.provenance.recipe["rotation_select"] == record


def test_calibrate_is_deterministic_and_seeded(models, tok, corpus, oscar_run):
    cfg, first = oscar_run
    again = calibrate(models["qwen3"], tok, cfg, SPEC, data=corpus)
    for i in first.layer_ids:
        a, b = first.layers[i], again.layers[i]
        for attr in ("k", "v", "k_eigenvalues", "v_eigenvalues"):
            assert torch.equal(getattr(a, attr), getattr(b, attr)), (i, attr)
        assert (a.k_clip, a.v_clip) == (b.k_clip, b.v_clip)
    assert again.provenance.recipe["clip_search"] == first.provenance.recipe["clip_search"]
    other = calibrate(models["qwen3"], tok, replace(cfg, seed=1, clip_search=False), SPEC, data=corpus)
    assert token_sequences(tok, corpus, 1, 64, 0).tolist() != token_sequences(tok, corpus, 1, 64, 1).tolist()
    for i in first.layer_ids:
        assert not torch.equal(first.layers[i].k, other.layers[i].k)
        assert not torch.equal(first.layers[i].v_eigenvalues, other.layers[i].v_eigenvalues)


# ---- 9. errors -------------------------------------------------------------------------------------
class NotAttentionInterfaceModel(torch.nn.Module):
    _supports_attention_backend = False

    def __init__(self):
        super().__init__()
        self.config = transformers.LlamaConfig(**_config_kwargs())
        self.lin = torch.nn.Linear(4, 4)


def test_unsupported_models_are_named(tok, corpus):
    cfg = CalibrationConfig(tokens=128, seq_len=128, clip_search=False)
    with pytest.raises(UnsupportedModelError, match="NotAttentionInterfaceModel"):
        calibrate(NotAttentionInterfaceModel(), tok, cfg, SPEC, data=corpus)
    with (
        pytest.raises(UnsupportedModelError, match="NotAttentionInterfaceModel"),
        capture_attention(NotAttentionInterfaceModel(), lambda *a: None),
    ):
        pass

    # a transformers model whose attention does not call ALL_ATTENTION_FUNCTIONS
    torch.manual_seed(0)
    neo_cfg = transformers.GPTNeoConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global"], 2]],
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    neo = transformers.GPTNeoForCausalLM(neo_cfg).eval()
    with pytest.raises(UnsupportedModelError, match="GPTNeoForCausalLM"):
        calibrate(neo, tok, cfg, SPEC, data=corpus)
    assert neo.config._attn_implementation == "eager"

    # a model that claims support, but one layer's attention bypasses the interface
    llama = make_llama()

    def bypass(hidden_states, **kwargs):
        return torch.zeros_like(hidden_states), None

    llama.model.layers[1].self_attn.forward = bypass
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM.*\[1\]"):
        calibrate(llama, tok, cfg, SPEC, data=corpus)
    assert llama.config._attn_implementation == "sdpa"


def test_hybrid_model_full_attention_layers_are_calibrated(tok, corpus):
    """Qwen3.5 (linear + full attention) routes its full-attention layers through
    ALL_ATTENTION_FUNCTIONS, but its class does not set ``_supports_attention_backend``.
    ``attention_layer_ids`` already selects its sparse full-attention ids, so calibration must
    work (spec §2.9: RotationZoo ships Qwen3.5 rotations keyed by those ids)."""
    cls = getattr(transformers, "Qwen3_5ForCausalLM", None)
    if cls is None:
        pytest.skip("this transformers has no Qwen3.5")
    cfg = transformers.Qwen3_5TextConfig(
        **_config_kwargs(num_hidden_layers=4),
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    cfg = CalibrationConfig(tokens=128, seq_len=128, clip_search=False, granularity="layer")
    rs = calibrate(model, tok, cfg, SPEC, data=corpus)
    assert rs.layer_ids == [3]
    assert rs.layers[3].k.shape == (D, D)
    assert rs.orthogonality_errors()[3] < 1e-5


def test_corpus_too_small_names_both_counts(models, tok, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("x" * 50)  # 50 characters + one EOS = 51 tokens
    cfg = CalibrationConfig(
        tokens=256, seq_len=128, clip_search=False, offsets="none", max_ppl_increase=None, granularity="layer"
    )
    with pytest.raises(CorpusError, match="has 51 tokens, fewer than the 256 asked") as e:
        calibrate(models["llama"], tok, cfg, SPEC, data=[small])
    msg = str(e.value)
    assert "51" in msg and "256" in msg and "small.txt" in msg
    with pytest.raises(CorpusError, match="no such file"):
        token_sequences(tok, [tmp_path / "missing.txt"], 1, 8)
    empty = tmp_path / "empty_dir"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "blob.bin").write_bytes(b"\x00\x01")
    with pytest.raises(CorpusError, match="no text files"):
        token_sequences(tok, [empty], 1, 8)


def test_head_dim_mismatch_on_load(oscar_run, models, tmp_path):
    _, rs = oscar_run
    save_rotations(rs, tmp_path)
    assert load_rotations(tmp_path, model_config=models["qwen3"].config).head_dim == D
    other = transformers.Qwen3Config(**_config_kwargs(head_dim=16))
    with pytest.raises(RotationFileError, match="head_dim") as e:
        load_rotations(tmp_path, model_config=other)
    assert "16" in str(e.value) and "32" in str(e.value)


def test_bad_jsonl_line_is_named(tok, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps({"prompt": "no text"}) + "\n")
    with pytest.raises(CorpusError, match=r"bad\.jsonl:3"):
        token_sequences(tok, [f], 1, 100)
    f.write_text("{not json\n")
    with pytest.raises(CorpusError, match=r"bad\.jsonl:1.*invalid JSON"):
        token_sequences(tok, [f], 1, 100)
    f.write_text(json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(CorpusError, match=r"bad\.jsonl:1.*messages"):
        token_sequences(tok, [f], 1, 100)


@pytest.mark.parametrize(
    ("field", "value"),
    [("granularity", "foo"), ("method", "pca"), ("v_target", "sst"), ("tokens", 0), ("seq_len", -1)],
)
def test_calibration_config_errors_name_the_field(field, value):
    with pytest.raises(SpecError, match=rf"CalibrationConfig\.{field}.*{value!r}"):
        CalibrationConfig(**{field: value})


def test_clip_search_needs_holdout():
    with pytest.raises(SpecError, match="holdout_tokens"):
        CalibrationConfig(holdout_tokens=0, clip_search=True)
    # the search is off by default (and no held-out sequence is read without the quality target)
    off = dict(offsets="none", max_ppl_increase=None, granularity="layer")
    assert CalibrationConfig(holdout_tokens=0, **off).num_holdout_sequences == 0
    cfg = CalibrationConfig(tokens=300, seq_len=128, holdout_tokens=129, clip_search=True)
    assert (cfg.num_sequences, cfg.num_holdout_sequences) == (3, 2)


def test_rotation_select_needs_holdout_and_is_off_by_default():
    assert CalibrationConfig().rotation_select is False
    with pytest.raises(SpecError, match=r"holdout_tokens.*rotation_select"):
        CalibrationConfig(
            holdout_tokens=0, rotation_select=True, offsets="none", max_ppl_increase=None, granularity="layer"
        )
    cfg = CalibrationConfig(tokens=300, seq_len=128, holdout_tokens=129, rotation_select=True)
    assert cfg.num_holdout_sequences == 2


# ---- 10. data ---------------------------------------------------------------------------------------
def test_jsonl_text_and_messages(tmp_path):
    f = tmp_path / "chat.jsonl"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    f.write_text(json.dumps({"text": "plain doc"}) + "\n" + json.dumps({"messages": msgs}) + "\n")
    tok = CharTokenizer()
    docs = list(iter_documents([f], tok))
    assert docs == ["plain doc", "system: be brief\nuser: hi"]
    expected = [ord(c) for c in docs[0]] + [0] + [ord(c) for c in docs[1]] + [0]
    seq = token_sequences(tok, [f], 1, len(expected))
    assert seq.tolist() == [expected]
    # with a chat template, the tokenizer renders the messages
    assert list(iter_documents([f], ChatTokenizer()))[1] == "<system>be brief</system><user>hi</user>"


def test_folders_are_searched_recursively(tmp_path):
    root = tmp_path / "data"
    (root / "a" / "b").mkdir(parents=True)
    (root / "top.md").write_text("top")
    (root / "a" / "b" / "deep.py").write_text("deep")
    (root / "a" / "notes.jsonl").write_text(json.dumps({"text": "jsonl"}) + "\n")
    (root / "a" / "skip.bin").write_text("binary")
    (root / "a" / "blank.txt").write_text("   \n")
    docs = list(iter_documents([root], CharTokenizer(), seed=0))
    assert sorted(docs) == ["deep", "jsonl", "top"]
    # the order is a seeded shuffle of the files: reproducible for a seed
    assert list(iter_documents([root], CharTokenizer(), seed=5)) == list(
        iter_documents([root], CharTokenizer(), seed=5)
    )
    orders = {tuple(iter_documents([root], CharTokenizer(), seed=s)) for s in range(8)}
    assert len(orders) > 1


def test_default_corpus(tok):
    ids = token_sequences(tok, None, 2, 64)
    assert ids.dtype == torch.long and ids.shape == (2, 64)
    assert torch.equal(ids, token_sequences(tok, None, 2, 64))
    assert int(ids.min()) >= 0 and int(ids.max()) < 128


# ---- 11. CLI ------------------------------------------------------------------------------------------
def _word_tokenizer(lines: list[str]) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", eos_token="[EOS]")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny Qwen3 and a word-level fast tokenizer saved with save_pretrained, plus a data file."""
    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(1)
    lines = [_random_text(rng, 40) for _ in range(60)]
    data = root / "data.txt"
    data.write_text("\n".join(lines))
    tokenizer = _word_tokenizer(lines)
    assert len(tokenizer) <= 128
    model = make_qwen3()
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return model, tokenizer, root / "model", data


def test_cli_calibrate_end_to_end(saved_model, tmp_path, capsys):
    model, tokenizer, model_dir, data = saved_model
    out = tmp_path / "out"
    from oscarkv.cli import main

    rc = main([
        "calibrate", "--model", str(model_dir), "--out", str(out), "--tokens", "256", "--seq-len", "128",
        "--holdout-tokens", "128", "--clip-search", "--sink-tokens", "4", "--recent-tokens", "16",
        "--data", str(data), "--device", "cpu", "--quiet", "--export-oscar", "--granularity", "layer",
    ])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "RotationZoo" in printed
    assert (out / "rotations.safetensors").is_file()
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    rs = load_rotations(out, model_config=cfg)
    assert rs.layer_ids == list(range(N_LAYERS)) and rs.head_dim == D
    assert rs.spec.sink_tokens == 4 and rs.spec.recent_tokens == 16
    assert rs.provenance.recipe["tokens"] == 256 and rs.provenance.recipe["holdout_tokens"] == 128
    assert all(rs.layers[i].k_clip is not None for i in rs.layer_ids)

    pts = sorted(p.name for p in out.glob("*.pt"))
    assert pts == ["k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt"]
    only_oscar = tmp_path / "oscar"
    only_oscar.mkdir()
    for name in pts:
        shutil.copy(out / name, only_oscar / name)
    zoo = load_rotations(only_oscar, model_config=cfg)
    assert zoo.provenance.source == "oscar-rotationzoo"
    for i in rs.layer_ids:
        assert torch.equal(zoo.layers[i].k, rs.layers[i].k)
        assert torch.equal(zoo.layers[i].v, rs.layers[i].v)
        assert torch.equal(zoo.layers[i].k_eigenvalues, rs.layers[i].k_eigenvalues)

    # the same statistics as the Python API on the same model/tokenizer/data
    api = calibrate(
        model,
        tokenizer,
        CalibrationConfig(tokens=256, seq_len=128, holdout_tokens=128, granularity="layer"),
        QuantSpec(sink_tokens=4, recent_tokens=16),
        data=[data],
    )
    for i in rs.layer_ids:
        torch.testing.assert_close(api.layers[i].k, rs.layers[i].k, atol=1e-6, rtol=0)


CLI_SMALL = ["--device", "cpu", "--quiet", "--tokens", "256", "--seq-len", "128", "--sink-tokens", "4",
             "--recent-tokens", "16"]  # fmt: skip


def test_cli_corpus_error_is_exit_code_2(saved_model, tmp_path, capsys):
    from oscarkv.cli import main

    _, _, model_dir, _ = saved_model
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("the of")
    argv = ["calibrate", "--model", str(model_dir), "--out", str(tmp_path / "o"), "--data", str(tiny)]
    flags = ["--no-clip-search", "--offsets", "none", "--max-ppl-increase", "none", "--granularity", "layer"]
    assert main([*argv, *CLI_SMALL, *flags]) == 2
    assert "fewer than the 256 asked" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_kv_head_with_export_oscar_is_a_clean_error(saved_model, tmp_path, capsys):
    """OSCAR files hold one matrix per layer, so ``--granularity kv_head --export-oscar`` is a
    user error: it should end with exit code 2 and a message, like the other user errors."""
    from oscarkv.cli import main

    _, _, model_dir, data = saved_model
    argv = ["calibrate", "--model", str(model_dir), "--out", str(tmp_path / "o"), "--data", str(data)]
    rc = main([*argv, *CLI_SMALL, "--no-clip-search", "--granularity", "kv_head", "--export-oscar"])
    assert rc == 2
    assert "kv_head" in capsys.readouterr().err


def test_cli_auto_granularity_with_export_oscar_is_refused_up_front(saved_model, tmp_path, capsys):
    """The default granularity, auto, may keep per-KV-head rotations, which OSCAR's files cannot
    hold: ``--export-oscar`` without ``--granularity layer`` is refused before any work (exit 2,
    nothing written). Data-free methods take per-layer matrices under auto and export."""
    from oscarkv.cli import main

    _, _, model_dir, data = saved_model
    out = tmp_path / "o"
    argv = ["calibrate", "--model", str(model_dir), "--out", str(out), "--data", str(data), *CLI_SMALL]
    assert main([*argv, "--export-oscar"]) == 2
    err = capsys.readouterr().err
    assert "--export-oscar needs --granularity layer (got auto" in err and "hint" in err
    assert not out.exists()
    data_free = ["--method", "hadamard", "--offsets", "none", "--max-ppl-increase", "none"]
    assert main([*argv, "--export-oscar", *data_free]) == 0
    assert len(list(out.glob("*.pt"))) == 2
    rs = load_rotations(out / "rotations.safetensors")
    assert rs.granularity == "layer" and rs.provenance.recipe["granularity_choice"]["chosen"] == "layer"


def test_cli_calibrate_default_auto_prints_the_choice_and_info_shows_it(
    saved_model, tmp_path, capsys, monkeypatch
):
    from oscarkv.cli import main

    monkeypatch.setenv("COLUMNS", "300")  # rich wraps table cells at the terminal width
    _, _, model_dir, data = saved_model
    out = tmp_path / "o"
    argv = ["calibrate", "--model", str(model_dir), "--out", str(out), "--data", str(data), *CLI_SMALL]
    assert main([*argv, "--holdout-tokens", "128", "--offsets", "none", "--max-ppl-increase", "none"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    rs = load_rotations(out)
    ch = rs.provenance.recipe["granularity_choice"]
    assert ch["chosen"] == rs.granularity == rs.provenance.recipe["granularity"]
    nlls = f"held-out NLL {ch['nll_layer']:.4f} per layer, {ch['nll_kv_head']:.4f} per KV head"
    assert f"granularity: auto chose {rs.granularity}: {nlls}" in printed
    assert f"rotations ({rs.granularity}, V target oscar)" in printed
    assert main(["info", str(out)]) == 0
    info = " ".join(capsys.readouterr().out.split())
    assert f"granularity choice │ auto chose {rs.granularity}: {nlls}" in info
    assert f"margin {GRANULARITY_MARGIN}" in info


def test_top_level_calibrate_is_the_same_function(models, tok, corpus):
    cfg = CalibrationConfig(tokens=128, seq_len=128, method="identity", clip_search=False)
    rs = oscarkv.calibrate(models["llama"], tok, cfg, SPEC, data=corpus)
    assert isinstance(rs, oscarkv.RotationSet) and rs.layer_ids == [0, 1]


# ---- clip search by held-out loss --------------------------------------------------------------
def test_coordinate_search_finds_the_constructed_minimum():
    from oscarkv.calibration.loss_search import coordinate_search

    target = (0.9, 0.86)
    calls: list[tuple[float, ...]] = []

    def bowl(x):
        calls.append(x)
        return (x[0] - target[0]) ** 2 + 2 * (x[1] - target[1]) ** 2

    best, f = coordinate_search(bowl, (SPEC.k_clip, SPEC.v_clip), (CLIP_GRID_K, CLIP_GRID_V))
    assert best == target and f == 0.0
    # a tie never moves away from the start
    assert coordinate_search(lambda x: 1.0, (0.96, 0.92), (CLIP_GRID_K, CLIP_GRID_V))[0] == (0.96, 0.92)


def _plain_nll(model, seq: torch.Tensor, n: int) -> float:
    """Mean next-token NLL of the last ``n - 1`` targets of ``seq [1, T]`` (exact model)."""
    with torch.no_grad():
        lp = model(input_ids=seq).logits[0, -n:-1].log_softmax(-1)
    return float(-lp.gather(-1, seq[0, -n + 1 :, None]).mean())


@pytest.mark.parametrize("objective", ["nll", "kl"])
def test_loss_clip_search_picks_the_held_out_loss_minimiser(models, objective):
    from oscarkv.calibration.fit import fixed_layer
    from oscarkv.calibration.loss_search import LossClipSearch

    model, gen = models["qwen3"], torch.Generator().manual_seed(3)
    spec = QuantSpec(sink_tokens=4, recent_tokens=8, group_size=D)
    rots = {i: fixed_layer("identity", D, H_KV, "layer") for i in range(N_LAYERS)}
    k_grid = (0.0, 0.5, 0.7, 0.9)
    ls = LossClipSearch(model, rots, spec, D, k_grid, (spec.v_clip,), objective, n_score=40)
    seqs = [torch.randint(0, 128, (1, 96), generator=gen) for _ in range(2)]
    for s in seqs:
        ls.add(s)
    # exact attention: the model's own loss (independently computed), or zero KL
    exact = sum(_plain_nll(model, s, 40) for s in seqs) / 2 if objective == "nll" else 0.0
    assert ls.loss(None) == pytest.approx(exact, abs=1e-5)
    # brute force over the K grid (V fixed: the V grid has one point) and the windows matter
    brute = {k: ls.loss(dict.fromkeys(range(N_LAYERS), (k, spec.v_clip))) for k in ls.k_grid}
    assert len(set(brute.values())) > 1
    clips, report = ls.search()
    assert set(clips.values()) == {(min(brute, key=brute.get), spec.v_clip)}
    assert report["global"] == pytest.approx(min(brute.values()))
    assert report["spec"] == pytest.approx(brute[spec.k_clip]) and report["objective"] == objective
    # per layer: each move lowers (or keeps) the loss of the global choice
    clips2, report2 = ls.search(per_layer=True)
    assert report2["per_layer"] <= report["global"] + 1e-12
    assert report2["per_layer"] == pytest.approx(ls.loss(clips2))


def test_calibrate_with_loss_clip_objective_records_the_choice(models, tok, corpus):
    spec = QuantSpec(sink_tokens=4, recent_tokens=16, group_size=D)
    cfg = CalibrationConfig(
        tokens=256, seq_len=128, holdout_tokens=128, clip_search=True, clip_objective="nll", seed=0
    )
    rs = calibrate(models["llama"], tok, cfg, spec, data=corpus)
    rep = rs.provenance.recipe["clip_loss"]
    assert rep["objective"] == "nll" and rep["global"] <= rep["spec"]
    assert {rs.clips(i) for i in rs.layer_ids} == {tuple(rep["global_choice"])}
    assert all(r["k_clip"] == rep["global_choice"][0] for r in summary_rows(rs))
    with pytest.raises(
        SpecError, match=r"CalibrationConfig\.clip_objective must be attn \| nll \| kl; got 'ppl'"
    ):
        CalibrationConfig(clip_objective="ppl")
