"""The server over a real pretrained model (SmolLM2-135M-Instruct, BF16 pages, fp32, CPU): the
official ``openai`` client's chat answers (plain and streamed, the tokenizer's template and a
``--chat-template`` file) equal ``LLM.chat``'s greedy answers."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from serve_demo import wait_idle

from oscarkv import LLM, EngineConfig, SamplingParams
from oscarkv.config import ServerConfig
from oscarkv.engine.request import RequestOutput
from oscarkv.server.launch import start_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # see conftest

MAX_TOKENS = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ],
]
# a template of our own (not SmolLM2's): the server must use the file, not the tokenizer's
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\nAnswer in French. "
)


def test_chat_through_openai_client_equals_llm_chat(smollm2_dir: Path, tmp_path: Path) -> None:
    cfg = EngineConfig(model=str(smollm2_dir), kv_dtype="bf16", device="cpu", dtype="fp32")
    llm = LLM.from_config(cfg)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    refs = llm.chat(CHATS, greedy)
    assert "Paris" in refs[0].text
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE)
    own = llm.chat(CHATS, greedy, chat_template=TEMPLATE)
    assert [o.prompt_token_ids for o in own] != [o.prompt_token_ids for o in refs]

    # the tokenizer's template: both conversations, plain and streamed
    with start_server(cfg, ServerConfig(port=0)) as srv:
        engine = srv.engine
        for chat, ref in zip(CHATS, refs, strict=True):
            _check_chat(srv.url, smollm2_dir.name, chat, ref, stream=True)
        wait_idle(srv)
    # a --chat-template file (the same engine, a new server): the file's template is used
    with start_server(cfg, ServerConfig(port=0, chat_template=str(tpl)), engine=engine) as srv:
        _check_chat(srv.url, smollm2_dir.name, CHATS[1], own[1], stream=False)
        wait_idle(srv)


def _check_chat(url: str, model: str, chat: list[dict], ref: RequestOutput, stream: bool) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=model, messages=chat, max_tokens=MAX_TOKENS,
                                       temperature=0)  # type: ignore[arg-type]  # fmt: skip
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text, (chat, msg.content, ref.text)
    assert r.choices[0].finish_reason == ref.finish_reason and r.model == model
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if not stream:
        return
    chunks = list(client.chat.completions.create(
        model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # type: ignore[arg-type]  # fmt: skip
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    assert body[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ref.token_ids)
