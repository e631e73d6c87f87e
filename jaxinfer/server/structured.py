"""Structured outputs over HTTP: `response_format` and vLLM's `structured_outputs` checked
for shape and turned into the request's one output constraint; the engine compiles it.
See docs/serving.md#structured-outputs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jaxinfer.engine.structured import StructuredOutputsParams, from_response_format, is_given

RESPONSE_FORMAT_KEYS = {"type", "json_schema"}
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


class FieldError(ValueError):
    """A malformed constraint; `param` names the field (the 400's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def constraint(body: Any) -> StructuredOutputsParams | None:
    """The body's constraint (None: unconstrained); FieldError for a malformed one."""
    if body.response_format is not None and body.structured_outputs is not None:
        raise FieldError("structured_outputs", "give response_format or structured_outputs, "
                         "not both (a request has one output constraint)")
    if body.response_format is not None:
        return _response_format(body.response_format)
    if body.structured_outputs is not None:
        try:
            return StructuredOutputsParams.parse(body.structured_outputs)
        except ValueError as e:
            raise FieldError(_named(e, "structured_outputs"), str(e)) from None
    return None


def field(body: Any) -> str | None:
    """The field a request's constraint came in, for an error the engine raises on it."""
    if body.response_format is not None:
        kind = body.response_format.get("type")
        return "response_format.json_schema" if kind == "json_schema" else "response_format"
    if body.structured_outputs is not None:
        given = [k for k, v in body.structured_outputs.items() if is_given(k, v)]
        return f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return None


def worded(message: str, field: str) -> str:
    """An engine error about a constraint, worded with the field the client sent: the
    engine names a constraint by its kind (`structured_outputs.json: ...`) however it
    came (`response_format`, a tool's `parameters`)."""
    head = re.match(r"structured_outputs\.[a-z_]+", message)
    return message if head is None else field + message[head.end():]


def _response_format(value: dict[str, Any]) -> StructuredOutputsParams | None:
    unknown = sorted(set(value) - RESPONSE_FORMAT_KEYS)
    if unknown:
        raise FieldError(f"response_format.{unknown[0]}", f"response_format.{unknown[0]}: "
                         "unknown or unsupported parameter")
    spec = value.get("json_schema")
    if value.get("type") == "json_schema" and isinstance(spec, Mapping):
        unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
        if unknown:
            raise FieldError("response_format.json_schema", f"response_format.json_schema."
                             f"{unknown[0]}: unknown or unsupported parameter")
        schema = spec.get("schema")
        if "schema" in spec and not isinstance(schema, dict | bool):
            raise FieldError("response_format.json_schema", "response_format.json_schema."
                             f"schema must be a JSON schema (an object), not "
                             f"{type(schema).__name__}")
    try:
        return from_response_format(value)
    except ValueError as e:
        raise FieldError(_named(e, "response_format"), str(e)) from None


def _named(error: ValueError, default: str) -> str:
    """The dotted field a message opens with (`response_format.json_schema must ...`)."""
    head = re.match(r"[a-z_]+(\.[a-z_]+)*", str(error))
    name = head.group() if head else ""
    return name if name.split(".")[0] == default else default
