"""`tool_choice="auto"` end to end: a tiny random Qwen3 checkpoint with a Hermes-style
chat template (tools in the system turn, `<tool_call>` blocks, a generation prompt that
opens `<think>`), served with `--enable_auto_tool_choice --tool_call_parser=hermes
--reasoning_parser=qwen3`, through the official `openai` client. A random model writes no
calls by itself: a regex constraint makes it write a short thought and one Hermes call,
which comes back as `tool_calls` (whole and streamed, OpenAI's delta shape), the thought
as `reasoning`. Unconstrained, the output starts inside the prompt's `<think>` block: all
of it is reasoning. Also `LLM.chat(tools=...)`: the template sees the tools."""

from __future__ import annotations

import json
import pathlib
import re

import openai
import pytest
from serving import start_server

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.text import chat_template
from jaxinfer.text.tokenizer import Tokenizer

TEMPLATE = (pathlib.Path(__file__).parent / "templates" / "qwen3_tools.jinja").read_text()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
FLAGS = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 768}
# a thought, the end of the block the prompt opened, then one Hermes call
CALL_REGEX = (r"[a-z ]{1,12}</think>\n\n<tool_call>\n\{\"name\": \"get_weather\", "
              r"\"arguments\": \{\"city\": \"(Paris|Rome|Oslo)\"\}\}\n</tool_call>")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("qwen3_tools")
    testing.make_hf_model(path, "qwen3", seed=1, max_position_embeddings=1024)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tool_server(qwen3_dir):
    server = start_server(f"--model={qwen3_dir}", "--enable_auto_tool_choice",
                          "--tool_call_parser=hermes", "--reasoning_parser=qwen3", **FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tool_client(tool_server):
    with openai.OpenAI(base_url=tool_server.url, api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client


def _prompt(tools=TOOLS) -> str:
    return chat_template.render(TEMPLATE, MESSAGES, add_generation_prompt=True, tools=tools)


def _ids(model_dir: pathlib.Path, text: str) -> list[int]:
    """A rendered chat prompt's ids, as the chat endpoint encodes it (no special tokens
    added)."""
    return Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)


def test_llm_chat_passes_tools_to_the_template(qwen3_dir):
    llm = LLM(str(qwen3_dir), **FLAGS)
    params = SamplingParams(temperature=0, max_tokens=4)
    with_tools = llm.chat(MESSAGES, params, tools=TOOLS, use_tqdm=False)[0]
    plain = llm.chat(MESSAGES, params, use_tqdm=False)[0]
    assert with_tools.prompt_token_ids == llm.tokenizer.encode(_prompt(),
                                                                add_special_tokens=False)
    assert '"name": "get_weather"' in _prompt() and len(plain.prompt_token_ids) < len(
        with_tools.prompt_token_ids)


def test_unconstrained_output_starts_inside_the_prompts_think_block(tool_client, tool_server,
                                                                   qwen3_dir):
    """Greedy, the same text as the rendered prompt sent to /v1/completions: all of it
    reasoning (the prompt opened the block), no content, no calls."""
    response = tool_client.chat.completions.create(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, temperature=0,
        max_tokens=16)
    ids = tool_client.completions.create(model=tool_server.model,
                                         prompt=_ids(qwen3_dir, _prompt()),
                                         max_tokens=16, temperature=0)
    message = response.choices[0].message
    assert response.usage.prompt_tokens == ids.usage.prompt_tokens
    assert "</think>" not in ids.choices[0].text  # a random model never closes it here
    assert message.reasoning == ids.choices[0].text
    assert (message.content, message.tool_calls) == (None, None)
    assert response.choices[0].finish_reason == "length"


def test_auto_reads_a_hermes_call_whole_and_streamed(tool_client, tool_server):
    kwargs = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, temperature=1.0,
                  max_tokens=120, extra_body={"structured_outputs": {"regex": CALL_REGEX}})
    for seed in range(3):
        response = tool_client.chat.completions.create(**kwargs, seed=seed)
        choice = response.choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert re.fullmatch(r"[a-z ]{1,12}", choice.message.reasoning)
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
        chunks = list(tool_client.chat.completions.create(**kwargs, seed=seed, stream=True))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].id.startswith("chatcmpl-tool-") and deltas[0].type == "function"
        assert (deltas[0].function.name, deltas[0].function.arguments) == ("get_weather", "")
        assert all(d.index == 0 and d.id is None for d in deltas[1:])
        assert "".join(d.function.arguments for d in deltas[1:]) == call.function.arguments
        reasoning = [(c.choices[0].delta.model_extra or {}).get("reasoning") or ""
                     for c in chunks if c.choices]
        assert "".join(reasoning) == choice.message.reasoning
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_go_back_through_the_template(tool_client, tool_server, qwen3_dir):
    """A second turn with the assistant's call and the tool's answer: the prompt is the
    template's rendering of both (arguments as an object, as Qwen3's template wants)."""
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}]
    response = tool_client.chat.completions.create(
        model=tool_server.model, messages=history, tools=TOOLS, tool_choice="none",
        temperature=0, max_tokens=2)
    rendered = chat_template.render(TEMPLATE, [*MESSAGES, {
        "role": "assistant", "content": "", "tool_calls": [
            call | {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}], add_generation_prompt=True, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\nsunny" in rendered
    whole = tool_client.completions.create(model=tool_server.model,
                                           prompt=_ids(qwen3_dir, rendered), max_tokens=1)
    assert response.usage.prompt_tokens == whole.usage.prompt_tokens
