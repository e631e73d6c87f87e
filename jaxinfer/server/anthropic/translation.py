"""A Messages request read as the chat-completions request it asks for (system, content
blocks, tools, tool_choice, thinking -> chat messages, tools, template variables), and
what the two share once answered: stop reasons, usage and ids. Each refusal is a 400
naming the field Anthropic's way (`messages.1.content.0.tool_use_id`). See
docs/serving.md#anthropics-messages-api.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pydantic

from jaxinfer.config import ServerConfig
from jaxinfer.server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from jaxinfer.server.protocol import APIError

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
          "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock}
NOT_SERVED = {"image": "images are not served yet (this server's models read text)",
              "document": "documents are not served (send their text as a text block)"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A Messages request as the chat request it becomes, and what its answer needs."""

    chat: dict[str, Any]  # a /v1/chat/completions body
    stop_sequences: tuple[str, ...] = ()
    show_thinking: bool = True  # False: thinking blocks carry no text (display "omitted")


def chat_request(body: MessagesRequest | CountTokensRequest, config: ServerConfig) -> Plan:
    """The chat body a Messages (or count_tokens) body asks for; a 400 for what cannot be
    served."""
    messages = _system(body.system) + _messages(body.messages)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    last = body.messages[-1]
    if last.role == "assistant":  # a prefill: the answer goes on from it
        chat |= {"add_generation_prompt": False, "continue_final_message": True}
    chat |= _tools(body, config)
    chat |= _thinking(body, config)
    if isinstance(body, CountTokensRequest):
        return Plan(chat)
    chat |= {"max_tokens": body.max_tokens, "stream": body.stream}
    chat |= {name: getattr(body, name) for name in ("temperature", "top_p", "top_k")
             if getattr(body, name) is not None}
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    output = body.output_config
    if output is not None and output.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": output.format.json_schema}}
    if output is not None and output.effort is not None:
        chat["reasoning_effort"] = output.effort
    if body.stream:  # every chunk carries the usage so far: message_start's input tokens
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    display = body.thinking.display if body.thinking else None
    return Plan(chat, tuple(body.stop_sequences or ()), show_thinking=display != "omitted")


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(block.text for block in system)
    return [{"role": "system", "content": text}]


def _messages(messages: list) -> list[dict[str, Any]]:
    """Chat messages: a user turn's tool results become tool messages (its text a user
    message, in order); an assistant turn's tool_use blocks its tool_calls, its thinking
    its reasoning."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # the ids of the tool_use blocks sent so far
    for i, message in enumerate(messages):
        where = f"messages.{i}.content"
        final = i == len(messages) - 1
        if not message.content and not (final and message.role == "assistant"):
            raise APIError(400, f"{where}: a message needs content (only a final assistant "
                           "message may be empty)", param=where)
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        blocks = [_block(block, f"{where}.{j}") for j, block in enumerate(message.content)]
        if message.role == "assistant":
            out.append(_assistant(blocks, where))
            calls.update(block.id for block in blocks if isinstance(block, ToolUseBlock))
        else:
            out += _user(blocks, where, calls)
    return out


def _block(data: dict[str, Any], where: str) -> Any:
    kind = data.get("type")
    if kind in NOT_SERVED:
        raise APIError(400, f"{where}: {kind} blocks: {NOT_SERVED[kind]}", param=where)
    model = BLOCKS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(400, f"{where}.type: {str(kind)[:80]!r} is not a content block this "
                       f"server reads ({', '.join(BLOCKS)})", param=f"{where}.type")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        error = e.errors(include_url=False)[0]
        field = ".".join([where, *map(str, error["loc"])])
        message = ("unknown or unsupported parameter" if error["type"] == "extra_forbidden"
                   else error["msg"])
        raise APIError(400, f"{field[:160]}: {message}", param=field[:160]) from None


def _assistant(blocks: list, where: str) -> dict[str, Any]:
    text = [b.text for b in blocks if isinstance(b, TextBlock)]
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if any(isinstance(b, ToolResultBlock) for b in blocks):
        raise APIError(400, f"{where}: tool_result blocks go in a user message",
                       param=where)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning"] = "\n".join(thinking)
    return message


def _user(blocks: list, where: str, calls: set[str]) -> list[dict[str, Any]]:
    out, text = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                field = f"{where}.{j}.tool_use_id"
                raise APIError(400, f"{field}: no earlier tool_use block has the id "
                               f"{block.tool_use_id[:80]!r}", param=field)
            if text:
                out.append({"role": "user", "content": text})
                text = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block, f"{where}.{j}.content")})
        else:
            raise APIError(400, f"{where}.{j}: {block.type} blocks go in an assistant "
                           "message", param=f"{where}.{j}")
    return out + ([{"role": "user", "content": text}] if text else [])


def _result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for k, item in enumerate(block.content):
        if item.get("type") != "text":
            _block(item, f"{where}.{k}")  # refuses images and unknown blocks by name
            raise APIError(400, f"{where}.{k}: a tool result holds text blocks here",
                           param=f"{where}.{k}")
        texts.append(_block(item, f"{where}.{k}").text)
    return "\n".join(texts)


def _tools(body: MessagesRequest | CountTokensRequest, config: ServerConfig
           ) -> dict[str, Any]:
    """`tools` and `tool_choice` as chat's: any -> required, tool -> a named function;
    auto (the default with tools) needs the server's tool-call parser."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice.type != "none":
            raise APIError(400, "tool_choice needs tools (the tools it may call)",
                           param="tool_choice")
        return {}
    tools = [{"type": "function", "function": {
        "name": t.name, "parameters": t.input_schema}
        | ({"description": t.description} if t.description is not None else {})
        | ({"strict": t.strict} if t.strict is not None else {})} for t in body.tools]
    kind = choice.type if choice else "auto"
    if kind == "auto" and not config.enable_auto_tool_choice:
        raise APIError(400, 'tool_choice {"type": "auto"} (the default when tools are '
                       "given) needs a server started with --enable_auto_tool_choice and "
                       '--tool_call_parser; send tool_choice "any", "tool" or "none"',
                       param="tool_choice")
    chat: dict[str, Any] = {"tools": tools, "tool_choice": {
        "auto": "auto", "any": "required", "none": "none"}.get(kind) or {
        "type": "function", "function": {"name": choice.name}}}
    if choice is not None and choice.disable_parallel_tool_use is not None:
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return chat


def _thinking(body: MessagesRequest | CountTokensRequest, config: ServerConfig
              ) -> dict[str, Any]:
    """Template variables for `thinking`: `disabled`, or a forced tool call (Anthropic
    forces none while thinking), asks the template not to think (`enable_thinking`, Qwen3's
    variable); `enabled` needs the server's reasoning parser."""
    thinking = body.thinking
    forced = body.tools and body.tool_choice and body.tool_choice.type in ("any", "tool")
    if thinking is None or thinking.type == "disabled":
        off = thinking is not None or forced
        return {"chat_template_kwargs": {"enable_thinking": False}} if off else {}
    if config.reasoning_parser is None:
        raise APIError(400, f"thinking {{\"type\": \"{thinking.type}\"}} needs a server "
                       "started with --reasoning_parser (it reads the model's reasoning "
                       "apart from its answer)", param="thinking")
    if forced:
        raise APIError(400, "thinking may not be used with a forced tool_choice (\"any\" "
                       "or \"tool\"), as Anthropic's rule", param="thinking")
    budget = thinking.budget_tokens
    if thinking.type == "enabled":
        max_tokens = getattr(body, "max_tokens", None)
        if budget is None or budget < MIN_THINKING_BUDGET or (
                max_tokens is not None and budget >= max_tokens):
            raise APIError(400, f"thinking.budget_tokens: must be >= {MIN_THINKING_BUDGET} "
                           "and less than max_tokens", param="thinking.budget_tokens")
    elif budget is not None:
        raise APIError(400, "thinking.budget_tokens: goes with type \"enabled\" only",
                       param="thinking.budget_tokens")
    return {}


# ---- the answer ------------------------------------------------------------------------

def stop_reason(finish_reason: str | None, stopped_by: Any,
                stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish_reason and
    stop_reason (the stop string or token id that ended it)."""
    if finish_reason == "stop" and isinstance(stopped_by, str) and stopped_by in stop_sequences:
        return "stop_sequence", stopped_by
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: input tokens beside those the prefix cache served (their sum is
    the prompt, as Anthropic counts)."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt - cached, "output_tokens":
            chat_usage.get("completion_tokens", 0), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("chatcmpl-tool-")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use `input`; {} when they are no JSON object (cut short
    by max_tokens)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
