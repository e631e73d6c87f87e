"""A Responses API response from a chat choice: its output items (reasoning, the
message, function calls), status, usage, and the request's settings echoed back as
OpenAI's `Response` object has them. Pure functions over plain data. See
docs/serving.md#the-responses-api.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from jaxinfer.server.responses_api.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    """OpenAI's ids: `resp_...`, `msg_...`, `fc_...`, `call_...`, `rs_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """vLLM's reasoning item: the reasoning itself as `reasoning_text`, no summary."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    """The assistant's message; `text` None: its content parts not started yet."""
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict[str, Any]:
    """A function call from a chat `tool_calls` entry (its id becomes `call_id`)."""
    function = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"], "status": status}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def response(body: ResponsesRequest, response_id: str, model: str, *, created_at: int,
             output: list[dict], status: str, finish_reason: str | None = None,
             usage: dict | None = None) -> dict[str, Any]:
    """OpenAI's `Response` object; `finish_reason` "length" makes it incomplete."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "model": model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": None},
        "store": body.store, "temperature": body.temperature,
        "text": {"format": {"type": "text"} if fmt is None else fmt.model_dump(
            by_alias=True, exclude_none=True)},
        "tool_choice": (choice or "auto") if not hasattr(choice, "name") else
        choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "top_p": body.top_p, "truncation": "disabled", "usage": usage,
        "user": body.user}


def now() -> int:
    return int(time.time())


def assistant_messages(output: list[dict]) -> list[dict]:
    """The output as chat messages, for the stored conversation: one assistant turn with
    its reasoning, text and calls."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            turn["reasoning"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            turn["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [turn]
