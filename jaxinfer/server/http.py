"""uvicorn's HTTP/1.1 protocol (h11) with a deadline for a request's headers, a bounded
drain after an early answer, and errors in OpenAI's shape where uvicorn answers in
plain text. See docs/serving.md#deadlines.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxinfer.server.protocol import APIError


def protocol_class(header_read_timeout: float, body_read_timeout: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these deadlines."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_read_timeout": header_read_timeout,
                 "body_read_timeout": body_read_timeout})


def error_bytes(error: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying `error`, closing the connection."""
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in error.headers().items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_REASONS = {400: "Bad Request", 408: "Request Timeout"}


class GuardedH11Protocol(H11Protocol):
    header_read_timeout: float = 10.0
    body_read_timeout: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self.loop.call_later(self.body_read_timeout, self._close_if_still_sending,
                                 self.cycle)

    def _close_if_still_sending(self, cycle: object) -> None:
        """Close a connection still sending the body of the request `cycle` answered."""
        if (self.cycle is cycle and not self.transport.is_closing()
                and self.conn.their_state is h11.SEND_BODY):
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm_header_deadline()
        elif self.conn.their_state is h11.IDLE:  # still reading a request's headers
            self._arm_header_deadline()
        else:
            self._disarm_header_deadline()

    def send_400_response(self, msg: str) -> None:
        self._disarm_header_deadline()
        self.transport.write(error_bytes(APIError(
            400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})",
            code="invalid_http_request")))
        self.transport.close()

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_read_timeout,
                                                         self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.transport.write(error_bytes(APIError(
            408, f"the request's headers did not arrive within {self.header_read_timeout:g} s "
            "(header_read_timeout)", code="request_timeout")))
        self.transport.close()
