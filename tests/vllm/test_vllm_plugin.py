"""The vLLM plug-in (``oscarkv.vllm_plugin``, docs/vllm.md).

The options and layout tests run anywhere. The others need vLLM's CPU build in its own
virtualenv (docs/vllm.md), and are skipped without it; they run the 30M reference model from
../shared, or a random model of its attention shape where ../shared is missing, and tiny random
mixture-of-experts checkpoints (``tests/engine/moe_models.py``) of the architectures vLLM's CPU
build runs. vLLM starts its workers with ``spawn`` and a failed start kills its engine process, so
every engine runs in a subprocess (``run_vllm.py``, ``start_fail.py``, the OpenAI server); one
engine per configuration, shared through module-scoped fixtures. About 7½ minutes on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from conftest import SHARED_DIR, random_orthogonal, random_rotation_set, tiny_lm_config, write_tiny_lm
from oscarkv.config import QuantSpec
from oscarkv.errors import InputError, OscarkvError
from oscarkv.rotation import LayerRotation, RotationSet, save_rotations
from oscarkv.vllm_plugin.checks import store_capacity
from oscarkv.vllm_plugin.layout import flat_rows, hp_token_bytes, int2_token_bytes, page_rows, write_rows
from oscarkv.vllm_plugin.options import PluginOptions

HERE = Path(__file__).resolve().parent
SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)  # small windows: INT2 early
MAX_TOKENS = 40
VOCAB = 2048  # prompt ids below it: the demo tokenizer's size, which the stand-in model shares


def _have_vllm() -> bool:
    # not "vllm": with tests/ on sys.path this folder is itself a namespace package of that name
    try:
        import vllm.entrypoints  # noqa: F401
    except ImportError:
        return False
    return True


VLLM = pytest.mark.skipif(not _have_vllm(), reason="needs vLLM (the CPU build, docs/vllm.md)")


# ---- anywhere ------------------------------------------------------------------------------


def test_options_opt_in_only() -> None:
    assert PluginOptions.from_additional_config({}) is None
    assert PluginOptions.from_additional_config({"other": 1}) is None
    assert PluginOptions.from_additional_config({"oscarkv": {}}) == PluginOptions()
    assert PluginOptions.from_additional_config({"oscarkv": True}).kv_dtype == "bf16"
    assert PluginOptions.from_additional_config({"oscarkv": {"kv_dtype": "int2"}}).rotations is None
    assert PluginOptions.from_additional_config({"oscarkv": {"kv_dtype": "int2"}}).absorb_v


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"kv_dtype": "fp8"}, "kv_dtype must be one of"),
        ({"rotation": "x"}, "unknown option"),
        ({"kv_dtype": "bf16", "rotations": "x"}, "uses no rotations"),
        ("bf16", "must be a dict"),
        ({"absorb_v": False}, "kv_dtype='int2' only"),
        ({"kv_dtype": "int2", "absorb_v": "yes"}, "true or false"),
    ],
)
def test_options_errors(raw: object, words: str) -> None:
    with pytest.raises(InputError, match=words):
        PluginOptions.from_additional_config({"oscarkv": raw})


def test_token_bytes() -> None:
    # the 30M reference model: 2 KV heads, head_dim 128, bf16
    assert hp_token_bytes(2, 128, 2) == 1024
    assert int2_token_bytes(2, 128) == 144  # 2 x 2 x (32 code bytes + fp16 scale and zero)


def test_pages_round_trip_and_padding() -> None:
    nb, bs, h, d = 3, 4, 2, 8
    cache = torch.zeros(nb, 1, bs, 2 * h * d, dtype=torch.bfloat16)
    pages = page_rows(cache, h, d)
    k = torch.randn(3, h, d).bfloat16()
    v = torch.randn(3, h, d).bfloat16()
    write_rows(pages, k, v, torch.tensor([9, -1, 2]))
    assert torch.equal(pages[2, 1, 0], k[0]) and torch.equal(pages[2, 1, 1], v[0])
    assert torch.equal(pages[0, 2, 0], k[2]) and torch.equal(pages[0, 2, 1], v[2])
    assert int((cache != 0).any(-1).sum()) == 2  # the padded row went nowhere
    with pytest.raises(RuntimeError, match="unexpected KV page view"):
        page_rows(torch.zeros(nb, h, bs, 2 * d), h, d)


def test_flat_rows_skip_other_layers_pages() -> None:
    # two layers' pages interleaved block by block, as vLLM may lay them out
    raw = torch.arange(3 * 2 * 4 * 6, dtype=torch.uint8).view(3, 2, 4, 6)
    layer1 = raw[:, 1:2]  # [blocks, 1, bs, C], block stride 2 pages
    rows, rpb = flat_rows(layer1)
    assert rpb == 8 and torch.equal(rows[2 * rpb + 3], layer1[2, 0, 3])


# ---- vLLM ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 30M reference model from ../shared; without it (a bare CI checkout) a random Qwen3 of the
    same attention shape (8 layers, 4 heads, 2 KV heads, head dim 128) with the demo tokenizer."""
    if not _have_vllm():
        pytest.skip("needs vLLM (the CPU build, docs/vllm.md)")
    if SHARED_DIR.is_dir():
        return SHARED_DIR / "models" / "oscar-ref-qwen3-30m"
    cfg = tiny_lm_config("qwen3", vocab=VOCAB, layers=8, heads=4, kv_heads=2, head_dim=128, positions=4096)
    return write_tiny_lm(cfg, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def artifact(work: Path) -> Path:
    return save_rotations(random_rotation_set(8, 128, SPEC), work / "rot").parent


def _run_vllm(work: Path, name: str, job: dict) -> tuple[dict, str]:
    (work / f"{name}.job.json").write_text(json.dumps(job))
    cmd = [
        sys.executable,
        str(HERE / "run_vllm.py"),
        str(work / f"{name}.job.json"),
        str(work / f"{name}.json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return json.loads((work / f"{name}.json").read_text()), log


def _int2_config(rot: Path | str, absorb_v: bool = True) -> dict:
    return {"oscarkv": {"kv_dtype": "int2", "rotations": str(rot), "absorb_v": absorb_v}}


def _prompts() -> list[list[list[int]]]:
    """Token-id prompts: three short ones prefilled together in one 64-token step, their
    decodes demoting as they go; then one of 150 tokens alone, in chunks of 64, 64 and 22."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(10, VOCAB, (n,), generator=g).tolist() for n in (12, 20, 25, 150)]
    return [ids[:3], ids[3:]]


@VLLM
@pytest.mark.slow
@pytest.mark.parametrize("absorb_v", [True, False], ids=["absorbed", "rotate_on_write"])
def test_int2_matches_our_engine(model: Path, work: Path, artifact: Path, absorb_v: bool) -> None:
    """``absorb_v=True`` (the default, with the ``oscarkv`` load format) against our engine's
    default; ``absorb_v=False`` (vLLM's own loader, values rotated on write) against ours with
    ``absorb_v=False``."""
    from oscarkv import LLM, SamplingParams

    llm = {
        "dtype": "float32",  # our engine runs fp32 on CPU: same dtype, same rounding
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "additional_config": _int2_config(artifact, absorb_v),
    } | ({"load_format": "oscarkv"} if absorb_v else {})
    job = {"model": str(model), "llm": llm, "max_tokens": MAX_TOKENS, "batches": _prompts()}
    res, log = _run_vllm(work, f"int2_{absorb_v}", job)
    assert "oscarkv: KV pages hold INT2 rows (144 bytes per token per layer)" in log
    assert ("oscarkv: R_V absorbed into qkv_proj of 8 layers" in log) == absorb_v
    # max_model_len: the CPU default budget (0.25 GiB) holds no BF16 request of the model's 32K
    # positions, and with max_running unset the engine takes the requests of max_model_len it holds
    kw = {
        "device": "cpu",
        "page_tokens": 16,
        "max_batched_tokens": 64,
        "prefix_cache": False,
        "max_model_len": 4096,
    }
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ours = LLM(str(model), rotations=str(artifact), absorb_v=absorb_v, **kw)
    want = [[o.token_ids for o in ours.generate(b, sp)] for b in _prompts()]
    assert res["tokens"] == want
    if absorb_v:
        return
    bf16 = LLM(str(model), kv_dtype="bf16", **kw)
    plain = [[o.token_ids for o in bf16.generate(b, sp)] for b in _prompts()]
    assert plain != want  # the INT2 tier really changed something


@VLLM
@pytest.mark.slow
def test_passthrough_matches_vllm_greedy(model: Path, work: Path) -> None:
    long = "import json\n\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40))
    batches = [
        ["def add(a, b):", "import os\nimport sys\n\ndef main():", "class Stack:\n    def __init__(self):"],
        [long, long + "def g("],  # the second hits the first's cached prefix
        [long],  # a full repeat
    ]
    # fp32: in bf16 a different summation order flips near-ties, and vLLM's CPU attention sums in
    # an order that depends on the instruction set (the trained model diverged at token 8 on an
    # AVX-512 EPYC and not elsewhere)
    job = {"model": str(model), "llm": {"dtype": "float32"}, "max_tokens": 32, "batches": batches}
    plain, plain_log = _run_vllm(work, "plain", job)
    job["llm"] |= {"max_num_batched_tokens": 64, "additional_config": {"oscarkv": {"kv_dtype": "bf16"}}}
    ours, log = _run_vllm(work, "bf16", job)
    assert "oscarkv:" not in plain_log  # installed but not opted in: vLLM's own attention
    assert "oscarkv: KV pages in the oscarkv 16-bit passthrough layout" in log
    assert ours["prefix_cache"].get("vllm:prefix_cache_hits", 0) > 0  # the cached-prefix path ran
    assert ours["tokens"] == plain["tokens"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@VLLM
@pytest.mark.slow
def test_openai_server_answers_with_int2(model: Path, work: Path, artifact: Path) -> None:
    import openai

    port, log = _free_port(), work / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
           "--no-enable-prefix-caching", "--load-format", "oscarkv", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 * 2**20),
           "--additional-config", json.dumps(_int2_config(artifact))]  # fmt: skip
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "the server did not come up in 180 s"
                time.sleep(1)
        out = client.completions.create(
            model=str(model), prompt="def add(a, b):", max_tokens=8, temperature=0
        )
        assert out.choices[0].text and out.usage.completion_tokens == 8
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "oscarkv: KV pages hold INT2 rows" in log.read_text()


# ---- mixture-of-experts architectures --------------------------------------------------------
# vLLM's CPU build runs Qwen3-MoE and GLM-4 MoE; it does not run MiniMax-M2 (its router, see
# test_vllm_cpu_cannot_route_minimax_m2). docs/vllm.md "Architectures".
MOE_VLLM = ("qwen3_moe", "glm4_moe")
MOE_LEN = 512  # the tiny checkpoints' max_position_embeddings
MOE_BATCHES = [*_prompts(), _prompts()[1]]  # the long prompt again: a prefix-cache hit


def _moe_models() -> ModuleType:
    """``tests/engine/moe_models.py`` (not on ``sys.path`` when only this folder runs)."""
    spec = importlib.util.spec_from_file_location("moe_models", HERE.parent / "engine" / "moe_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=MOE_VLLM)
def moe(request: pytest.FixtureRequest, work: Path) -> SimpleNamespace:
    """A tiny random checkpoint of the architecture (3 layers, 2 KV heads, head_dim 128, 8
    experts), nonzero q/k/v biases where it has them (GLM: R_V absorption folds the V bias), and
    its rotations calibrated per KV head as in tests/engine/test_engine_moe.py."""
    if not _have_vllm():
        pytest.skip("needs vLLM (the CPU build, docs/vllm.md)")
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oscarkv import calibrate
    from oscarkv.config import CalibrationConfig

    kind = request.param
    path = _moe_models().write_moe_model(kind, work / kind)
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    for name, t in weights.items():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            weights[name] = 0.3 * torch.randn(t.shape, generator=g)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = CalibrationConfig(tokens=256, seq_len=128, holdout_tokens=128, granularity="kv_head",
                            max_ppl_increase=None, seed=0)  # fmt: skip
    rot = work / f"rot-{kind}"
    save_rotations(calibrate(hf, AutoTokenizer.from_pretrained(path), cfg, SPEC), rot)
    return SimpleNamespace(kind=kind, path=path, rotations=rot)


def _split_runs(log: str, names: list[str]) -> dict[str, str]:
    """Each run's part of a ``run_vllm.py`` log with ``"runs"`` (between its markers)."""
    return {n: log.split(f"@@run {n}\n", 1)[1].split(f"@@end {n} ", 1)[0] for n in names}


@pytest.fixture(scope="module")
def moe_vllm(moe: SimpleNamespace, work: Path) -> SimpleNamespace:
    """vLLM on the architecture, one engine per configuration, one process (vLLM imported once):
    ``bf16`` (passthrough, 64-token chunks, the long prompt twice: a prefix-cache hit; first, so
    the process's prefix-cache counters are its own), ``int2`` (calibrated rotations, R_V absorbed
    at load) and ``plain`` (vLLM's own attention). fp32 weights throughout, as our engine on CPU."""
    base = {"dtype": "float32", "max_model_len": MOE_LEN}
    chunked = base | {"max_num_batched_tokens": 64, "max_num_seqs": 8}
    runs = {
        "bf16": chunked | {"additional_config": {"oscarkv": {"kv_dtype": "bf16"}}},
        "int2": chunked | {"enable_prefix_caching": False, "load_format": "oscarkv",
                           "additional_config": _int2_config(moe.rotations)},
        "plain": base,
    }  # fmt: skip
    job = {"model": str(moe.path), "runs": runs, "max_tokens": MAX_TOKENS, "batches": MOE_BATCHES}
    res, log = _run_vllm(work, f"{moe.kind}_runs", job)
    logs = _split_runs(log, list(runs))
    return SimpleNamespace(**{n: SimpleNamespace(log=logs[n], **res["runs"][n]) for n in runs})


@VLLM
@pytest.mark.slow
def test_moe_passthrough_matches_vllm_greedy(moe_vllm: SimpleNamespace) -> None:
    """``kv_dtype="bf16"`` gives vLLM's own greedy tokens on the architecture."""
    assert "oscarkv:" not in moe_vllm.plain.log
    assert "oscarkv: KV pages in the oscarkv 16-bit passthrough layout" in moe_vllm.bf16.log
    assert moe_vllm.bf16.prefix_cache.get("vllm:prefix_cache_hits", 0) > 0
    assert moe_vllm.bf16.tokens == moe_vllm.plain.tokens


@VLLM
@pytest.mark.slow
def test_moe_int2_matches_our_engine(moe: SimpleNamespace, moe_vllm: SimpleNamespace) -> None:
    """INT2 with calibrated per-KV-head rotations and R_V absorbed at load (``load_format="oscarkv"``,
    into GLM's q/k/v biases too): vLLM's greedy tokens equal ``oscarkv.LLM``'s, token for token,
    with the setup of :func:`test_int2_matches_our_engine`."""
    from oscarkv import LLM, SamplingParams

    assert "oscarkv: R_V absorbed into qkv_proj of 3 layers" in moe_vllm.int2.log
    kw = {"device": "cpu", "page_tokens": 16, "max_batched_tokens": 64, "prefix_cache": False,
          "max_model_len": MOE_LEN}  # fmt: skip
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ours = LLM(str(moe.path), rotations=str(moe.rotations), **kw)
    want = [[o.token_ids for o in ours.generate(b, sp)] for b in MOE_BATCHES]
    assert moe_vllm.int2.tokens == want
    assert want != moe_vllm.plain.tokens  # the INT2 tier really changed the output


@VLLM
def test_vllm_cpu_cannot_route_minimax_m2() -> None:
    """Why vLLM's CPU build does not run MiniMax-M2: its MoE asks vLLM's router for sigmoid scores
    with a correction bias and no expert groups (``models/minimax_m2.py``), and the CPU router
    computes sigmoid scores only for grouped top-k. GLM-4 MoE's grouped routing is served. Should
    the first call start to pass, vLLM has caught up: try minimax_m2 in ``MOE_VLLM``."""
    from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router

    hidden, logits = torch.zeros(3, 16), torch.randn(3, 8)
    minimax = create_fused_moe_router(top_k=2, global_num_experts=8, renormalize=True, scoring_func="sigmoid",
                                      e_score_correction_bias=torch.zeros(8))  # fmt: skip
    with pytest.raises(AssertionError):
        minimax.select_experts(hidden, logits)
    glm = create_fused_moe_router(top_k=2, global_num_experts=8, renormalize=True, use_grouped_topk=True,
                                  num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                                  routed_scaling_factor=2.5, e_score_correction_bias=torch.zeros(8))  # fmt: skip
    weights, ids = glm.select_experts(hidden, logits)
    assert ids.shape == (3, 2) and torch.allclose(weights.sum(-1), torch.full((3,), 2.5))


def _fake_vllm_config(model_dir: Path, rot: Path | None, **over: object) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` that :mod:`oscarkv.vllm_plugin.checks` reads (the 30M
    reference model's shape: 8 layers, 2 KV heads, head_dim 128)."""
    hf = tiny_lm_config("qwen3", vocab=100, layers=8, heads=4, kv_heads=2, head_dim=128)
    for k in ("sliding_window", "use_sliding_window"):
        if k in over:
            setattr(hf, k, over.pop(k))
    mc = SimpleNamespace(model=str(model_dir), hf_text_config=hf, use_mla=over.pop("use_mla", False),
                         is_encoder_decoder=over.pop("is_encoder_decoder", False),
                         get_total_num_kv_heads=lambda: 2, get_head_size=lambda: 128)  # fmt: skip
    cc = SimpleNamespace(
        cache_dtype=over.pop("cache_dtype", "auto"), enable_prefix_caching=over.pop("prefix", False)
    )
    cfg = SimpleNamespace(model_config=mc, cache_config=cc, speculative_config=None,
                          parallel_config=SimpleNamespace(tensor_parallel_size=over.pop("tp", 1)),
                          load_config=SimpleNamespace(load_format=over.pop("load_format", "oscarkv")))  # fmt: skip
    cfg.opts = PluginOptions("int2", None if rot is None else str(rot))
    assert not over
    return cfg


def _kv_head_artifact(path: Path, heads: int) -> Path:
    g = torch.Generator().manual_seed(3)

    def rot() -> torch.Tensor:
        return torch.stack([random_orthogonal(128, g) for _ in range(heads)])

    layers = {
        i: LayerRotation(rot(), rot(), torch.ones(heads, 128), torch.ones(heads, 128)) for i in range(8)
    }
    return save_rotations(RotationSet(layers, SPEC, granularity="kv_head"), path)


def test_bad_configurations_are_refused(tmp_path: Path) -> None:
    """Every start-up check of :mod:`~oscarkv.vllm_plugin.checks`, on a stand-in config (fast;
    :func:`test_bad_configuration_stops_vllm` shows one reaching the user through vLLM)."""
    from oscarkv.vllm_plugin.checks import check_model, int2_setup

    good = save_rotations(random_rotation_set(8, 128, SPEC), tmp_path / "good")
    cases = {
        "no rotations": (_fake_vllm_config(tmp_path, None), "needs rotations"),
        "missing": (_fake_vllm_config(tmp_path, tmp_path / "nowhere"), "no such file or directory"),
        "head_dim": (
            _fake_vllm_config(tmp_path, save_rotations(random_rotation_set(8, 64, SPEC), tmp_path / "hd")),
            "head_dim does not match the model",
        ),
        "kv heads": (
            _fake_vllm_config(tmp_path, _kv_head_artifact(tmp_path / "kvh", 3)),
            "KV head count does not match the model",
        ),
        "layers": (
            _fake_vllm_config(tmp_path, save_rotations(random_rotation_set(4, 128, SPEC), tmp_path / "ly")),
            "layer ids do not match the model",
        ),
        "prefix caching": (_fake_vllm_config(tmp_path, good, prefix=True), "--no-enable-prefix-caching"),
        "sliding": (
            _fake_vllm_config(tmp_path, good, sliding_window=64, use_sliding_window=True),
            "sliding-window",
        ),
        "mla": (_fake_vllm_config(tmp_path, good, use_mla=True), "(MLA)"),
        "enc-dec": (_fake_vllm_config(tmp_path, good, is_encoder_decoder=True), "encoder-decoder"),
        "fp8": (_fake_vllm_config(tmp_path, good, cache_dtype="fp8"), "--kv-cache-dtype fp8"),
        "fp8 windows": (
            _fake_vllm_config(
                tmp_path,
                save_rotations(
                    random_rotation_set(8, 128, replace(SPEC, window_dtype="fp8_e4m3")), tmp_path / "f8w"
                ),
            ),
            "QuantSpec.window_dtype='fp8_e4m3'",
        ),
        "tp": (_fake_vllm_config(tmp_path, good, tp=2), "tensor_parallel_size=1"),
        "absorb without loader": (
            _fake_vllm_config(tmp_path, good, load_format="auto"),
            "needs load_format='oscarkv' (--load-format oscarkv)",
        ),
    }
    for name, (cfg, words) in cases.items():
        with pytest.raises(OscarkvError) as e:
            check_model(cfg, cfg.opts)
            int2_setup(cfg, cfg.opts)
        assert words in str(e.value), (name, str(e.value))
    cfg = _fake_vllm_config(tmp_path, good)
    check_model(cfg, cfg.opts)
    assert int2_setup(cfg, cfg.opts).row_bytes == 144
    shutil.copy(good, tmp_path / "rotations.safetensors")  # the artifact next to the model
    cfg = _fake_vllm_config(tmp_path, None)
    assert int2_setup(cfg, cfg.opts).spec == SPEC


@VLLM
@pytest.mark.slow
def test_bad_configuration_stops_vllm(model: Path, work: Path, artifact: Path) -> None:
    """A refused configuration stops vLLM's start with our message in its output (the worker's
    log, above "Engine core initialization failed")."""
    cases = {
        "prefix_cache": ({"additional_config": _int2_config(artifact)}, "--no-enable-prefix-caching"),
        "kv_heads": (
            {
                "additional_config": _int2_config(_kv_head_artifact(work / "kvh", 3)),
                "enable_prefix_caching": False,
                "load_format": "oscarkv",
            },
            "KV head count does not match the model",
        ),
    }
    spec = {n: {"model": str(model), "llm": llm} for n, (llm, _) in cases.items()}
    (work / "cases.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "start_fail.py"), str(work / "cases.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    log = proc.stdout
    assert proc.returncode == 0, log[-4000:]
    for name, (_, words) in cases.items():
        part = log.split(f"@@case {name}\n", 1)[1].split(f"@@end {name} ", 1)
        assert part[1].startswith("failed"), f"{name} started"
        assert words in part[0], f"{name}: {words!r} not in\n{part[0][-3000:]}"


@VLLM
def test_int2_pages_fit_vllms_allocator() -> None:
    """vLLM's own spec classes size an INT2 page from what the backend publishes, and unify it
    with the per-request 16-bit store without padding (:func:`store_capacity`)."""
    from dataclasses import replace

    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size
    from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec

    h, d, bs = 2, 128, 128  # the 30M reference model, vLLM's CPU block size
    for dtype, hp_row in ((torch.bfloat16, 1024), (torch.float32, 2048)):
        int2 = FullAttentionSpec(block_size=bs, num_kv_heads=h, head_size=d, dtype=torch.uint8)
        int2 = replace(int2, num_head_slots=1, state_content_bytes=int2_token_bytes(h, d))
        cap = store_capacity(16 + 39, bs * 144, hp_row)
        store = CircularBufferSpec(block_size=cap, num_kv_heads=h, head_size=d, dtype=dtype)
        store = replace(store, num_head_slots=1, state_content_bytes=hp_row)
        out = unify_kv_cache_spec_page_size({"attn": int2, "attn.oscarkv_hp": store})
        assert out["attn"].page_size_bytes == out["attn.oscarkv_hp"].page_size_bytes == cap * hp_row
        assert out["attn"].page_size_padded is None and cap >= 55


@VLLM
def test_register_targets_cpu_and_custom_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """``register`` overrides ``CPU_ATTN`` and fills the ``CUSTOM`` slot (what ``--attention-backend
    CUSTOM`` selects on CUDA) with classes vLLM can validate; the CUDA backend itself never ran."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends import registry

    import oscarkv.vllm_plugin as plugin
    from oscarkv.vllm_plugin.cuda_backend import OscarCudaAttentionBackend

    calls = []
    monkeypatch.setattr(registry, "register_backend", lambda member, path: calls.append((member, path)))
    plugin.register()
    enum = registry.AttentionBackendEnum
    assert calls == [(enum.CPU_ATTN, plugin.BACKEND_PATH), (enum.CUSTOM, plugin.CUDA_BACKEND_PATH)]
    monkeypatch.undo()
    plugin.register()  # for real: the classes resolve through the registry
    assert enum.CUSTOM.get_class() is OscarCudaAttentionBackend
    assert enum[OscarCudaAttentionBackend.get_name()] is enum.CUSTOM  # as the layer maps it back
    kw = {"head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "auto", "block_size": 16,
          "use_mla": False, "has_sink": False, "use_sparse": False, "use_mm_prefix": False,
          "use_per_head_quant_scales": False, "device_capability": DeviceCapability(9, 0),
          "attn_type": "decoder"}  # fmt: skip
    assert OscarCudaAttentionBackend.validate_configuration(**kw) == []
    bad = OscarCudaAttentionBackend.validate_configuration(
        **(kw | {"kv_cache_dtype": "fp8", "use_mla": True})
    )
    assert "kv_cache_dtype not supported" in bad and "MLA not supported" in bad
