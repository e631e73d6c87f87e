"""A chat-completions stream read back as Anthropic's event sequence: message_start and
a ping, then per content block content_block_start, its deltas (text_delta,
thinking_delta then a signature_delta, input_json_delta) and content_block_stop, then
message_delta (stop reason, usage) and message_stop; an error chunk becomes an error
event. `Translated` rewrites the chat route's own response as it is sent, so aborts on
disconnect and shutdown stay the chat route's. See docs/serving.md#anthropics-messages-api.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi.responses import Response

from jaxinfer.server.anthropic import errors, translation
from jaxinfer.server.anthropic.errors import event
from jaxinfer.server.anthropic.translation import Plan


class Events:
    """One response's translator: `feed` the chat stream's bytes, get Anthropic's events."""

    def __init__(self, plan: Plan, model: str) -> None:
        self._plan = plan
        self._model = model
        self._pending = ""
        self._started = False
        self._ended = False
        self._index = -1  # the open block's index; -1: none yet
        self._open: str | None = None  # its kind: text, thinking, or a call's id
        self._finish: str | None = None
        self._stopped_by: Any = None

    def feed(self, data: str) -> str:
        self._pending += data
        *whole, self._pending = self._pending.split("\n\n")
        out = []
        for item in whole:
            payload = item.removeprefix("data: ").strip()
            if not payload or self._ended:
                continue
            if payload == "[DONE]":
                out.append(event("message_stop", {"type": "message_stop"}))
                self._ended = True
            else:
                out += self._chunk(json.loads(payload))
        return "".join(out)

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:
            self._ended = True  # Anthropic's stream ends at its error event
            return [errors.stream_event(chunk["error"])]
        out = [] if self._started else self._start(chunk)
        for choice in chunk["choices"]:
            out += self._choice(choice)
        if not chunk["choices"]:  # the usage chunk: the last before [DONE]
            out += self._close()
            reason, sequence = translation.stop_reason(self._finish, self._stopped_by,
                                                       self._plan.stop_sequences)
            out.append(event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": translation.usage(chunk.get("usage"))}))
        return out

    def _start(self, chunk: dict[str, Any]) -> list[str]:
        self._started = True
        usage = translation.usage(chunk.get("usage"))
        message = {"id": translation.message_id(chunk["id"]), "type": "message",
                   "role": "assistant", "model": self._model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": usage | {"output_tokens": 0}}
        return [event("message_start", {"type": "message_start", "message": message}),
                event("ping", {"type": "ping"})]

    def _choice(self, choice: dict[str, Any]) -> list[str]:
        out, delta = [], choice.get("delta") or {}
        if delta.get("reasoning"):
            out += self._open_block("thinking", {"type": "thinking", "thinking": ""})
            if self._plan.show_thinking:
                out.append(self._delta({"type": "thinking_delta",
                                        "thinking": delta["reasoning"]}))
        if delta.get("content"):
            out += self._open_block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                call_id = translation.tool_use_id(call["id"])
                out += self._open_block(call_id, {"type": "tool_use", "id": call_id,
                                                  "name": call["function"]["name"],
                                                  "input": {}})
            arguments = call["function"].get("arguments")
            if arguments:
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": arguments}))
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
            self._stopped_by = choice.get("stop_reason")
        return out

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[str]:
        if self._open == kind:
            return []
        out = self._close()
        self._index += 1
        self._open = kind
        return out + [event("content_block_start", {"type": "content_block_start",
                                                    "index": self._index,
                                                    "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta",
                                             "index": self._index, "delta": delta})

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": signature()}))
        self._open = None
        return out + [event("content_block_stop", {"type": "content_block_stop",
                                                   "index": self._index})]


def signature() -> str:
    """A thinking block's signature: opaque to the client, and never checked here."""
    return uuid.uuid4().hex


class Translated(Response):
    """The chat route's streaming response, its events rewritten as they are sent."""

    def __init__(self, chat: Response, events: Events) -> None:
        super().__init__(status_code=chat.status_code)
        self._chat = chat
        self._events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def translated(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                text = bytes(message.get("body", b"")).decode("utf-8")
                message = message | {"body": self._events.feed(text).encode("utf-8")}
            await send(message)

        await self._chat(scope, receive, translated)
