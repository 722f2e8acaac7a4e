"""The evaluation harness: every method on a tiny model, tasks, report files, CLI on the reference model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from oscarkv.calibration.fit import fixed_layer
from oscarkv.config import ALL_EVAL_METHODS, EvalConfig, QuantSpec, SpecError
from oscarkv.eval import METHODS, get_method, run_eval, write_report
from oscarkv.eval.kivi import RESIDUAL, kivi_bits_per_element, kivi_fake_kv
from oscarkv.eval.report import log_ppl_difference, paired_difference, summary, summary_markdown
from oscarkv.eval.tasks.needle import build_cases, generate_answers
from oscarkv.eval.tasks.ppl import batched_nll, batched_sequence_nlls, continuation_nll, perplexity
from oscarkv.rotation import LayerRotation, RotationSet

SPEC = QuantSpec(sink_tokens=4, recent_tokens=16)


class CharTok:
    eos_token_id = 0
    pad_token_id = 0
    chat_template = None

    def __call__(self, text, add_special_tokens=False, **_):
        return {"input_ids": [1 + ord(c) % 250 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i) - 1) if 1 <= int(i) < 251 else "" for i in ids)


def _tiny_model(init_std: float = 0.02) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        initializer_range=init_std,
    )
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _tiny_model()


@pytest.fixture(scope="module")
def rotations(model):
    gen = torch.Generator().manual_seed(1)
    layers = {}
    for i in range(2):
        rk = torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=torch.float64))[0].float()
        layers[i] = LayerRotation(
            rk, fixed_layer("hadamard", 32, 2, "layer").v, torch.ones(32), torch.ones(32)
        )
    return RotationSet(layers, SPEC)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_through_its_cache(model, rotations, name):
    m = get_method(name, rotations, model.config)
    seq = torch.randint(1, 256, (160,), generator=torch.Generator().manual_seed(2))
    nll, n = continuation_nll(model, m, seq, context=100, chunk=16)
    assert n == 60 and math.isfinite(nll) and nll > 0
    k, v = torch.randn(1, 2, 150, 32), torch.randn(1, 2, 150, 32)
    kq, vq = m.fake_kv(0, k, v)
    assert kq.shape == k.shape and vq.shape == v.shape and torch.isfinite(kq).all()
    bpe = m.bits_per_element(4096, 128)
    assert 2.0 < bpe <= 16.0
    # a batch of sequences scores each one as if alone (equal lengths, no padding)
    seqs = torch.stack([seq, torch.randint(1, 256, (160,), generator=torch.Generator().manual_seed(3))])
    both, n2 = continuation_nll(model, m, seqs, context=100, chunk=16)
    second, _ = continuation_nll(model, m, seqs[1], context=100, chunk=16)
    assert n2 == 120 and both == pytest.approx(nll + second, rel=1e-4)
    # per-sequence sums, batched 1 at a time or together, are each sequence's own NLL
    per, counts = batched_sequence_nlls(model, m, seqs, context=100, chunk=16, batch_size=2)
    assert counts == [60, 60] and per == pytest.approx([nll, second], rel=1e-4)
    assert batched_nll(model, m, seqs, 100, 16, 1) == (pytest.approx(nll + second, rel=1e-4), 120)


def test_bf16_continuation_nll_is_one_full_forward(model, rotations):
    """Prefill (its last position's logits only) then chunks: the same NLL as one forward over the
    whole sequence scoring the continuation, for the exact cache."""
    seq = torch.randint(1, 256, (160,), generator=torch.Generator().manual_seed(4))
    nll, n = continuation_nll(model, get_method("bf16", rotations, model.config), seq, context=100, chunk=16)
    with torch.inference_mode():
        lp = model(input_ids=seq[None]).logits[0, 99:-1].double().log_softmax(-1)
    assert n == 60 and nll == pytest.approx(float(-lp.gather(-1, seq[100:, None]).sum()), rel=1e-5)


def test_bits_per_element_of_the_baselines(model, rotations):
    bpe = {n: get_method(n, rotations, model.config).bits_per_element(131072, 128) for n in METHODS}
    assert bpe["bf16"] == 16.0
    assert bpe["naive-int2"] == bpe["quarot-int2"] == 2.25
    assert bpe["int4"] == 4.25 and bpe["turboquant-k3v3"] == 3.25
    # by hand, not through the functions the methods call: OSCAR stores sink + recent = 4 + 16
    # tokens at 16 bits and the rest at 2 + 2·16/128 = 2.25 (one fp16 scale and zero per row)
    assert bpe["oscar"] == pytest.approx((20 * 16 + (131072 - 20) * 2.25) / 131072)
    # fp8 windows: the same 20 tokens at 8 bits
    assert bpe["oscar-fp8w"] == pytest.approx((20 * 8 + (131072 - 20) * 2.25) / 131072)
    # KIVI-2: keys 2 + 2·16/32 (per-channel groups of 32 tokens), values 2 + 2·16/128, averaged
    # (2.625); the 131072 % 128 = 0 residual tokens at 16 bits
    assert bpe["kivi2"] == pytest.approx(2.625)
    at_1000 = {
        n: get_method(n, rotations, model.config).bits_per_element(1000, 128) for n in ("oscar", "kivi2")
    }
    assert at_1000["oscar"] == pytest.approx((20 * 16 + 980 * 2.25) / 1000)  # 2.525
    assert at_1000["kivi2"] == pytest.approx((1000 % 128 * 16 + 896 * 2.625) / 1000)  # 104 residual: 4.016


def test_quantization_noise_orders_as_bits(model, rotations):
    """On the same keys, fewer bits and no rotation must give more reconstruction error."""
    k = torch.randn(1, 2, 400, 32) * torch.linspace(0.1, 3, 32)
    k[..., 3] += 8.0  # an outlier channel
    err = {}
    for n in ("int4", "quarot-int2", "naive-int2"):
        kq, _ = get_method(n, rotations, model.config).fake_kv(0, k, k)
        err[n] = float((kq - k).square().mean())
    assert err["int4"] < err["quarot-int2"] < err["naive-int2"]


def test_no_window_methods_quantize_everything_and_windowed_ones_keep_the_tiers(model, rotations):
    k = torch.randn(1, 2, 100, 32)
    kq, _ = get_method("clip-only", rotations, model.config).fake_kv(0, k, k)
    assert torch.allclose(kq[:, :, :4], k[:, :, :4], atol=1e-5)  # sink exact
    assert torch.allclose(kq[:, :, -16:], k[:, :, -16:], atol=1e-5)  # recent exact
    assert not torch.allclose(kq[:, :, 4:-16], k[:, :, 4:-16], atol=1e-3)
    kq, _ = get_method("quarot-int2", rotations, model.config).fake_kv(0, k, k)
    assert not torch.allclose(kq[:, :, :4], k[:, :, :4], atol=1e-3)


def test_kivi_keeps_the_residual_exact():
    k, v = torch.randn(1, 2, RESIDUAL * 2 + 37, 32), torch.randn(1, 2, RESIDUAL * 2 + 37, 32)
    kq, vq = kivi_fake_kv(k, v)
    assert torch.equal(kq[:, :, -37:], k[:, :, -37:]) and torch.equal(vq[:, :, -37:], v[:, :, -37:])
    assert not torch.allclose(kq[:, :, :-37], k[:, :, :-37], atol=1e-3)
    assert kivi_bits_per_element(256, 128) == pytest.approx((3 + 2.25) / 2)


def test_oscar_needs_rotations(model):
    with pytest.raises(ValueError, match="rotations"):
        get_method("oscar", None, model.config)
    with pytest.raises(ValueError, match="unknown method"):
        get_method("int3", None, model.config)


FILLER = tuple(f"    x_{chr(97 + i % 26)} = compute(a, b)  # line {chr(65 + i % 26)}" for i in range(300))


def test_needle_prompts():
    tok = CharTok()
    cases = build_cases(tok, [2000], [0.1, 0.9], trials=2, needles=3, seed=0, filler=FILLER)
    assert len(cases) == 4
    for c in cases:
        text = tok.decode(c.ids)
        assert len(c.ids) == 2000  # exact, so prompts batch without padding
        name = text.rsplit("\n", 1)[-1].removesuffix(": int =")
        assert text.endswith(f"\n{name}: int =")
        # the queried needle is a line of its own at needle_pos, holding the answer, once
        assert tok.decode(c.ids[c.needle_pos :]).startswith(f"{name}: int = {c.answer}\n")
        assert text[c.needle_pos - 1] == "\n" and text.count(f"{name}: int = ") == 1
        assert len(c.answer) == 4 and c.answer.isdigit()
        assert abs(c.needle_pos / len(c.ids) - c.depth) < 0.12  # the other needles shift it a little
    early, late = cases[0], cases[2]
    assert early.needle_pos < late.needle_pos
    # the same arguments give the same prompts (every method is scored on the same prompts)
    again = build_cases(tok, [2000], [0.1, 0.9], trials=2, needles=3, seed=0, filler=FILLER)
    assert [c.ids for c in again] == [c.ids for c in cases]


def _check_needles(tok, cases, spec: QuantSpec) -> None:
    """Every needle line lies in the INT2 tier (after the sink, before the recent window), the
    answer occurs once in the prompt (in the queried needle line) and never in the 16-bit recent
    window or the query tail."""
    for c in cases:
        text = tok.decode(c.ids)
        name = text.rsplit("\n", 1)[-1].removesuffix(": int =")
        needle = f"{name}: int = {c.answer}"
        assert tok.decode(c.ids[c.needle_pos :]).startswith(needle + "\n")
        end = c.needle_pos + len(tok(needle)["input_ids"])  # one past the needle's last token
        assert spec.sink_tokens <= c.needle_pos and end <= len(c.ids) - spec.recent_tokens
        assert text.count(c.answer) == 1 and c.answer not in tok.decode(c.ids[-spec.recent_tokens :])
        values = [ln.split(" = ")[1] for ln in text.split("\n") if ": int = " in ln]
        assert len(values) == c.needles == len(set(values))  # other needles never hold the answer


def test_needle_prompt_too_short_to_trim_is_refused():
    with pytest.raises(ValueError, match="no filler to trim"):
        build_cases(CharTok(), [300], [0.0], trials=1, needles=1, seed=0, filler=FILLER)


@pytest.mark.parametrize("name", ["bf16", "oscar", "kivi2"])
def test_batched_needle_generation_equals_one_prompt_at_a_time(rotations, name):
    """Exact-length prompts batch without padding; each prompt's result is the one it gets alone
    (two lengths, a batch that does not divide the count). Larger initial weights, so the random
    model's continuations depend on the prompt."""
    model = _tiny_model(init_std=0.2)
    cases = build_cases(CharTok(), [300, 360], [0.3, 0.7], trials=3, needles=1, seed=2, filler=FILLER)
    m = get_method(name, rotations, model.config)
    together = generate_answers(model, CharTok(), m, cases, batch_size=4, max_new_tokens=4)
    alone = [generate_answers(model, CharTok(), m, [c], batch_size=1, max_new_tokens=4)[0] for c in cases]
    assert together == alone and len(together) == 12 and len(set(together)) > 1


def test_needles_sit_in_the_quantized_middle():
    """At the default windows (sink 64, recent 256) and ~3K tokens, needles at depths 0.05-0.9
    are stored in INT2, not in a 16-bit window, and the answer is nowhere else in the prompt."""
    tok = CharTok()
    spec = QuantSpec()
    depths = [0.05, 0.3, 0.6, 0.9]
    for needles in (1, 4):
        cases = build_cases(tok, [3072], depths, trials=2, needles=needles, seed=1, filler=FILLER)
        for c in cases:
            # needles go in at line boundaries, so the depth is exact to a line
            assert abs(c.needle_pos / len(c.ids) - c.depth) < 0.02 and len(c.ids) == 3072
        _check_needles(tok, cases, spec)


@pytest.mark.shared
def test_needles_sit_in_the_quantized_middle_with_the_reference_tokenizer(shared_dir: Path):
    """The same with the reference model's tokenizer and the stdlib filler (what `oscarkv eval`
    builds): the needle stays in INT2 and the answer never leaks into the prompt tail."""
    from transformers import AutoTokenizer

    ref = shared_dir / "models" / "oscar-ref-qwen3-30m"
    if not ref.exists():
        pytest.skip("reference model not present")
    tok = AutoTokenizer.from_pretrained(str(ref))
    for needles in (1, 4):
        cases = build_cases(tok, [3072], [0.05, 0.5, 0.9], trials=3, needles=needles, seed=needles)
        assert all(len(c.ids) == 3072 for c in cases)
        _check_needles(tok, cases, QuantSpec())


def test_needle_filler_is_stdlib_code():
    from oscarkv.eval.tasks.needle import NAMES, filler_lines

    lines = filler_lines()
    assert len(lines) > 1000 and any(ln.startswith(("def ", "class ", "import ")) for ln in lines)
    assert not any(n in ln for ln in lines[:2000] for n in NAMES)
    assert filler_lines() is lines  # cached


def _fake_stdlib(root: Path, n: int) -> list[str]:
    """``n`` eval-split modules (crc32 of the relative path % 10 == 0) plus calib-split ones."""
    import zlib

    names, i = [], 0
    while len(names) < n:
        name = f"mod_{i}.py"
        body = "".join(f"def f{i}x{j}(y):\n    return y + {j}\n" for j in range(20))
        (root / name).write_text(body)
        if zlib.crc32(name.encode()) % 10 == 0:
            names.append(name)
        i += 1
    return names


def test_eval_sequences_are_deterministic_and_stable(tmp_path):
    from oscarkv.calibration.data import CorpusError, eval_sequences, ranked_eval_files

    tok = CharTok()
    _fake_stdlib(tmp_path, 6)
    a = eval_sequences(tok, 4, 100, seed=0, root=tmp_path)
    assert a.shape == (4, 100) and torch.equal(a, eval_sequences(tok, 4, 100, seed=0, root=tmp_path))
    # one window per module: the 4 windows come from 4 different files
    srcs = {tok.decode(row.tolist()).split("def f")[1].split("x")[0] for row in a}
    assert len(srcs) == 4
    assert not torch.equal(a, eval_sequences(tok, 4, 100, seed=1, root=tmp_path))
    # ranks depend on a file's own path only: adding files never reorders the existing ones
    before = [p.name for p in ranked_eval_files(0, tmp_path)[1]]
    _fake_stdlib(tmp_path, 12)
    after = [p.name for p in ranked_eval_files(0, tmp_path)[1]]
    assert [n for n in after if n in before] == before
    with pytest.raises(CorpusError, match="fewer than"):
        eval_sequences(tok, 50, 100, root=tmp_path)


def test_eval_config_validation():
    with pytest.raises(SpecError, match="tasks"):
        EvalConfig(tasks="ppl,foo")
    with pytest.raises(SpecError, match="context"):
        EvalConfig(context=256, ppl_continuation=512)
    q = EvalConfig(quick=True).effective()
    assert q.context == 1024 and q.ppl_sequences == 1 and not q.quick


def test_run_eval_rows_and_report(model, rotations, tmp_path, monkeypatch):
    import oscarkv.eval.runner as runner

    seqs = torch.randint(1, 256, (2, 400), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(runner, "eval_sequences", lambda tok, n, seq_len, seed=0: seqs[:n, :seq_len])
    cfg = EvalConfig(
        methods="bf16,oscar,naive-int2,kivi2",
        tasks="ppl,passkey,attn-error",
        context=400,
        ppl_sequences=2,
        ppl_continuation=64,
        ppl_chunk=32,
        needle_trials=1,
        needle_depths=2,
        needle_lengths=1,
        passkey_at_context=2,
        attn_sequences=2,
    )
    rows = run_eval(model, CharTok(), rotations, cfg)
    for r in rows:
        assert {"method", "task", "metric", "value", "bits_per_element"} <= set(r)
    got = {(r["method"], r["task"]) for r in rows}
    assert ("oscar", "ppl") in got and ("kivi2", "passkey") in got and ("naive-int2", "attn-error") in got
    bf16_err = [r["value"] for r in rows if r["method"] == "bf16" and r["metric"] == "attn_out_err"]
    assert bf16_err and max(bf16_err) == 0.0
    naive = [r["value"] for r in rows if r["method"] == "naive-int2" and r["metric"] == "attn_out_err"]
    assert min(naive) > 0
    files = write_report(tmp_path, rows, {"context": 400})
    names = {f.name for f in files}
    assert {"results.json", "results.md", "passkey_heatmap.png", "layer_errors.png"} <= names
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["rows"] and data["summary"][0]["method"] == "bf16"
    at = {r["method"]: r for r in rows if r["metric"] == "accuracy_at_context"}
    assert all(len(r["hits"]) == 2 and r["value"] == sum(r["hits"]) / 2 for r in at.values())
    naive = next(s for s in data["summary"] if s["method"] == "naive-int2")
    assert naive["passkey_vs_bf16"] == (sum(at["naive-int2"]["hits"]) - sum(at["bf16"]["hits"])) / 2
    assert "Δ vs BF16" in (tmp_path / "results.md").read_text()
    # ppl rows carry each sequence's summed NLL and token count; they add up to the perplexity
    ppl = {r["method"]: r for r in rows if r["task"] == "ppl"}
    for name, r in ppl.items():
        assert r["seq_tokens"] == [64, 64] and len(r["seq_nll"]) == 2 and r["tokens"] == 128
        assert r["value"] == pytest.approx(math.exp(sum(r["seq_nll"]) / sum(r["seq_tokens"])), rel=1e-9)
        # and each is that sequence's own NLL, scored alone
        alone, _ = continuation_nll(model, get_method(name, rotations, model.config), seqs[1], 336, 32)
        assert r["seq_nll"][1] == pytest.approx(alone, rel=1e-4)
    summ = {s["method"]: s for s in data["summary"]}
    for name in ("oscar", "naive-int2", "kivi2"):
        d = [(a - b) / 64 for a, b in zip(ppl[name]["seq_nll"], ppl["bf16"]["seq_nll"], strict=True)]
        assert summ[name]["ppl_dlog_vs_bf16"] == pytest.approx(sum(d) / 2)
        assert summ[name]["ppl_dlog_vs_bf16_se"] == pytest.approx(abs(d[0] - d[1]) / 2)
        # equal token counts: the mean log difference is the log of the ppl ratio
        assert math.exp(summ[name]["ppl_dlog_vs_bf16"]) == pytest.approx(summ[name]["ppl_ratio"])
    assert "ppl_dlog_vs_bf16" not in summ["bf16"] and "oscar_ppl_dlog_vs_this" not in summ["oscar"]
    for name in ("naive-int2", "kivi2"):
        assert summ[name]["oscar_ppl_dlog_vs_this"] == pytest.approx(
            summ["oscar"]["ppl_dlog_vs_bf16"] - summ[name]["ppl_dlog_vs_bf16"]
        )
        assert summ[name]["oscar_passkey_vs_this"] == (sum(at["oscar"]["hits"]) - sum(at[name]["hits"])) / 2
    md = (tmp_path / "results.md").read_text()
    assert "ppl Δlog vs BF16 (± SE)" in md and "OSCAR vs baselines (paired, per sequence)" in md


def test_log_ppl_difference():
    # per-sequence mean NLLs a = 1.1, 1.2, 2.0 and b = 1.0, 1.0, 1.8: differences 0.1, 0.2, 0.2
    a, b, n = [4.4, 6.0, 20.0], [4.0, 5.0, 18.0], [4, 5, 10]
    m, se = log_ppl_difference(a, n, b, n)
    # mean 1/6; deviations -1/15, 1/30, 1/30 -> sample variance (1/225 + 2/900) / 2 = 1/300
    assert m == pytest.approx(1 / 6) and se == pytest.approx((1 / 300 / 3) ** 0.5) == pytest.approx(1 / 30)
    # sequences are the unit: not the pooled log ratio (a long sequence does not weigh more)
    assert m != pytest.approx((sum(a) - sum(b)) / sum(n), rel=1e-3)
    m, se = log_ppl_difference(b, n, a, n)
    assert m == pytest.approx(-1 / 6) and se == pytest.approx(1 / 30)  # negative: the first is better
    # equal token counts: the mean is the log of the perplexity ratio
    m, _ = log_ppl_difference(a, [8, 8, 8], b, [8, 8, 8])
    assert math.exp(m) == pytest.approx(perplexity(sum(a), 24) / perplexity(sum(b), 24))
    with pytest.raises(ValueError, match="same sequences"):
        log_ppl_difference(a, n, b, [4, 5, 11])
    with pytest.raises(ValueError, match="at least one scored token"):
        log_ppl_difference([1.0, 2.0], [0, 3], [1.0, 2.0], [0, 3])
    # one sequence: no standard error
    m, se = log_ppl_difference([2.0], [2], [1.0], [2])
    assert m == 0.5 and math.isnan(se)


def _ppl_row(method, seq_nll, n=10):
    return {
        "method": method, "task": "ppl", "metric": "ppl", "bits_per_element": 2.0, "context_len": 100,
        "value": perplexity(sum(seq_nll), n * len(seq_nll)), "seq_nll": seq_nll, "seq_tokens": [n] * len(seq_nll),
    }  # fmt: skip


def _hits_row(method, hits):
    return {
        "method": method, "task": "passkey", "metric": "accuracy_at_context", "bits_per_element": 2.0,
        "context_len": 100, "value": sum(hits) / len(hits), "n": len(hits), "hits": hits,
    }  # fmt: skip


def test_summary_pairs_oscar_with_the_other_int2_methods():
    rows = [
        _ppl_row("bf16", [10.0, 20.0, 30.0]),
        _ppl_row("oscar", [11.0, 20.5, 31.0]),  # per token +0.1, +0.05, +0.1 vs BF16
        _ppl_row("hadamard-int2", [11.2, 20.4, 31.3]),  # OSCAR - this: -0.02, +0.01, -0.03
        _ppl_row("int4", [10.1, 20.1, 30.1]),  # not INT2: no OSCAR comparison
        _hits_row("bf16", [1, 1, 1, 0]),
        _hits_row("oscar", [1, 0, 1, 0]),
        _hits_row("hadamard-int2", [0, 0, 1, 1]),
        _hits_row("int4", [1, 1, 1, 0]),
    ]
    s = {x["method"]: x for x in summary(rows)}
    assert s["oscar"]["ppl_dlog_vs_bf16"] == pytest.approx(0.25 / 3)
    assert s["oscar"]["ppl_dlog_vs_bf16_se"] == pytest.approx((0.05**2 * 2 / 3 / 2 / 3) ** 0.5)
    h = s["hadamard-int2"]
    assert h["oscar_ppl_dlog_vs_this"] == pytest.approx(-0.04 / 3)
    # per token: d = -0.02, 0.01, -0.03, mean -0.04/3, SE 0.0120
    d = [-0.02, 0.01, -0.03]
    var = sum((x + 0.04 / 3) ** 2 for x in d) / 2
    assert h["oscar_ppl_dlog_vs_this_se"] == pytest.approx((var / 3) ** 0.5)
    assert h["oscar_passkey_vs_this"] == 0.0 and h["oscar_passkey_vs_this_se"] == pytest.approx(
        (2 / 3 / 4) ** 0.5
    )
    assert not any(k.startswith("oscar_") for k in s["int4"]) and not any(
        k.startswith("oscar_") for k in s["oscar"]
    )
    md = summary_markdown(rows, {"context": 100})
    section = md.split("## OSCAR vs baselines (paired, per sequence)")[1]
    assert "| hadamard-int2 | -0.0133 ± 0.0120 | +0.000 ± 0.408 |" in section and "int4" not in section
    assert "ppl over 3 sequences" in md
    # rows without per-sequence sums (older results.json) still summarise, without the new fields
    old = [{k: v for k, v in r.items() if k not in ("seq_nll", "seq_tokens")} for r in rows]
    s = {x["method"]: x for x in summary(old)}
    assert "ppl_dlog_vs_bf16" not in s["oscar"] and "oscar_ppl_dlog_vs_this" not in s["hadamard-int2"]
    assert "oscar_passkey_vs_this" in s["hadamard-int2"]


def test_summary_pairs_oscar_with_oscar_fp8w_on_chat_retrieval():
    """The fp8-windows option against the default: OSCAR − oscar-fp8w on the same retrieval
    prompts (and perplexity sequences), in the pairwise section."""
    ret = [
        {**_hits_row(m, h), "task": "chat-retrieval"}
        for m, h in (("oscar", [1, 1, 0, 1]), ("oscar-fp8w", [1, 0, 0, 1]))
    ]
    rows = [_ppl_row("oscar", [11.0, 20.5, 31.0]), _ppl_row("oscar-fp8w", [11.1, 20.5, 31.2]), *ret]
    f = {x["method"]: x for x in summary(rows)}["oscar-fp8w"]
    assert f["oscar_retrieval_vs_this"] == 0.25 and f["oscar_retrieval_vs_this_se"] == pytest.approx(0.25)
    assert f["oscar_ppl_dlog_vs_this"] == pytest.approx(-0.03 / 3)
    assert "| oscar-fp8w | -0.0100 ± 0.0058 | - | +0.250 ± 0.250 |" in summary_markdown(rows)


def test_paired_difference():
    # one prompt lost, one gained, two unchanged: mean 0, and the SE comes from the two changes only
    m, se = paired_difference([1, 0, 1, 1], [1, 1, 0, 1])
    assert m == 0.0 and se == pytest.approx((2 / 3 / 4) ** 0.5)
    m, se = paired_difference([0, 0, 1, 1], [1, 1, 1, 1])
    assert m == -0.5 and se == pytest.approx((1 / 3 / 4) ** 0.5)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_difference([1], [1, 0])


@pytest.mark.shared
@pytest.mark.slow
def test_cli_eval_quick_on_the_reference_model(shared_dir: Path, tmp_path: Path):
    from oscarkv.calibration import calibrate
    from oscarkv.cli import main
    from oscarkv.config import CalibrationConfig
    from oscarkv.hf.loading import load_model
    from oscarkv.rotation import save_rotations

    ref = shared_dir / "models" / "oscar-ref-qwen3-30m"
    if not ref.exists():
        pytest.skip("reference model not present")
    model, tok = load_model(str(ref), "cpu", "fp32")
    rots = calibrate(model, tok, CalibrationConfig(tokens=2048, seq_len=1024, holdout_tokens=1024))
    save_rotations(rots, tmp_path / "rot")
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--model",
                str(ref),
                "--rotations",
                str(tmp_path / "rot"),
                "--out",
                str(out),
                "--quick",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    data = json.loads((out / "results.json").read_text())
    methods = {r["method"] for r in data["rows"]}
    assert methods == set(ALL_EVAL_METHODS.split(","))  # the default: every method but the optional ones
    ppl = {s["method"]: s["ppl"] for s in data["summary"]}
    assert all(math.isfinite(v) for v in ppl.values())
    # the harness must exercise the quantized history: naive INT2 is clearly worse than BF16
    assert ppl["naive-int2"] > 1.05 * ppl["bf16"]
    _check_reference_quality({s["method"]: s for s in data["summary"]})


def _check_reference_quality(summ: dict[str, dict]) -> None:
    """OSCAR's quality in `oscarkv eval --quick` on the reference model, against what was measured
    (x86, CPU torch 2.13 wheel), with margins that platform noise (a different clip chosen on
    held-out data, say) stays inside and a real regression does not. Quick mode scores one
    sequence, so the baselines' per-token log-ppl differences are paired on the same tokens."""
    oscar = summ["oscar"]
    # measured: OSCAR 1.059x BF16 (Hadamard INT2 1.061x, clip-only 1.129x, KIVI-2 1.148x, naive 1.233x)
    assert oscar["ppl_ratio"] <= 1.09, oscar
    # OSCAR minus baseline, per-token log ppl (negative: OSCAR better); measured -0.152 vs naive
    # INT2, -0.081 vs KIVI-2, -0.064 vs clip-only, -0.001 vs Hadamard INT2. (QuaRot INT2, unclipped
    # and without windows, scores +0.028 on this one sequence: not asserted on ppl, but its
    # attention error is 20x OSCAR's, below.)
    bounds = {"naive-int2": -0.10, "kivi2": -0.04, "clip-only": -0.03, "hadamard-int2": 0.01}
    for name, bound in bounds.items():
        assert summ[name]["oscar_ppl_dlog_vs_this"] <= bound, (name, summ[name])
    # attention-output error of the stored cache: measured OSCAR 0.0113, Hadamard INT2 0.0127,
    # clip-only 0.0151, KIVI-2 0.215, QuaRot INT2 0.249, naive INT2 0.440
    assert oscar["attn_out_err"] <= 0.02, oscar
    assert oscar["attn_out_err"] <= 1.02 * summ["hadamard-int2"]["attn_out_err"]
    for name in ("clip-only", "kivi2", "quarot-int2", "naive-int2"):
        assert oscar["attn_out_err"] < summ[name]["attn_out_err"], (name, summ[name])
    # the passkey at full context: measured 1.0 for OSCAR and BF16 (naive INT2 and clip-only 0.0)
    assert oscar["passkey_at_context"] >= summ["bf16"]["passkey_at_context"], oscar


def test_build_cases_names_an_unusable_filler():
    with pytest.raises(ValueError, match="pass a larger filler"):
        build_cases(CharTok(), [500], [0.5], trials=1, needles=1, filler=["x = 1", "y = 2"] * 10)


def test_text_sequences_from_user_data(tmp_path):
    """``--data``: windows of the user's documents (files, JSONL records), not the stdlib text;
    too little text is a one-line error naming the flags to lower."""
    from oscarkv.calibration.data import CorpusError
    from oscarkv.eval.runner import text_sequences

    text = "".join(chr(97 + (i * 7) % 26) for i in range(300))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "zz" * 100}) + "\n")
    tok = CharTok()
    got = text_sequences(tok, [tmp_path / "a.txt"], 2, 100, seed=0)
    assert got.tolist() == [tok(text[:100])["input_ids"], tok(text[100:200])["input_ids"]]
    both = text_sequences(tok, [tmp_path], 1, 450, seed=0)
    stream = set(both[0].tolist())
    assert tok("z")["input_ids"][0] in stream and tok("a")["input_ids"][0] in stream
    with pytest.raises(CorpusError, match="--context, --ppl-sequences"):
        text_sequences(tok, [tmp_path / "a.txt"], 4, 100, seed=0)


def test_cli_eval_data_is_checked_before_the_model_loads(tmp_path, capsys):
    from oscarkv.cli import main

    rc = main(["eval", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), "--methods", "bf16",
               "--data", str(tmp_path / "missing.txt")])  # fmt: skip
    assert rc != 0
    err = capsys.readouterr().err
    assert "missing.txt: no such file or directory" in err and "no-model" not in err
