"""OpenAI's Responses API (/v1/responses) end to end: a real `python -m jaxinfer serve` on
127.0.0.1 (the demo model, a store of 4 responses, a 3 s body deadline) and the official
`openai` client. Whole and streamed responses (the event sequence and its numbers), the
same greedy text as /v1/chat/completions for the same conversation, a forced function
call and its output sent back, `text.format` json_schema, `previous_response_id`, the
store's bounds (an evicted id is a 404), GET and DELETE, bad inputs as 4xx in OpenAI's
shape, a client leaving mid-stream and a stalled body, requests counted by route in
/metrics. Reasoning items come from a tiny Qwen3 checkpoint served with
`--reasoning_parser=qwen3`. The store's bounds (with a clock of the test's) and the
translation into chat messages are also checked without a server."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import socket
import threading
import time
import urllib.parse

import jsonschema
import openai
import pytest
from serving import metric_values, start_server

from jaxinfer import testing
from jaxinfer.server import protocol
from jaxinfer.server.protocol import APIError
from jaxinfer.server.responses_api import translation
from jaxinfer.server.responses_api.protocol import ResponsesRequest
from jaxinfer.server.responses_api.store import ResponseStore

STORE_ENTRIES = 4
BODY_S = 3
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object",
                         "properties": {"city": {"type": "string",
                                                 "enum": ["Paris", "Rome", "Oslo"]}},
                         "required": ["city"], "additionalProperties": False}}]
# a long string the constraint will not let end early (no ignore_eos in this API)
LONG = {"format": {"type": "json_schema", "name": "long",
                   "schema": {"type": "string", "minLength": 2000}}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def rserver():
    s = start_server(f"--responses_store_max_entries={STORE_ENTRIES}",
                     f"--body_read_timeout={BODY_S}")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rclient(rserver):
    with openai.OpenAI(base_url=rserver.url, api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client


def _greedy(client, server, **kwargs):
    return client.responses.create(model=server.model, temperature=0, **kwargs)


def _chat_text(client, server, messages, max_tokens):
    response = client.chat.completions.create(model=server.model, messages=messages,
                                              max_tokens=max_tokens, temperature=0)
    return response.choices[0].message.content, response.usage


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same delta folded into one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i
                                                   and types[i - 1] == t)]


# ---- whole and streamed ------------------------------------------------------------------

def test_create_equals_chat_for_the_same_conversation(rclient, rserver):
    response = _greedy(rclient, rserver, instructions="You write Python.",
                       input="def main():", max_output_tokens=12)
    text, usage = _chat_text(rclient, rserver, [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def main():"}], 12)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        usage.prompt_tokens, usage.completion_tokens)
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert response.status == "incomplete"  # 12 tokens, cut: max_output_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "You write Python." and response.max_output_tokens == 12


def test_stream_sends_the_event_sequence_numbered_from_zero(rclient, rserver):
    whole = _greedy(rclient, rserver, input="import os\n", max_output_tokens=10)
    events = list(rclient.responses.create(model=rserver.model, input="import os\n",
                                           max_output_tokens=10, temperature=0,
                                           stream=True))
    types = [e.type for e in events]
    assert _collapsed(types) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                 "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert final.usage.output_tokens == whole.usage.output_tokens == 10


def test_text_format_json_schema_whole_and_with_the_stream_helper(rclient, rserver):
    text = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}}
    whole = _greedy(rclient, rserver, input="A person as JSON:", max_output_tokens=60,
                    text=text)
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    assert whole.status == "completed" and whole.text.format.type == "json_schema"
    with rclient.responses.stream(model=rserver.model, input="A person as JSON:",
                                  max_output_tokens=60, temperature=0, text=text) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text


# ---- function calls ---------------------------------------------------------------------

def test_forced_function_call_and_its_output_sent_back(rclient, rserver):
    response = _greedy(rclient, rserver, input="Weather in Paris?", tools=TOOLS,
                       tool_choice={"type": "function", "name": "get_weather"},
                       max_output_tokens=40)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    assert response.status == "completed"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    continued = _greedy(rclient, rserver, previous_response_id=response.id, input=[output],
                        max_output_tokens=8)
    # the same conversation written out as items, and as chat messages
    items = _greedy(rclient, rserver, max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments}, output])
    text, usage = _chat_text(rclient, rserver, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], 8)
    assert continued.output_text == items.output_text == text
    assert continued.usage.input_tokens == items.usage.input_tokens == usage.prompt_tokens
    # a stored conversation holding a call goes on (its arguments kept as JSON text)
    again = _greedy(rclient, rserver, previous_response_id=items.id, input="And Rome?",
                    max_output_tokens=4)
    assert again.usage.input_tokens > items.usage.input_tokens + items.usage.output_tokens


def test_a_streamed_function_call_sends_its_arguments_as_deltas(rclient, rserver):
    events = list(rclient.responses.create(
        model=rserver.model, input="Weather?", tools=TOOLS, tool_choice="required",
        max_output_tokens=60, temperature=0, stream=True))
    types = _collapsed([e.type for e in events])
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.arguments == ""
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert done.arguments == arguments and done.call_id == added.call_id
    jsonschema.validate(json.loads(arguments), TOOLS[0]["parameters"])
    assert events[-1].response.output[0].arguments == arguments


def test_openapi_lists_the_routes_and_the_request_body(rserver):
    paths = rserver.get("/openapi.json").json()["paths"]
    body = paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/ResponsesRequest")
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}

def test_metrics_count_requests_by_route(rclient, rserver):
    def count(handler: str, method: str, status: int) -> float:
        name = f"jaxinfer:http_requests_total{{handler={handler},method={method},status={status}}}"
        return metric_values(rserver).get(name, 0)

    before = [count("/v1/responses", "POST", 200), count("/v1/chat/completions", "POST", 200),
              count("/v1/responses/{response_id}", "GET", 404)]
    _greedy(rclient, rserver, input="a", max_output_tokens=2)
    _chat_text(rclient, rserver, [{"role": "user", "content": "a"}], 2)
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve("resp_gone")
    assert [count("/v1/responses", "POST", 200), count("/v1/chat/completions", "POST", 200),
            count("/v1/responses/{response_id}", "GET", 404)] == [b + 1 for b in before]

# ---- the store -------------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation(rclient, rserver):
    first = _greedy(rclient, rserver, instructions="Be brief.", input="def add(a, b):",
                    max_output_tokens=6)
    second = _greedy(rclient, rserver, previous_response_id=first.id, input="def sub(a, b):",
                     max_output_tokens=6)
    # instructions are not carried over (OpenAI's rule)
    text, usage = _chat_text(rclient, rserver, [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "def sub(a, b):"}], 6)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id


def test_get_and_delete(rclient, rserver):
    created = _greedy(rclient, rserver, input="x = ", max_output_tokens=3,
                      metadata={"run": "7"})
    fetched = rclient.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump() and fetched.metadata == {"run": "7"}
    raw = rserver.post("/v1/responses", json={"input": "y", "max_output_tokens": 2,
                                              "store": False}).json()
    for response_id in (raw["id"], "resp_never"):
        with pytest.raises(openai.NotFoundError):
            rclient.responses.retrieve(response_id)
    deleted = _delete(rserver, created.id)
    assert (deleted.status_code, deleted.json()) == (200, {
        "id": created.id, "object": "response.deleted", "deleted": True})
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(created.id)
    _assert_error(_delete(rserver, created.id), 404, "response_id")


def test_the_store_evicts_past_its_bound_and_an_evicted_id_is_404(rclient, rserver):
    ids = [_greedy(rclient, rserver, input=f"n = {i}", max_output_tokens=2).id
           for i in range(STORE_ENTRIES + 2)]
    for evicted in ids[:2]:
        with pytest.raises(openai.NotFoundError) as error:
            _greedy(rclient, rserver, previous_response_id=evicted, input="more",
                    max_output_tokens=2)
        assert error.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            rclient.responses.retrieve(evicted)
    for kept in ids[2:]:
        assert rclient.responses.retrieve(kept).id == kept


def test_store_bounds_count_size_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=3, max_bytes=2000, ttl_s=60, clock=lambda: now[0])

    def put(name: str, filler: int = 0) -> bool:
        return store.put({"id": name}, [{"role": "user", "content": "x" * filler}])

    for name in "abc":
        assert put(name)
    assert store.get("a") is not None  # now the most recently used
    put("d")
    assert [n for n in "abcd" if store.get(n)] == ["a", "c", "d"]  # b went first
    assert not put("huge", 5000) and store.get("huge") is None  # alone over max_bytes
    put("e", 1500)  # room made by size: the least recently used go
    assert store.num_bytes <= 2000 and store.get("e") is not None
    assert store.delete("e") and not store.delete("e")
    put("f")
    now[0] = 59.0
    put("g")
    now[0] = 61.0  # f is older than the ttl, g is not
    assert store.get("f") is None and store.get("g") is not None
    assert len(store) == 1



# ---- the translation, without a server ----------------------------------------------------

def test_items_become_chat_messages_in_order():
    body = protocol.validate(ResponsesRequest, {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                     {"type": "input_text", "text": "twice?"}]},
        {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "two calls"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "1"}]}]})
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": a}}
             for c, a in (("c1", "{}"), ("c2", '{"a": 1}'))]
    assert translation.messages(body, history) == [
        {"role": "system", "content": "Be brief."}, *history,
        {"role": "user", "content": "Weather twice?"},
        {"role": "assistant", "content": "", "tool_calls": calls, "reasoning": "two calls"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]


def test_chat_errors_are_worded_with_the_responses_fields():
    for chat, responses in (("max_completion_tokens", "max_output_tokens"),
                            ("response_format.json_schema", "text.format"),
                            ("tools[2].function.parameters", "tools[2].parameters"),
                            ("messages", "input"), ("temperature", "temperature")):
        error = translation.renamed(APIError(400, f"{chat}: bad", param=chat))
        assert (error.param, error.message) == (responses, f"{responses}: bad")

# ---- bad inputs, disconnects, deadlines -------------------------------------------------

def _delete(server, response_id: str):
    import httpx2 as httpx
    return httpx.delete(f"{server.url}/responses/{response_id}", timeout=30)


def _assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input[1].call_id"),
    ({"input": "x = 1; " * 20_000}, "input"),  # far longer than the context
    ({"input": [{"role": "user", "content": "x"}] * 2049}, "input"),  # too many items
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": False}}}, "text.format"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "background": True}, "background"),
])
def test_bad_inputs_are_4xx_in_openais_shape_and_serving_goes_on(rserver, body, param):
    _assert_error(rserver.post("/v1/responses", json=body), 400, param)
    assert rserver.post("/v1/responses", json={"input": "ok",
                                               "max_output_tokens": 2}).status_code == 200


def test_an_oversized_body_is_413(rserver):
    response = rserver.post("/v1/responses", json={"input": "x" * (9 * 2**20)})
    assert _assert_error(response, 413, None)["code"] == "request_too_large"


def _idle(server, limit_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + limit_s
    while True:
        values = metric_values(server)
        if values["jaxinfer:num_requests_running"] == 0 == values[
                "jaxinfer:num_requests_waiting"] or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_a_client_leaving_mid_stream_aborts_and_frees_its_pages(rclient, rserver):
    before = _idle(rserver)

    async def read_then_leave() -> int:
        async with openai.AsyncOpenAI(base_url=rserver.url, api_key="unused",
                                      max_retries=0, timeout=120) as client:
            stream = await client.responses.create(
                model=rserver.model, input="Say it:", max_output_tokens=400, text=LONG,
                temperature=0, stream=True)
            received = 0
            async for _ in stream:
                received += 1
                if received == 6:
                    break
            await stream.close()
            return received

    assert asyncio.run(read_then_leave()) == 6
    after = _idle(rserver)
    aborted = "jaxinfer:request_success_total{finished_reason=abort}"
    assert after[aborted] - before[aborted] == 1
    assert after["jaxinfer:kv_cache_pages_in_use"] == 0
    assert after["jaxinfer:generation_tokens_total"] - before[
        "jaxinfer:generation_tokens_total"] < 400
    assert _greedy(rclient, rserver, input="ok", max_output_tokens=2).usage.output_tokens == 2


def test_a_body_that_stalls_gets_408_and_the_connection_closes(rserver):
    url = urllib.parse.urlsplit(rserver.url)
    body = json.dumps({"input": "hi", "max_output_tokens": 2}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: t\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:8])
        start, raw = time.monotonic(), b""
        while chunk := sock.recv(65536):
            raw += chunk
    assert time.monotonic() - start < 10 * BODY_S
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(payload)["error"]["code"] == "request_timeout"



def test_a_stream_cut_by_shutdown_ends_with_error_and_response_failed():
    """Two signals abort the streams at once: the client reads an `error` event, then
    `response.failed`, and the server exits 0."""
    server = start_server("--shutdown_timeout=60")
    events, started = [], threading.Event()

    def read() -> None:
        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0,
                           timeout=120) as client:
            for event in client.responses.create(
                    model=server.model, input="Say it:", max_output_tokens=400,
                    temperature=0, stream=True, text=LONG):
                events.append(event)
                started.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert started.wait(60)
    server.process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    server.process.send_signal(signal.SIGINT)
    thread.join(120)
    assert server.process.wait(60) == 0, "".join(server.log[-40:])
    error, failed = events[-2:]
    assert error.type == "error" and error.code == "shutting_down"
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "shutting_down"
    assert [e.sequence_number for e in events] == list(range(len(events)))

# ---- reasoning items -------------------------------------------------------------------

TEMPLATE = (pathlib.Path(__file__).parent / "templates" / "qwen3_tools.jinja").read_text()


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_reasoning")
    testing.make_hf_model(path, "qwen3", seed=1, max_position_embeddings=1024)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {
        "chat_template": TEMPLATE}))
    server = start_server(f"--model={path}", "--reasoning_parser=qwen3", max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=768)
    yield server
    server.stop()


def test_reasoning_comes_out_as_a_reasoning_item(reasoning_server):
    """The template opens `<think>` in the prompt, so a random model's output is all
    reasoning: the same text as chat's `reasoning`, whole and streamed."""
    with openai.OpenAI(base_url=reasoning_server.url, api_key="unused", max_retries=0,
                       timeout=120) as client:
        kwargs = dict(model=reasoning_server.model, input="2 + 2?", max_output_tokens=12,
                      temperature=0, reasoning={"effort": "low"})
        response = client.responses.create(**kwargs)
        events = list(client.responses.create(**kwargs, stream=True))
        chat = client.chat.completions.create(
            model=reasoning_server.model, messages=[{"role": "user", "content": "2 + 2?"}],
            max_tokens=12, temperature=0)
    (item,) = response.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert item.content[0].type == "reasoning_text"
    assert item.content[0].text == chat.choices[0].message.reasoning
    assert response.reasoning.effort == "low"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _collapsed([e.type for e in events])[2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
