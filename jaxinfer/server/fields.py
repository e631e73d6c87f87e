"""What the server settles in a request's JSON before the strict body models see it:
OpenAI's platform fields accepted and ignored, and chat messages that need content.
See docs/serving.md#fields-accepted-and-ignored.
"""

from __future__ import annotations

import logging
from typing import Any

import pydantic

from jaxinfer.server.protocol import APIError

log = logging.getLogger(__name__)
HEADER = "x-jaxinfer-ignored-fields"
STATE_KEY = "jaxinfer_ignored_fields"  # where a request's scope keeps what was ignored


class _Ignored(pydantic.BaseModel):
    """The fields accepted and ignored, with OpenAI's types (checked, then dropped)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    prediction: dict[str, Any] | None = None


# per route: OpenAI's chat API defines them all; its (legacy) completions and its
# embeddings API only `user` (and vLLM's classify, after embeddings)
IGNORED = {"/v1/chat/completions": tuple(_Ignored.model_fields),
           "/v1/completions": ("user",), "/v1/embeddings": ("user",),
           "/classify": ("user",), "/v1/classify": ("user",)}
CONTENT_ROLES = ("system", "developer", "user", "tool")  # content required


def take_ignored(path: str, data: Any, scope: dict[str, Any]) -> None:
    """Check and remove from the JSON object `data` the fields the route ignores; name
    them in `scope` (for the response header) and in one log line."""
    if not isinstance(data, dict):
        return  # protocol.validate refuses it with its own message
    names = [name for name in IGNORED.get(path, ()) if name in data]
    if not names:
        return
    try:
        _Ignored.model_validate({name: data[name] for name in names})
    except pydantic.ValidationError as e:
        error = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in error["loc"])
        raise APIError(400, f"{field}: {error['msg']}", param=field) from None
    for name in names:
        del data[name]
    scope.setdefault("state", {})[STATE_KEY] = names
    log.info("%s: accepted and ignored %s (no effect on a self-hosted model's output)",
             path, ", ".join(names))


def check_message_content(data: Any) -> None:
    """400 naming `messages[i].content` for a non-assistant message without content."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if (isinstance(message, dict) and message.get("role") in CONTENT_ROLES
                and message.get("content") is None):
            raise APIError(400, f"messages[{i}].content: a {message['role']} message needs "
                           "content (a string or a list of text parts), not null",
                           param=f"messages[{i}].content")


class IgnoredFieldsHeader:
    """ASGI middleware: a response to a request whose body had ignored fields says which
    in the `x-jaxinfer-ignored-fields` header (set by `take_ignored` before the handler
    answers)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict[str, Any]) -> None:
            names = scope.get("state", {}).get(STATE_KEY)
            if message["type"] == "http.response.start" and names:
                headers = list(message.get("headers", []))
                headers.append((HEADER.encode(), ",".join(names).encode()))
                message = message | {"headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)
