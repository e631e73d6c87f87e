"""Chat messages and tool definitions as the chat endpoint reads them (pydantic, strict,
unknown fields refused); `Message.plain()` is what the chat template sees. A call's
arguments nest at most MAX_NESTING levels: the template walks them recursively.
See docs/serving.md#tool-calling.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic

MAX_NESTING = 128  # levels of arrays and objects a body, or a call's arguments, may nest


class Body(pydantic.BaseModel):
    """Every request body's base: unknown fields refused, types strict, finite numbers."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @pydantic.field_validator("arguments")
    @classmethod
    def _nested_within_the_limit(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except RecursionError:  # the decoder's own limit, ~1,000 levels
            raise ValueError(f"nested more than {MAX_NESTING} levels deep") from None
        except ValueError:  # not JSON: the template sees the text as sent
            return arguments
        if nests_deeper(value, MAX_NESTING):
            raise ValueError(f"nested more than {MAX_NESTING} levels deep")
        return arguments


class ToolCall(Body):
    """A call an assistant turn made, sent back in a later request."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Body):
    name: Annotated[str, pydantic.Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant turn's reasoning sent back (vLLM's name, and DeepSeek's older one); the
    # chat template sees it under every name templates read (text/chat_template.py)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @pydantic.field_validator("tool_calls")
    @classmethod
    def _calls_are_an_assistants(cls, calls: list | None, info: pydantic.ValidationInfo
                                 ) -> list | None:
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return calls

    @pydantic.model_validator(mode="after")
    def _tool_messages_name_their_call(self) -> Message:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id: the id of the call it "
                             "answers")
        return self

    def plain(self) -> dict[str, str]:
        """The message as the chat template sees it: text parts joined."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.tool_calls is not None:  # arguments as objects, as templates read them
            out["tool_calls"] = [call_for_template(c.model_dump()) for c in self.tool_calls]
        return out | {key: getattr(self, key) for key in ("name", "reasoning",
                                                         "reasoning_content", "tool_call_id")
                      if getattr(self, key) is not None}


def call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's call with its JSON arguments parsed (vLLM does so: templates such as
    Qwen3's and Llama 3's write `arguments | tojson`); text that is no JSON object stays."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except (ValueError, RecursionError):
        return call
    if not isinstance(arguments, dict):
        return call
    return call | {"function": call["function"] | {"arguments": arguments}}


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests more than `limit` levels of arrays and objects (a loop,
    not recursion: the value may nest deeper than the interpreter recurses)."""
    todo = [(value, 1)] if isinstance(value, dict | list) else []
    while todo:
        item, depth = todo.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        todo += [(child, depth + 1) for child in children if isinstance(child, dict | list)]
    return False
