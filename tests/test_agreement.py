"""The chat-agreement task: the loop detector, exact-length chat prompts from the evaluation text,
and a tiny run through `run_eval` and the report on the bundled demo model."""

from __future__ import annotations

import json
import random

import pytest

from oscarkv.config import EvalConfig, SpecError
from oscarkv.demo import demo_model_path
from oscarkv.eval import run_eval, write_report
from oscarkv.eval.report import summary
from oscarkv.eval.tasks.agreement import (
    INSTRUCTIONS,
    agreement_frame,
    build_agreement_cases,
    common_prefix,
    distinct_ngram_ratio,
    is_loop,
    tail_repeat_fraction,
)


@pytest.fixture(scope="module")
def demo_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(demo_model_path()), dtype="float32").eval()


def test_exact_cycles_loop_and_distinct_text_does_not() -> None:
    for period in (1, 3, 7, 16):
        cycle = list(range(100, 100 + period))
        assert is_loop(list(range(40)) + cycle * (100 // period)), period  # fluent start, then a cycle
    assert not is_loop(list(range(128)))  # nothing repeats
    rng = random.Random(0)
    assert not is_loop([rng.randrange(5000) for _ in range(128)])
    assert tail_repeat_fraction(list(range(128))) == 0.0 and tail_repeat_fraction([1, 2]) == 0.0
    # a short answer is never a loop, however repetitive
    assert not is_loop([7] * 15) and is_loop([7] * 16)


def test_a_repeated_phrase_with_changing_numbers_loops() -> None:
    """``a 500 (a bug) for a 404 (not found) for a 400 …`` as tokens: a fixed phrase around an
    HTTP status code and a description, both drawn afresh every cycle (digits as separate tokens,
    as SmolLM2 splits them)."""
    rng = random.Random(1)
    a, for_, lp, rp = 10, 12, 13, 14
    codes = [[45, 40, 40], [44, 40, 44], [44, 40, 40], [44, 40, 41], [44, 40, 43], [44, 40, 48]]
    words = [[20, 21], [22, 23], [24], [25, 26]]  # "a bug", "not found", ...
    toks = [30, 31, 32, 33, 34, 35]  # "The server returns"
    while len(toks) < 128:
        toks += [a, *rng.choice(codes), lp, *rng.choice(words), rp, for_]
    toks = toks[:128]
    assert 0.5 <= tail_repeat_fraction(toks) < 0.9 and is_loop(toks)
    # the same phrase lengths with fresh words every cycle: no loop
    fresh = list(range(1000, 1128))
    assert not is_loop(fresh) and distinct_ngram_ratio(fresh) == 1.0


def test_a_fluent_list_does_not_loop(chat_tok) -> None:
    text = (
        "The module defines three helpers. First, `read_config` opens the file and parses each "
        "line into a key and a value. Second, `merge` combines two dictionaries, preferring the "
        "later one. Third, `write_config` writes the result back, sorted by key, and returns the "
        "number of lines written. Errors are reported through a custom exception, and the tests "
        "cover empty files, duplicated keys and unreadable paths."
    )
    ids = chat_tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 64 and not is_loop(ids)
    looping = chat_tok(" for a 404 (not found)" * 20, add_special_tokens=False)["input_ids"]
    assert is_loop(looping) and distinct_ngram_ratio(looping) < 0.3


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0


def test_prompts_are_exact_length_chat_prompts_from_distinct_excerpts(chat_tok, tmp_path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        lines = [
            f"Section {i}.{j}: the value of item {i * 100 + j} is stored in the table." for j in range(80)
        ]
        (docs / f"d{i}.md").write_text("\n".join(lines))
    cases = build_agreement_cases(chat_tok, 400, 8, [docs], seed=3)
    head, tail = agreement_frame(chat_tok)
    assert len(cases) == 8
    texts = []
    for c in cases:
        assert len(c.ids) == 400
        assert list(c.ids[: len(head)]) == head and list(c.ids[-len(tail) :]) == tail
        text = chat_tok.decode(c.ids)
        assert text.rstrip().endswith("<|assistant|>") and INSTRUCTIONS[c.instruction] in text
        texts.append(chat_tok.decode(c.ids[len(head) : len(head) + 200]))
    assert len(set(texts)) == 8  # no two prompts open on the same text
    again = build_agreement_cases(chat_tok, 400, 8, [docs], seed=3)
    assert [c.ids for c in again] == [c.ids for c in cases]
    assert [c.ids for c in build_agreement_cases(chat_tok, 400, 8, [docs], seed=4)] != [c.ids for c in cases]
    with pytest.raises(ValueError, match="fewer than the 500 chat-agreement prompts"):
        build_agreement_cases(chat_tok, 400, 500, [docs])
    with pytest.raises(ValueError, match="leaves no room for the text"):
        build_agreement_cases(chat_tok, 40, 1, [docs])


def test_default_text_is_the_stdlib_eval_split(chat_tok) -> None:
    cases = build_agreement_cases(chat_tok, 300, 2, None, seed=0)
    assert len(cases) == 2 and all(len(c.ids) == 300 for c in cases)


def test_config_checks_the_generation_budget() -> None:
    with pytest.raises(SpecError, match="agreement_tokens"):
        EvalConfig(tasks="chat-agreement", context=200, ppl_continuation=64, agreement_tokens=128)
    with pytest.raises(SpecError, match="agreement_prompts"):
        EvalConfig(tasks="chat-agreement", agreement_prompts=0)
    q = EvalConfig(tasks="chat-agreement", quick=True).effective()
    assert q.agreement_prompts == 2 and q.agreement_tokens == 32


def test_tiny_run_through_the_runner_and_report(chat_tok, demo_model, tmp_path) -> None:
    cfg = EvalConfig(methods="bf16,naive-int2", tasks="chat-agreement", context=400, ppl_continuation=64,
                     agreement_prompts=2, agreement_tokens=8, batch_size=2)  # fmt: skip
    rows = run_eval(demo_model, chat_tok, None, cfg)
    loops = {r["method"]: r for r in rows if r["metric"] == "loop_rate"}
    exact = {r["method"]: r for r in rows if r["metric"] == "exact_match"}
    assert set(loops) == {"bf16", "naive-int2"} and set(exact) == {"naive-int2"}
    for r in loops.values():
        assert r["n"] == 2 and r["new_tokens"] == 8 and len(r["texts"]) == 2 and len(r["loops"]) == 2
        assert all(1 <= n <= 8 for n in r["lengths"]) and r["value"] == sum(r["loops"]) / 2
    e = exact["naive-int2"]
    assert len(e["prefix"]) == 2 and all(0 <= p <= 8 for p in e["prefix"])
    assert all(
        x == (p == n) for x, p, n in zip(e["exact"], e["prefix"], loops["bf16"]["lengths"], strict=True)
    )
    s = {x["method"]: x for x in summary(rows)}
    assert s["naive-int2"]["exact_match"] == e["value"] and s["bf16"]["loop_count"] == sum(
        loops["bf16"]["loops"]
    )
    assert "exact_match" not in s["bf16"] and "loops_not_bf16" in s["naive-int2"]
    files = write_report(tmp_path, rows, {"context": 400})
    md = (tmp_path / "results.md").read_text()
    assert "Chat agreement with BF16 and loop rate (2 long chat prompts, 8 greedy tokens each)" in md
    assert json.loads(files[0].read_text())["summary"][1]["agreement_n"] == 2


def test_run_eval_refuses_a_tokenizer_without_a_template(demo_model) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(demo_model_path()))
    plain.chat_template = None
    cfg = EvalConfig(methods="bf16", tasks="chat-agreement", context=400, ppl_continuation=64)
    with pytest.raises(ValueError, match="chat-agreement task asks through the chat template") as e:
        run_eval(demo_model, plain, None, cfg)
    assert "leave chat-agreement out of --tasks" in e.value.hint
