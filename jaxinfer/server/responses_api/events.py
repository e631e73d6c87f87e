"""A choice's pieces as the Responses API's output items and stream events: reasoning,
the message and function calls each opened (`response.output_item.added`, a content
part), grown by deltas and closed (`...done`), numbered by `sequence_number` from 0.
The whole response is built by the same writer, its events dropped. See
docs/serving.md#the-responses-api.
"""

from __future__ import annotations

import json
from typing import Any

from jaxinfer.server.responses_api import output
from jaxinfer.server.streams import Piece

Event = dict[str, Any]


class EventWriter:
    """The output items of one choice as its pieces arrive, and the events saying so."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._text = ""  # its text (reasoning, message) or arguments (call)

    def event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def piece(self, piece: Piece) -> list[Event]:
        """The events of one piece: reasoning, text, then tool-call deltas."""
        self.output_tokens += len(piece.token_ids)
        self.finish_reason = piece.finish_reason or self.finish_reason
        events = []
        if piece.reasoning:
            events += self._grow("reasoning", piece.reasoning)
        if piece.text:
            events += self._grow("message", piece.text)
        for delta in piece.tool_calls:
            if "id" in delta:  # a new call: its id and name
                events += self._close()
                events += self._start_call(delta)
            arguments = delta["function"].get("arguments", "")
            if arguments:
                events += self._grow("function_call", arguments)
        return events

    def close(self) -> list[Event]:
        """Close the item still open (the choice finished)."""
        return self._close()

    def _grow(self, kind: str, delta: str) -> list[Event]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._start(kind)
        self._text += delta
        where = self._where()
        if kind == "function_call":
            return events + [self.event("response.function_call_arguments.delta",
                                        delta=delta, **where)]
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", content_index=0,
                                        delta=delta, **where)]
        return events + [self.event("response.output_text.delta", content_index=0,
                                    delta=delta, logprobs=[], **where)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _start(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item, part = output.reasoning_item(output.new_id("rs"), "", "in_progress"), {
                "type": "reasoning_text", "text": ""}
        else:
            item, part = output.message_item(output.new_id("msg"), None, "in_progress"), \
                output.text_part("")
        self._open, self._text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.items),
                           item=item),
                self.event("response.content_part.added", content_index=0, part=part,
                           **self._where())]

    def _start_call(self, delta: dict) -> list[Event]:
        # OpenAI's call ids (`call_...`) rather than the chat path's (`chatcmpl-tool-...`)
        call = {"id": output.new_id("call"), "function": {"name": delta["function"]["name"],
                                                          "arguments": ""}}
        self._open = output.call_item(output.new_id("fc"), call, "in_progress")
        self._text = ""
        return [self.event("response.output_item.added", output_index=len(self.items),
                           item=self._open)]

    def _close(self) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where, text = self._where(), self._text
        if item["type"] == "function_call":
            done = item | {"arguments": text, "status": "completed"}
            events = [self.event("response.function_call_arguments.done", arguments=text,
                                 name=item["name"], **where)]
        elif item["type"] == "reasoning":
            done = output.reasoning_item(item["id"], text)
            events = [self.event("response.reasoning_text.done", content_index=0, text=text,
                                 **where),
                      self.event("response.content_part.done", content_index=0,
                                 part=done["content"][0], **where)]
        else:
            done = output.message_item(item["id"], text)
            events = [self.event("response.output_text.done", content_index=0, text=text,
                                 logprobs=[], **where),
                      self.event("response.content_part.done", content_index=0,
                                 part=done["content"][0], **where)]
        events.append(self.event("response.output_item.done", item=done, **where))
        self.items.append(done)
        self._open, self._text = None, ""
        return events

    def whole_items(self) -> list[dict[str, Any]]:
        """The closed items; an empty message when the model wrote nothing at all."""
        return self.items or [output.message_item(output.new_id("msg"), "")]


def sse(event: Event) -> str:
    """One server-sent event: its type as the event name, then its JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"
