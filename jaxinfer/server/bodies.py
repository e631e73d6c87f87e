"""Reading a request body within the server's limits: its size (413, at once when
Content-Length declares more), its deadline (408) and shutdown (503); docs/serving.md#deadlines.
"""

from __future__ import annotations

import asyncio

import fastapi
from starlette.requests import ClientDisconnect

from jaxinfer.config import ServerConfig
from jaxinfer.server.protocol import APIError
from jaxinfer.server.streams import Disconnected

SHUTTING_DOWN = "the server is shutting down"


async def read(request: fastapi.Request, config: ServerConfig, draining: asyncio.Event
               ) -> bytes:
    """The body, within `body_read_timeout` seconds (else 408); 413 past the size limit,
    at once when Content-Length declares it (before uvicorn sends `100 Continue`; a
    client already sending reads the 413 while uvicorn drops the rest, see http.py); 503
    as soon as the server starts shutting down."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > config.max_request_body_bytes:
        waits = request.headers.get("expect", "").lower() == "100-continue"
        raise _too_large(int(declared), config.max_request_body_bytes, "declares", close=waits)
    reading = asyncio.ensure_future(_stream(request, config.max_request_body_bytes))
    waiting = asyncio.ensure_future(draining.wait())
    try:
        done, _ = await asyncio.wait({reading, waiting}, timeout=config.body_read_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        reading.cancel()
        waiting.cancel()
    if reading in done:
        return reading.result()
    if waiting in done:
        raise APIError(503, SHUTTING_DOWN, code="shutting_down", close=True)
    raise APIError(408, f"the request body did not arrive within {config.body_read_timeout:g}"
                   " s (body_read_timeout)", code="request_timeout", close=True)


async def _stream(request: fastapi.Request, limit: int) -> bytes:
    """The body, or 413 past `limit` bytes (the rest is read and dropped, never kept); a
    client that leaves meanwhile raises Disconnected."""
    body, size = bytearray(), 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                body += chunk
    except ClientDisconnect:
        raise Disconnected from None
    if size > limit:
        raise _too_large(size, limit, "has")
    return bytes(body)


def _too_large(size: int, limit: int, verb: str, close: bool = False) -> APIError:
    return APIError(413, f"the request body {verb} {size} bytes; the limit is {limit} "
                    "(max_request_body_bytes)", code="request_too_large", close=close)
