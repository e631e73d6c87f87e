"""Server-sent event responses the generating routes share (chat, Messages,
Responses): a response that aborts its requests however it ends, and the watch for a
client that leaves. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import fastapi
from fastapi.responses import StreamingResponse

from jaxinfer.server.streams import Stream


class EventStream(StreamingResponse):
    """Server-sent events that abort their requests however the response ends (a client
    gone before the first event never starts the generator, whose cleanup then never
    runs)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def watch_disconnect(request: fastapi.Request, inbox: asyncio.Queue) -> None:
    """Put None in `inbox` when the client disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    inbox.put_nowait(None)


def abort_unfinished(loop: Any, streams: list[Stream]) -> None:
    """Abort the requests of `streams` still running on `loop` (an EngineLoop)."""
    for stream in streams:
        if not stream.finished:
            loop.abort(stream.request_id)
