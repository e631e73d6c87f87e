"""The routes of a pooling model (docs/pooling.md#serving): OpenAI's /v1/embeddings,
vLLM's /score and /classify, and /rerank in Jina's and Cohere's shape, over a
PoolingLoop; what a pooling server answers on the generation routes and on /metrics.
Inputs are tokenized and answers rendered on the loop's preparing threads; the
scores are LLM.score's (pooling/calls.py).
"""

from __future__ import annotations

import base64
import functools
import json
import math
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import fastapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from jaxinfer.pooling.params import PoolingParams
from jaxinfer.server import prometheus
from jaxinfer.server import responses as out
from jaxinfer.server.pooling_loop import PoolingLoop
from jaxinfer.server.pooling_protocol import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    listed,
    paired,
)
from jaxinfer.server.protocol import APIError
from jaxinfer.server.state import BodyModel, ServerState, authorized, parsed, state_of

Handler = Callable[[fastapi.Request], Awaitable[Response]]
GENERATION = ("/v1/completions", "/v1/chat/completions")  # refused on a pooling model
Pair = tuple[str, str, str, str]  # (query, document, their field names)
ROUTES = {path: ("POST",) for path in ("/v1/embeddings", "/score", "/v1/score", "/rerank",
                                       "/v1/rerank", "/v2/rerank", "/classify",
                                       "/v1/classify")}


def handlers(pooling: bool) -> dict[str, Handler]:
    """The pooling routes' handlers; on a pooling server also the generation routes'
    refusals and its own /metrics."""
    routes: dict[str, Handler] = {"/v1/embeddings": embeddings, "/score": score,
                                  "/v1/score": score, "/rerank": rerank,
                                  "/v1/rerank": rerank, "/v2/rerank": rerank,
                                  "/classify": classify, "/v1/classify": classify}
    if pooling:
        routes |= {path: _generation for path in GENERATION} | {"/metrics": _metrics}
    return routes


async def _generation(request: fastapi.Request) -> Response:
    authorized(request)
    raise APIError(400, f"{request.url.path}: this model is a pooling model (embeddings, "
                   "scores): it generates no text; it serves " + ", ".join(ROUTES),
                   param="model", code="pooling_model")


async def _metrics(request: fastapi.Request) -> Response:
    state = state_of(request)
    return PlainTextResponse(prometheus.pooling_exposition(state.loop.snapshot(),
                                                           state.model_name),
                             media_type=prometheus.CONTENT_TYPE)


async def _parsed(request: fastapi.Request, model: BodyModel
                  ) -> tuple[ServerState, PoolingLoop, Any]:
    """The state, the pooling loop and the body; a 400 on a model that generates."""
    if not isinstance(authorized(request).loop, PoolingLoop):
        raise APIError(400, f"{request.url.path} needs a pooling model (embeddings, "
                       "reranking): this server's model generates text (a pooling model "
                       "is served with --runner=pooling)", param="model",
                       code="not_a_pooling_model")
    state, body = await parsed(request, model)
    return state, state.loop, body


def _params(loop: PoolingLoop, **given: Any) -> PoolingParams:
    """PoolingParams checked against the model; a 400 naming the field."""
    params = PoolingParams(**given)
    engine = loop.engine
    try:
        params.check(engine.pooler, engine.hidden_size, engine.max_model_len)
    except ValueError as e:
        field = next((name for name in given if str(e).startswith(name)), None)
        raise APIError(400, str(e), param=field) from None
    return params


# ---- embeddings and classify -----------------------------------------------------------

async def embeddings(request: fastapi.Request) -> Response:
    state, loop, body = await _parsed(request, EmbeddingRequest)
    params = _params(loop, dimensions=body.dimensions, normalize=body.normalize,
                     truncate_prompt_tokens=body.truncate_prompt_tokens)
    try:
        loop.engine.prompt_prefix(body.prompt_name)
    except ValueError as e:
        raise APIError(400, str(e), param="prompt_name") from None
    prompts, names = listed(body.input, "input")
    inputs = await loop.run(_inputs, loop, prompts, names, params, body.prompt_name)
    pooled = await loop.pool(inputs)
    data = await loop.run(_embedding_data, loop, pooled, params, body.encoding_format)
    tokens = _tokens(inputs)
    return JSONResponse(out.header("list", out.new_id("embd"), state.model_name) | {
        "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def classify(request: fastapi.Request) -> Response:
    state, loop, body = await _parsed(request, ClassifyRequest)
    if not loop.engine.num_labels:
        raise APIError(400, f"{request.url.path} needs a classifier (a "
                       "*ForSequenceClassification model): this model embeds; it serves "
                       "/v1/embeddings, /score and /rerank", param="model",
                       code="not_a_classifier")
    params = _params(loop, truncate_prompt_tokens=body.truncate_prompt_tokens)
    prompts, names = listed(body.input, "input")
    inputs = await loop.run(_inputs, loop, prompts, names, params, None)
    pooled = await loop.pool(inputs)
    data = await loop.run(_classify_data, loop, pooled, params)
    return JSONResponse(out.header("list", out.new_id("classify"), state.model_name) | {
        "data": data, "usage": _usage(_tokens(inputs))})


def _inputs(loop: PoolingLoop, prompts: list, names: list[str], params: PoolingParams,
            prompt_name: str | None) -> list:
    """Each prompt tokenized and checked (a preparing thread); a 400 naming the input."""
    inputs = []
    for prompt, name in zip(prompts, names, strict=True):
        try:
            inputs.append(loop.engine.inputs(prompt, params=params, prompt_name=prompt_name))
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None
    return inputs


def _embedding_data(loop: PoolingLoop, pooled: list, params: PoolingParams,
                    encoding: str) -> list[dict[str, Any]]:
    data = []
    for index, item in enumerate(pooled):
        vector = loop.engine.embedding(item, params).reshape(-1)
        value = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                 if encoding == "base64" else vector.tolist())
        data.append({"object": "embedding", "index": index, "embedding": value})
    return data


def _classify_data(loop: PoolingLoop, pooled: list, params: PoolingParams
                   ) -> list[dict[str, Any]]:
    labels = _labels(str(loop.engine.model_dir), loop.engine.num_labels)
    data = []
    for index, item in enumerate(pooled):
        probs = loop.engine.probabilities(item, params).tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": labels[best], "probs": probs,
                     "num_classes": len(probs)})
    return data


@functools.lru_cache(maxsize=4)
def _labels(model_dir: str, num_labels: int) -> tuple[str, ...]:
    """config.json's id2label, else each label's index as text (vLLM's)."""
    path = pathlib.Path(model_dir) / "config.json"
    id2label = json.loads(path.read_text()).get("id2label") or {}
    return tuple(str(id2label.get(str(i), i)) for i in range(num_labels))


# ---- score and rerank ------------------------------------------------------------------

async def score(request: fastapi.Request) -> Response:
    state, loop, body = await _parsed(request, ScoreRequest)
    params = _params(loop, truncate_prompt_tokens=body.truncate_prompt_tokens)
    scores, tokens = await _scores(loop, paired(body.text_1, body.text_2), params)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse(out.header("list", out.new_id("score"), state.model_name) | {
        "data": data, "usage": _usage(tokens)})


async def rerank(request: fastapi.Request) -> Response:
    state, loop, body = await _parsed(request, RerankRequest)
    params = _params(loop, truncate_prompt_tokens=body.truncate_prompt_tokens)
    listed(body.query, "query")
    listed(body.documents, "documents")
    pairs = [(body.query, document, "query", f"documents.{i}")
             for i, document in enumerate(body.documents)]
    scores, tokens = await _scores(loop, pairs, params)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
    results = [{"index": i, **({"document": {"text": body.documents[i]}}
                               if body.return_documents else {}),
                "relevance_score": scores[i]} for i in order]
    return JSONResponse({"id": out.new_id("rerank"), "model": state.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                         "results": results})


async def _scores(loop: PoolingLoop, pairs: list[Pair], params: PoolingParams
                  ) -> tuple[list[float], int]:
    """Each pair's score and the tokens pooled: a cross-encoder's classifier on the pair,
    else the cosine of the two embeddings (as LLM.score)."""
    if loop.engine.num_labels:
        inputs = await loop.run(_pair_inputs, loop, pairs, params)
        pooled = await loop.pool(inputs)
        scores = await loop.run(_cross_scores, loop, pooled, params)
        return scores, _tokens(inputs)
    queries = list(dict.fromkeys((q, name) for q, _, name, _ in pairs))  # each pooled once
    inputs = await loop.run(_cosine_inputs, loop, queries, pairs, params)
    pooled = await loop.pool(inputs)
    scores = await loop.run(_cosines, loop, pooled, queries, pairs, params)
    return scores, _tokens(inputs)


def _pair_inputs(loop: PoolingLoop, pairs: list[Pair], params: PoolingParams) -> list:
    inputs = []
    for query, document, query_name, document_name in pairs:
        try:
            inputs.append(loop.engine.inputs(query, document, params=params))
        except ValueError as e:
            raise APIError(400, f"{query_name} with {document_name}: {e}",
                           param=document_name) from None
    return inputs


def _cross_scores(loop: PoolingLoop, pooled: list, params: PoolingParams) -> list[float]:
    return [float(loop.engine.probabilities(item, params)[0]) for item in pooled]


def _cosine_inputs(loop: PoolingLoop, queries: list[tuple[str, str]], pairs: list[Pair],
                   params: PoolingParams) -> list:
    """The queries' inputs with the model's "query" prompt, then the documents' with its
    "document" prompt, where it has them (sentence-transformers' encode_query and
    encode_document)."""
    prompts = {name: name if name in loop.engine.pooler.prompts else None
               for name in ("query", "document")}
    return (_inputs(loop, [q for q, _ in queries], [n for _, n in queries], params,
                    prompts["query"])
            + _inputs(loop, [d for _, d, _, _ in pairs], [n for _, _, _, n in pairs],
                      params, prompts["document"]))


def _cosines(loop: PoolingLoop, pooled: list, queries: list[tuple[str, str]],
             pairs: list[Pair], params: PoolingParams) -> list[float]:
    where = {query: i for i, query in enumerate(queries)}
    vectors = [loop.engine.embedding(item, params) for item in pooled]
    scores = []
    for index, (query, _, name, _) in enumerate(pairs):
        a, b = vectors[where[query, name]], vectors[len(queries) + index]
        scores.append(float(a.dot(b)) / max(math.sqrt(float(a.dot(a)) * float(b.dot(b))),
                                            1e-12))
    return scores


def _tokens(inputs: list) -> int:
    return sum(len(ids) for ids, _ in inputs)


def _usage(tokens: int) -> dict[str, int]:
    """vLLM's usage of a pooling answer: its prompt tokens, no completion."""
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
