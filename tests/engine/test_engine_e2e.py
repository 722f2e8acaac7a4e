"""The whole engine on CPU: BF16 pages == transformers greedy, INT2 == OscarCache greedy, under
chunked prefill, the prefix cache and preemption; sampling, stops, aborts and bad input."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import random_orthogonal, random_rotation_set, write_tiny_lm
from oscarkv import LLM, OscarCache, QuantSpec, SamplingParams
from oscarkv.demo import demo_model_path
from oscarkv.engine import Engine
from oscarkv.errors import OscarkvError
from oscarkv.rotation import LayerRotation, RotationSet, save_rotations

SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
LENS = (1, 7, 63, 64, 65, 200)
VOCAB = 2048  # the demo tokenizer's


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # identical reductions in HF and the engine
    yield
    torch.set_num_threads(n)


def _tiny(kind: str, path: Path) -> Path:
    import transformers

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    cfg = {
        "llama": lambda: transformers.LlamaConfig(**kw, head_dim=16),
        "qwen2": lambda: transformers.Qwen2Config(**kw),
        "qwen3": lambda: transformers.Qwen3Config(**kw, head_dim=16),
    }[kind]()
    if kind == "qwen2":
        cfg.attention_bias = True  # Qwen2 has q/k/v biases
    return write_tiny_lm(cfg, path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-models")
    out = {k: _tiny(k, root / k) for k in ("llama", "qwen2", "qwen3")}
    out["demo"] = demo_model_path()
    return out


def prompts(lens=LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def hf_greedy(path: Path, ids: list[int], n: int, rotations=None, spec=None, **load) -> list[int]:
    """transformers' greedy tokens (fp32; ``load``: more ``from_pretrained`` arguments), through
    ``OscarCache`` when ``rotations`` are given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    kw = {}
    if rotations is not None:
        kw["past_key_values"] = OscarCache.from_rotations(model, rotations, spec=spec, backend="torch")
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **kw)  # fmt: skip
    return out[0, len(ids) :].tolist()


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


# ---- BF16 pages == transformers ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "demo"])
def test_bf16_engine_equals_transformers_greedy(models, kind: str) -> None:
    ps = prompts()
    llm = LLM(str(models[kind]), kv_dtype="bf16", device="cpu", page_tokens=16, max_batched_tokens=64,
              check_invariants=True)  # fmt: skip
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        ref = hf_greedy(models[kind], p, GREEDY.max_tokens)
        assert o.token_ids == ref, (kind, len(p), first_diff(o.token_ids, ref))
        assert o.finish_reason == "length"
    assert llm.engine.scheduler.idle


@pytest.mark.parametrize(("chunk", "prefix"), [(5, False), (1024, True), (64, True)])
def test_bf16_chunking_and_prefix_cache_do_not_change_tokens(models, chunk: int, prefix: bool) -> None:
    base = prompts((150,), seed=3)[0]
    ps = [base[:100] + p for p in prompts((1, 40, 70), seed=4)] + [base]
    llm = LLM(str(models["demo"]), kv_dtype="bf16", device="cpu", page_tokens=8,
              max_batched_tokens=chunk, prefix_cache=prefix, check_invariants=True)  # fmt: skip
    first = llm.generate(ps, GREEDY)
    again = llm.generate(ps, GREEDY)  # served partly from the prefix cache when it is on
    for p, a, b in zip(ps, first, again, strict=True):
        assert a.token_ids == b.token_ids == hf_greedy(models["demo"], p, GREEDY.max_tokens)
    assert (sum(o.num_cached_tokens for o in again) > 0) == prefix


# ---- INT2 == OscarCache -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_rotations(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RotationSet]:
    rs = random_rotation_set(4, 128, SPEC)
    d = tmp_path_factory.mktemp("rot")
    save_rotations(rs, d)
    return d, rs


def hf_chunked_greedy(
    path: Path, ids: list[int], n: int, rs: RotationSet, chunks: list[int], spec: QuantSpec = SPEC
) -> list[int]:
    """OscarCache greedy with the prompt fed in ``chunks`` (a chunked prefill attends to the
    earlier chunks as stored, INT2 included: the engine's oracle for chunking and prefix hits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache = OscarCache.from_rotations(model, rs, spec=spec, backend="torch")
    out, pos = [], 0
    with torch.no_grad():
        for c in chunks:
            logits = model(torch.tensor([ids[pos : pos + c]]), past_key_values=cache).logits
            pos += c
        assert pos == len(ids)
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), past_key_values=cache).logits
    return out


def int2_llm(models, path: Path, **kw) -> LLM:
    return LLM(str(models["demo"]), rotations=str(path), device="cpu", page_tokens=8, spec=SPEC,
               check_invariants=True, **kw)  # fmt: skip


@pytest.mark.parametrize("absorb", [True, False])
def test_int2_engine_equals_oscarcache_greedy(models, demo_rotations, absorb: bool) -> None:
    path, rs = demo_rotations
    ps = prompts((7, 30, 60, 120), seed=6)  # inside the sink, across it, across the window, beyond
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = int2_llm(models, path, absorb_v=absorb)  # every prompt in one prefill chunk
    for p, o in zip(ps, llm.generate(ps, params), strict=True):
        ref = hf_greedy(models["demo"], p, params.max_tokens, rs, SPEC)
        assert o.token_ids == ref, (len(p), first_diff(o.token_ids, ref))
    # the start-up line states what the artifact costs at the spec the engine stores
    bits = rs.with_spec(llm.engine.runner.spec).bits_per_element(131072)
    assert f"{bits:.2f} bits per K/V element at 128K" in llm.engine.startup_report()


FP8_SPEC = replace(SPEC, window_dtype="fp8_e4m3")


def test_int2_engine_with_fp8_windows_equals_oscarcache_greedy(models, demo_rotations) -> None:
    """Sink and ring in fp8 (``window_dtype="fp8_e4m3"`` over an artifact of 16-bit windows): the
    engine's greedy tokens equal ``OscarCache``'s with the same fp8 windows, in one prefill chunk
    and in chunks; they are not the 16-bit windows' tokens."""
    path, rs = demo_rotations
    ps = prompts((7, 30, 60, 120), seed=6)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = int2_llm(models, path, window_dtype="fp8_e4m3")
    assert llm.engine.runner.pool.hp_k.dtype == torch.float8_e4m3fn
    assert "fp8 sinks and rings" in llm.engine.startup_report()
    outs = [o.token_ids for o in llm.generate(ps, params)]
    for p, o in zip(ps, outs, strict=True):
        ref = hf_greedy(models["demo"], p, params.max_tokens, rs, FP8_SPEC)
        assert o == ref, (len(p), first_diff(o, ref))
    assert outs != [o.token_ids for o in int2_llm(models, path).generate(ps, params)]
    p = prompts((130,), seed=13)[0]
    out = int2_llm(models, path, window_dtype="fp8_e4m3", max_batched_tokens=48).generate([p], params)[0]
    assert out.token_ids == hf_chunked_greedy(models["demo"], p, 40, rs, [48, 48, 34], FP8_SPEC)


def test_padded_decode_steps_equal_unpadded(models, demo_rotations) -> None:
    """Decode steps padded to a batch bucket with bucketed list lengths (what CUDA runs, eager or
    in a graph) give the tokens of unpadded steps: padding rows write nothing and read nothing."""
    path, _ = demo_rotations
    ps = prompts((7, 30, 60), seed=6)  # a batch of 3, padded to 4
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in int2_llm(models, path).generate(ps, params)]
    llm = int2_llm(models, path)
    llm.engine.runner.pad_decode = True
    assert [o.token_ids for o in llm.generate(ps, params)] == want


def test_int2_chunked_prefill_equals_oscarcache_fed_the_same_chunks(models, demo_rotations) -> None:
    path, rs = demo_rotations
    p = prompts((130,), seed=13)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = int2_llm(models, path, max_batched_tokens=48).generate([p], params)[0]
    assert out.token_ids == hf_chunked_greedy(models["demo"], p, 24, rs, [48, 48, 34])


def test_int2_prefix_hits_serve_pages_that_depend_only_on_the_prefix(models, demo_rotations) -> None:
    """A hit is capped below what a fresh run keeps in 16 bits, and the cached INT2 pages are a
    function of the prefix alone: B served from A's pages == B served from C's pages. (A hit is
    not bit-equal to a fresh run: the new tokens then attend to the stored INT2 prefix, as a
    chunked prefill does.)"""
    path, rs = demo_rotations
    stem = prompts((160,), seed=7)[0]
    a, b, c = (stem + prompts((n,), seed=n)[0] for n in (60, 45, 80))  # warmers demote the whole stem
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = []
    for warm in (a, c):
        llm = int2_llm(models, path)
        first = llm.generate([warm], params)[0]
        assert first.num_cached_tokens == 0
        assert first.token_ids == hf_greedy(models["demo"], warm, 16, rs, SPEC)
        outs.append(llm.generate([b], params)[0])
    hit = outs[0].num_cached_tokens
    assert hit == outs[1].num_cached_tokens == 160  # the stem, whole pages, below len(b) - R
    assert hit <= len(b) - SPEC.recent_tokens
    assert outs[0].token_ids == outs[1].token_ids


def test_preemption_recomputes_and_releases_every_page(models, demo_rotations) -> None:
    path, _ = demo_rotations
    ps = prompts((150, 140, 160, 130), seed=14)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plan = int2_llm(models, path, max_running=4).engine.runner.plan
    fixed = plan.total_bytes - plan.q_pages * plan.q_page_bytes
    budget = (fixed + 40 * plan.q_page_bytes) / 2**30  # 39 INT2 pages of 8: not all four at once
    llm = int2_llm(models, path, max_running=4, kv_budget_gb=budget, decode_reserve_pages=0)
    outs = llm.generate(ps, params)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert llm.engine.stats["preemptions"] > 0
    eng = llm.engine
    assert eng.scheduler.idle and eng.hp.n_free == eng.hp.capacity and eng.q.n_free == eng.q.capacity
    # in 16 bits a recompute reproduces the same tokens
    bf = LLM(str(models["demo"]), kv_dtype="bf16", device="cpu", page_tokens=8, max_running=4,
             kv_budget_gb=60 * 8 * 4096 / 2**30, decode_reserve_pages=0, check_invariants=True)  # fmt: skip
    outs = bf.generate(ps, params)
    assert bf.engine.stats["preemptions"] > 0
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == hf_greedy(models["demo"], p, 40)


# ---- sampling, stops, aborts ---------------------------------------------------------------------
def test_seeded_samples_do_not_depend_on_the_batch(models) -> None:
    llm = LLM(str(models["demo"]), kv_dtype="bf16", device="cpu")
    p = prompts((20,), seed=9)[0]
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)
    alone = llm.generate([p], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 3
    batch = llm.generate([*prompts((5, 50, 13), seed=10), p], [*others, seeded])
    assert batch[-1].token_ids == alone
    unseeded = [
        llm.generate([p], SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True))[0].token_ids
        for _ in range(3)
    ]
    assert len({tuple(u) for u in unseeded}) > 1  # sampling without a seed does vary


def test_stop_strings_stop_ids_and_eos(models) -> None:
    llm = LLM(str(models["demo"]), kv_dtype="bf16", device="cpu")
    free = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = free.text[10:13]
    cut = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    tok = free.token_ids[5]
    by_id = llm.generate(
        ["def add(a, b):"], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok])
    )[0]
    assert (
        by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    )


def test_abort_mid_prefill_frees_everything(models) -> None:
    eng = Engine(LLM(str(models["demo"]), kv_dtype="bf16", device="cpu", max_batched_tokens=16).config)
    rid = eng.add_request(prompts((100,), seed=11)[0], SamplingParams(max_tokens=5))
    keep = eng.add_request(prompts((10,), seed=12)[0], SamplingParams(max_tokens=3, temperature=0))
    eng.step()  # a 16-token chunk of the first prompt
    eng.abort(rid)
    outs: dict[str, object] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.rid] = o
    assert outs[rid].finish_reason == "abort" and outs[keep].finish_reason == "length"
    assert eng.hp.n_free == eng.hp.capacity and eng.scheduler.idle


# ---- bad input ------------------------------------------------------------------------------
def test_bad_requests_fail_at_add_and_leave_the_engine_idle(models, demo_rotations) -> None:
    llm = LLM(str(models["demo"]), kv_dtype="bf16", device="cpu", max_model_len=256)
    eng = llm.engine
    cases = [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([5, VOCAB], SamplingParams(), r"integer id in \[0, 2048\)"),
        (prompts((256,))[0], SamplingParams(), "max_model_len"),
        (prompts((200,))[0], SamplingParams(max_tokens=100), "max_model_len"),
    ]
    for prompt, params, words in cases:
        with pytest.raises(OscarkvError, match=words):
            eng.add_request(prompt, params)
    assert eng.scheduler.idle and eng.hp.n_free == eng.hp.capacity
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=0),
        dict(max_tokens=0),
        dict(temperature=math.nan),
    ):
        with pytest.raises(OscarkvError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_bad_engine_configs(models, demo_rotations, tmp_path: Path) -> None:
    demo = str(models["demo"])
    other = tmp_path / "other"
    g = torch.Generator().manual_seed(0)
    save_rotations(
        RotationSet(
            {
                i: LayerRotation(
                    random_orthogonal(16, g), random_orthogonal(16, g), torch.ones(16), torch.ones(16)
                )
                for i in range(2)
            }
        ),
        other,
    )
    for kw, words in [
        ({}, "needs rotations"),
        ({"rotations": str(other)}, "head_dim"),
        ({"rotations": str(demo_rotations[0]), "kv_budget_gb": 1e-6}, "too small"),
        ({"kv_dtype": "bf16", "rotations": str(demo_rotations[0])}, "uses no rotations"),
        ({"kv_dtype": "int4"}, "kv_dtype"),
        ({"kv_dtype": "bf16", "cuda_graphs": "yes"}, "cuda_graphs"),
        ({"kv_dtype": "bf16", "cuda_graphs": "on"}, "cuda_graphs on cannot run"),
        ({"kv_dtype": "bf16", "graph_capture": "eager"}, "graph_capture"),
        ({"nonsense": 1}, "unknown option"),
    ]:
        with pytest.raises(OscarkvError, match=words):
            LLM(demo, device="cpu", **kw)
    with pytest.raises(OscarkvError, match="not supported"):
        llama_dir = tmp_path / "gpt2"
        import transformers

        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(llama_dir)
        LLM(str(llama_dir), kv_dtype="bf16", device="cpu")


# ---- defaults that fit the machine ------------------------------------------------------------
DEMO = str(demo_model_path())


def _long_model(path: Path, positions: int) -> Path:
    """A tiny random Qwen3 with ``positions`` positions and wide KV rows (4 layers, 8 KV heads of
    128: 32 KiB per token in fp32), so that its full length is costly."""
    from conftest import tiny_lm_config

    return write_tiny_lm(tiny_lm_config(vocab=VOCAB, layers=4, heads=8, kv_heads=8, head_dim=128,
                                        positions=positions), path)  # fmt: skip


def test_default_budget_holds_an_8k_request_the_old_fixed_default_did_not(tmp_path: Path) -> None:
    """No flags on a CPU: an 8K request of 256 MiB (more than a fixed 0.25 GiB budget held) starts
    at the model's full length, from a share of the available memory, and answers."""
    from oscarkv.config.engine import CPU_BUDGET_FRACTION
    from oscarkv.engine.kv_budget import GIB, available_memory

    avail = available_memory()
    if avail is None or CPU_BUDGET_FRACTION * avail < 0.5 * GIB:
        pytest.skip("less than 2 GiB of memory available")
    llm = LLM(str(_long_model(tmp_path / "m", 8192)), kv_dtype="bf16", device="cpu")
    assert llm.engine.max_model_len == 8192 and llm.engine.cfg.max_running >= 1
    assert "available" in llm.engine.startup_report()
    assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"


def test_an_unset_max_model_len_is_lowered_to_the_longest_request_the_budget_holds(tmp_path: Path) -> None:
    """The default budget (unset) on a model whose full length it does not hold: max_model_len is
    lowered, with one warning line, and a request of the new length runs whole."""
    from oscarkv.errors import OscarkvWarning

    model = _long_model(tmp_path / "m", 1 << 17)  # 4 GiB per request: more than the default's cap
    with pytest.warns(
        OscarkvWarning, match=r"max_model_len lowered to \d+ from the model's 131072 positions"
    ):
        llm = LLM(str(model), kv_dtype="bf16", device="cpu")
    n = llm.engine.max_model_len
    assert 256 <= n < 1 << 17 and n % 16 == 0 and llm.engine.cfg.max_running == 1
    with pytest.raises(OscarkvError, match="max_model_len"):
        llm.engine.add_request([5] * n, SamplingParams(max_tokens=1))
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("kv_dtype", ["bf16", "int2"])
def test_lowered_max_model_len_with_a_set_budget_and_a_set_length_refused(demo_rotations, kv_dtype) -> None:
    """A budget without room for the demo model's 2048 positions: unset, max_model_len is lowered
    (a request of exactly that length runs, without preemption); set by the user, the same length
    is an error naming both numbers and both fixes, never silently changed; a length beyond the
    model's positions is an error naming them; a budget without a short request is refused."""
    from oscarkv.errors import OscarkvWarning

    kw = {"rotations": str(demo_rotations[0]), "spec": SPEC, "page_tokens": 8} if kv_dtype == "int2" else {}
    budget = 4 / 1024 if kv_dtype == "bf16" else 0.0008  # GiB; bf16: 4 MiB at 4 KiB per token
    with pytest.warns(OscarkvWarning, match="max_model_len lowered to"):
        llm = LLM(DEMO, kv_dtype=kv_dtype, device="cpu", kv_budget_gb=budget, check_invariants=True, **kw)
    n = llm.engine.max_model_len
    assert 256 <= n < 2048 and llm.engine.cfg.max_running == 1
    if kv_dtype == "bf16":
        assert n == 1008  # (4 MiB − the dummy page) / 64 KiB pages of 16 tokens
    ids = prompts((n - 4,), seed=5)[0]
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and llm.engine.stats["preemptions"] == 0
    with pytest.raises(OscarkvError, match="too small for one request of max_model_len=2048") as e:
        LLM(DEMO, kv_dtype=kv_dtype, device="cpu", kv_budget_gb=budget, max_model_len=2048, **kw)
    assert "--kv-budget-gb" in e.value.hint and "--max-model-len" in e.value.hint
    with pytest.raises(OscarkvError, match="max_model_len=1000000000 is more than the 2048 positions") as e:
        LLM(DEMO, kv_dtype=kv_dtype, device="cpu", max_model_len=10**9, **kw)
    assert "at most 2048" in e.value.hint
    with pytest.raises(OscarkvError, match="too small for one request of max_model_len=256"):
        LLM(DEMO, kv_dtype=kv_dtype, device="cpu", kv_budget_gb=budget / 8, **kw)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int2"])
def test_default_flags_start_and_answer(demo_rotations, kv_dtype) -> None:
    """The demo model with nothing but its KV dtype (and rotations for int2) on a CPU."""
    kw = {"rotations": str(demo_rotations[0])} if kv_dtype == "int2" else {}
    llm = LLM(DEMO, kv_dtype=kv_dtype, device="cpu", **kw)
    assert llm.engine.max_model_len == 2048
    assert llm.generate(["def add(a, b):"], GREEDY)[0].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["bf16", "int2"])
def test_smollm2_starts_and_answers_with_default_flags(smollm2_dir: Path, tmp_path: Path, kv_dtype) -> None:
    """SmolLM2-135M (8,192 positions, 0.35 GiB per full bf16 request in fp32) with no flags but
    the KV dtype (random rotations for int2: this checks start-up, not quality)."""
    kw = {}
    if kv_dtype == "int2":
        save_rotations(random_rotation_set(30, 64, QuantSpec()), tmp_path / "rot")
        kw["rotations"] = str(tmp_path / "rot")
    llm = LLM(str(smollm2_dir), kv_dtype=kv_dtype, **kw)
    assert llm.engine.max_model_len == 8192
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=8, temperature=0))[0]  # fmt: skip
    assert out.token_ids and out.finish_reason in ("length", "stop")
    if kv_dtype == "bf16":
        assert "Paris" in out.text
