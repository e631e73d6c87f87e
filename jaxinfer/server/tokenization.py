"""vLLM's /tokenize and /detokenize: a prompt, or chat messages rendered by the chat
template as /v1/chat/completions renders them, to token ids (and their vocabulary
entries), and token ids back to text. See docs/serving.md#tokenization.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import fastapi
import pydantic
from fastapi.responses import JSONResponse, Response

from jaxinfer.server.protocol import APIError, Body, Message, Tool
from jaxinfer.server.state import ServerState, parsed
from jaxinfer.text.tokenizer import Tokenizer

# apply_chat_template's own arguments: the request's fields set them, never the kwargs
RESERVED_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "tools",
                   "tokenize")


class TokenizeCompletionRequest(Body):
    """A prompt to tokenize (vLLM's completion form)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS and the like, as the tokenizer adds them
    return_token_strs: bool = False  # also each id's vocabulary entry


class TokenizeChatRequest(Body):
    """Chat messages to render and tokenize (vLLM's chat form)."""

    model: str | None = None
    messages: Annotated[list[Message], pydantic.Field(min_length=1)]
    add_generation_prompt: bool | None = None  # None: True unless continue_final_message
    continue_final_message: bool = False  # end inside the last message, left open
    add_special_tokens: bool = False  # on top of what the template writes
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables
    tools: list[Tool] | None = None  # shown to the template, as in chat completions
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Annotated[int, pydantic.Field(ge=0)]]


class TokenizeResponse(pydantic.BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(pydantic.BaseModel):
    prompt: str


def tokenize_form(data: Any) -> type[Body]:
    """The form a /tokenize body is in: chat when it has `messages` (vLLM's rule)."""
    chat = isinstance(data, dict) and "messages" in data
    return TokenizeChatRequest if chat else TokenizeCompletionRequest


async def tokenize(request: fastapi.Request) -> Response:
    state, body = await parsed(request, tokenize_form)
    tokenizer = _tokenizer(state)
    ids = await asyncio.to_thread(_token_ids, tokenizer, body)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len,
                                         tokens=ids, token_strs=strs).model_dump())


async def detokenize(request: fastapi.Request) -> Response:
    state, body = await parsed(request, DetokenizeRequest)
    tokenizer = _tokenizer(state)
    size = tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if token >= size:
            raise APIError(400, f"tokens.{i}: {token} is not a token id of this tokenizer "
                           f"(ids are below {size})", param=f"tokens.{i}")
    # special tokens kept, as vLLM's (transformers' decode keeps them by default)
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


def _tokenizer(state: ServerState) -> Tokenizer:
    if state.tokenizer is None:
        raise APIError(400, "this server has no tokenizer (it was started with "
                       "--skip_tokenizer_init): it cannot tokenize or detokenize",
                       code="no_tokenizer")
    return state.tokenizer


def template_kwargs(given: dict | None, reasoning_effort: str | None = None) -> dict:
    """vLLM's chat_template_kwargs (and reasoning_effort, which gpt-oss's template reads)
    as template variables; a 400 naming one the request sets itself."""
    kwargs = dict(given or {})
    for key in kwargs:
        if key in RESERVED_KWARGS:
            raise APIError(400, f"chat_template_kwargs.{key}: set by the request itself, "
                           "not a template variable of its own",
                           param=f"chat_template_kwargs.{key}")
    if reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning_effort)
    return kwargs


def _token_ids(tokenizer: Tokenizer, body: TokenizeCompletionRequest | TokenizeChatRequest
               ) -> list[int]:
    """The body's ids; a 400 naming the field a ValueError or TypeError is about."""
    if isinstance(body, TokenizeCompletionRequest):
        try:
            return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ValueError as e:
            raise APIError(400, f"prompt: {e}", param="prompt") from None
    kwargs = template_kwargs(body.chat_template_kwargs)
    tools = None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        text = tokenizer.apply_chat_template(
            [m.plain() for m in body.messages], body.add_generation_prompt, tools=tools,
            continue_final_message=body.continue_final_message, **kwargs)
        return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    except (ValueError, TypeError) as e:
        field = ("continue_final_message" if str(e).startswith("continue_final_message")
                 else "messages")
        raise APIError(400, str(e), param=field) from None
