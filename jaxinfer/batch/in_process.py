"""OpenAI batch lines answered by the server's own routes, in this process: `serve`'s FastAPI
app over an EngineLoop on the LLM's engine (a PoolingLoop on a pooling model's), each
line's body sent to its route as an ASGI request (no socket). So a body is parsed, checked
and answered exactly as `serve` answers it, errors included; an embeddings line that
names no encoding_format is answered in base64. See docs/batch.md#openais-batch-format
and docs/pooling.md#batch-jobs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from jaxinfer import server
from jaxinfer.api import LLM
from jaxinfer.batch import openai
from jaxinfer.batch.files import Request
from jaxinfer.config import ServerConfig
from jaxinfer.pooling.engine import PoolingEngine
from jaxinfer.server.app import create_app
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.pooling_loop import PoolingLoop
from jaxinfer.server.protocol import APIError

log = logging.getLogger(__name__)
LINES_PER_SLOT = 4  # lines in flight per engine slot: the scheduler always has some waiting
NO_WAITING_LIMIT = 2**31  # the loop's own admission bound: the batch bounds what it sends
STREAM_REFUSED = ("a batch line is answered with one JSON body; stream=true is not "
                  "available in a batch")


def complete(llm: LLM, requests: Sequence[Request], on_record: Callable[[dict], None], *,
             model_name: str, progress: bool = False, lora_modules: Sequence[str] = ()) -> None:
    """Send each request (an OpenAI batch line that names a route) to its route, with
    LINES_PER_SLOT lines per engine slot in flight, and call `on_record` with each line's
    output record as its answer comes back. `model_name`: what a body's `model` must name,
    as `serve`'s --served_model_name, or an adapter of `lora_modules` (serve's
    --lora_modules: name=path or vLLM's JSON), each loaded first."""
    if not requests:
        return
    pooling = isinstance(llm.engine, PoolingEngine)
    if pooling:  # the lines in flight pool as one batch
        loop = PoolingLoop(llm.engine, max_waiting_requests=NO_WAITING_LIMIT)
        in_flight = LINES_PER_SLOT * llm.engine.config.max_num_seqs
    else:
        loop = EngineLoop(llm.engine, max_waiting_requests=NO_WAITING_LIMIT)
        in_flight = LINES_PER_SLOT * llm.engine.counts()[2]
    config = ServerConfig(lora_modules=tuple(lora_modules))
    app = create_app(server.make_state(llm, config, loop, model_name))
    loop.start()
    try:
        with tqdm(total=len(requests), desc="requests", disable=not progress) as bar:
            asyncio.run(_send_all(app, iter(requests), on_record, bar, in_flight,
                                  openai.urls_of(pooling)))
    finally:
        loop.stop()
    if not loop.healthy:
        raise RuntimeError(f"the engine failed: {loop.failure}")


async def _send_all(app: Any, requests: Iterator[Request], on_record: Callable[[dict], None],
                    bar: tqdm, workers: int, urls: tuple[str, ...]) -> None:
    """`workers` senders share one iterator, so each line is sent once and at most
    `workers` are in flight (a file of a million lines is never all in memory as tasks)."""
    generated = 0

    async def send() -> None:
        nonlocal generated
        for request in requests:
            record = await _answer(app, request, urls)
            on_record(record)
            if record["error"] is None:
                generated += openai.token_counts(record)[1]
            bar.update(1)
            bar.set_postfix(tok_per_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.0f}",
                            refresh=False)

    await asyncio.gather(*(send() for _ in range(workers)))


async def _answer(app: Any, request: Request, urls: tuple[str, ...]) -> dict:
    """The output record of one line: the route's status and body; the error line of a url
    the model does not serve (a Ray driver reads the file not knowing the model's kind)."""
    line = request.record
    refused = openai.line_error(request.id, line, urls)
    if refused is not None:
        return refused
    body = line["body"]
    if isinstance(body, dict) and body.get("stream") is True:
        error = APIError(400, f"stream: {STREAM_REFUSED}", param="stream")
        return openai.response_record(request.id, error.status, error.body())
    if line["url"] == "/v1/embeddings" and isinstance(body, dict):
        body = {"encoding_format": "base64"} | body  # compact: 4 bytes a float, as OpenAI's
    status, raw = await post(app, line["url"], json.dumps(body, ensure_ascii=False).encode())
    return openai.response_record(request.id, status, _json(status, raw))


async def post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` to `path` of the ASGI `app`, as a client that stays connected: (status,
    response body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "client": ("batch", 0),
             "server": ("batch", 0),
             "headers": [(b"host", b"batch"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent_body = False
    status, chunks = 0, []

    async def receive() -> dict:
        nonlocal sent_body
        if sent_body:  # the route watches for a disconnect: none comes
            await asyncio.get_running_loop().create_future()
        sent_body = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:  # Starlette re-raises what its 500 handler answered
        if not status:
            raise
        log.exception("POST %s failed", path)
    return status, b"".join(chunks)


def _json(status: int, raw: bytes) -> Any:
    """A response body as JSON; one that is not (none of the routes sends such) as an
    error in OpenAI's shape."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        text = raw.decode("utf-8", errors="replace")
        return APIError(status, text or f"HTTP status {status}").body()
