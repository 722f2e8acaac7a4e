"""The engine's own decoder and loader against transformers (CPU, fp32).

Ragged sequences run as one token-flat batch; the test attention function gives each sequence its
own causal attention from its ``cu_seqlens`` range, so the logits must equal HF's per sequence.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import oscarkv
from conftest import random_orthogonal, tiny_lm_config
from oscarkv.engine.models import AttentionFn, ModelShape, check_config, load_decoder, model_shape
from oscarkv.engine.models.layers import RotaryEmbedding, apply_rotary
from oscarkv.errors import ModelError
from oscarkv.rotation import absorb_output_weight, absorb_value_weight, rotate_heads

DEMO = Path(oscarkv.__file__).parent / "assets" / "demo-model"
VOCAB = 101
LENS = (5, 1, 9, 3)
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- helpers ------------------------------------------------------------------------------------
def dense_attention(lens: tuple[int, ...], r_v: dict[int, torch.Tensor] | None = None) -> AttentionFn:
    """Exact causal attention per sequence (``cu_seqlens``), GQA by repeating KV heads; with ``r_v``
    the output is rotated back by ``R_Vᵀ`` (values arrive as ``v·R_V`` from an absorbed v_proj)."""
    cu = [0, *itertools.accumulate(lens)]

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        for s, e in itertools.pairwise(cu):
            qs = q[s:e].transpose(0, 1)  # [Hq, n, d]
            ks, vs = (x[s:e].repeat_interleave(rep, dim=1).transpose(0, 1) for x in (k, v))
            w = (qs @ ks.transpose(1, 2)) * scale  # as HF eager: scores in the model dtype
            w = w.masked_fill(
                torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
            out[s:e] = (w.softmax(-1, dtype=torch.float32).to(q.dtype) @ vs).transpose(0, 1)
        if r_v is not None and layer in r_v:
            out = rotate_heads(out.unsqueeze(2), r_v[layer], inverse=True).squeeze(2)
        return out

    return attn


def flat_batch(vocab: int, lens: tuple[int, ...] = LENS, seed: int = 0):
    """``(per-sequence ids, flat ids [T], flat positions [T])``, each sequence from position 0."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
    return seqs, torch.cat(seqs), torch.cat([torch.arange(n) for n in lens])


@torch.no_grad()
def hf_logits(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([model(s[None]).logits[0].float() for s in seqs])


def configs() -> dict:
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    llama = tiny_lm_config("llama", vocab=VOCAB, layers=2, heads=4, kv_heads=2, head_dim=16, bias=True)
    llama.mlp_bias = True
    return {
        "llama": llama,  # q/k/v/o and MLP biases, untied
        "mistral": MistralConfig(**small, num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
        "qwen2": Qwen2Config(**small, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
        "qwen3": tiny_lm_config("qwen3", vocab=VOCAB, layers=2, heads=4, kv_heads=2, head_dim=32),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Tiny random HF models (random norms and biases too) saved with ``save_pretrained``."""
    out = {}
    for kind, cfg in configs().items():
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.5)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


# ---- rotary ------------------------------------------------------------------------------------
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("rope", ROPES)
def test_rotary_matches_hf(rope: str) -> None:
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256,
                      rope_parameters=dict(ROPES[rope]))  # fmt: skip
    hf = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(cfg, 32, 256, dtype=torch.float32, device="cpu")
    pos = torch.tensor([0, 1, 7, 63, 64, 65, 200, 255])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos[None])
    c, s = ours(pos)
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling)
    assert (ours.attention_scaling != 1.0) == (rope == "yarn")
    torch.testing.assert_close(torch.cat((c, c), -1), cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat((s, s), -1), sin[0], rtol=0, atol=1e-6)
    q, k = torch.randn(2, len(pos), 3, 32).unbind(0)  # [T, H, d]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(apply_rotary(q, c, s), want_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, c, s), want_k[0].transpose(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rope", ["dynamic", "longrope", "no_such_rope"])
def test_length_dependent_or_unknown_rope_is_refused(rope: str) -> None:
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # fmt: skip
    cfg.rope_parameters = {"rope_type": rope, "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ModelError, match=f"RoPE type '{rope}' is not supported"):
        check_config(cfg)


# ---- logits against transformers -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_ragged_flat_batch_matches_hf(saved, kind: str) -> None:
    path, hf = saved[kind]
    dec, shape = load_decoder(str(path), torch.float32, "cpu")
    seqs, ids, pos = flat_batch(VOCAB)
    with torch.no_grad():
        got = dec(ids, pos, dense_attention(LENS))
    assert got.dtype == torch.float32 and got.shape == (sum(LENS), VOCAB)
    torch.testing.assert_close(got, hf_logits(hf, seqs), rtol=1e-5, atol=ATOL)
    assert shape.model_type == kind and shape.num_layers == 2 and shape.vocab == VOCAB
    assert shape.tie_embeddings == (kind == "qwen2") and (dec.lm_head is None) == shape.tie_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demo_model_matches_hf(dtype: torch.dtype) -> None:
    # eager, as the test attention: HF's own sdpa and eager paths differ by 3e-5 on these logits (|x| ~ 20)
    hf = AutoModelForCausalLM.from_pretrained(DEMO, dtype=dtype, attn_implementation="eager").eval()
    dec, shape = load_decoder(str(DEMO), dtype, "cpu")
    assert shape == ModelShape("qwen3", 4, 2, 1, 128, 256, 2048, 2048, 1e-6, True, (0,), rotary_dim=128)
    assert dec.embed_tokens.weight.dtype == dtype and dec.rotary.cos_sin.dtype == dtype
    seqs, ids, pos = flat_batch(shape.vocab, (17, 1, 40))
    with torch.no_grad():
        got = dec(ids, pos, dense_attention((17, 1, 40)))
    assert got.dtype == torch.float32
    if dtype == torch.float32:
        torch.testing.assert_close(got, hf_logits(hf, seqs), rtol=1e-5, atol=ATOL)
    else:  # same ops in the same order: equal here; two bf16 steps of slack for other BLAS blockings
        torch.testing.assert_close(got, hf_logits(hf, seqs), rtol=2**-6, atol=2**-5)


def test_last_idx_selects_rows(saved) -> None:
    dec, _ = load_decoder(str(saved["qwen3"][0]), torch.float32, "cpu")
    _, ids, pos = flat_batch(VOCAB)
    last = torch.tensor(list(itertools.accumulate(LENS))) - 1
    with torch.no_grad():
        full = dec(ids, pos, dense_attention(LENS))
        got = dec(ids, pos, dense_attention(LENS), last_idx=last)
    assert got.shape == (len(LENS), VOCAB)
    torch.testing.assert_close(got, full[last], rtol=0, atol=1e-6)


def test_sharded_checkpoint_with_index(saved, tmp_path: Path) -> None:
    _, hf = saved["llama"]
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    save_file({"junk": torch.zeros(1)}, str(tmp_path / "stray.safetensors"))  # not in the index: unread
    dec, _ = load_decoder(str(tmp_path), torch.float32, "cpu")
    seqs, ids, pos = flat_batch(VOCAB)
    with torch.no_grad():
        got = dec(ids, pos, dense_attention(LENS))
    torch.testing.assert_close(got, hf_logits(hf, seqs), rtol=1e-5, atol=ATOL)


def test_tied_checkpoint_may_carry_lm_head(saved, tmp_path: Path) -> None:
    path, hf = saved["qwen2"]  # tied: save_pretrained wrote no lm_head.weight
    shutil.copy(path / "config.json", tmp_path)
    t = tensors(path)
    assert "lm_head.weight" not in t
    t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])  # ignored, as HF ties it
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    dec, _ = load_decoder(str(tmp_path), torch.float32, "cpu")
    seqs, ids, pos = flat_batch(VOCAB)
    with torch.no_grad():
        got = dec(ids, pos, dense_attention(LENS))
    torch.testing.assert_close(got, hf_logits(hf, seqs), rtol=1e-5, atol=ATOL)


# ---- R_V absorption ---------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "per_head"), [("llama", False), ("qwen2", True), ("qwen3", True)])
def test_absorbed_r_v_reproduces_unrotated_logits(saved, kind: str, per_head: bool) -> None:
    path, hf = saved[kind]
    shape = model_shape(hf.config)
    gen = torch.Generator().manual_seed(3)
    d, hkv = shape.head_dim, shape.num_kv_heads
    r_v = {i: torch.stack([random_orthogonal(d, gen) for _ in range(hkv)]) if per_head else random_orthogonal(d, gen)
           for i in range(shape.num_layers)}  # fmt: skip
    dec, _ = load_decoder(str(path), torch.float32, "cpu", r_v=r_v)
    seqs, ids, pos = flat_batch(VOCAB)
    want = hf_logits(hf, seqs)
    with torch.no_grad():
        got = dec(ids, pos, dense_attention(LENS))  # o_proj takes the rotated outputs
        twice = dec(ids, pos, dense_attention(LENS, r_v))  # rotated back once more
    torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL)
    assert (twice - want).abs().max() > 1e-3  # the values and outputs really were rotated


@pytest.mark.parametrize("per_head", [False, True])
def test_absorb_output_weight_takes_rotated_outputs(per_head: bool) -> None:
    hq, hkv, d, n_out = 6, 3, 8, 5
    w, o = torch.randn(n_out, hq * d), torch.randn(4, hq, d)
    r = torch.stack([random_orthogonal(d) for _ in range(hkv)]) if per_head else random_orthogonal(d)
    o_rot = torch.einsum("thd,hde->the", o, r.repeat_interleave(hq // hkv, 0)) if per_head else o @ r
    w2 = absorb_output_weight(w, r, d)
    torch.testing.assert_close(o_rot.reshape(4, -1) @ w2.T, o.reshape(4, -1) @ w.T, rtol=1e-5, atol=1e-5)
    assert absorb_output_weight(w.bfloat16(), r, d).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="neither"):
        absorb_output_weight(w, torch.eye(d).repeat(4, 1, 1), d)  # 4 KV heads do not divide 6


@pytest.mark.parametrize("per_head", [False, True])
def test_absorb_value_weight_rotates_each_head(per_head: bool) -> None:
    hkv, d, n_in = 3, 8, 5
    w, b, x = torch.randn(hkv * d, n_in), torch.randn(hkv * d), torch.randn(4, n_in)
    r = torch.stack([random_orthogonal(d) for _ in range(hkv)]) if per_head else random_orthogonal(d)
    w2, b2 = absorb_value_weight(w, b, r, d)
    assert b2 is not None and w2.dtype == w.dtype
    want = (x @ w.T + b).view(4, hkv, d)
    want = torch.einsum("thd,hde->the", want, r) if per_head else want @ r
    torch.testing.assert_close((x @ w2.T + b2).view(4, hkv, d), want, rtol=1e-5, atol=1e-5)
    w3, b3 = absorb_value_weight(w.bfloat16(), None, r, d)
    assert b3 is None and w3.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="neither"):
        absorb_value_weight(w, b, torch.eye(d + 1), d)


def test_r_v_is_checked(saved) -> None:
    path = str(saved["llama"][0])
    with pytest.raises(ModelError, match=r"r_v has layer 7; the model's layers are 0\.\.1"):
        load_decoder(path, torch.float32, "cpu", r_v={7: torch.eye(16)})
    with pytest.raises(ModelError, match=r"r_v\[0\] has shape \[3, 16, 16\]"):
        load_decoder(path, torch.float32, "cpu", r_v={0: torch.eye(16).repeat(3, 1, 1)})


# ---- errors -----------------------------------------------------------------------------------
def one_line_error(path: Path, match: str) -> ModelError:
    with pytest.raises(ModelError, match=match) as e:
        load_decoder(str(path), torch.float32, "cpu")
    assert "\n" not in str(e.value)
    return e.value


@pytest.mark.parametrize(
    "cfg", [GPT2Config(n_layer=1), BertConfig(num_hidden_layers=1)], ids=["gpt2", "bert"]
)
def test_unsupported_model_type(tmp_path: Path, cfg) -> None:
    cfg.save_pretrained(tmp_path)
    err = one_line_error(tmp_path, f"model_type '{cfg.model_type}' is not supported")
    assert "llama, mistral, qwen2, qwen3, qwen3_moe, glm4_moe, minimax_m2 (full attention only)" in str(err)


def test_sliding_window_is_refused(tmp_path: Path) -> None:
    small = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    MistralConfig(**small, sliding_window=4096).save_pretrained(tmp_path / "m")
    one_line_error(tmp_path / "m", r"mistral with sliding-window attention \(sliding_window=4096\)")
    Qwen2Config(**small, use_sliding_window=True, sliding_window=32, max_window_layers=1).save_pretrained(
        tmp_path / "q"
    )
    one_line_error(tmp_path / "q", "qwen2 with sliding-window attention")


def test_missing_key_is_listed(saved, tmp_path: Path) -> None:
    path = saved["llama"][0]
    shutil.copy(path / "config.json", tmp_path)
    t = tensors(path)
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    one_line_error(tmp_path, r"missing 1: model\.layers\.1\.mlp\.up_proj\.weight$")


def test_unexpected_key_is_listed(saved, tmp_path: Path) -> None:
    path = saved["qwen3"][0]
    shutil.copy(path / "config.json", tmp_path)
    t = tensors(path)
    t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    one_line_error(tmp_path, r"unexpected 1: model\.layers\.0\.self_attn\.extra\.weight")


def test_shape_mismatch_and_no_weights(saved, tmp_path: Path) -> None:
    path = saved["qwen3"][0]
    shutil.copy(path / "config.json", tmp_path)
    one_line_error(tmp_path, r"no \*\.safetensors weights")
    t = tensors(path)
    t["model.norm.weight"] = torch.ones(3)
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    one_line_error(tmp_path, r"model\.norm\.weight has shape \[3\]; the config gives \[64\]")


# ---- dummy weights and shape -------------------------------------------------------------------------
def test_dummy_load_is_seeded_and_reads_no_weights(saved, tmp_path: Path) -> None:
    shutil.copy(saved["qwen3"][0] / "config.json", tmp_path)  # a config and nothing else
    _, ids, pos = flat_batch(VOCAB)

    def run(seed: int) -> torch.Tensor:
        dec, _ = load_decoder(str(tmp_path), torch.float32, "cpu", load_format="dummy", seed=seed)
        assert torch.equal(dec.layers[0].self_attn.q_norm.weight, torch.ones(32))
        assert 0.015 < dec.layers[1].mlp.down_proj.weight.std() < 0.025
        with torch.no_grad():
            return dec(ids, pos, dense_attention(LENS))

    a, b, c = run(0), run(0), run(1)
    assert torch.isfinite(a).all() and torch.equal(a, b) and not torch.equal(a, c)


def test_eos_ids_prefer_generation_config(saved, tmp_path: Path) -> None:
    path, _ = saved["llama"]
    for f in ("config.json", "model.safetensors"):
        shutil.copy(path / f, tmp_path)
    assert load_decoder(str(tmp_path), torch.float32, "cpu")[1].eos_token_ids == (2,)  # config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 7]}))
    assert load_decoder(str(tmp_path), torch.float32, "cpu")[1].eos_token_ids == (7, 2)
