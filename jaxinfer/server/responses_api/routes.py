"""POST /v1/responses, GET and DELETE /v1/responses/{id}: a Responses request is made a
chat completion request (translation.py) and run through the chat path (sampling
params, tools, output constraints, the chat template, reasoning and tool-call parsers,
admission); its pieces come back as output items, whole or as events (events.py), and
the response is kept in the store (store.py) unless `store` is false. See
docs/serving.md#the-responses-api.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import fastapi
from fastapi.responses import JSONResponse, Response

from jaxinfer.config import ServerConfig
from jaxinfer.server import event_streams, protocol, structured, tokenization, tools
from jaxinfer.server.engine_loop import EngineLoop, Submission
from jaxinfer.server.pooling_loop import PoolingLoop
from jaxinfer.server.protocol import APIError, ChatRequest
from jaxinfer.server.reasoning import ReasoningSplitter, splitter
from jaxinfer.server.responses_api import output, translation
from jaxinfer.server.responses_api.events import EventWriter, sse
from jaxinfer.server.responses_api.protocol import ResponsesRequest
from jaxinfer.server.responses_api.store import ResponseStore
from jaxinfer.server.state import ServerState, authorized, parsed
from jaxinfer.server.streams import Disconnected, Piece, Stream, updates

ROUTES = {"/v1/responses": ("POST",), "/v1/responses/{response_id}": ("GET", "DELETE")}


def install(app: fastapi.FastAPI, config: ServerConfig) -> None:
    app.state.responses = ResponseStore(max_entries=config.responses_store_max_entries,
                                        max_bytes=config.responses_store_max_bytes,
                                        ttl_s=config.responses_store_ttl_s)
    app.add_api_route("/v1/responses", create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])


def _store(request: fastapi.Request) -> ResponseStore:
    return request.app.state.responses


def _body_model(data: Any) -> type[ResponsesRequest]:
    translation.check_item_types(data)
    return ResponsesRequest


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"no response with id {protocol.shortened(response_id)!r}: never "
                    "stored (store=false), deleted, or evicted from the server's store "
                    "(bounded in count, size and age)", param=param, code="response_not_found")


async def retrieve(request: fastapi.Request, response_id: str) -> Response:
    authorized(request)
    entry = _store(request).get(response_id)
    if entry is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(entry.response)


async def delete(request: fastapi.Request, response_id: str) -> Response:
    authorized(request)
    if not _store(request).delete(response_id):
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class _Run:
    """One request's way through the chat path, and what its response needs."""

    def __init__(self, state: ServerState, body: ResponsesRequest, chat: ChatRequest,
                 history: list[dict]) -> None:
        params = protocol.sampling_params(chat, state.defaults)
        params, calls = tools.plan(chat, state.config, params)
        self.field = structured.field(chat) or calls.field
        self.submission = Submission(
            messages=[m.plain() for m in chat.messages], params=params,
            limit=protocol.max_tokens(chat), tools=calls.tools, constraint_field=self.field,
            template_kwargs=tokenization.template_kwargs(None, chat.reasoning_effort),
            lora=state.adapters.get(body.model))
        self.reader: ReasoningSplitter | None = splitter(state.config, state.tokenizer,
                                                         params, calls)
        self.body = body
        # as the body gave them (a call's arguments JSON text), to be read again later
        sent = [m.model_dump(exclude_none=True) for m in chat.messages]
        self.conversation = history + _new_turns(sent, body, len(history))
        self.id = output.new_id("resp")
        self.created_at = output.now()
        lora = self.submission.lora
        self.model = lora.lora_name if lora else state.model_name

    def pieces(self, stream: Stream, pieces: list[Piece]) -> list[Piece]:
        return pieces if self.reader is None else self.reader.split(stream, pieces)

    def response(self, status: str, writer: EventWriter | None = None,
                 stream: Stream | None = None, **extra: Any) -> dict[str, Any]:
        if writer is None:
            return output.response(self.body, self.id, self.model, created_at=self.created_at,
                                   output=[], status=status) | extra
        usage = output.usage(len(stream.prompt_token_ids), writer.output_tokens,
                             stream.num_cached_tokens)
        return output.response(self.body, self.id, self.model, created_at=self.created_at,
                               output=writer.whole_items(), status=status,
                               finish_reason=writer.finish_reason, usage=usage) | extra

    def keep(self, response: dict[str, Any], store: ResponseStore) -> None:
        if self.body.store:
            store.put(response, self.conversation + output.assistant_messages(
                response["output"]))


def _new_turns(messages: list[dict], body: ResponsesRequest, num_history: int) -> list[dict]:
    """This request's own messages: no instructions (never carried over), no history."""
    skip = (0 if body.instructions is None else 1) + num_history
    return messages[skip:]


async def create(request: fastapi.Request) -> Response:
    state, body = await parsed(request, _body_model)
    if isinstance(state.loop, PoolingLoop):
        raise APIError(400, "/v1/responses: this model is a pooling model: it generates no "
                       "text", param="model", code="pooling_model")
    history = []
    if body.previous_response_id is not None:
        entry = _store(request).get(body.previous_response_id)
        if entry is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = entry.conversation
    try:
        run = _Run(state, body, translation.chat_request(body, history), history)
    except APIError as e:
        raise translation.renamed(e) from None
    try:
        streams = await state.loop.submit([run.submission], asyncio.Queue())
    except APIError as e:
        raise translation.renamed(tools.constraint_error(e, run.field)) from None
    if body.stream:
        events = _events(state.loop, run, streams[0], _store(request))
        return event_streams.EventStream(
            events, on_close=lambda: event_streams.abort_unfinished(state.loop, streams))
    watcher = asyncio.create_task(event_streams.watch_disconnect(request, streams[0].inbox))
    try:
        return JSONResponse(await _collect(run, streams[0], _store(request)))
    except Disconnected:
        return Response(status_code=499)
    except APIError as e:
        raise translation.renamed(tools.constraint_error(e, run.field)) from None
    finally:
        watcher.cancel()
        event_streams.abort_unfinished(state.loop, streams)


async def _collect(run: _Run, stream: Stream, store: ResponseStore) -> dict[str, Any]:
    writer = EventWriter()
    async for _, update in updates([stream]):
        for piece in run.pieces(stream, update.pieces):
            writer.piece(piece)
    writer.close()
    response = run.response("completed", writer, stream)
    run.keep(response, store)
    return response


async def _events(loop: EngineLoop, run: _Run, stream: Stream,
                  store: ResponseStore) -> AsyncIterator[str]:
    """The Responses event stream: created, in_progress, each item's events, then
    completed (or incomplete at max_output_tokens); an error mid-stream is an `error`
    event and `response.failed`. Leaving early aborts the request."""
    writer = EventWriter()
    try:
        yield sse(writer.event("response.created", response=run.response("in_progress")))
        yield sse(writer.event("response.in_progress", response=run.response("in_progress")))
        async for _, update in updates([stream]):
            for piece in run.pieces(stream, update.pieces):
                for event in writer.piece(piece):
                    yield sse(event)
        for event in writer.close():
            yield sse(event)
        response = run.response("completed", writer, stream)
        run.keep(response, store)
        yield sse(writer.event(f"response.{response['status']}", response=response))
    except APIError as e:
        e = translation.renamed(tools.constraint_error(e, run.field))
        yield sse(writer.event("error", code=e.code, message=e.message, param=e.param))
        error = {"code": e.code or "server_error", "message": e.message}
        yield sse(writer.event("response.failed", response=run.response("failed", error=error)))
    finally:
        event_streams.abort_unfinished(loop, [stream])
