"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with
its status codes (an overloaded queue is 529), from the server's APIErrors; chat's field
names in a message are put in Anthropic's terms. See docs/serving.md#anthropics-messages-api.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse

from jaxinfer.server.protocol import APIError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
         503: "api_error", 529: "overloaded_error"}
# OpenAI's error types, as a stream's error event carries them, in Anthropic's terms
STREAM_TYPES = {"invalid_request_error": "invalid_request_error", "internal_error": "api_error",
                "service_unavailable": "api_error"}
OVERLOADED = 529  # Anthropic's status for "try again later"
# chat's names for Anthropic's fields: a tool's schema, the stop strings
SCHEMA = re.compile(r"tools\[(\d+)\]\.function\.parameters")
PARAMS = {"stop": "stop_sequences", "response_format.json_schema": "output_config.format.schema",
          "reasoning_effort": "output_config.effort"}


def status(error: APIError) -> int:
    return OVERLOADED if error.code == "overloaded" else error.status


def body(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def response(error: APIError) -> JSONResponse:
    code = status(error)
    return JSONResponse(body(TYPES.get(code, "invalid_request_error"), worded(error)),
                        status_code=code, headers=error.headers())


def worded(error: APIError) -> str:
    """The message in Anthropic's field names, opening with the field it is about."""
    message = SCHEMA.sub(r"tools.\1.input_schema", error.message).replace(
        "response_format.json_schema", PARAMS["response_format.json_schema"])
    if error.param is None:
        return message
    param = SCHEMA.sub(r"tools.\1.input_schema", PARAMS.get(error.param, error.param))
    return message if param in message else f"{param}: {message}"


def stream_event(chat_error: dict[str, Any]) -> str:
    """The SSE error event for a chat stream's error chunk."""
    error = APIError(400, chat_error.get("message", ""), param=chat_error.get("param"))
    kind = STREAM_TYPES.get(chat_error.get("type", ""), "api_error")
    return event("error", body(kind, worded(error)))


def event(name: str, data: dict[str, Any]) -> str:
    return (f"event: {name}\ndata: "
            + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n")
