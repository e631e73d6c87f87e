"""The FastAPI app: OpenAI's routes (/v1/completions, /v1/chat/completions, /v1/models)
and vLLM's (/tokenize, /detokenize, /health, /ping, /version, /metrics, /docs; adapter
loads: lora_routes.py) over an EngineLoop, or a pooling model's (pooling_routes.py) over
a PoolingLoop; bodies read by hand so every error leaves in OpenAI's shape. A request's
`model` may name a LoRA adapter (adapters.py). See docs/serving.md (#routes, #errors,
#prompt-logprobs) and docs/pooling.md#serving.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.metadata
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import fastapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from jaxinfer.engine.request import SamplingParams, prompt_logprobs_json
from jaxinfer.server import (
    adapters,
    anthropic,
    dev_routes,
    event_streams,
    http_metrics,
    lora_routes,
    openapi,
    pooling_routes,
    prometheus,
    protocol,
    structured,
    tokenization,
    tools,
)
from jaxinfer.server import responses as out
from jaxinfer.server.bodies import SHUTTING_DOWN
from jaxinfer.server.engine_loop import EngineLoop, Submission
from jaxinfer.server.fields import IgnoredFieldsHeader
from jaxinfer.server.pooling_loop import PoolingLoop
from jaxinfer.server.protocol import APIError, ChatRequest, CompletionRequest
from jaxinfer.server.reasoning import ReasoningSplitter, splitter
from jaxinfer.server.responses_api import routes as responses_routes
from jaxinfer.server.state import ServerState, authorized, parsed, state_of
from jaxinfer.server.streams import Disconnected, Piece, Stream, Update, updates
from jaxinfer.server.usage import per_chunk

__all__ = ["ServerState", "create_app"]
log = logging.getLogger(__name__)
ROUTES = {"/v1/completions": ("POST",), "/v1/chat/completions": ("POST",),
          "/v1/models": ("GET",), "/tokenize": ("POST",), "/detokenize": ("POST",),
          "/health": ("GET",), "/ping": ("GET", "POST"), "/version": ("GET",),
          "/metrics": ("GET",), **pooling_routes.ROUTES, **responses_routes.ROUTES,
          **anthropic.ROUTES}
DOCS = ("/docs", "/redoc", "/openapi.json")  # FastAPI's own


def _installed_version() -> str:
    try:
        return importlib.metadata.version("jaxinfer")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


VERSION = _installed_version()


def create_app(state: ServerState) -> fastapi.FastAPI:
    # No redirect of "/v1/completions/" to the route: a 307 is outside OpenAI's shape.
    app = fastapi.FastAPI(title="jaxinfer", version=VERSION, docs_url=DOCS[0],
                          redoc_url=DOCS[1], openapi_url=DOCS[2], redirect_slashes=False)
    openapi.install(app, VERSION)
    app.state.server = state
    app.add_middleware(IgnoredFieldsHeader)  # names the fields a request had ignored
    app.state.http_requests = collections.Counter()  # by route (server/http_metrics.py)
    app.add_middleware(http_metrics.RequestCounter, counts=app.state.http_requests)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Disconnected, _disconnected)
    app.add_exception_handler(Exception, _internal_error)
    handlers = {"/health": _health, "/ping": _health, "/version": _version,
                "/metrics": _metrics, "/v1/models": _models, "/v1/completions": _completions,
                "/v1/chat/completions": _chat, "/tokenize": tokenization.tokenize,
                "/detokenize": tokenization.detokenize}
    pooling = isinstance(state.loop, PoolingLoop)
    handlers |= pooling_routes.handlers(pooling)
    handlers |= anthropic.handlers(_chat_answer)  # /v1/messages: chat, translated
    for path, handler in handlers.items():
        for method in ROUTES[path]:  # a route per method: one operation id each
            app.add_api_route(path, handler, methods=[method])
    if state.config.server_dev_mode and pooling:
        log.warning("--server_dev_mode: a pooling model has no sleep, pause or weight "
                    "updates; those routes are not served")
    elif state.config.server_dev_mode:
        dev_routes.install(app)
    responses_routes.install(app, state.config)  # /v1/responses: a 400 on a pooling model
    if adapters.runtime_updating(state.config) and not pooling:
        lora_routes.install(app)
    return app


# ---- errors ----------------------------------------------------------------------------

def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


async def _api_error(request: fastapi.Request, error: Exception) -> JSONResponse:
    return _error_response(error)


async def _http_error(request: fastapi.Request, error: Exception) -> JSONResponse:
    if error.status_code == 404:
        path = protocol.shortened(request.url.path)
        return _error_response(APIError(404, f"{request.method} {path} does not exist"
                                        f"{lora_routes.off_hint(request.url.path)}; the "
                                        f"routes are {', '.join((*ROUTES, *DOCS))}",
                                        code="not_found"))
    return _error_response(APIError(error.status_code, str(error.detail)))


async def _disconnected(request: fastapi.Request, error: Exception) -> Response:
    """A client that left (mid-upload, say): nobody reads the answer; one log line."""
    log.info("%s %s: the client went away", request.method, request.url.path)
    return Response(status_code=499)


async def _internal_error(request: fastapi.Request, error: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    return _error_response(APIError(500, f"internal error: {type(error).__name__}: {error}"))


# ---- plain routes ------------------------------------------------------------------------

async def _health(request: fastapi.Request) -> Response:
    """/health, and vLLM's SageMaker-style /ping (GET and POST)."""
    loop = state_of(request).loop
    if not loop.healthy:
        raise APIError(503, f"the engine failed: {loop.failure}", code="engine_failed")
    if not loop.accepting:
        raise APIError(503, SHUTTING_DOWN, code="shutting_down")
    return JSONResponse({"status": "ok"})


async def _version(request: fastapi.Request) -> Response:
    return JSONResponse({"version": VERSION})


async def _metrics(request: fastapi.Request) -> Response:
    state = state_of(request)
    snapshot = await state.loop.call(prometheus.snapshot)
    by_route = http_metrics.families(request.app.state.http_requests)
    return PlainTextResponse(prometheus.exposition(snapshot, state.model_name, by_route),
                             media_type=prometheus.CONTENT_TYPE)


async def _models(request: fastapi.Request) -> Response:
    state = authorized(request)
    return JSONResponse({"object": "list", "data": lora_routes.model_cards(state)})


# ---- completions and chat ----------------------------------------------------------------

async def _completions(request: fastapi.Request) -> Response:
    state, body = await parsed(request, CompletionRequest)
    params = protocol.sampling_params(body, state.defaults)
    protocol.check_scoring(body, params, enabled=state.enable_prompt_logprobs)
    prompts = body.prompt if _is_batch(body.prompt) else [body.prompt]
    limit, lora = protocol.max_tokens(body), state.adapters.get(body.model)
    submissions = [Submission(prompt=p, params=params, limit=limit, echo=body.echo,
                              constraint_field=structured.field(body),
                              priority=body.priority, lora=lora) for p in prompts]
    shape = _Shape("text_completion", "cmpl", state, params, top=body.logprobs,
                   echo=body.echo, echo_only=protocol.echo_only(body), lora=lora)
    return await _respond(request, state, shape, submissions, body)


async def _chat(request: fastapi.Request) -> Response:
    state, body = await parsed(request, ChatRequest)
    return await _chat_answer(request, state, body)


async def _chat_answer(request: fastapi.Request, state: ServerState,
                       body: ChatRequest) -> Response:
    """The chat route once its body is read; /v1/messages is answered through it."""
    params = protocol.sampling_params(body, state.defaults)
    protocol.check_scoring(body, params, enabled=state.enable_prompt_logprobs)
    params, calls = tools.plan(body, state.config, params)
    messages = [m.plain() for m in body.messages]
    submission = Submission(messages=messages, params=params,
                            add_generation_prompt=body.add_generation_prompt,
                            limit=protocol.max_tokens(body), tools=calls.tools,
                            constraint_field=structured.field(body) or calls.field,
                            continue_final_message=body.continue_final_message,
                            template_kwargs=tokenization.template_kwargs(
                                body.chat_template_kwargs, body.reasoning_effort),
                            priority=body.priority, lora=state.adapters.get(body.model))
    shape = _Shape("chat.completion", "chatcmpl", state, params, top=body.top_logprobs or 0,
                   reasoning=splitter(state.config, state.tokenizer, params, calls),
                   chat_echo=_chat_echo(body, messages), lora=submission.lora)
    return await _respond(request, state, shape, [submission], body)


def _chat_echo(body: ChatRequest, messages: list[dict]) -> str:
    """vLLM's chat `echo`: the reply starts with the last message when that message is
    the assistant's (the role the reply takes), else nothing."""
    last = messages[-1]
    if not body.echo or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    return content if isinstance(content, str) else "".join(
        part.get("text", "") for part in content or [])


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


@dataclasses.dataclass
class _Shape:
    """How one endpoint renders choices, whole and as chunks. Completions: `top` is
    `logprobs`; with `echo` a choice's first rendering starts with the prompt
    (`echo_only`: nothing else); with prompt logprobs it carries `prompt_logprobs`."""

    kind: str
    prefix: str
    state: ServerState
    params: SamplingParams
    top: int | None = None
    echo: bool = False
    echo_only: bool = False
    reasoning: ReasoningSplitter | None = None  # chat: --reasoning_parser
    chat_echo: str = ""  # chat `echo`: the text the reply starts with
    lora: Any = None  # the adapter the request's `model` named: the answers' `model`
    response_id: str = ""

    def __post_init__(self) -> None:
        self.response_id = out.new_id(self.prefix)

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def choice(self, choice: out.Choice, stream: Stream, *, delta: bool, first: bool = True,
               text_offset: int = 0) -> dict[str, Any]:
        """`first`: the choice's first rendering (whole, or its first chunk)."""
        if self.chat:
            if self.chat_echo and first:
                choice = dataclasses.replace(choice, text=self.chat_echo + choice.text)
            return out.chat_choice(choice, self.state.token_text, self.top or 0, delta,
                                   self.reasoning.names if self.reasoning else ())
        if self.echo_only:
            choice = out.Choice(choice.index, finish_reason=choice.finish_reason,
                                stop_reason=choice.stop_reason)
        if self.echo and first:
            echo = out.Echo(stream.prompt_text, stream.prompt_token_ids, stream.prompt_logprobs)
            choice = out.echoed(choice, echo, top=self.top, generated=not self.echo_only)
        rendered = out.completion_choice(choice, self.state.token_text, text_offset)
        if self.params.prompt_logprobs is not None and first:
            rendered["prompt_logprobs"] = _prompt_logprobs(stream)
        return rendered

    def pieces(self, stream: Stream, update: Update) -> list[Piece]:
        """The update's pieces; under a reasoning parser, split into reasoning and content."""
        return update.pieces if self.reasoning is None else self.reasoning.split(
            stream, update.pieces)

    def generated(self, token_ids: list[int]) -> int:
        """The completion tokens `token_ids` count for (none under `echo_only`)."""
        return 0 if self.echo_only else len(token_ids)

    def body(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        kind = self.kind + (".chunk" if chunk and self.chat else "")
        model = self.lora.lora_name if self.lora else self.state.model_name
        return out.header(kind, self.response_id, model) | {
            "choices": choices, **extra}


async def _respond(request: fastapi.Request, state: ServerState, shape: _Shape,
                   submissions: list[Submission], body: Any) -> Response:
    try:
        streams = await state.loop.submit(submissions, asyncio.Queue())
    except APIError as e:
        raise tools.constraint_error(e, submissions[0].constraint_field) from None
    if body.stream:
        events = _events(state.loop, shape, streams, body.stream_options)
        return event_streams.EventStream(
            events, on_close=lambda: event_streams.abort_unfinished(state.loop, streams))
    watcher = asyncio.create_task(event_streams.watch_disconnect(request, streams[0].inbox))
    try:
        return JSONResponse(await _collect(shape, streams))
    except Disconnected:
        return Response(status_code=499)
    finally:
        watcher.cancel()
        event_streams.abort_unfinished(state.loop, streams)


def _usage(streams: list[Stream], completion_tokens: int) -> dict[str, Any]:
    return out.usage(sum(len(s.prompt_token_ids) for s in streams), completion_tokens,
                     sum(s.num_cached_tokens for s in streams))


def _prompt_logprobs(stream: Stream) -> list | None:
    """vLLM's JSON of the prompt's logprobs; None if it was never scored (aborted)."""
    scored = stream.prompt_logprobs
    return None if scored is None else prompt_logprobs_json(scored)


async def _collect(shape: _Shape, streams: list[Stream]) -> dict[str, Any]:
    n = shape.params.n
    choices = [out.Choice(index=i) for i in range(n * len(streams))]
    async for prompt_index, update in updates(streams):
        for piece in shape.pieces(streams[prompt_index], update):
            choices[prompt_index * n + piece.index].add(
                piece.text, piece.token_ids, piece.logprobs, piece.finish_reason,
                piece.reasoning, piece.tool_calls, piece.stop_reason)
    generated = sum(shape.generated(c.token_ids) for c in choices)
    extra = {}
    if shape.chat and shape.params.prompt_logprobs is not None:  # vLLM's place in chat
        extra["prompt_logprobs"] = _prompt_logprobs(streams[0])
    rendered = [shape.choice(c, streams[c.index // n], delta=False) for c in choices]
    return shape.body(rendered, chunk=False, usage=_usage(streams, generated), **extra)


async def _events(loop: EngineLoop, shape: _Shape, streams: list[Stream],
                  options: protocol.StreamOptions | None) -> AsyncIterator[str]:
    """The SSE stream: a chunk per completion per step, the usage chunk if asked, [DONE];
    an error mid-stream is sent as an error event. Leaving early aborts the rest."""
    n, generated, offsets = shape.params.n, 0, {}
    include_usage = options is not None and options.include_usage
    extra = per_chunk(options, lambda: _usage(streams, generated))
    try:
        if shape.chat:  # OpenAI opens each chat choice with the assistant's role
            opening = [{"index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None} for i in range(n)]
            yield _event(shape.body(opening, chunk=True, **extra()))
        async for prompt_index, update in updates(streams):
            for piece in shape.pieces(streams[prompt_index], update):
                index = prompt_index * n + piece.index
                choice = out.Choice(index, piece.text, piece.token_ids, piece.logprobs,
                                    piece.finish_reason, piece.reasoning, list(piece.tool_calls),
                                    piece.stop_reason)
                rendered = shape.choice(choice, streams[prompt_index], delta=True,
                                        first=index not in offsets,
                                        text_offset=offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(rendered.get("text", ""))
                generated += shape.generated(piece.token_ids)
                yield _event(shape.body([rendered], chunk=True, **extra()))
        if include_usage:
            yield _event(shape.body([], chunk=True, usage=_usage(streams, generated)))
    except APIError as e:
        yield _event(e.body())
    finally:
        event_streams.abort_unfinished(loop, streams)
    yield "data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> str:
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"
