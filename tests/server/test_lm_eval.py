"""EleutherAI's lm-eval against a live ``oscarkv serve`` (``local-completions``), on two local
tasks: a loglikelihood task (multiple choice, scored through ``echo`` + ``logprobs``) and a
generation task (greedy, stop at a newline). Bundled demo model, CPU, fp32, BF16 KV: the scores
through the server equal lm-eval's own HF backend on the same weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_demo import DEMO, MODEL, engine_config

from oscarkv import QuantSpec
from oscarkv.config import ServerConfig
from oscarkv.server.launch import RunningServer, start_server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency ([dev])")

DATA = Path(__file__).parent / "lm_eval_tasks"
COMMON = {
    "test_split": "test",
    "doc_to_text": "{{context}}",
    "target_delimiter": "",
    "metadata": {"version": 1},
}
TASKS = {
    "oscarkv_mc": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}",
                   "metric_list": [{"metric": "acc"}]},
    "oscarkv_gen": {"output_type": "generate_until", "doc_to_target": "{{answer}}",
                    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0},
                    "metric_list": [{"metric": "exact_match"}]},
}  # fmt: skip


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two tasks' YAML (JSON is YAML) with absolute data paths."""
    d = tmp_path_factory.mktemp("tasks")
    for name, spec in TASKS.items():
        data = str(DATA / f"{name.removeprefix('oscarkv_')}.jsonl")
        body = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                **COMMON, **spec}  # fmt: skip
        (d / f"{name}.yaml").write_text(json.dumps(body, indent=1))
    return d


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    s = start_server(engine_config(), ServerConfig(port=0))
    yield s
    s.stop()


def _evaluate(model: str, model_args: str, task_dir: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), batch_size=4,
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)  # fmt: skip
    assert res is not None
    return res


def test_lm_eval_local_completions_scores_equal_the_hf_backend(srv: RunningServer, task_dir: Path) -> None:
    api = _evaluate(
        "local-completions",
        f"base_url={srv.url}/v1/completions,model={MODEL},tokenizer={DEMO},"
        "tokenized_requests=True,num_concurrent=1,max_retries=1",
        task_dir,
    )
    hf = _evaluate("hf", f"pretrained={DEMO},dtype=float32,device=cpu", task_dir)
    mc, gen = api["results"]["oscarkv_mc"], api["results"]["oscarkv_gen"]
    assert mc["acc,none"] == hf["results"]["oscarkv_mc"]["acc,none"]
    assert gen["exact_match,none"] == hf["results"]["oscarkv_gen"]["exact_match,none"]
    # per request, not only the aggregate: each choice's log-likelihood and each generated text
    for a, b in zip(api["samples"]["oscarkv_mc"], hf["samples"]["oscarkv_mc"], strict=True):
        ll_a = [r[0][0] for r in a["resps"]]
        ll_b = [r[0][0] for r in b["resps"]]
        assert ll_a == pytest.approx(ll_b, abs=1e-3)
    for a, b in zip(api["samples"]["oscarkv_gen"], hf["samples"]["oscarkv_gen"], strict=True):
        assert a["filtered_resps"] == b["filtered_resps"]
    assert len(api["samples"]["oscarkv_mc"]) == 10 and len(api["samples"]["oscarkv_gen"]) == 8
    assert mc["acc,none"] > 0 and gen["exact_match,none"] > 0  # the tasks measure something


SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
LONG = "oscarkv_long_mc"


@pytest.fixture(scope="module")
def long_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A loglikelihood task whose contexts run past the INT2 server's 16-bit windows (48 tokens)."""
    import inspect
    import json as _json

    d = tmp_path_factory.mktemp("long-task")
    lines = inspect.getsource(json).splitlines()
    docs = [
        {
            "context": "\n".join(lines[i : i + 14]) + "\ndef",
            "choices": [" dumps", " loads", " main"],
            "gold": 0,
        }
        for i in (40, 120, 200)
    ]
    (d / "long.jsonl").write_text("".join(_json.dumps(x) + "\n" for x in docs))
    body = {"task": LONG, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(d / "long.jsonl")}},
            **COMMON, **TASKS["oscarkv_mc"]}  # fmt: skip
    (d / f"{LONG}.yaml").write_text(_json.dumps(body, indent=1))
    return d


def _long_lls(url: str, task_dir: Path) -> tuple[list[list[float]], list[tuple[str, str]]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = f"base_url={url}/v1/completions,model={MODEL},tokenizer={DEMO},tokenized_requests=True,num_concurrent=1,max_retries=1"
    res = simple_evaluate(model="local-completions", model_args=args, tasks=[LONG], batch_size=4,
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)  # fmt: skip
    assert res is not None
    samples = res["samples"][LONG]
    return [[r[0][0] for r in s["resps"]] for s in samples], [
        tuple(a) for s in samples for a in s["arguments"]
    ]


def test_lm_eval_through_an_int2_server_scores_what_decoding_reads(
    srv: RunningServer, long_task: Path, tmp_path: Path
) -> None:
    """Through an INT2 server (the default ``--prompt-scoring decode``) each choice's
    log-likelihood is the engine's decode-rule score of the same tokens (which equals
    ``OscarCache`` decoding them: tests/engine/test_prompt_scoring.py), and differs from the
    16-bit server's past the windows."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from conftest import random_rotation_set
    from oscarkv import LLM, SamplingParams
    from oscarkv.rotation import save_rotations

    rot = tmp_path / "rot"
    save_rotations(random_rotation_set(4, 128, SPEC), rot)
    cfg = engine_config(kv_dtype="int2", rotations=str(rot), spec=SPEC, page_tokens=8)
    int2 = start_server(cfg, ServerConfig(port=0))
    try:
        got, args = _long_lls(int2.url, long_task)
    finally:
        int2.stop()
    bf16, _ = _long_lls(srv.url, long_task)
    lm = LocalCompletionsAPI(base_url="http://127.0.0.1:1/v1/completions", model=MODEL, tokenizer=DEMO,
                             tokenized_requests=True)  # fmt: skip
    pairs = [lm._encode_pair(ctx, cont) for ctx, cont in args]
    assert all(len(a) > SPEC.sink_tokens + SPEC.recent_tokens for a, _ in pairs)  # past the windows
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    with LLM(DEMO, rotations=str(rot), device="cpu", spec=SPEC, page_tokens=8, max_running=4) as llm:
        outs = llm.generate([a + b for a, b in pairs], params)
    want = [sum(lp[0] for lp in o.prompt_logprobs[len(a) :]) for o, (a, _) in zip(outs, pairs, strict=True)]
    flat = [x for row in got for x in row]
    assert flat == pytest.approx(want, abs=1e-4)
    assert max(abs(x - y) for x, y in zip(flat, (x for row in bf16 for x in row), strict=True)) > 0.05
