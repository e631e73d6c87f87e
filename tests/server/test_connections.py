"""Clients below the API, over raw sockets: connections that send no headers, half their
headers or half their body are closed with a 408 after the (short, set by flag)
deadlines; a declared body over the limit is a 413 before it is sent, `Expect:
100-continue` included; clients that leave mid-upload cost one log line each, no
traceback; every error, malformed HTTP included, is JSON in OpenAI's shape; SIGTERM
answers a stalled upload with the shutdown 503 and does not wait for it; a second
signal still ends each stream with an error event and `[DONE]`. Deadlines decide which
answer comes (a 408 where a 413 or 503 was due fails); no timing is asserted beyond
an exit well before uvicorn's own graceful timeout."""

from __future__ import annotations

import contextlib
import json
import select
import signal
import socket
import threading
import time
import urllib.parse

import pytest
from serving import start_server

HEADER_S, BODY_S, SHUTDOWN_S = 1, 3, 2
BODY = json.dumps({"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def guarded():
    s = start_server(f"--header_read_timeout={HEADER_S}", f"--body_read_timeout={BODY_S}",
                     f"--shutdown_timeout={SHUTDOWN_S}")
    yield s
    s.stop()


def _connect(server) -> socket.socket:
    url = urllib.parse.urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _head(path: str = "/v1/completions", length: int = len(BODY), *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _until_closed(socks: list[socket.socket], limit_s: float,
                  trickle: frozenset[int] = frozenset()) -> list[bytes | None]:
    """What each socket received until the server closed it (None: still open after
    `limit_s`); sockets in `trickle` (indexes) send a header byte every 0.2 s meanwhile."""
    got: list[bytearray] = [bytearray() for _ in socks]
    open_ = set(range(len(socks)))
    deadline, next_byte = time.monotonic() + limit_s, 0.0
    while open_ and time.monotonic() < deadline:
        if time.monotonic() >= next_byte:
            for i in trickle & open_:
                with contextlib.suppress(OSError):  # closed by the server meanwhile
                    socks[i].send(b"X")
            next_byte = time.monotonic() + 0.2
        readable, _, _ = select.select([socks[i] for i in open_], [], [], 0.05)
        for sock in readable:
            i = socks.index(sock)
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            got[i] += chunk
            if not chunk:
                open_.discard(i)
    for sock in socks:
        sock.close()
    return [None if i in open_ else bytes(data) for i, data in enumerate(got)]


def _parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body of one HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def _assert_openai_error(raw: bytes, status: int, code: str | None = None) -> dict:
    got, headers, body = _parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def _exchange(server, raw: bytes, limit_s: float = 30) -> bytes:
    sock = _connect(server)
    sock.sendall(raw)
    (got,) = _until_closed([sock], limit_s)
    assert got is not None, "the server kept the connection open"
    return got


# ---- header and body deadlines --------------------------------------------------------------

def test_connections_without_whole_headers_get_408_and_are_closed(guarded):
    """Ten send nothing, ten half a request line and stop, ten trickle a header byte every
    0.2 s (each stays under any per-read timeout): all thirty are answered and closed."""
    socks = [_connect(guarded) for _ in range(30)]
    for sock in socks[10:20]:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: te")
    for sock in socks[20:]:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
    got = _until_closed(socks, 10 * HEADER_S, trickle=frozenset(range(20, 30)))
    assert None not in got  # every connection closed by the server
    for raw in got:
        error = _assert_openai_error(raw, 408, "request_timeout")
        assert "header_read_timeout" in error["message"]
    assert guarded.post("/v1/completions", content=BODY).status_code == 200


def test_a_body_that_stalls_gets_408_and_the_connection_closes(guarded):
    sock = _connect(guarded)
    sock.sendall(_head() + BODY[:10])
    (raw,) = _until_closed([sock], 10 * BODY_S)
    assert raw is not None
    error = _assert_openai_error(raw, 408, "request_timeout")
    assert "body_read_timeout" in error["message"]
    assert _parse(raw)[1]["connection"] == "close"


def test_a_kept_alive_connection_gets_the_header_deadline_for_its_next_request(guarded):
    sock = _connect(guarded)
    sock.sendall(_head() + BODY)
    first = b""
    while b'"usage"' not in first:
        first += sock.recv(65536)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # the next request, stalled
    (rest,) = _until_closed([sock], 10 * HEADER_S)
    assert _parse(first)[0] == 200
    assert rest is not None
    _assert_openai_error(rest, 408, "request_timeout")


# ---- declared sizes ---------------------------------------------------------------------------

def _response(sock: socket.socket) -> bytes:
    """One whole response (its headers, then content-length bytes), not waiting for EOF."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head = raw.split(b"\r\n\r\n")[0].decode("latin-1").lower()
    length = int(head.split("content-length:")[1].split("\r\n")[0])
    while len(raw) < len(head) + 4 + length:
        raw += sock.recv(65536)
    return raw


@pytest.mark.parametrize("expect", [False, True])
def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(guarded, expect):
    """Only the headers go out: a 413 at once (not the 408 of waiting for the body); with
    `Expect: 100-continue` no `100 Continue` first, and the connection closes."""
    extra = ("Expect: 100-continue",) if expect else ()
    sock = _connect(guarded)
    sock.sendall(_head("/v1/completions", 200_000_000, *extra))
    raw = _response(sock)
    error = _assert_openai_error(raw, 413, "request_too_large")
    assert "200000000" in error["message"] and "max_request_body_bytes" in error["message"]
    # Without Expect the client may be sending: uvicorn drops its bytes, BODY_S at most.
    (rest,) = _until_closed([sock], 10 * BODY_S)
    assert rest == b""


def test_a_client_sending_an_oversized_body_reads_the_413(guarded):
    """httpx sends the whole body before it reads: the 413 came at the headers, and the
    rest was read and dropped, so the client still gets the answer, not a reset."""
    response = guarded.post("/v1/completions", content=b" " * (9 * 2**20),
                            headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_expect_100_continue_within_the_limit_is_served(guarded):
    sock = _connect(guarded)
    sock.sendall(_head("/v1/completions", len(BODY), "Expect: 100-continue",
                       "Connection: close"))
    interim = sock.recv(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    sock.sendall(BODY)
    (raw,) = _until_closed([sock], 30)
    status, _, body = _parse(raw)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


# ---- clients leaving --------------------------------------------------------------------------

def test_clients_leaving_mid_upload_log_a_line_each_and_no_traceback(guarded):
    start = len(guarded.log)
    socks = [_connect(guarded) for _ in range(20)]
    for sock in socks:
        sock.sendall(_head("/v1/completions", 1000) + b'{"prompt": "')
    time.sleep(0.5)  # the handlers are reading the bodies
    for sock in socks:
        sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = guarded.log[start:]
        if sum("went away" in line for line in lines) >= 20:
            break
        time.sleep(0.1)
    lines = guarded.log[start:]
    assert sum("went away" in line for line in lines) == 20, "".join(lines[-20:])
    assert not [line for line in lines if "Traceback" in line or "ERROR" in line[:8]
                or "Exception in ASGI" in line]
    assert guarded.post("/v1/completions", content=BODY).status_code == 200


# ---- errors in OpenAI's shape -----------------------------------------------------------------

MALFORMED = {
    "request line": b"GARBAGE\r\n\r\n",
    "header without a colon": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nno colon\r\n\r\n",
    "content-length not a number": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                                   b"Content-Length: abc\r\n\r\n",
    "two content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1"
                           b"\r\nContent-Length: 2\r\n\r\nab",
    "headers over h11's limit": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Big: "
                                + b"a" * 20_000,  # 16 KiB of headers unfinished
    "bad chunked body": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    "non-ASCII target": b"POST /v1/\xff HTTP/1.1\r\nHost: t\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_http_gets_a_json_400(guarded, case):
    _assert_openai_error(_exchange(guarded, MALFORMED[case]), 400)


def test_a_trailing_slash_is_a_json_404_not_a_redirect(guarded):
    raw = _exchange(guarded, _head("/v1/completions/", len(BODY), "Connection: close") + BODY)
    error = _assert_openai_error(raw, 404, "not_found")
    assert "/v1/completions/" in error["message"] and "/v1/chat/completions" in error["message"]


def test_an_echoed_field_name_is_truncated(guarded):
    name = "x" * 100_000
    response = guarded.post("/v1/completions", json={"prompt": "hi", name: 1})
    assert response.status_code == 400
    assert len(response.content) < 1000
    error = response.json()["error"]
    assert error["param"].startswith("xxxx") and "100000 characters" in error["param"]


# ---- shutdown (last: these stop their servers) -------------------------------------------------

def test_sigterm_answers_a_stalled_upload_with_503_and_does_not_wait_for_it(guarded):
    stalled = _connect(guarded)
    stalled.sendall(_head("/v1/completions", 1000) + b'{"prompt": "')
    time.sleep(0.5)
    signalled = time.monotonic()
    guarded.process.send_signal(signal.SIGTERM)
    (raw,) = _until_closed([stalled], 30)
    assert raw is not None
    _assert_openai_error(raw, 503, "shutting_down")  # not the 408 of the body deadline
    assert guarded.process.wait(60) == 0
    # uvicorn's graceful timeout is SHUTDOWN_S + 5: nothing held the exit that long.
    assert time.monotonic() - signalled < SHUTDOWN_S + 5
    assert not [line for line in guarded.log if "Traceback" in line]


def _stream(server, events: list[str], started: threading.Event) -> None:
    """A long streamed completion read to its end, its data lines into `events`; sets
    `started` at the first one."""
    body = json.dumps({"prompt": "def main():", "max_tokens": 480, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    sock = _connect(server)
    sock.sendall(_head("/v1/completions", len(body)) + body)
    pending = b""
    while chunk := sock.recv(65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        events += [line.decode() for line in lines if line.startswith(b"data: ")]
        if events:
            started.set()
    sock.close()


def test_a_second_signal_ends_streams_with_an_error_event_and_done():
    server = start_server("--shutdown_timeout=60")
    results = [[] for _ in range(4)]
    started = [threading.Event() for _ in results]
    threads = [threading.Thread(target=_stream, args=(server, events, event))
               for events, event in zip(results, started, strict=True)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60)
    server.process.send_signal(signal.SIGINT)  # the streams are under way
    time.sleep(0.3)
    server.process.send_signal(signal.SIGINT)
    for thread in threads:
        thread.join(120)
    assert server.process.wait(60) == 0, "".join(server.log[-40:])
    for events in results:
        assert events and events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and "second signal" in error["message"]
        assert len(events) < 480  # cut short, not finished
    assert not [line for line in server.log if "Traceback" in line]
