"""The OpenAPI schema behind /openapi.json and /docs. The handlers read their bodies by
hand (every error in OpenAI's shape), so FastAPI sees no body models: the request and
response models are added here. See docs/serving.md#routes.
"""

from __future__ import annotations

from typing import Any

import fastapi
import fastapi.openapi.utils
import pydantic
from pydantic.json_schema import models_json_schema

from jaxinfer.server import lora_routes, tokenization
from jaxinfer.server import pooling_protocol as pooling
from jaxinfer.server.protocol import ChatRequest, CompletionRequest
from jaxinfer.server.responses_api.protocol import ResponsesRequest

REF = "#/components/schemas/{model}"
# route -> the bodies it takes (one of them); and the models of its 200 answers
BODIES: dict[str, tuple[type[pydantic.BaseModel], ...]] = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatRequest,),
    "/v1/responses": (ResponsesRequest,),
    "/tokenize": (tokenization.TokenizeCompletionRequest, tokenization.TokenizeChatRequest),
    "/detokenize": (tokenization.DetokenizeRequest,),
    "/v1/embeddings": (pooling.EmbeddingRequest,),
    **{path: (pooling.ScoreRequest,) for path in ("/score", "/v1/score")},
    **{path: (pooling.RerankRequest,) for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    **{path: (pooling.ClassifyRequest,) for path in ("/classify", "/v1/classify")},
    lora_routes.LOAD: (lora_routes.LoadAdapterRequest,),
    lora_routes.UNLOAD: (lora_routes.UnloadAdapterRequest,),
}
ANSWERS: dict[str, type[pydantic.BaseModel]] = {
    "/tokenize": tokenization.TokenizeResponse,
    "/detokenize": tokenization.DetokenizeResponse,
}


class ErrorDetail(pydantic.BaseModel):
    message: str
    type: str
    param: str | None  # the field the error is about (`messages[0].content`, ...)
    code: str | None


class ErrorResponse(pydantic.BaseModel):
    """Every error: OpenAI's shape (server/protocol.py APIError)."""

    error: ErrorDetail


def install(app: fastapi.FastAPI, version: str) -> None:
    """`app.openapi` builds (once) the schema with the real bodies."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = schema(app, version)
        return app.openapi_schema

    app.openapi = openapi


def schema(app: fastapi.FastAPI, version: str) -> dict[str, Any]:
    document = fastapi.openapi.utils.get_openapi(
        title=app.title, version=version, routes=app.routes,
        description="jaxinfer's OpenAI-compatible server (docs/serving.md)")
    models = list(dict.fromkeys((m, "validation") for bodies in BODIES.values() for m in bodies))
    models += [(m, "serialization") for m in (*ANSWERS.values(), ErrorResponse)]
    refs, definitions = models_json_schema(models, ref_template=REF)
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components.update(definitions.get("$defs", {}))
    for path, bodies in BODIES.items():
        if path not in document["paths"]:  # a route this server does not serve
            continue
        shapes = [refs[(m, "validation")] for m in bodies]
        body = shapes[0] if len(shapes) == 1 else {"oneOf": shapes}
        operation = document["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": body}}}
        operation["responses"]["4XX"] = {
            "description": "a request refused (400 naming the field in `param`, 401, 404, "
                           "413, ...)",
            "content": {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}}}
    for path, model in ANSWERS.items():
        answer = document["paths"][path]["post"]["responses"]["200"]
        answer["content"] = {"application/json": {"schema": refs[(model, "serialization")]}}
    return document
