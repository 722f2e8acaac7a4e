"""Incremental detokenization (streamed text == one-shot decode, stop strings never leak), and
the tokenizer helpers of ``engine/tokenizer.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oscarkv.demo import demo_model_path
from oscarkv.engine.detok import IncrementalDetokenizer
from oscarkv.engine.tokenizer import apply_chat, encode_prompt, eos_token_ids, load_tokenizer
from oscarkv.errors import InputError, ModelError

TOK = load_tokenizer(demo_model_path())  # byte-level BPE, vocab 2048, id 0 = <|endoftext|>
V = len(TOK)
TEXT = "Ça va? Héllo wörld 😀👍🏽 日本語のテキスト, naïve café — done."
LONG_INPUT = "sequence-length-is-longer-than-the-specified-maximum"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream(
    ids: Sequence[int], stop: Sequence[str] = (), prompt: Sequence[int] = (), chunks: Any = None
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` (one at a time, or in ``chunks`` sizes); returns (pieces, detokenizer)."""
    d = IncrementalDetokenizer(TOK, list(prompt), tuple(stop))
    pieces, i, sizes = [], 0, iter(chunks or [])
    while i < len(ids):
        n = next(sizes, 1)
        pieces.append(d.add(ids[i : i + n]))
        i += n
    pieces.append(d.flush())
    return pieces, d


def decode(ids: Sequence[int]) -> str:
    return TOK.decode(list(ids), skip_special_tokens=True)


def test_multibyte_characters_are_held_until_complete() -> None:
    ids = TOK.encode(TEXT)
    assert any("\ufffd" in TOK.decode([i]) for i in ids)  # the case exists: tokens split characters
    pieces, d = stream(ids)
    assert "".join(pieces) == TEXT == d.text
    assert not any("\ufffd" in p for p in pieces)
    assert not d.stopped and d.stop_text is None


@FUZZ
@given(
    ids=st.lists(st.integers(0, V - 1), max_size=40),
    prompt=st.lists(st.integers(0, V - 1), max_size=8),
    chunks=st.lists(st.integers(1, 4), max_size=40),
)
def test_random_token_streams_match_one_shot_decode(
    ids: list[int], prompt: list[int], chunks: list[int]
) -> None:
    pieces, d = stream(ids, prompt=prompt, chunks=chunks)
    assert "".join(pieces) == decode(ids) == d.text


@FUZZ
@given(text=st.text(max_size=30), prompt=st.text(max_size=10), stop=st.text(min_size=1, max_size=3))
def test_random_text_with_a_stop_string(text: str, prompt: str, stop: str) -> None:
    ids = TOK.encode(text)
    want = decode(ids)
    pieces, d = stream(ids, stop=[stop], prompt=TOK.encode(prompt))
    assert "".join(pieces) == want.split(stop)[0] == d.text
    assert d.stopped == (stop in want)


def test_stop_spanning_tokens_is_caught_on_its_last_token_and_never_emitted() -> None:
    text = "Hello world, this is a test of stop strings."
    stop = "is a te"
    ids = TOK.encode(text)
    k = next(k for k in range(len(ids) + 1) if stop in decode(ids[:k]))
    assert stop not in TOK.decode([ids[k - 1]])  # the stop really spans tokens
    d = IncrementalDetokenizer(TOK, [], (stop,))
    pieces = [d.add([i]) for i in ids[: k - 1]]
    assert not d.stopped
    assert text.startswith("".join(pieces)) and len("".join(pieces)) <= text.index(stop)
    pieces.append(d.add([ids[k - 1]]))
    assert d.stopped and d.stop_text == stop
    assert "".join(pieces) == text[: text.index(stop)]
    assert d.add(ids[k:]) == "" and d.flush() == ""
    assert d.text == text[: text.index(stop)]


def test_text_before_a_possible_stop_is_held_back() -> None:
    text = "abcdefghij"
    ids = TOK.encode(text)
    d = IncrementalDetokenizer(TOK, [], ("xyz", "q"))  # longest stop 3: hold 2 characters
    out = "".join(d.add([i]) for i in ids)
    assert out == text[:-2] and d.flush() == text[-2:]
    d = IncrementalDetokenizer(TOK, [], ())  # no stops: nothing held
    assert "".join(d.add([i]) for i in ids) == text and d.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    text = "one two three four"
    ids = TOK.encode(text)
    pieces, d = stream(ids, stop=["four", "two", "zzz"])
    assert "".join(pieces) == "one " and d.stop_text == "two"
    pieces, d = stream(ids, stop=["two t", "e t"], chunks=[len(ids)])  # all at once: both present
    assert "".join(pieces) == "on" and d.stop_text == "e t"


def test_stop_at_the_very_start_and_inside_a_character() -> None:
    pieces, d = stream(TOK.encode("STOP here"), stop=["STOP"])
    assert pieces[-1] == "" and "".join(pieces) == "" and d.stopped
    text = "ab 😀 cd"
    pieces, d = stream(TOK.encode(text), stop=["😀"])
    assert "".join(pieces) == "ab " and d.stop_text == "😀"


def test_special_tokens_are_skipped() -> None:
    ids = [0, *TOK.encode("hi there"), 0]
    pieces, _ = stream(ids)
    assert "".join(pieces) == "hi there"


def test_prompt_context_keeps_a_sentencepiece_leading_space() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Paris": 1, "▁The": 2, "▁capital": 3, "▁is": 4}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    assert sp.decode([1]) == "Paris"  # a decode of the output alone drops the space
    d = IncrementalDetokenizer(sp, [2, 3, 4], ())
    assert d.add([1]) + d.flush() == " Paris"  # as vLLM: "The capital is" + " Paris"


def test_prompt_ending_inside_a_character_is_no_context() -> None:
    ids = TOK.encode("x日本 ok")
    cut = next(k for k in range(1, len(ids)) if TOK.decode(ids[:k]).endswith("\ufffd"))
    out = ids[cut:]
    assert decode(out).startswith("\ufffd")  # the output starts with the character's later bytes
    pieces, _ = stream(out, prompt=ids[:cut])
    assert "".join(pieces) == decode(out)


class CountingTokenizer:
    """The demo tokenizer, recording the longest id list it was asked to decode."""

    def __init__(self) -> None:
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        return TOK.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_short() -> None:
    ids = TOK.encode(TEXT * 8)
    counting = CountingTokenizer()
    d = IncrementalDetokenizer(counting, TOK.encode("prompt"), ("zz",))
    out = "".join(d.add([i]) for i in ids) + d.flush()
    assert out == TEXT * 8
    assert counting.longest <= 12 < len(ids)  # a short window each step, not the whole output


@pytest.mark.parametrize("stop", [("a",), ("ab", "b"), ("é",)])
def test_pieces_are_never_part_of_a_stop(stop: tuple[str, ...]) -> None:
    text = "xxé ab yy"
    ids = TOK.encode(text)
    pieces, d = stream(ids, stop=stop)
    cut = min(text.index(s) for s in stop)
    assert "".join(pieces) == text[:cut] and d.stopped


# ---- engine/tokenizer.py: loading, EOS ids, chat templates, prompt checks ----------------------
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_load_tokenizer_and_its_errors(tmp_path: Path) -> None:
    tok = load_tokenizer(demo_model_path())
    assert len(tok) == 2048 and tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.deprecation_warnings[LONG_INPUT] is True
    with pytest.raises(ModelError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ModelError, match="cannot load its tokenizer"):
        load_tokenizer(tmp_path)  # a directory without tokenizer files
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({}, unk_token=None)).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelError, match="its tokenizer is empty"):
        load_tokenizer(tmp_path)


def test_long_prompts_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        ids = encode_prompt(TOK, "word " * 3000, V)  # longer than model_max_length 2048
    assert len(ids) > 2048 and "sequence length is longer" not in caplog.text.lower()


def test_eos_token_ids(tmp_path: Path) -> None:
    assert eos_token_ids(TOK, demo_model_path()) == (0,)  # tokenizer and generation config agree
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 0, 7]}))
    assert eos_token_ids(TOK, tmp_path) == (0, 5, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert eos_token_ids(TOK, tmp_path) == (0, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelError, match="eos_token_id"):
        eos_token_ids(TOK, tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ModelError, match="not a JSON object"):
        eos_token_ids(TOK, tmp_path)
    assert eos_token_ids(TOK, tmp_path / "none") == (0,)  # no generation config: the tokenizer's


def test_apply_chat_with_an_explicit_template() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = apply_chat(TOK, msgs, chat_template=TEMPLATE)
    assert TOK.decode(ids) == "<|system|>Be brief.\n<|user|>Hi!\n<|assistant|>"
    assert ids == TOK.encode("<|system|>Be brief.\n<|user|>Hi!\n<|assistant|>", add_special_tokens=False)


def bos_tokenizer() -> Any:
    """The demo tokenizer with a BOS (id 0) added by its post-processor, as Llama's does."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(TOK.backend_tokenizer.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>")


def test_special_tokens_come_from_the_template_in_chat_and_the_tokenizer_in_prompts() -> None:
    bos = bos_tokenizer()
    hi = TOK.encode("hi")
    assert encode_prompt(bos, "hi", V) == [0, *hi]  # the tokenizer's default, as vLLM
    ids = apply_chat(
        bos, [{"role": "user", "content": "hi"}], chat_template="<s>{{ messages[0]['content'] }}"
    )
    assert ids == TOK.encode("<s>hi")  # the template's text only: no BOS added on top


def test_apply_chat_without_a_template_raises() -> None:
    assert not TOK.chat_template
    with pytest.raises(InputError, match=r"no chat template; pass chat_template=\.\.\."):
        apply_chat(TOK, [{"role": "user", "content": "hi"}])


def test_apply_chat_template_errors_are_input_errors() -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    with pytest.raises(InputError, match="user first"):
        apply_chat(TOK, [{"role": "assistant", "content": "hi"}], chat_template=strict)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ({"role": "user", "content": "hi"}, "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"role": "bot", "content": "hi"}], r"messages\[0\]\.role must be one of"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\.content must be a string"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], r"content must be a string"),
    ],
)
def test_apply_chat_validates_messages(messages: Any, match: str) -> None:
    with pytest.raises(InputError, match=match):
        apply_chat(TOK, messages, chat_template=TEMPLATE)


def test_encode_prompt() -> None:
    assert encode_prompt(TOK, "hello there", V) == TOK.encode("hello there")
    assert encode_prompt(TOK, [0, 5, V - 1], V) == [0, 5, V - 1]
    assert encode_prompt(TOK, (3, 4), V) == [3, 4]


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "empty"),
        ([], "empty"),
        ([1, V], r"prompt token 1 must be an integer id in \[0, 2048\)"),
        ([-1], "prompt token 0"),
        ([1, 2.0], "prompt token 1"),
        ([True], "prompt token 0"),
        (None, "a string or a list of token ids"),
    ],
)
def test_encode_prompt_rejects(prompt: Any, match: str) -> None:
    with pytest.raises(InputError, match=match):
        encode_prompt(TOK, prompt, V)
