"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client against
real servers: the demo model (with an API key and a short body deadline) and a tiny
random Qwen3 with a Hermes-style tool template (`--tool_call_parser=hermes
--reasoning_parser=qwen3`). Whole and streamed answers equal the chat route's for the
same conversation; forced tool calls validate against their schema; a tool_result goes
back through the template; thinking blocks carry the reasoning; bad inputs are 4xx in
Anthropic's error shape and the server goes on serving; a client that leaves mid-stream
aborts its request; a stalled body gets the 408 of the chat route's deadline. The
translation alone: test_anthropic_translation.py."""

from __future__ import annotations

import json
import pathlib
import socket
import time
import urllib.parse

import anthropic
import jsonschema
import openai
import pytest
from serving import metric_values, start_server

from jaxinfer import testing

KEY, BODY_S = "sekrit", 3
SYSTEM = "You write Python."
USER = [{"role": "user", "content": "def main():"}]
GREEDY = {"temperature": 0}  # the client no longer sends temperature itself: extra_body
TEMPLATE = (pathlib.Path(__file__).parent / "templates" / "qwen3_tools.jinja").read_text()
# Qwen3's generation prompt: an empty closed <think> block when enable_thinking is false
THINKING_OFF = ("{%- if add_generation_prompt and enable_thinking is defined and not "
                "enable_thinking %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
                "{%- elif add_generation_prompt %}")
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "additionalProperties": False,
                           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
                           "required": ["city"]}}]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
TOOL_FLAGS = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 768}


@pytest.fixture(scope="module")
def server():
    s = start_server(f"--api_key={KEY}", f"--body_read_timeout={BODY_S}")
    yield s
    s.stop()


def _clients(server):
    root = server.url.removesuffix("/v1")
    return (anthropic.Anthropic(base_url=root, api_key=KEY, max_retries=0, timeout=120),
            openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120))


@pytest.fixture(scope="module")
def clients(server):
    claude, gpt = _clients(server)
    with claude, gpt:
        yield claude, gpt


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tools")
    testing.make_hf_model(path, "qwen3", seed=1, max_position_embeddings=1024)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace("{%- if add_generation_prompt %}",
                                               THINKING_OFF)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    s = start_server(f"--model={path}", "--enable_auto_tool_choice",
                     "--tool_call_parser=hermes", "--reasoning_parser=qwen3", **TOOL_FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tool_clients(tool_server):
    claude, gpt = _clients(tool_server)
    with claude, gpt:
        yield claude, gpt


def _post(server, body: dict, **headers: str):
    return server.post("/v1/messages", json=body, headers={"x-api-key": KEY} | headers)


def _events(response) -> list[tuple[str, dict]]:
    """(event name, data) of an SSE body."""
    out = []
    for item in response.text.split("\n\n"):
        if item.strip():
            name, data = item.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def _assert_anthropic_error(response, status: int, kind: str, says: str = "") -> None:
    assert response.status_code == status, response.text[:300]
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert says in body["error"]["message"], body["error"]["message"]


# ---- the demo model -------------------------------------------------------------------------

def test_messages_create_is_the_chat_routes_greedy_answer(server, clients):
    claude, gpt = clients
    message = claude.messages.create(model=server.model, system=SYSTEM, messages=USER,
                                     max_tokens=20, extra_body=GREEDY)
    chat = gpt.chat.completions.create(model=server.model, max_tokens=20, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM}, *USER])
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens == 20


def test_messages_stream_helpers_give_the_whole_answer(server, clients):
    claude, _ = clients
    kwargs = dict(model=server.model, messages=USER, max_tokens=24, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24
    names = [name for name, _ in _events(_post(server, kwargs_body(server, 24, stream=True)))]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def kwargs_body(server, max_tokens: int, **extra) -> dict:
    return {"model": server.model, "messages": USER, "max_tokens": max_tokens, **GREEDY,
            **extra}


def test_a_final_assistant_message_is_a_prefill(server, clients):
    """The answer goes on from the last assistant message, as chat's
    continue_final_message."""
    claude, gpt = clients
    history = [*USER, {"role": "assistant", "content": "    x ="}]
    message = claude.messages.create(model=server.model, messages=history, max_tokens=12,
                                     extra_body=GREEDY)
    chat = gpt.chat.completions.create(model=server.model, messages=history, max_tokens=12,
                                       temperature=0, extra_body={
                                           "add_generation_prompt": False,
                                           "continue_final_message": True})
    assert message.content[0].text == chat.choices[0].message.content


def test_metrics_count_the_route(server, clients):
    claude, _ = clients
    name = "jaxinfer:http_requests_total{handler=/v1/messages,method=POST,status=%d}"
    before = metric_values(server)
    claude.messages.create(**_create(server, 2))
    _post(server, {"model": server.model, "messages": USER})
    after = metric_values(server)
    for status in (200, 400):
        assert after[name % status] - before.get(name % status, 0) == 1


def test_output_config_format_constrains_the_text_to_its_schema(server, clients):
    claude, _ = clients
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    message = claude.messages.create(**_create(server, 40), output_config={
        "format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)
    assert message.stop_reason == "end_turn"
    bad = _post(server, kwargs_body(server, 4) | {"output_config": {
        "format": {"type": "json_schema", "schema": False}}})
    _assert_anthropic_error(bad, 400, "invalid_request_error", "output_config")


def test_a_stop_sequence_ends_the_text_whole_and_streamed(server, clients):
    claude, _ = clients
    full = claude.messages.create(**_create(server, 40)).content[0].text
    stop = full[10:14]
    for streamed in (False, True):
        if streamed:
            with claude.messages.stream(**_create(server, 40), stop_sequences=[stop]) as s:
                message = s.get_final_message()
        else:
            message = claude.messages.create(**_create(server, 40), stop_sequences=[stop])
        assert message.content[0].text == full[:full.index(stop)]
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def _create(server, max_tokens: int) -> dict:
    return dict(model=server.model, messages=USER, max_tokens=max_tokens, extra_body=GREEDY)


def test_count_tokens_is_the_chat_prompt(server, clients):
    claude, gpt = clients
    counted = claude.messages.count_tokens(model=server.model, system=SYSTEM, messages=USER)
    chat = gpt.chat.completions.create(model=server.model, max_tokens=1,
                                       messages=[{"role": "system", "content": SYSTEM}, *USER])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_the_api_key_goes_in_x_api_key_or_authorization(server):
    body = kwargs_body(server, 2)
    assert _post(server, body).status_code == 200
    assert server.post("/v1/messages", json=body,
                       headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    _assert_anthropic_error(_post(server, body, **{"x-api-key": "wrong"}), 401,
                            "authentication_error")
    _assert_anthropic_error(server.post("/v1/messages", json=body), 401,
                            "authentication_error", "x-api-key")
    with anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="wrong",
                             max_retries=0) as wrong, pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**_create(server, 2))


def test_missing_max_tokens_is_the_clients_bad_request_error(server, clients):
    claude, _ = clients
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.post("/v1/messages", cast_to=anthropic.types.Message,
                    body={"model": server.model, "messages": USER})
    assert caught.value.body["error"] == {"type": "invalid_request_error",
                                          "message": "max_tokens: Field required"}


BAD = {
    "missing max_tokens": ({"max_tokens": None}, 400, "max_tokens"),
    "an unknown block type": ({"messages": [{"role": "user", "content": [
        {"type": "hologram"}]}]}, 400, "messages.0.content.0.type: 'hologram'"),
    "an image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "x"}}]}]}, 400, "images"),
    "a tool_result for an unknown id": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]}, 400,
        "messages.0.content.0.tool_use_id"),
    "an oversized input": ({"messages": [{"role": "user", "content": "x = 1; " * 100_000}]},
                           400, "max_model_len 512"),
    "max_tokens past the context": ({"max_tokens": 5000}, 400, "max_tokens"),
    "an unknown field": ({"logprobs": True}, 400, "logprobs"),
    "thinking without a reasoning parser": ({"thinking": {"type": "adaptive"}}, 400,
                                            "--reasoning_parser"),
    "tools without a parser (auto)": ({"tools": TOOLS}, 400, "tool_choice"),
    "too many stop sequences": ({"stop_sequences": ["@"] * 17}, 400, "stop_sequences"),
    "an unknown model": ({"model": "claude-opus"}, 404, "claude-opus"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_are_anthropic_4xx_and_serving_goes_on(server, case):
    change, status, says = BAD[case]
    body = {k: v for k, v in (kwargs_body(server, 4) | change).items() if v is not None}
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    _assert_anthropic_error(_post(server, body), status, kind, says)
    _assert_anthropic_error(_post(server, body | {"stream": True}), status, kind, says)
    assert _post(server, kwargs_body(server, 2)).json()["usage"]["output_tokens"] == 2


def test_a_body_over_the_size_limit_is_413(server):
    response = server.post("/v1/messages", content=b" " * (9 * 2**20),
                           headers={"x-api-key": KEY, "Content-Type": "application/json"})
    _assert_anthropic_error(response, 413, "request_too_large", "max_request_body_bytes")


def test_a_client_that_leaves_mid_stream_aborts_its_request(server, clients):
    claude, _ = clients
    aborted = "jaxinfer:request_success_total{finished_reason=abort}"
    before = metric_values(server).get(aborted, 0)
    with claude.messages.stream(**_create(server, 400)) as stream:
        for i, _ in enumerate(stream):
            if i == 4:
                break  # the client goes away
    for _ in range(300):
        values = metric_values(server)
        if values["jaxinfer:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert values[aborted] - before == 1
    assert values["jaxinfer:kv_cache_pages_in_use"] == 0
    assert claude.messages.create(**_create(server, 3)).usage.output_tokens == 3


def test_a_stalled_body_gets_the_408_deadline_and_the_connection_closes(server):
    body = json.dumps(kwargs_body(server, 2)).encode()
    url = urllib.parse.urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10 * BODY_S)
    head = ["POST /v1/messages HTTP/1.1", "Host: test", "Content-Type: application/json",
            f"Content-Length: {len(body)}", f"x-api-key: {KEY}"]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body[:10])
    raw = b""
    while chunk := sock.recv(65536):  # until the server closes the connection
        raw += chunk
    sock.close()
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    error = json.loads(answer)
    assert error["type"] == "error" and "body_read_timeout" in error["error"]["message"]
    assert _post(server, kwargs_body(server, 2)).status_code == 200


# ---- the tool model -------------------------------------------------------------------------

@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_call_validates_against_its_schema(tool_server, tool_clients, choice):
    """Sampled, whole and streamed: every tool_use block's input is valid under the tool's
    schema; "any" may call several times unless parallel use is disabled."""
    claude, _ = tool_clients
    kwargs = dict(model=tool_server.model, messages=WEATHER, tools=TOOLS, tool_choice=choice,
                  max_tokens=200)
    single = choice["type"] == "tool" or choice.get("disable_parallel_tool_use")
    for seed in range(2):
        message = claude.messages.create(**kwargs, extra_body={"temperature": 1.0,
                                                               "top_k": 50 + seed})
        with claude.messages.stream(**kwargs, extra_body={"top_k": 50 + seed}) as stream:
            final = stream.get_final_message()
        for answer in (message, final):
            assert answer.content and {block.type for block in answer.content} == {"tool_use"}
            assert len(answer.content) == 1 or not single
            for call in answer.content:
                assert call.name == "get_weather" and call.id.startswith("toolu_")
                jsonschema.validate(call.input, TOOLS[0]["input_schema"])
            assert answer.stop_reason == "tool_use"


def test_a_tool_result_goes_back_through_the_template(tool_server, tool_clients):
    claude, gpt = tool_clients
    first = claude.messages.create(model=tool_server.model, messages=WEATHER, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   max_tokens=200)
    (call,) = first.content
    history = [*WEATHER, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "sunny"}]}]
    answer = claude.messages.create(model=tool_server.model, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"}, max_tokens=4,
                                    extra_body=GREEDY)
    counted = claude.messages.count_tokens(model=tool_server.model, messages=history,
                                           tools=TOOLS, tool_choice={"type": "none"})
    chat = gpt.chat.completions.create(
        model=tool_server.model, tools=[_chat_tool(t) for t in TOOLS], tool_choice="none",
        max_tokens=4, temperature=0, messages=[*WEATHER, {
            "role": "assistant", "content": None, "tool_calls": [{
                "id": call.id, "type": "function", "function": {
                    "name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    usage = answer.usage
    assert counted.input_tokens == chat.usage.prompt_tokens == (
        usage.input_tokens + usage.cache_read_input_tokens)
    assert answer.content[0].thinking == chat.choices[0].message.reasoning


def _chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["name"], "parameters":
                                             tool["input_schema"],
                                             "description": tool["description"]}}


def test_thinking_blocks_carry_the_reasoning_whole_and_streamed(tool_server, tool_clients):
    """The generation prompt opens <think>: a random model's output is all reasoning."""
    claude, gpt = tool_clients
    kwargs = dict(model=tool_server.model, messages=WEATHER, max_tokens=12,
                  thinking={"type": "adaptive"}, extra_body=GREEDY)
    message = claude.messages.create(**kwargs)
    chat = gpt.chat.completions.create(model=tool_server.model, messages=WEATHER,
                                       max_tokens=12, temperature=0)
    (block,) = message.content
    assert block.type == "thinking" and block.signature
    assert block.thinking == chat.choices[0].message.reasoning
    assert message.stop_reason == "max_tokens"
    with claude.messages.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == block.thinking
    assert deltas[-1].type == "signature_delta"
    assert final.content[0].thinking == block.thinking
    disabled = claude.messages.create(**kwargs | {"thinking": {"type": "disabled"}})
    assert disabled.content[0].type == "text"  # the template closed the block


@pytest.mark.parametrize("change, says", [
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive"}, "tools": TOOLS, "tool_choice": {"type": "any"}},
     "forced tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}}, "get_time"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
])
def test_tool_and_thinking_misuse_is_a_400_naming_the_field(tool_server, change, says):
    body = {"model": tool_server.model, "messages": WEATHER, "max_tokens": 8} | change
    response = tool_server.post("/v1/messages", json=body)
    _assert_anthropic_error(response, 400, "invalid_request_error", says)

