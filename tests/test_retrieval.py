"""The chat-retrieval task: exact-length chat prompts with key/value needles, scoring, and the
paired difference to BF16 in the report."""

from __future__ import annotations

import pytest

from oscarkv.demo import demo_model_path
from oscarkv.eval.report import summary
from oscarkv.eval.tasks import retrieval
from oscarkv.eval.tasks.needle import filler_lines
from oscarkv.eval.tasks.retrieval import QUESTION, build_retrieval_cases, chat_frame, run_retrieval


@pytest.mark.parametrize("n_tok,keys", [(600, 1), (1500, 4)])
def test_cases_are_exact_length_chat_prompts_holding_their_needles(chat_tok, n_tok: int, keys: int) -> None:
    cases = build_retrieval_cases(chat_tok, n_tok, 6, keys, filler_lines(), seed=3)
    head, tail = chat_frame(chat_tok)
    assert len(cases) == 6 and len({c.answer for c in cases}) == 6
    for c in cases:
        assert len(c.ids) == n_tok and c.context_len == n_tok and c.needles == keys
        assert list(c.ids[: len(head)]) == head and list(c.ids[-len(tail) :]) == tail
        text = chat_tok.decode(c.ids)
        assert text.count("The special magic number for") == keys
        assert len(c.answer) == 7 and text.count(c.answer) == 1
        # the queried needle starts at needle_pos and is the one the question names
        needle = chat_tok.decode(c.ids[c.needle_pos :])
        key = needle.removeprefix("The special magic number for ").split(" is:")[0]
        assert needle.startswith("The special magic number for") and f" is: {c.answer}." in needle[:80]
        assert QUESTION.format(key=key) in text
        assert 0.05 <= c.depth <= 0.95
    # same seed, same prompts; another seed, others
    again = build_retrieval_cases(chat_tok, n_tok, 6, keys, filler_lines(), seed=3)
    assert [c.ids for c in again] == [c.ids for c in cases]
    assert build_retrieval_cases(chat_tok, n_tok, 1, keys, filler_lines(), seed=4)[0].ids != cases[0].ids


def test_bad_inputs_are_clear(chat_tok) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(demo_model_path()))
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        chat_frame(plain)
    with pytest.raises(ValueError, match="raise --context"):
        build_retrieval_cases(chat_tok, 60, 1, 2, filler_lines())
    with pytest.raises(ValueError, match="keys per prompt"):
        build_retrieval_cases(chat_tok, 600, 1, 0, filler_lines())
    with pytest.raises(ValueError, match="needs text lines"):
        build_retrieval_cases(chat_tok, 600, 1, 1, ["", "  "])


def test_scoring_is_a_string_match(chat_tok, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = build_retrieval_cases(chat_tok, 600, 3, 2, filler_lines(), seed=1)
    said = [f"The number is {cases[0].answer}.", "I do not know.", cases[2].answer[:6]]
    monkeypatch.setattr(retrieval, "generate_answers", lambda *a, **k: said)
    assert run_retrieval(None, chat_tok, None, cases) == [True, False, False]


def test_report_pairs_retrieval_hits_with_bf16() -> None:
    rows = [
        {"method": m, "task": "chat-retrieval", "metric": "accuracy_at_context", "value": sum(h) / 4,
         "bits_per_element": b, "context_len": 1000, "n": 4, "hits": h}
        for m, h, b in (("bf16", [1, 1, 0, 1], 16.0), ("oscar", [1, 0, 0, 1], 3.0))
    ]  # fmt: skip
    s = {r["method"]: r for r in summary(rows)}
    assert s["oscar"]["retrieval_at_context"] == 0.5 and s["oscar"]["retrieval_n"] == 4
    assert s["oscar"]["retrieval_vs_bf16"] == pytest.approx(-0.25)
    assert s["oscar"]["retrieval_vs_bf16_se"] == pytest.approx(0.25)
    assert "retrieval_vs_bf16" not in s["bf16"]


def test_cli_refuses_chat_retrieval_without_a_template_before_any_task(tmp_path, capsys) -> None:
    """The demo model has no chat template: the command fails with the fix, before perplexity runs,
    and writes nothing."""
    from oscarkv.cli import main

    out = tmp_path / "ev"
    rc = main(["eval", "--model", str(demo_model_path()), "--methods", "bf16", "--tasks", "ppl,chat-retrieval",
               "--context", "700", "--ppl-sequences", "1", "--device", "cpu", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert rc != 0 and "chat template" in err and "leave chat-retrieval out of --tasks" in err
    assert not out.exists()
