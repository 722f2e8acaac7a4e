"""Bad input is refused up front with a one-line error (issue #27): config values, generation
settings and calibration data files. Fast, CPU only, no model loads."""

from __future__ import annotations

import json
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import pytest

from oscarkv.calibration.data import (
    CHECK_BYTES,
    CorpusError,
    check_sources,
    iter_documents,
    quiet_length_warning,
    token_sequences,
)
from oscarkv.config import (
    MAX_DEMOTE_BLOCK,
    MAX_WINDOW_TOKENS,
    CalibrationConfig,
    EvalConfig,
    GenerateConfig,
    QuantSpec,
    SpecError,
)
from oscarkv.errors import InputError, OscarkvError

DEMO_MODEL = Path(__file__).resolve().parents[1] / "src" / "oscarkv" / "assets" / "demo-model"


def raises_one_line(exc: type[Exception], match: str, fn: Any, *args: Any, **kwargs: Any) -> Exception:
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``match``, with a one-line message and hint."""
    with pytest.raises(exc, match=match) as ei:
        fn(*args, **kwargs)
    e = ei.value
    assert isinstance(e, OscarkvError) and isinstance(e, ValueError)
    assert "\n" not in str(e)
    assert "\n" not in e.hint
    return e


class CharTok:
    """A tiny tokenizer: one id per character (no warn-once dict)."""

    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [1 + ord(c) % 250 for c in text]}


# ---- QuantSpec -------------------------------------------------------------------------------
def test_quant_spec_refuses_a_huge_recent_window():
    e = raises_one_line(
        SpecError, r"QuantSpec\.recent_tokens must be an integer in \[0, 1048576\] .*allocated up front",
        QuantSpec, recent_tokens=10**9,
    )  # fmt: skip
    assert "1000000000" in str(e) and "--recent-tokens" in e.hint
    assert QuantSpec(recent_tokens=MAX_WINDOW_TOKENS).recent_tokens == MAX_WINDOW_TOKENS


def test_quant_spec_refuses_a_huge_sink():
    raises_one_line(SpecError, r"sink_tokens.*1048576", QuantSpec, sink_tokens=MAX_WINDOW_TOKENS + 1)


def test_quant_spec_refuses_a_huge_demote_block():
    e = raises_one_line(
        SpecError, r"QuantSpec\.demote_block must be an integer in \[1, 4096\].*; got 1000000$",
        QuantSpec, demote_block=10**6,
    )  # fmt: skip
    assert "--demote-block" in e.hint
    assert QuantSpec(demote_block=MAX_DEMOTE_BLOCK).demote_block == MAX_DEMOTE_BLOCK


def test_quant_spec_refuses_a_huge_group():
    raises_one_line(SpecError, r"group_size.*4096.*; got 8192$", QuantSpec, group_size=8192)


def test_quant_spec_from_dict_wrong_type_is_a_spec_error():
    raises_one_line(SpecError, r"QuantSpec\.key_bits must be one of 2, 3, 4; got '2'$",
                    QuantSpec.from_dict, {"key_bits": "2"})  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value"),
    [("codebook", 3), ("codebook", ["uniform"]), ("meta_dtype", ["fp16"]), ("meta_dtype", None),
     ("k_clip", "0.9"), ("group_size", 32.0), ("sink_tokens", 1.5), ("demote_block", "8")],
)  # fmt: skip
def test_quant_spec_from_dict_non_strings_and_wrong_numbers(key, value):
    raises_one_line(SpecError, rf"QuantSpec\.{key} must be", QuantSpec.from_dict, {key: value})


def test_quant_spec_from_dict_stays_strict_about_unknown_keys():
    raises_one_line(SpecError, r"unknown QuantSpec fields \['bogus'\]", QuantSpec.from_dict, {"bogus": 1})
    raises_one_line(SpecError, "mapping", QuantSpec.from_dict, [("key_bits", 2)])


# ---- EvalConfig ------------------------------------------------------------------------------
def test_eval_methods_unknown_name_lists_the_known_ones():
    e = raises_one_line(
        SpecError, r"unknown method 'foo'; known: bf16, oscar, ", EvalConfig, methods="bf16,foo"
    )
    assert "kivi2" in str(e)


@pytest.mark.parametrize("methods", ["", ",,", "bf16,", "bf16,,oscar"])
def test_eval_methods_empty_names(methods):
    raises_one_line(SpecError, r"EvalConfig\.methods must be comma-separated method names", EvalConfig,
                    methods=methods)  # fmt: skip


def test_eval_methods_duplicates():
    raises_one_line(SpecError, r"methods lists 'oscar' twice", EvalConfig, methods="bf16,oscar,oscar")


def test_eval_passkey_at_context_negative_and_zero():
    raises_one_line(SpecError, r"EvalConfig\.passkey_at_context must be an integer >= 0 \(0 = none\); got -5$",
                    EvalConfig, passkey_at_context=-5)  # fmt: skip
    cfg = EvalConfig(passkey_at_context=0, quick=True)
    assert cfg.effective().passkey_at_context == 0


def test_eval_passkey_at_context_zero_builds_no_prompts():
    from oscarkv.eval.runner import passkey_at_context_cases

    assert passkey_at_context_cases(CharTok(), EvalConfig(passkey_at_context=0)) == []


def test_eval_quick_with_a_long_context_is_an_error():
    raises_one_line(
        SpecError, r"^--quick runs at most 1024 tokens of context, got --context 8192; drop --context or --quick$",
        EvalConfig, quick=True, context=8192,
    )  # fmt: skip


def test_eval_context_default_and_effective():
    assert EvalConfig().context is None
    assert EvalConfig().effective().context == 3072
    assert EvalConfig(quick=True).effective().context == 1024
    assert EvalConfig(quick=True, context=512).effective().context == 512
    assert EvalConfig(context=2048).effective().context == 2048
    # the continuation check uses the effective context (and the quick continuation of 128)
    raises_one_line(SpecError, r"context must be > ppl_continuation \+ 64 = 3074; got 3072",
                    EvalConfig, ppl_continuation=3010)  # fmt: skip
    assert EvalConfig(quick=True, ppl_continuation=3000).effective().context == 1024


def test_eval_check_model_positions():
    e = raises_one_line(
        SpecError, r"^--context 4096 exceeds the model's 2048 positions; pass --context 2048 or less$",
        EvalConfig(context=4096).check_model_positions, 2048,
    )  # fmt: skip
    assert e.hint == ""
    raises_one_line(SpecError, "--context 3072 exceeds", EvalConfig().check_model_positions, 2048)
    EvalConfig(quick=True).check_model_positions(2048)  # effective context 1024
    EvalConfig(context=4096).check_model_positions(None)  # unknown: no check
    EvalConfig(context=2048).check_model_positions(2048)


def test_calibration_check_model_positions():
    raises_one_line(
        SpecError, r"^--seq-len 2048 exceeds the model's 1024 positions; pass --seq-len 1024 or less$",
        CalibrationConfig().check_model_positions, 1024,
    )  # fmt: skip
    CalibrationConfig(seq_len=1024).check_model_positions(1024)
    CalibrationConfig().check_model_positions(None)


# ---- GenerateConfig --------------------------------------------------------------------------
@pytest.mark.parametrize("t", [-1.0, 0.0, 0, math.nan, math.inf])
def test_generate_temperature_must_be_positive_and_finite(t):
    e = raises_one_line(SpecError, r"GenerateConfig\.temperature must be a finite number > 0 "
                        r"\(use greedy decoding \(no --sample\) for temperature 0\)",
                        GenerateConfig, sample=True, temperature=t)  # fmt: skip
    assert "--temperature" in e.hint


@pytest.mark.parametrize("p", [1.5, 0.0, -0.1, math.nan])
def test_generate_top_p_in_unit_interval(p):
    raises_one_line(SpecError, r"GenerateConfig\.top_p must be a number in \(0, 1\]", GenerateConfig,
                    sample=True, top_p=p)  # fmt: skip


def test_generate_top_k_at_least_one():
    raises_one_line(SpecError, r"top_k must be an integer >= 1; got 0$", GenerateConfig, sample=True, top_k=0)


@pytest.mark.parametrize("n", [0, -5, 2**20 + 1, 1.5, True])
def test_generate_max_new_tokens_bounds(n):
    raises_one_line(SpecError, r"GenerateConfig\.max_new_tokens must be an integer in \[1, 1048576\]",
                    GenerateConfig, max_new_tokens=n)  # fmt: skip


@pytest.mark.parametrize(("field", "value"), [("temperature", 0.5), ("top_p", 0.9), ("top_k", 40)])
def test_generate_sampling_settings_need_sample(field, value):
    flag = "--" + field.replace("_", "-")
    e = raises_one_line(SpecError, rf"^{flag} only applies with --sample; add --sample$", GenerateConfig,
                        **{field: value})  # fmt: skip
    assert flag in e.hint


def test_generate_sampling_kwargs():
    assert GenerateConfig().sampling_kwargs() == {"do_sample": False}
    assert GenerateConfig(sample=True).sampling_kwargs() == {
        "do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 0,
    }  # fmt: skip
    kw = GenerateConfig(sample=True, temperature=1.2, top_p=0.5, top_k=40).sampling_kwargs()
    assert kw == {"do_sample": True, "temperature": 1.2, "top_p": 0.5, "top_k": 40}
    assert GenerateConfig(max_new_tokens=2**20).max_new_tokens == 2**20


# ---- calibration data files ------------------------------------------------------------------
BAD_FILES = [
    ("blob.txt", b"hello\x00\x01\x02 world", r"blob\.txt: is a binary file \(it holds NUL bytes\)"),
    ("utf16.txt", "hello world".encode("utf-16"), r"utf16\.txt: is UTF-16 text; expected UTF-8"),
    ("latin1.txt", b"caf\xe9 au lait", r"latin1\.txt: is not UTF-8 \(invalid byte 0xe9 at offset 3\)"),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', r"latin1\.jsonl:1: is not UTF-8 \(invalid byte 0xe9"),
]


@pytest.mark.parametrize(("name", "data", "match"), BAD_FILES)
def test_bad_data_file_is_a_one_line_corpus_error(tmp_path, name, data, match):
    f = tmp_path / name
    f.write_bytes(data)
    e = raises_one_line(CorpusError, match, check_sources, [f])
    assert isinstance(e, InputError)
    # the same file at tokenization time (no check_sources first) gives the same error
    e2 = raises_one_line(CorpusError, match, token_sequences, CharTok(), [f], 1, 4)
    if "binary" not in match:
        assert "iconv" in e.hint and "iconv" in e2.hint


def test_latin1_jsonl_later_line_is_named(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    raises_one_line(CorpusError, r"mixed\.jsonl:2: is not UTF-8", check_sources, [f])
    raises_one_line(CorpusError, r"mixed\.jsonl:2: is not UTF-8", list, iter_documents([f], CharTok()))


def test_check_sources_missing_file(tmp_path):
    raises_one_line(CorpusError, r"missing\.txt: no such file or directory", check_sources,
                    [tmp_path / "missing.txt"])  # fmt: skip


def test_check_sources_dir_without_text(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "weights.bin").write_bytes(b"\x00\x01")
    raises_one_line(CorpusError, r"no text files", check_sources, [tmp_path])


def test_check_sources_jsonl_first_record(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n{not json\n")
    raises_one_line(CorpusError, r"bad\.jsonl:2: invalid JSON", check_sources, [f])
    f.write_text(json.dumps({"prompt": "x"}) + "\n")
    raises_one_line(CorpusError, r"bad\.jsonl:1: expected an object with a 'text'", check_sources, [f])
    f.write_text(json.dumps({"messages": "hi"}) + "\n")
    raises_one_line(CorpusError, r"bad\.jsonl:1: 'messages' must be a list", check_sources, [f])


def test_check_sources_accepts_good_files_and_folders(tmp_path):
    (tmp_path / "d").mkdir()
    a = tmp_path / "d" / "a.md"
    a.write_text("héllo wörld\n", encoding="utf-8")
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"text": "line\u2028separator"}, ensure_ascii=False) + "\n", encoding="utf-8")
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfwith a BOM")
    assert check_sources([tmp_path / "d", j, bom]) == [a, j, bom]
    assert check_sources(None) == [] and check_sources([]) == []


def test_check_sources_multibyte_char_split_at_the_limit_is_fine(tmp_path):
    f = tmp_path / "big.txt"
    data = b"a" * (CHECK_BYTES - 1) + "é".encode() + b"tail"  # é's two bytes straddle the limit
    assert data[CHECK_BYTES - 1 : CHECK_BYTES + 1] == "é".encode()
    f.write_bytes(data)
    assert check_sources([f]) == [f]
    f.write_bytes(b"a" * (CHECK_BYTES - 9) + b"caf\xe9 tail")  # a latin-1 byte before the limit is refused
    raises_one_line(CorpusError, r"big\.txt: is not UTF-8 \(invalid byte 0xe9", check_sources, [f])


# ---- the tokenizer's length warning ---------------------------------------------------------
@pytest.fixture
def demo_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)


def _length_warnings(caplog: pytest.LogCaptureFixture, fn: Any) -> list[str]:
    root = logging.getLogger("transformers")  # transformers does not propagate to the root logger
    root.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"):
            caplog.clear()
            fn()
    finally:
        root.removeHandler(caplog.handler)
    return [r.getMessage() for r in caplog.records if "sequence length is longer" in r.getMessage()]


def test_length_warning_is_not_logged(demo_tokenizer, caplog, tmp_path):
    cls = type(demo_tokenizer)
    text = "word " * (demo_tokenizer.model_max_length + 100)
    # the capture works: a fresh tokenizer does warn on a text longer than model_max_length
    fresh = cls.from_pretrained(DEMO_MODEL)
    assert _length_warnings(caplog, lambda: fresh(text, add_special_tokens=False))

    f = tmp_path / "long.txt"
    f.write_text(text)
    tok = cls.from_pretrained(DEMO_MODEL)
    assert _length_warnings(caplog, lambda: token_sequences(tok, [f], 1, 64)) == []
    tok = cls.from_pretrained(DEMO_MODEL)  # callers tokenizing iter_documents' output are quiet too
    assert _length_warnings(caplog, lambda: [tok(d) for d in iter_documents([f], tok)]) == []
    tok = quiet_length_warning(cls.from_pretrained(DEMO_MODEL))
    assert _length_warnings(caplog, lambda: tok(text, add_special_tokens=False)) == []
    assert isinstance(quiet_length_warning(CharTok()), CharTok)  # no warn-once dict: left alone


def test_passkey_cases_resolve_the_default_context(demo_tokenizer):
    from oscarkv.eval.runner import passkey_at_context_cases

    cases = passkey_at_context_cases(demo_tokenizer, EvalConfig(quick=True))  # context None -> 1024
    assert [c.context_len for c in cases] == [1024]


def test_eval_sequences_is_quiet(demo_tokenizer, caplog, tmp_path):
    from oscarkv.calibration.data import eval_sequences

    root = tmp_path / "stdlib"
    root.mkdir()
    # a file name whose crc32 puts it in the eval split (one in ten)
    name = next(f"m{i}.py" for i in range(1000) if zlib.crc32(f"m{i}.py".encode()) % 10 == 0)
    (root / name).write_text("x = 1\n" * (demo_tokenizer.model_max_length + 10))
    tok = type(demo_tokenizer).from_pretrained(DEMO_MODEL)
    out: list[Any] = []
    assert _length_warnings(caplog, lambda: out.append(eval_sequences(tok, 1, 32, root=root))) == []
    assert tuple(out[0].shape) == (1, 32)


# ---- EngineConfig ------------------------------------------------------------------------------
def test_engine_config_refuses_invariant_prefill_without_int2():
    """``prefill_attention="invariant"`` changes what INT2 prompts attend to; bf16 stores no INT2,
    so the flag would do nothing: refused rather than ignored."""
    from oscarkv.config import EngineConfig

    e = raises_one_line(
        SpecError, "prefill_attention must be fresh with kv_dtype bf16 .invariant needs int2.; got 'invariant'",
        EngineConfig, kv_dtype="bf16", prefill_attention="invariant",
    )  # fmt: skip
    assert "--kv-dtype int2" in e.hint
    assert EngineConfig(kv_dtype="int2", prefill_attention="invariant").prefill_attention == "invariant"


def test_engine_config_help_names_the_cpu_default_budget_and_the_lowered_length():
    from dataclasses import fields

    from oscarkv.config import EngineConfig
    from oscarkv.config.engine import CPU_BUDGET_CAP_GB

    helps = {f.name: f.metadata["help"] for f in fields(EngineConfig)}
    assert (
        "available memory" in helps["kv_budget_gb"] and f"{CPU_BUDGET_CAP_GB:g} GiB" in helps["kv_budget_gb"]
    )
    assert "lowered" in helps["max_model_len"]
