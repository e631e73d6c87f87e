"""Tool calling in /v1/chat/completions (OpenAI's fields, vLLM's rules): `tools` for the
chat template, and the constraint `tool_choice` asks for. See docs/serving.md#tool-calling.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxinfer.config import ServerConfig
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.structured import StructuredOutputsParams
from jaxinfer.server.protocol import APIError, ChatRequest, NamedToolChoice
from jaxinfer.server.structured import worded
from jaxinfer.text.tokenizer import TooLong

NO_PARAMETERS = {"type": "object", "properties": {}}  # a function given none: no arguments
# Where function i's parameters sit in the `required` schema (a JSON pointer).
PARAMETERS_AT = "/items/anyOf/{}/properties/parameters"
_PARAMETERS_AT = re.compile(re.escape(PARAMETERS_AT).replace(r"\{\}", r"(\d+)"))
# Schema keywords whose values are data, never schemas (no `$ref` in them is one), and
# those whose values map names to schemas.
_DATA = frozenset({"enum", "const", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependencies", "dependentSchemas"})


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output is read for calls: `parser` (auto), `required`, or the
    `named` function; none of them: the output is text."""

    tools: list[dict] | None = None  # as the chat template sees them
    parser: str | None = None
    required: bool = False
    named: str | None = None
    field: str = "tools"  # what a constraint error names: the parameters constrained

    @property
    def reads_calls(self) -> bool:
        return self.parser is not None or self.required or self.named is not None


def plan(body: ChatRequest, config: ServerConfig,
         params: SamplingParams) -> tuple[SamplingParams, ToolPlan]:
    """The request's params (with the constraint `tool_choice` asks for) and its plan; a
    400 naming the field for a request that cannot be served."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools (the functions it may call)",
                           param="tool_choice")
        return params, ToolPlan()
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) < len(names):
        raise APIError(400, f"tools: two functions are named "
                       f"{next(n for n in names if names.count(n) > 1)!r}", param="tools")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    choice = choice or "auto"
    if choice == "none":
        return params, ToolPlan(tools)
    if choice == "auto":
        if not config.enable_auto_tool_choice:
            raise APIError(400, '"auto" tool choice (the default when tools are given) '
                           "needs a server started with --enable_auto_tool_choice and "
                           "--tool_call_parser; send tool_choice 'required', 'none' or a "
                           "named function", param="tool_choice")
        return params, ToolPlan(tools, parser=config.tool_call_parser)
    if params.structured_outputs is not None:
        raise APIError(400, f"tool_choice={_shown(choice)} constrains the output; it "
                       "cannot be given with response_format or structured_outputs",
                       param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        return _named(body, tools, choice.function.name, params)
    schema = required_schema(tools, parallel=body.parallel_tool_calls is not False)
    field = _parameters_field(0) if len(tools) == 1 else "tools"
    return _constrained(params, schema, field), ToolPlan(tools, required=True, field=field)


def _named(body: ChatRequest, tools: list[dict], name: str,
           params: SamplingParams) -> tuple[SamplingParams, ToolPlan]:
    index = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
    if index is None:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                       f"tools ({', '.join(t['function']['name'] for t in tools)})",
                       param="tool_choice")
    schema = tools[index]["function"].get("parameters") or NO_PARAMETERS
    field = _parameters_field(index)
    return _constrained(params, schema, field), ToolPlan(tools, named=name, field=field)


def _constrained(params: SamplingParams, schema: dict, field: str) -> SamplingParams:
    try:
        constraint = StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise APIError(400, worded(str(e), field), param=field) from None
    return dataclasses.replace(params, structured_outputs=constraint)


def _parameters_field(index: int) -> str:
    return f"tools[{index}].function.parameters"


def required_schema(tools: list[dict], *, parallel: bool) -> dict[str, Any]:
    """vLLM's schema for `tool_choice="required"`: a list of calls, each one function's
    name and its parameters. A function's local references (`#/$defs/T`,
    `#/definitions/T`, `#` for its parameters' root) are rewritten to point where its
    parameters sit here, so each function's definitions stay its own."""
    items = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = _rebased(function.get("parameters") or NO_PARAMETERS,
                              "#" + PARAMETERS_AT.format(i))
        items.append({"type": "object", "additionalProperties": False,
                      "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebased(schema: dict, base: str) -> dict:
    """A copy of `schema` whose local references (`#` and `#/...`) point below `base`.
    A loop, not recursion: a client's schema may nest as deep as a body does."""
    root = {"schema": schema}
    todo: list[tuple[Any, Any, bool]] = [(root, "schema", True)]  # (holder, key, a schema?)
    while todo:
        holder, key, is_schema = todo.pop()
        value = holder[key] = _copied(holder[key])
        if isinstance(value, list):
            todo += [(value, i, is_schema) for i, v in enumerate(value)
                     if isinstance(v, dict | list)]
            continue
        if not is_schema:  # a map of name -> schema
            todo += [(value, k, True) for k, v in value.items() if isinstance(v, dict | list)]
            continue
        ref = value.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            value["$ref"] = base + ref[1:]
        todo += [(value, k, k not in _SCHEMA_MAPS) for k, v in value.items()
                 if k not in _DATA and isinstance(v, dict | list)]
    return root["schema"]


def _copied(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value)


def error_field(field: str, message: str) -> tuple[str, str]:
    """An engine error about a tool constraint: the field it names, and its message for
    the client, a pointer into the `required` schema made one into the parameters (with
    several functions, the pointer tells which function's parameters)."""
    found = _PARAMETERS_AT.search(message)
    if found and field == "tools":
        field = _parameters_field(int(found[1]))
    return field, worded(_PARAMETERS_AT.sub("", message), field)


def prompt_token_ids(engine: Any, messages: list[dict], tools: list[dict],
                     add_generation_prompt: bool, **chat: Any) -> list[int]:
    """The chat prompt rendered with `tools` (the engine's own path takes no template
    variables), then checked by the engine as any token-id prompt."""
    if engine.tokenizer is None:
        raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): chat "
                         "messages need one")
    try:
        ids = engine.tokenizer.prompt_ids(None, messages, tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          max_tokens=engine.max_model_len - 1, **chat)
    except TooLong as e:
        raise ValueError(f"{e}; max_model_len {engine.max_model_len} leaves no room to "
                         "generate") from None
    return engine.prompt_token_ids(ids)


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())


def constraint_error(error: APIError, field: str | None) -> APIError:
    """An error about the request's constraint worded with the field it came in (the
    engine names it by kind: `structured_outputs.json: ...`)."""
    if field is None or error.param != field or error.code is not None:
        return error
    if field.startswith("tools"):
        param, message = error_field(field, error.message)
    else:
        param, message = field, worded(error.message, field)
    return APIError(error.status, message, param=param)
