"""Tensor parallelism on CPU (gloo, two processes): TP=2 gives TP=1's greedy tokens on a tiny
random Qwen3 written here and on the 30M reference model (both 4 heads, 2 KV heads, head dim 128)
with INT2 and BF16 KV, a killed worker ends the engine with a clear
error (no hang, no orphan), and a model whose heads do not split is refused before any spawn."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from conftest import SHARED_DIR, random_orthogonal, random_rotation_set, tiny_lm_config, write_tiny_lm
from oscarkv import LLM, QuantSpec, SamplingParams
from oscarkv.engine.distributed import TensorParallelError
from oscarkv.engine.models.parallel import VocabParallelEmbedding, vocab_shard
from oscarkv.engine.tp_step import StepMsg
from oscarkv.errors import ModelError
from oscarkv.rotation import LayerRotation, RotationSet, save_rotations

REF = SHARED_DIR / "models" / "oscar-ref-qwen3-30m"  # Qwen3: 8 layers, 4 heads, 2 KV heads, d 128
SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
KW = dict(device="cpu", page_tokens=8, max_batched_tokens=96, max_running=8, kv_budget_gb=0.05,
          check_invariants=True)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take the parent's count: one each on a 2-core box
    yield
    torch.set_num_threads(n)
    assert not mp.active_children(), "a tensor-parallel worker outlived its test"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (2 layers, 4 heads, 2 KV heads, head dim 128, vocab 2048, the demo
    tokenizer): what CI runs without ../shared."""
    cfg = tiny_lm_config(vocab=2048, layers=2, heads=4, kv_heads=2, head_dim=128)
    return write_tiny_lm(cfg, tmp_path_factory.mktemp("tp-tiny"))


@pytest.fixture(scope="module", params=["tiny", pytest.param("ref", marks=pytest.mark.shared)])
def model(request: pytest.FixtureRequest) -> tuple[Path, int, int]:
    """``(model dir, layers, vocab)``: the tiny model or the 30M reference model (needs ../shared)."""
    return (REF, 8, 8192) if request.param == "ref" else (request.getfixturevalue("tiny"), 2, 2048)


@pytest.fixture(scope="module")
def kv_head_rotations(model: tuple[Path, int, int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random per-KV-head rotations ``[2, 128, 128]`` with channel offsets, so each rank must
    take its own heads' matrices and offsets."""
    g = torch.Generator().manual_seed(3)

    def layer() -> LayerRotation:
        k, v = (torch.stack([random_orthogonal(128, g) for _ in range(2)]) for _ in range(2))
        off = lambda: 0.05 * torch.randn(2, 128, generator=g)  # noqa: E731
        return LayerRotation(k, v, torch.ones(2, 128), torch.ones(2, 128), k_offset=off(), v_offset=off())

    rs = RotationSet({i: layer() for i in range(model[1])}, spec=SPEC, granularity="kv_head")
    out = tmp_path_factory.mktemp("tp-rot")
    save_rotations(rs, out)
    return out


def prompts(vocab: int = 2048) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    # inside the sink, across the window, beyond it (INT2 pages), and one that shares a prefix
    ps = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 70, 190)]
    return [*ps, ps[2][:120] + ps[0]]


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@pytest.mark.parametrize("kv", ["int2", "bf16"])
def test_tp2_gives_the_tokens_of_tp1(kv: str, model: tuple[Path, int, int], kv_head_rotations: Path) -> None:
    path, _, vocab = model
    rot = {"rotations": str(kv_head_rotations), "spec": SPEC} if kv == "int2" else {}
    ps = prompts(vocab)
    with LLM(str(path), kv_dtype=kv, **rot, **KW) as one:
        want = one.generate(ps, GREEDY)
        scored = one.generate(ps[:2], SCORE)
    with LLM(str(path), kv_dtype=kv, **rot, **KW, tensor_parallel=2) as llm:
        got = llm.generate(ps, GREEDY)
        scored_tp = llm.generate(ps[:2], SCORE)  # prompt rows through the vocab-parallel head
        again = llm.generate(ps[-1:], GREEDY)[0]  # served partly from the prefix cache
        assert "tensor parallel 2" in llm.engine.runner.startup_report()
        procs = list(llm.engine.workers.procs)
    for p, a, b in zip(ps, want, got, strict=True):
        assert a.token_ids == b.token_ids, (kv, len(p), first_diff(a.token_ids, b.token_ids))
    assert again.num_cached_tokens > 0 and again.token_ids == got[-1].token_ids
    for a, b in zip(scored, scored_tp, strict=True):  # fp32 sums split over ranks: 1e-3
        assert b.prompt_logprobs[0] is None and len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert [x[0] for x in b.prompt_logprobs[1:]] == pytest.approx(
            [x[0] for x in a.prompt_logprobs[1:]], abs=1e-3
        )
    assert all(p.exitcode == 0 for p in procs)  # stopped cleanly by shutdown()


@pytest.fixture(scope="module")
def tiny32k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3 with 32,768 positions."""
    cfg = tiny_lm_config(vocab=2048, layers=2, heads=4, kv_heads=2, head_dim=128, positions=32768)
    return write_tiny_lm(cfg, tmp_path_factory.mktemp("tp-32k"))


@pytest.mark.parametrize("kv", ["int2", "bf16"])
@pytest.mark.parametrize("which", ["tiny32k", pytest.param("ref", marks=pytest.mark.shared)])
def test_tp2_on_a_32k_model_starts_and_answers_with_default_flags(
    kv: str, which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """No budget, slots or length: the ranks split the CPU default budget and hold the model's
    32K positions."""
    from oscarkv.engine.kv_budget import GIB, available_memory

    avail = available_memory()
    if avail is None or avail < 3 * GIB:
        pytest.skip("less than 3 GiB of memory available")
    path, layers = (REF, 8) if which == "ref" else (request.getfixturevalue("tiny32k"), 2)
    kw = {}
    if kv == "int2":
        save_rotations(random_rotation_set(layers, 128, SPEC), tmp_path / "rot")
        kw["rotations"] = str(tmp_path / "rot")
    with LLM(str(path), kv_dtype=kv, tensor_parallel=2, **kw) as llm:
        assert llm.engine.max_model_len == 32768 and llm.engine.cfg.max_running >= 1
        assert "split over 2 ranks" in llm.engine.startup_report()
        out = llm.generate(prompts(2048 if which == "tiny32k" else 8192)[:2], GREEDY)
    assert [o.finish_reason for o in out] == ["length", "length"]


def test_tp2_lowers_an_unset_max_model_len_as_tp1_does(tiny32k: Path) -> None:
    """A per-rank budget without room for 32K tokens: every rank lowers max_model_len alike (to
    what TP=1 lowers it to with twice the budget: half the KV heads per rank), and a request of
    that length gives TP=1's tokens."""
    from oscarkv.errors import OscarkvWarning

    kw = dict(kv_dtype="bf16", device="cpu", max_batched_tokens=1024, check_invariants=True)
    with pytest.warns(OscarkvWarning, match="max_model_len lowered to"):
        one = LLM(str(tiny32k), kv_budget_gb=0.04, **kw)
    with one:
        n = one.engine.max_model_len
        assert n < 32768
        p = torch.randint(3, 2048, (n - 8,), generator=torch.Generator().manual_seed(2)).tolist()
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        want = one.generate([p], sp)[0].token_ids
    with pytest.warns(OscarkvWarning, match=f"max_model_len lowered to {n} "):
        two = LLM(str(tiny32k), kv_budget_gb=0.02, tensor_parallel=2, **kw)
    with two:
        assert two.engine.max_model_len == n
        assert two.generate([p], sp)[0].token_ids == want


def _generate_bounded(llm: LLM, timeout: float = 60.0) -> BaseException | None:
    """``llm.generate`` in a thread, so that a hang fails the test instead of stalling it."""
    box: list[BaseException | None] = [None]

    def go() -> None:
        try:
            llm.generate(prompts()[:3], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        except BaseException as e:
            box[0] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the engine hung for {timeout:.0f} s after a worker died"
    return box[0]


@pytest.mark.parametrize("when", ["between steps", "during a step", "raises"])
def test_a_killed_worker_ends_the_engine_with_a_clear_error(when: str, tiny: Path) -> None:
    llm = LLM(str(tiny), kv_dtype="bf16", **KW, tensor_parallel=2)
    try:
        (proc,) = llm.engine.workers.procs
        if when == "between steps":
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        elif when == "during a step":  # mid-generation: in a collective or about to send a step
            threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL)).start()
        else:  # a step the worker cannot run: it reports its exception and exits
            llm.engine.workers.send(StepMsg())
        err = _generate_bounded(llm)
        assert isinstance(err, TensorParallelError), repr(err)
        if when == "raises":
            assert "rank 1 raised" in str(err) and "exit code 1" in str(err), str(err)
        else:
            assert "rank 1 of 2 exited" in str(err) and "SIGKILL" in str(err), str(err)
        with pytest.raises(TensorParallelError):  # the engine stays stopped
            llm.engine.step() if llm.engine.has_unfinished() else llm.generate([[5, 6]], GREEDY)
    finally:
        llm.shutdown()


def test_kv_heads_that_do_not_split_are_refused_before_spawning(tiny: Path) -> None:
    with pytest.raises(ModelError, match=r"num_key_value_heads \(2\).*2 % 4 != 0") as e:
        LLM(str(tiny), kv_dtype="bf16", device="cpu", tensor_parallel=4)
    assert "1, 2" in e.value.hint
    assert not mp.active_children()


# ---- the sharding arithmetic, in one process -------------------------------------------------
class _Rank:
    """A stand-in communicator: reductions are left to the test, which sums the ranks' outputs."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x] * self.world


def test_vocab_parallel_embedding_pads_the_last_shard_and_sums_to_the_whole() -> None:
    vocab, hidden, world = 11, 4, 3
    full = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 7, 8, 10])
    out = torch.zeros(len(ids), hidden)
    for r in range(world):
        start, held, rows = vocab_shard(vocab, world, r)
        assert rows == 4 and held == (3 if r == 2 else 4)
        emb = VocabParallelEmbedding(vocab, hidden, _Rank(r, world), dtype=torch.float32, device="cpu")
        with torch.no_grad():
            emb.weight[:held] = full[start : start + held]
        out += emb(ids)
    assert torch.equal(out, full[ids])


def test_checkpoint_shards_cut_heads_columns_and_vocab() -> None:
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from oscarkv.engine.models import Decoder, model_shape

    cfg = Qwen3Config(hidden_size=16, intermediate_size=12, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_hidden_layers=1, vocab_size=10, attention_bias=True)  # fmt: skip
    comm = SimpleNamespace(rank=1, world=2)
    dec = Decoder(cfg, model_shape(cfg), dtype=torch.float32, device="cpu", comm=comm)
    targets = dec.checkpoint_targets()
    shard = lambda key: targets[key].shard  # noqa: E731
    assert shard("model.layers.0.self_attn.q_proj.weight") == (0, 16, 16, 32)
    assert shard("model.layers.0.self_attn.v_proj.bias") == (0, 8, 8, 16)
    assert shard("model.layers.0.mlp.up_proj.weight") == (0, 6, 6, 12)
    assert shard("model.layers.0.self_attn.o_proj.weight") == (1, 16, 16, 32)
    assert shard("model.layers.0.mlp.down_proj.weight") == (1, 6, 6, 12)
    assert shard("model.layers.0.self_attn.o_proj.bias") is None  # added once, after the reduce
    assert shard("model.embed_tokens.weight") == (0, 5, 5, 10)
    assert shard("model.layers.0.input_layernorm.weight") is None
    assert shard("model.layers.0.self_attn.q_norm.weight") is None  # per-head norms: replicated
