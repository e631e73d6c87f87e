"""What every route handler shares: `ServerState` (the engine loop and facts about the
served model) and the first steps of a request: the API key checked, the body read,
validated and its model name checked. See docs/serving.md#routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Any

import fastapi

from jaxinfer.config import ServerConfig
from jaxinfer.engine.request import SamplingParams
from jaxinfer.server import bodies, protocol
from jaxinfer.server import responses as out
from jaxinfer.server.adapters import Adapters
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.fields import check_message_content, take_ignored
from jaxinfer.server.pooling_loop import PoolingLoop
from jaxinfer.server.protocol import APIError, Body
from jaxinfer.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerState:
    """What the handlers share: the engine loop and facts about the served model."""

    loop: EngineLoop | PoolingLoop  # a PoolingLoop serves a pooling model (docs/pooling.md)
    config: ServerConfig
    model_name: str
    model_root: str
    max_model_len: int
    defaults: SamplingParams
    token_text: out.TokenText | None  # None without a tokenizer: no logprob texts
    enable_prompt_logprobs: bool = False  # the engine compiled its scoring steps
    # --reasoning_parser (server/reasoning.py), /tokenize and /detokenize
    tokenizer: Tokenizer | None = None
    # the LoRA adapters served by name (server/adapters.py): none without enable_lora
    adapters: Adapters = dataclasses.field(default_factory=Adapters)
    draining: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # a signal came
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))  # /v1/models


def state_of(request: fastapi.Request) -> ServerState:
    return request.app.state.server


def authorized(request: fastapi.Request) -> ServerState:
    """The state, once the request carries the API key (if the server has one); else 401."""
    state = state_of(request)
    key = state.config.api_key
    if key is None:
        return state
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                 key.encode()):
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key")
    return state


BodyModel = type[Body] | Callable[[Any], type[Body]]  # a model, or one picked by the JSON


async def parsed(request: fastapi.Request, model: BodyModel) -> tuple[ServerState, Any]:
    """The state and the body as `model` (a class, or a function of the JSON giving the
    class: /tokenize's two forms); a 400 naming the first bad field, a 404 naming a model
    this server does not serve (the served model or one of its adapters)."""
    state = authorized(request)
    data = protocol.parse_json(await bodies.read(request, state.config, state.draining))
    take_ignored(request.url.path, data, request.scope)
    check_message_content(data)
    if not isinstance(model, type):
        model = model(data)
    body = protocol.validate(model, data)
    name = getattr(body, "model", None)
    if name is not None and name != state.model_name and state.adapters.get(name) is None:
        names = ", ".join(repr(lora.lora_name) for lora in state.adapters.loaded())
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{state.model_name!r}" + (f" and the adapters {names}" if names else ""),
                       param="model", code="model_not_found")
    return state, body
