"""/v1/messages' translation without a server: a chat stream read back as Anthropic's
events (block order, ids, usage, stop reason), an error chunk as an error event, and
errors in Anthropic's status codes and field names."""

from __future__ import annotations

import json

from jaxinfer.server.anthropic import errors
from jaxinfer.server.anthropic.streaming import Events
from jaxinfer.server.anthropic.translation import Plan
from jaxinfer.server.protocol import APIError


def _chat_stream(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_a_chat_stream_becomes_anthropics_events_in_the_models_order():
    usage = {"prompt_tokens": 9, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 4}}
    choice = {"index": 0, "finish_reason": None}
    call = {"index": 0, "id": "chatcmpl-tool-7", "type": "function",
            "function": {"name": "f", "arguments": ""}}
    stream = _chat_stream(
        {"id": "chatcmpl-1", "choices": [choice | {"delta": {"role": "assistant"}}],
         "usage": usage},
        {"id": "chatcmpl-1", "choices": [choice | {"delta": {"reasoning": "hm"}}]},
        {"id": "chatcmpl-1", "choices": [choice | {"delta": {"content": "ok"}}]},
        {"id": "chatcmpl-1", "choices": [choice | {"delta": {"tool_calls": [call]}}]},
        {"id": "chatcmpl-1", "choices": [choice | {"delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "{}"}}]}, "finish_reason": "tool_calls"}]},
        {"id": "chatcmpl-1", "choices": [], "usage": usage})
    events = Events(Plan({}), "demo")
    text = "".join(events.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))
    got = [(name.removeprefix("event: "), json.loads(data.removeprefix("data: ")))
           for name, data in (item.split("\n") for item in text.split("\n\n") if item)]
    kinds = [(name, data.get("content_block", data.get("delta", {})).get("type"))
             for name, data in got]
    assert kinds == [
        ("message_start", None), ("ping", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    assert got[0][1]["message"]["id"] == "msg_1"
    assert got[0][1]["message"]["usage"]["input_tokens"] == 5
    assert got[9][1]["content_block"]["id"] == "toolu_7"
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert got[-2][1]["usage"]["cache_read_input_tokens"] == 4


def test_an_error_chunk_ends_the_stream_with_an_error_event():
    error = {"error": {"message": "the server shut down", "type": "service_unavailable",
                       "param": None, "code": "shutting_down"}}
    text = Events(Plan({}), "demo").feed(_chat_stream(error))
    assert text == ('event: error\ndata: {"type":"error","error":{"type":"api_error",'
                    '"message":"the server shut down"}}\n\n')


def test_an_overloaded_queue_is_529_with_retry_after():
    response = errors.response(APIError(503, "too many requests waiting",
                                        code="overloaded", retry_after=1))
    assert response.status_code == 529 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["type"] == "overloaded_error"
    renamed = errors.worded(APIError(400, "bad schema", param="tools[2].function.parameters"))
    assert renamed == "tools.2.input_schema: bad schema"
