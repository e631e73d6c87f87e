"""A Responses request made a chat completion request: instructions, the stored
conversation of `previous_response_id` and the input items become chat messages (a
function call an assistant turn's `tool_calls`, its output a tool message), function
tools and `text.format` the chat fields; errors name the Responses fields. See
docs/serving.md#the-responses-api.
"""

from __future__ import annotations

import re
from typing import Any

from jaxinfer.server.protocol import APIError, ChatRequest
from jaxinfer.server.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# chat fields -> the Responses fields they came from, for the errors the chat path raises
_RENAMED = ((re.compile(r"^messages(\[\d+\])?(\..*)?$"), "input"),
            (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
            (re.compile(r"^response_format.*$"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function\.parameters$"), r"tools[\1].parameters"))


def check_item_types(data: Any) -> None:
    """400 naming `input[i].type` for an item of a type not served (before the body
    model, whose union error would list every alternative)."""
    items = data.get("input") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            shown = kind if len(kind) <= 40 else kind[:40] + "..."
            raise APIError(400, f"input[{i}].type: the item type {shown!r} is not served; "
                           f"the types served are {', '.join(ITEM_TYPES)}",
                           param=f"input[{i}].type")


def messages(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The chat messages: `instructions` (never carried over from an earlier response,
    as OpenAI's), the earlier conversation, then the input items."""
    out: list[dict] = [] if body.instructions is None else [
        {"role": "system", "content": body.instructions}]
    out += history
    items = [MessageItem(role="user", content=body.input)] if isinstance(
        body.input, str) else body.input
    calls = {call["id"] for m in history for call in m.get("tool_calls", ())}
    reasoning = None  # a reasoning item's text waits for the assistant turn after it
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
        elif isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
            if item.role == "assistant" and reasoning:
                out[-1]["reasoning"], reasoning = reasoning, None
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            calls.add(item.call_id)
            _assistant_turn(out, reasoning)["tool_calls"].append(call)
            reasoning = None
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"input[{i}].call_id: no function_call with call_id "
                               f"{item.call_id[:80]!r} comes before this output (in the input "
                               "or the previous response)", param=f"input[{i}].call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _assistant_turn(out: list[dict], reasoning: str | None) -> dict:
    """The assistant turn a function call joins: the last message if it is the
    assistant's and nothing answered it yet, else a new one."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    last = out[-1]
    last.setdefault("tool_calls", [])
    if reasoning:
        last["reasoning"] = reasoning
    return last


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatRequest:
    """The chat completion request the Responses request asks for."""
    data: dict[str, Any] = {"model": body.model, "messages": messages(body, history),
                            "max_completion_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        data["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in body.tools]
    choice = body.tool_choice
    data["tool_choice"] = choice if choice is None or isinstance(choice, str) else {
        "type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        data["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": fmt.model_dump(
                by_alias=True, exclude={"type"}, exclude_none=True)}
    if body.reasoning is not None and body.reasoning.effort is not None:
        data["reasoning_effort"] = body.reasoning.effort
    data = {key: value for key, value in data.items() if value is not None}
    try:
        return ChatRequest.model_validate(data)
    except ValueError as e:  # a message the chat model refuses (an empty tool call id...)
        raise APIError(400, f"input: {e}", param="input") from None


def renamed(error: APIError) -> APIError:
    """A chat-path error worded with the Responses field it is about."""
    if error.param is None:
        return error
    for pattern, name in _RENAMED:
        if pattern.match(error.param):
            param = pattern.sub(name, error.param)
            message = error.message.replace(error.param, param, 1)
            return APIError(error.status, message, param=param, code=error.code,
                            retry_after=error.retry_after, close=error.close)
    return error
