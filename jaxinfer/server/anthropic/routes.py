"""/v1/messages and /v1/messages/count_tokens: the body read (the API key from
`x-api-key` or `Authorization`), translated to a chat request, answered by the chat
route's own handler and read back in Anthropic's shape; every error in Anthropic's.
See docs/serving.md#anthropics-messages-api.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import fastapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.server import bodies, protocol, tokenization
from jaxinfer.server.anthropic import errors, streaming, translation
from jaxinfer.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from jaxinfer.server.anthropic.translation import Plan
from jaxinfer.server.pooling_loop import PoolingLoop
from jaxinfer.server.protocol import APIError, ChatRequest
from jaxinfer.server.state import ServerState, authorized, state_of
from jaxinfer.server.streams import Disconnected

log = logging.getLogger(__name__)
# the chat route once its body is read (server/app.py): what a Messages request becomes
Chat = Callable[[fastapi.Request, ServerState, ChatRequest], Awaitable[Response]]
Handler = Callable[[fastapi.Request], Awaitable[Response]]


def handlers(chat: Chat) -> dict[str, Handler]:
    async def messages(request: fastapi.Request) -> Response:
        return await _anthropic(request, lambda: _messages(request, chat))

    return {"/v1/messages": messages, "/v1/messages/count_tokens": count_tokens}


async def count_tokens(request: fastapi.Request) -> Response:
    return await _anthropic(request, lambda: _count_tokens(request))


async def _anthropic(request: fastapi.Request,
                     answer: Callable[[], Awaitable[Response]]) -> Response:
    """`answer()`, its errors in Anthropic's shape."""
    try:
        return await answer()
    except APIError as e:
        return errors.response(e)
    except Disconnected:  # a client that left: the app's to log
        raise
    except Exception as e:
        log.exception("%s failed", request.url.path)
        return errors.response(APIError(500, f"internal error: {type(e).__name__}: {e}"))


async def _messages(request: fastapi.Request, chat: Chat) -> Response:
    state, body = await _parsed(request, MessagesRequest)
    plan = translation.chat_request(body, state.config)
    response = await chat(request, state, protocol.validate(ChatRequest, plan.chat))
    if isinstance(response, StreamingResponse):
        return streaming.Translated(response, streaming.Events(plan, body.model))
    if not isinstance(response, JSONResponse) or response.status_code != 200:
        return response  # the client went away (499)
    return JSONResponse(_message(json.loads(response.body), plan, body.model))


def _message(chat: dict[str, Any], plan: Plan, model: str) -> dict[str, Any]:
    """A whole chat completion as an Anthropic message: thinking, text, then tool_use
    blocks."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "signature": streaming.signature(),
                        "thinking": message["reasoning"] if plan.show_thinking else ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": translation.tool_use_id(call["id"]),
                        "name": call["function"]["name"],
                        "input": translation.tool_input(call["function"]["arguments"])})
    reason, sequence = translation.stop_reason(choice["finish_reason"],
                                               choice.get("stop_reason"),
                                               plan.stop_sequences)
    return {"id": translation.message_id(chat["id"]), "type": "message",
            "role": "assistant", "model": model, "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": translation.usage(chat["usage"])}


async def _count_tokens(request: fastapi.Request) -> Response:
    """The prompt's tokens, rendered as the Messages request would render it."""
    state, body = await _parsed(request, CountTokensRequest)
    chat = protocol.validate(tokenization.TokenizeChatRequest, _tokenize_body(
        translation.chat_request(body, state.config).chat))
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer (--skip_tokenizer_init): it "
                       "cannot count tokens", code="no_tokenizer")
    tools = None if chat.tools is None else [t.model_dump(exclude_none=True)
                                             for t in chat.tools]
    try:
        ids = await asyncio.to_thread(
            tokenizer.prompt_ids, None, [m.plain() for m in chat.messages], tools=tools,
            add_generation_prompt=chat.add_generation_prompt is not False,
            continue_final_message=chat.continue_final_message,
            template_kwargs=tokenization.template_kwargs(chat.chat_template_kwargs))
    except (ValueError, TypeError) as e:  # a text too long to count: its length alone
        raise APIError(400, f"messages: {e}", param="messages") from None
    return JSONResponse({"input_tokens": len(ids)})


def _tokenize_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat body as /tokenize's chat form takes it (no sampling, no tool_choice)."""
    keep = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message",
            "chat_template_kwargs")
    return {key: value for key, value in chat.items() if key in keep}


async def _parsed(request: fastapi.Request, model: type) -> tuple[ServerState, Any]:
    """The state and the body as `model`, once the API key is right; a 404 for a model
    this server does not serve, a 400 on a pooling model."""
    state = _authorized(request)
    data = protocol.parse_json(await bodies.read(request, state.config, state.draining))
    body = protocol.validate(model, data)
    if body.model != state.model_name and state.adapters.get(body.model) is None:
        raise APIError(404, f"model: the model {protocol.shortened(body.model)!r} does not "
                       f"exist; this server serves {state.model_name!r}", param="model")
    if isinstance(state.loop, PoolingLoop):
        raise APIError(400, f"{request.url.path}: this model is a pooling model (embeddings, "
                       "scores): it generates no text", param="model")
    return state, body


def _authorized(request: fastapi.Request) -> ServerState:
    """Anthropic's `x-api-key` header, or `Authorization: Bearer KEY` as on every route."""
    state = state_of(request)
    key, given = state.config.api_key, request.headers.get("x-api-key")
    if key is None or given is None:
        try:
            return authorized(request)
        except APIError:
            raise APIError(401, "missing or wrong API key (send 'x-api-key: KEY' or "
                           "'Authorization: Bearer KEY')") from None
    if not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "wrong API key in x-api-key")
    return state
