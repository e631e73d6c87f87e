"""Anthropic's Messages API bodies as /v1/messages reads them (pydantic, strict, unknown
fields refused, as the OpenAI bodies). Content blocks stay plain dicts here: each is read
by its `type` in translation.py, so an unknown or refused block is a 400 naming it. See
docs/serving.md#anthropics-messages-api.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

from jaxinfer.server.protocol import Body

# `cache_control` marks Anthropic's prompt-cache breakpoints; the prefix cache needs none,
# so it is accepted wherever Anthropic takes it and has no effect.
CacheControl = dict[str, Any] | None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = None  # an earlier answer's, sent back


class ToolUseBlock(Body):
    """A call an assistant turn made, sent back in a later request."""

    type: Literal["tool_use"]
    id: Annotated[str, pydantic.Field(min_length=1)]
    name: Annotated[str, pydantic.Field(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(Body):
    """A user turn's answer to a call: text, or a list of text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None


class ThinkingBlock(Body):
    """An assistant turn's reasoning sent back (the signature is ours, and ignored)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(Body):
    """A client tool; Anthropic's server tools (a `type` such as web_search_...) are
    refused in translation.py."""

    name: Annotated[str, pydantic.Field(min_length=1, max_length=128)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _a_client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tools are not served ({str(kind)[:80]}): only client "
                             "tools, each with an input_schema")
        return data


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None

    @pydantic.model_validator(mode="after")
    def _tool_names_one(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('"name" goes with type "tool", and only with it')
        return self


class Thinking(Body):
    """`enabled` (budget_tokens >= 1024, below max_tokens, as Anthropic's rule) and
    `adaptive` ask for the reasoning as thinking blocks; `disabled` asks the template
    not to think."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = pydantic.Field(alias="schema")


class OutputConfig(Body):
    """Anthropic's structured outputs (`format`: chat's `response_format` json_schema) and
    `effort` (chat's `reasoning_effort`, a template variable)."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high"] | None = None


class Metadata(Body):
    user_id: str | None = None  # accepted and ignored


class _Conversation(Body):
    """What /v1/messages and /v1/messages/count_tokens share."""

    model: str
    messages: Annotated[list[Message], pydantic.Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl = None


class MessagesRequest(_Conversation):
    max_tokens: int  # required, as Anthropic's
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(_Conversation):
    pass
