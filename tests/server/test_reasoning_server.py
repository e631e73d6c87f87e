"""`--reasoning_parser=openai_gptoss` in the chat endpoint. The demo model's tokenizer has
no harmony tokens and the demo model cannot write harmony, so the split itself is tested
one layer below HTTP: the test plays the engine thread, posting the updates the engine
would (token ids of a harmony tokenizer built here, with the engine's own detokenizer's
text) to a real `Stream`, and the app's own `_collect` and `_events` answer them (the
message and the SSE deltas, the reasoning apart from the content). Over real HTTP, the
demo model served with the parser: its plain output is all content."""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time

import openai
import pytest
import uvicorn
from serving import greedy
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from jaxinfer import server
from jaxinfer.config import ServerConfig
from jaxinfer.engine.request import SamplingParams
from jaxinfer.server import app, protocol
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.reasoning import splitter
from jaxinfer.server.streams import Piece, Stream, Update
from jaxinfer.text.reasoning import HARMONY_MARKERS
from jaxinfer.text.tokenizer import Tokenizer

REASONING = "User asks 2+2. Simple: 4."
ANSWER = "2 + 2 = 4. ✓"
HARMONY = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
           f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
TEMPLATE = pathlib.Path(__file__).parents[1] / "text" / "templates" / "gpt_oss.jinja"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE with harmony's special tokens, as gpt-oss's tokenizer has them."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([REASONING, ANSWER, "assistant final analysis"] * 5,
                                trainers.BpeTrainer(vocab_size=300, show_progress=False))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in (*HARMONY_MARKERS, "<|endoftext|>")])
    return Tokenizer(backend, special_tokens={"eos_token": "<|return|>"},
                     eos_token_ids=frozenset(), bos_token_id=None,
                     chat_template=TEMPLATE.read_text(encoding="utf-8"))


def _state(tokenizer: Tokenizer, **config) -> app.ServerState:
    return app.ServerState(loop=None, config=ServerConfig(**config), model_name="gpt-oss",
                           model_root="", max_model_len=512, defaults=SamplingParams(),
                           token_text=None, tokenizer=tokenizer)


def _play_engine(tokenizer: Tokenizer, stream: Stream, ids: list[int], size: int,
                 finish: str = "stop") -> None:
    """Post `ids` in steps of `size` as the engine thread does: each step's ids and the
    text its detokenizer (special tokens skipped) gave them."""
    stream.prompt_token_ids = tokenizer.encode("<|start|>assistant", add_special_tokens=False)
    detokenizer = tokenizer.detokenizer(stream.prompt_token_ids)
    for at in range(0, len(ids), size):
        step, last = ids[at:at + size], at + size >= len(ids)
        text = detokenizer.add(step) + (detokenizer.flush() if last else "")
        piece = Piece(0, text, step, None, finish if last else None)
        stream.post(Update([piece], finished=last))


async def _answer(tokenizer: Tokenizer, ids: list[int], size: int, *, streamed: bool,
                  params: SamplingParams | None = None, **config) -> list[dict]:
    """The app's body (whole) or SSE chunks (streamed) for a chat that generated `ids`."""
    state, params = _state(tokenizer, **config), params or SamplingParams()
    shape = app._Shape("chat.completion", "chatcmpl", state, params, top=0,
                       reasoning=splitter(state.config, tokenizer, params))
    stream = Stream(asyncio.Queue(), "chatcmpl-1", n=1)
    _play_engine(tokenizer, stream, ids, size)
    if not streamed:
        return [await app._collect(shape, [stream])]
    events = [e async for e in app._events(None, shape, [stream], None)]
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_whole_message_has_reasoning_apart_from_content(tokenizer, size):
    ids = tokenizer.encode(HARMONY, add_special_tokens=False)
    body, = asyncio.run(_answer(tokenizer, ids, size, streamed=False,
                                reasoning_parser="openai_gptoss"))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER,
                                             "reasoning": REASONING}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_reasoning_only_output_has_null_content(tokenizer):
    """Cut off (max_tokens) before the final channel: content is null, as vLLM's."""
    ids = tokenizer.encode(f"<|channel|>analysis<|message|>{REASONING}",
                           add_special_tokens=False)
    body, = asyncio.run(_answer(tokenizer, ids, 3, streamed=False,
                                reasoning_parser="openai_gptoss"))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None,
                                             "reasoning": REASONING}


@pytest.mark.parametrize("size", [1, 2, 7])
def test_streamed_deltas_carry_reasoning_then_content(tokenizer, size):
    ids = tokenizer.encode(HARMONY, add_special_tokens=False)
    chunks = asyncio.run(_answer(tokenizer, ids, size, streamed=True,
                                 reasoning_parser="openai_gptoss",
                                 include_reasoning_content=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = [d["reasoning"] for d in deltas if "reasoning" in d]
    content = [d["content"] for d in deltas[1:] if "content" in d]
    assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
    last_reasoning = max(i for i, d in enumerate(deltas) if "reasoning" in d)
    first_content = min(i for i, d in enumerate(deltas[1:], 1) if "content" in d)
    assert last_reasoning < first_content
    assert not any("<|" in c or "|>" in c for c in content)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_cuts_the_parsed_text_as_the_engine_cuts_its_own(tokenizer):
    """The engine ends the request at the token that completes a stop string; the raw text
    the parser reads is cut before the stop string too."""
    ids = tokenizer.encode(HARMONY, add_special_tokens=False)
    end = next(n for n in range(1, len(ids) + 1) if "= 4" in tokenizer.decode(ids[:n]))
    params = SamplingParams(stop=("= 4",))
    body, = asyncio.run(_answer(tokenizer, ids[:end], 2, streamed=False, params=params,
                                reasoning_parser="openai_gptoss",
                                include_reasoning_content=True))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "2 + 2 ",
                                             "reasoning": REASONING,
                                             "reasoning_content": REASONING}


def test_output_without_harmony_is_content_and_no_parser_adds_no_field(tokenizer):
    ids = tokenizer.encode("User asks 2+2.<|endoftext|>", add_special_tokens=False)
    body, = asyncio.run(_answer(tokenizer, ids, 2, streamed=False,
                                reasoning_parser="openai_gptoss"))
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": "User asks 2+2.", "reasoning": None}
    body, = asyncio.run(_answer(tokenizer, ids, 2, streamed=False))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "User asks 2+2."}


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_assistant_reasoning_sent_back_reaches_the_template(tokenizer, field):
    body = protocol.validate(protocol.ChatRequest, {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", field: "Add them."}],
        "add_generation_prompt": False})
    messages = [m.plain() for m in body.messages]
    assert messages[1] == {"role": "assistant", "content": "4", field: "Add them."}
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered.endswith("<|start|>assistant<|channel|>analysis<|message|>Add them."
                             "<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>")


@pytest.mark.parametrize("config, message", [
    ({"reasoning_parser": "deepseek_r9"}, "reasoning_parser='deepseek_r9' must be one of "
                                          "openai_gptoss"),
    ({"include_reasoning_content": True}, "include_reasoning_content=True needs "
                                          "reasoning_parser"),
])
def test_server_config_refuses_unknown_parsers(config, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**config)


@pytest.fixture(scope="module")
def parsing_server(demo_llm):
    """The session's demo LLM served in this process (uvicorn on a thread, 127.0.0.1) with
    --reasoning_parser and --include_reasoning_content: no second warm-up. The engine
    loop is stopped before the other tests use the LLM again."""
    config = ServerConfig(reasoning_parser="openai_gptoss", include_reasoning_content=True)
    loop = EngineLoop(demo_llm.engine, max_waiting_requests=16)
    uv = uvicorn.Server(uvicorn.Config(app.create_app(server.make_state(demo_llm, config, loop,
                                                                    "demo")),
                                       log_config=None, lifespan="off"))
    sock = server.bind("127.0.0.1", 0)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    loop.start()
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
                       api_key="unused", max_retries=0, timeout=120) as client:
        yield client
    uv.should_exit = True
    thread.join(30)
    loop.stop()


def test_http_plain_output_is_content_and_reasoning_is_null(parsing_server, demo_llm):
    messages = [{"role": "user", "content": "def main():"},
                {"role": "assistant", "content": "pass", "reasoning": "Say nothing."},
                {"role": "user", "content": "def read(path):"}]
    expected = demo_llm.chat(messages, greedy(demo_llm, 12))[0].text
    response = parsing_server.chat.completions.create(model="demo", messages=messages,
                                                      max_tokens=12, temperature=0)
    message = response.choices[0].message.model_dump()
    assert (message["content"], message["reasoning"], message["reasoning_content"]) == (
        expected, None, None)
    messages[1] = messages[1] | {"reasoning": None, "reasoning_content": "Say nothing."}
    chunks = list(parsing_server.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0, stream=True))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == expected
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
