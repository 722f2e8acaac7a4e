"""Mixture-of-experts families in the engine on CPU (fp32), on tiny random checkpoints written
with transformers (``moe_models.py``): the decoder's logits equal transformers' eager ones,
BF16 pages give transformers' greedy tokens, INT2 pages give ``OscarCache``'s with calibrated
rotations, and chunked prefill, prefix hits and preemption keep them; the grouped-GEMM experts
equal the looped reference; tensor_parallel=2 gives TP=1's tokens."""

from __future__ import annotations

import logging
import multiprocessing as mp
from pathlib import Path

import pytest
import test_engine_e2e as e2e
import torch
from moe_models import MOE_KINDS, VOCAB, moe_config, write_moe_model
from safetensors.torch import load_file, save_file

from oscarkv import LLM, QuantSpec, SamplingParams, calibrate
from oscarkv.config import CalibrationConfig
from oscarkv.engine.models import load_decoder
from oscarkv.engine.models.moe import Routing, grouped_experts, looped_experts, route
from oscarkv.errors import ModelError
from oscarkv.rotation import save_rotations

SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
KW = dict(
    device="cpu", page_tokens=8, check_invariants=True, kv_budget_gb=0.05
)  # small pools: the CPU default is up to 2 GiB


pytestmark = pytest.mark.usefixtures("one_thread")  # identical reductions in HF and the engine


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {k: write_moe_model(k, root / k) for k in MOE_KINDS}


def prompts(lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def hf_greedy(path: Path, ids: list[int], n: int, rotations=None) -> list[int]:
    return e2e.hf_greedy(
        path, ids, n, rotations, SPEC, attn_implementation="eager", experts_implementation="eager"
    )


# ---- the decoder ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_decoder_logits_equal_transformers(moe_dirs, kind: str) -> None:
    ids = torch.tensor(prompts((23,), seed=1)[0])
    want = hf_model(moe_dirs[kind])(ids[None]).logits[0].detach()

    def attn(layer, q, k, v):  # one causal sequence, GQA by repeating KV heads, as HF eager
        rep = q.shape[1] // k.shape[1]
        qs, ks, vs = (
            q.transpose(0, 1),
            k.repeat_interleave(rep, 1).transpose(0, 1),
            v.repeat_interleave(rep, 1).transpose(0, 1),
        )
        w = (qs @ ks.transpose(1, 2)) * q.shape[-1] ** -0.5
        w = w.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool).triu(1), float("-inf"))
        return (w.softmax(-1) @ vs).transpose(0, 1)

    dec, shape = load_decoder(str(moe_dirs[kind]), torch.float32, "cpu")
    with torch.no_grad():
        got = dec(ids, torch.arange(len(ids)), attn)
    assert shape.num_experts == 8 and shape.experts_per_token == 2 and shape.head_dim == 128
    assert shape.rotary_dim == (128 if kind == "qwen3_moe" else 64)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_equal_the_looped_reference(dtype: torch.dtype, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 8, 64, 32, 3
    x = torch.randn(tokens, h, generator=g).to(dtype)
    w13 = (0.1 * torch.randn(e, 2 * i, h, generator=g)).to(dtype)
    w2 = (0.1 * torch.randn(e, h, i, generator=g)).to(dtype)
    gate = torch.randn(e, h, generator=g).to(dtype)
    for routing in (
        Routing("softmax", k, True),
        Routing("sigmoid", k, True, n_group=4, topk_group=2, scale=2.5),
    ):
        weights, ids = route(routing, x, gate, torch.zeros(e))
        want = looped_experts(x, w13, w2, weights, ids)
        got = grouped_experts(x, w13, w2, weights, ids)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_correction_bias_selects_experts_but_never_weights_them() -> None:
    x = torch.tensor([[1.0, 0.0]])
    gate = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 scores lowest but is chosen
    weights, ids = route(Routing("sigmoid", 2, False), x, gate, bias)
    assert sorted(ids[0].tolist()) == [0, 3]
    s = torch.sigmoid(torch.tensor([2.0, -1.0]))
    assert sorted(weights[0].tolist()) == pytest.approx(sorted(s.tolist()))


def test_glm_multi_token_prediction_layers_are_skipped_with_a_log_line(
    moe_dirs, tmp_path: Path, caplog
) -> None:
    src = moe_dirs["glm4_moe"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    t = load_file(tmp_path / "model.safetensors")
    t["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # a layer past num_hidden_layers (3)
    t["model.layers.3.mlp.gate.weight"] = torch.zeros(8, 128)
    save_file(t, tmp_path / "model.safetensors")
    cfg = (
        (tmp_path / "config.json")
        .read_text()
        .replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1')
    )
    (tmp_path / "config.json").write_text(cfg)
    with caplog.at_level(logging.INFO, logger="oscarkv.engine"):
        load_decoder(str(tmp_path), torch.float32, "cpu")
    assert "skipped 2 checkpoint tensors" in caplog.text
    (tmp_path / "config.json").write_text(
        cfg.replace('"num_nextn_predict_layers": 1', '"num_nextn_predict_layers": 0')
    )
    with pytest.raises(ModelError, match=r"unexpected 2: model\.layers\.3\."):
        load_decoder(str(tmp_path), torch.float32, "cpu")


def test_tensor_parallel_sizes_of_a_moe_model_are_checked(moe_dirs) -> None:
    from oscarkv.engine.models import check_split

    cfg = moe_config("qwen3_moe")
    check_split(cfg, 2)
    with pytest.raises(ModelError, match=r"tensor_parallel=3 splits num_attention_heads \(4\)"):
        check_split(cfg, 3)


# ---- the engine: BF16 == transformers, INT2 == OscarCache -----------------------------------------
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_bf16_engine_equals_transformers_greedy(moe_dirs, kind: str) -> None:
    ps = prompts((1, 9, 70), seed=2)
    llm = LLM(str(moe_dirs[kind]), kv_dtype="bf16", max_batched_tokens=64, **KW)
    for p, o in zip(ps, llm.generate(ps, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(moe_dirs[kind], p, GREEDY.max_tokens), (kind, len(p))
    assert llm.engine.scheduler.idle


@pytest.fixture(scope="module")
def calibrated(moe_dirs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """Rotations fitted by ``calibrate`` on each model (per KV head, a little stdlib text)."""
    from transformers import AutoTokenizer

    out = {}
    for kind in ("qwen3_moe", "glm4_moe", "minimax_m2"):
        model = hf_model(moe_dirs[kind])
        tok = AutoTokenizer.from_pretrained(moe_dirs[kind])
        cfg = CalibrationConfig(tokens=256, seq_len=128, holdout_tokens=128, granularity="kv_head",
                                max_ppl_increase=None, seed=0)  # fmt: skip
        rs = calibrate(model, tok, cfg, SPEC)
        d = tmp_path_factory.mktemp(f"rot-{kind}")
        save_rotations(rs, d)
        out[kind] = (d, rs)
    return out


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe", "minimax_m2"])
def test_int2_engine_equals_oscarcache_greedy(moe_dirs, calibrated, kind: str) -> None:
    path, rs = calibrated[kind]
    ps = prompts((30, 120), seed=6)  # across the sink and the window, and far past it
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(str(moe_dirs[kind]), rotations=str(path), spec=SPEC, **KW)
    for p, o in zip(ps, llm.generate(ps, params), strict=True):
        assert o.token_ids == hf_greedy(moe_dirs[kind], p, params.max_tokens, rs), (kind, len(p))


def test_int2_chunks_prefix_hits_and_preemption_on_a_moe_model(moe_dirs, calibrated) -> None:
    """Chunked prefill and prefix hits give what the same engine gives without them where the
    stored rows are the same (BF16 pages: exactly the same tokens); a preempted INT2 run frees
    every page and finishes every request."""
    path = moe_dirs["glm4_moe"]
    stem = prompts((100,), seed=7)[0]
    ps = [stem + p for p in prompts((5, 40), seed=8)] + [stem]
    want = LLM(str(path), kv_dtype="bf16", **KW).generate(ps, GREEDY)
    llm = LLM(str(path), kv_dtype="bf16", max_batched_tokens=24, **KW)
    first, again = llm.generate(ps, GREEDY), llm.generate(ps, GREEDY)
    for a, b, c in zip(want, first, again, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
    assert sum(o.num_cached_tokens for o in again) > 0
    rot, _ = calibrated["glm4_moe"]
    ps = prompts((150, 140, 160, 130), seed=14)
    base = LLM(str(path), rotations=str(rot), spec=SPEC, max_running=4, **KW)
    plan = base.engine.runner.plan
    fixed = plan.total_bytes - plan.q_pages * plan.q_page_bytes
    budget = (fixed + 40 * plan.q_page_bytes) / 2**30  # not all four at once
    tight = LLM(str(path), rotations=str(rot), spec=SPEC, max_running=4, decode_reserve_pages=0,
                **dict(KW, kv_budget_gb=budget))  # fmt: skip
    outs = tight.generate(ps, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng = tight.engine
    assert all(len(o.token_ids) == 40 for o in outs) and eng.stats["preemptions"] > 0
    assert eng.scheduler.idle and eng.hp.n_free == eng.hp.capacity and eng.q.n_free == eng.q.capacity


@pytest.mark.parametrize("kind", ["qwen3_moe", "minimax_m2"])  # minimax: q/k norm statistics span ranks
def test_tp2_gives_the_tokens_of_tp1_on_a_moe_model(moe_dirs, calibrated, kind: str) -> None:
    path, _ = calibrated[kind]
    ps = prompts((6, 70, 150), seed=11)
    kw = dict(KW, max_batched_tokens=96, max_running=4, kv_budget_gb=0.05, rotations=str(path), spec=SPEC)
    with LLM(str(moe_dirs[kind]), **kw) as one:
        want = one.generate(ps, GREEDY)
    with LLM(str(moe_dirs[kind]), **kw, tensor_parallel=2) as two:
        got = two.generate(ps, GREEDY)
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
    assert not mp.active_children()


# ---- the front ends take a MoE checkpoint with no new flags ----------------------------------------
def test_serve_and_generate_take_a_moe_checkpoint(moe_dirs, calibrated, tmp_path: Path) -> None:
    """`oscarkv serve` (chat template from the checkpoint, the official openai client) and
    `oscarkv generate --engine` on a GLM-4 MoE checkpoint, INT2 with its calibrated rotations."""
    import json
    import shutil

    from openai import OpenAI

    from oscarkv.cli import main
    from oscarkv.config import EngineConfig, ServerConfig
    from oscarkv.server.launch import start_server

    model = tmp_path / "glm"
    shutil.copytree(moe_dirs["glm4_moe"], model)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    rot, _ = calibrated["glm4_moe"]
    eng = EngineConfig(
        model=str(model), rotations=str(rot), spec=SPEC, device="cpu", max_running=2, kv_budget_gb=0.05
    )
    with start_server(eng, ServerConfig(port=0)) as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        chat = client.chat.completions.create(model="glm", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0)  # fmt: skip
        assert chat.usage.completion_tokens == 5 and chat.usage.prompt_tokens > 3
        comp = client.completions.create(model="glm", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    want = LLM(str(model), rotations=str(rot), spec=SPEC, device="cpu", max_running=2, kv_budget_gb=0.05)
    assert (
        comp.choices[0].text
        == want.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))[0].text
    )
    reqs, out = tmp_path / "reqs.jsonl", tmp_path / "out.jsonl"
    reqs.write_text('{"prompt_token_ids": [5, 6, 7, 8]}\n')
    argv = ["generate", "--engine", "--model", str(model), "--rotations", str(rot), "--device", "cpu",
            "--prompts", str(reqs), "--out", str(out), "--max-new-tokens", "4", "--kv-budget-gb", "0.05"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["text"] == comp.choices[0].text
