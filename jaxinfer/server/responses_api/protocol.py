"""The body of POST /v1/responses as OpenAI's Responses API defines it, the parts the
server serves (pydantic, strict, unknown fields and item types refused): input items
(messages, function calls and their outputs, reasoning), function tools, `text.format`,
`reasoning`. See docs/serving.md#the-responses-api.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

from jaxinfer.server.messages import Body, FunctionCall

MAX_INPUT_ITEMS = 2048  # items of one request's `input`


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    """An earlier answer's text sent back (OpenAI's output_text part)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


TextContent = Annotated[InputText | OutputText, pydantic.Field(discriminator="type")]


class MessageItem(Body):
    """A message; `type` may be left out (OpenAI's easy input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Body):
    """A call an earlier answer made."""

    type: Literal["function_call"]
    call_id: Annotated[str, pydantic.Field(min_length=1)]
    name: Annotated[str, pydantic.Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: str | None = None

    @pydantic.field_validator("arguments")
    @classmethod
    def _nested_within_the_limit(cls, arguments: str) -> str:
        return FunctionCall.model_validate({"name": "", "arguments": arguments}).arguments


class FunctionCallOutputItem(Body):
    """A call's result, answering the function_call of the same `call_id`."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, pydantic.Field(min_length=1)]
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(Body):
    """An earlier answer's reasoning; its text goes back to the template with the
    assistant turn that follows it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "".join(part.text for part in parts)


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, pydantic.Tag("message")]
    | Annotated[FunctionCallItem, pydantic.Tag("function_call")]
    | Annotated[FunctionCallOutputItem, pydantic.Tag("function_call_output")]
    | Annotated[ReasoningItem, pydantic.Tag("reasoning")],
    pydantic.Discriminator(_item_type)]


class FunctionTool(Body):
    """A function the model may call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: Annotated[str, pydantic.Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    """`text.format`: plain text, any JSON object, or a JSON schema's value."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | bool | None = pydantic.Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a self-hosted model has


class ReasoningConfig(Body):
    """`effort` goes to the chat template (gpt-oss's reads it); summaries are not
    written: a reasoning item carries the reasoning itself."""

    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: str | Annotated[list[InputItem], pydantic.Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None  # kept with the response and returned
    truncation: Literal["disabled"] | None = None  # "auto" would drop input silently
    user: str | None = None  # OpenAI's end-user tag: no effect here
