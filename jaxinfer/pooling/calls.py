"""The pooling calls of `LLM` (vLLM's names and shapes): `embed`, `classify`, `score`;
a mixin, so api.py stays the front door. See docs/pooling.md#the-python-api.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.pooling.engine import Input, PoolingEngine
from jaxinfer.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxinfer.pooling.params import PoolingParams

Prompt = str | Sequence[int]


class PoolingCalls:
    """`LLM`'s calls on a pooling model (`self.engine` a PoolingEngine)."""

    engine: object

    def pooling_engine(self, what: str) -> PoolingEngine:
        if not isinstance(self.engine, PoolingEngine):
            raise ValueError(f"{what} needs a pooling model: this LLM generates text; "
                             "load an embedding or reranking model (runner='pooling')")
        return self.engine

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              prompt_name: str | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in order. `prompt_name`: the
        model's sentence-transformers prompt put before each text ("query", ...)."""
        del use_tqdm  # one call: no progress to show
        engine = self.pooling_engine("embed")
        params = _params(pooling_params, truncate_prompt_tokens, engine)
        inputs = _inputs(engine, _as_list(prompts), params, prompt_name)
        pooled = engine.pool(inputs)
        return [EmbeddingRequestOutput(
            request_id=f"embd-{i}", prompt_token_ids=ids,
            outputs=EmbeddingOutput(engine.embedding(p, params).reshape(-1).tolist()))
            for i, ((ids, _), p) in enumerate(zip(inputs, pooled, strict=True))]

    def classify(self, prompts: Prompt | Sequence[Prompt],
                 pooling_params: PoolingParams | None = None, *,
                 truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """A classifier's probabilities per prompt (sigmoid for one label, softmax)."""
        del use_tqdm
        engine = self.pooling_engine("classify")
        params = _params(pooling_params, truncate_prompt_tokens, engine)
        inputs = _inputs(engine, _as_list(prompts), params, None)
        pooled = engine.pool(inputs)
        return [ClassificationRequestOutput(
            request_id=f"classify-{i}", prompt_token_ids=ids,
            outputs=ClassificationOutput(engine.probabilities(p, params).tolist()))
            for i, ((ids, _), p) in enumerate(zip(inputs, pooled, strict=True))]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `score`: one text against each of `data_2` (or pairwise, lists of one
        length). A cross-encoder reads each pair and its classifier scores it; an
        embedding model scores the cosine of the two embeddings (the query with the
        model's "query" prompt, the document with its "document" prompt, where given)."""
        del use_tqdm
        engine = self.pooling_engine("score")
        params = _params(pooling_params, truncate_prompt_tokens, engine)
        pairs = score_pairs(data_1, data_2)
        if engine.num_labels:
            return _cross_scores(engine, pairs, params)
        return _cosine_scores(engine, pairs, params)


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]
                ) -> list[tuple[str, str]]:
    """(query, document) pairs as vLLM pairs them: one query against each document, or
    two lists of one length item by item."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in (("data_1", first), ("data_2", second)):
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name} must be a text or a non-empty list of texts")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"data_1 has {len(first)} texts and data_2 {len(second)}: give "
                         "one text, or lists of one length")
    return list(zip(first, second, strict=True))


def _cross_scores(engine: PoolingEngine, pairs: list[tuple[str, str]],
                  params: PoolingParams) -> list[ScoringRequestOutput]:
    inputs = []
    for index, (query, document) in enumerate(pairs):
        try:
            inputs.append(engine.inputs(query, document, params=params))
        except ValueError as e:
            raise ValueError(f"pair {index}: {e}") from None
    pooled = engine.pool(inputs)
    return [ScoringRequestOutput(
        request_id=f"score-{i}", prompt_token_ids=ids,
        outputs=ScoringOutput(float(engine.probabilities(p, params)[0])))
        for i, ((ids, _), p) in enumerate(zip(inputs, pooled, strict=True))]


def _cosine_scores(engine: PoolingEngine, pairs: list[tuple[str, str]],
                   params: PoolingParams) -> list[ScoringRequestOutput]:
    names = {name: name if name in engine.pooler.prompts else None
             for name in ("query", "document")}
    queries = _inputs(engine, [q for q, _ in pairs], params, names["query"])
    documents = _inputs(engine, [d for _, d in pairs], params, names["document"])
    pooled = engine.pool(queries + documents)
    out = []
    for i, ((ids_1, _), (ids_2, _)) in enumerate(zip(queries, documents, strict=True)):
        a, b = (engine.embedding(p, params) for p in (pooled[i], pooled[len(pairs) + i]))
        cosine = float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
        out.append(ScoringRequestOutput(request_id=f"score-{i}",
                                        prompt_token_ids=ids_1 + ids_2,
                                        outputs=ScoringOutput(cosine)))
    return out


def _params(params: PoolingParams | None, truncate: int | None,
            engine: PoolingEngine) -> PoolingParams:
    params = params or PoolingParams()
    if not isinstance(params, PoolingParams):
        raise TypeError(f"pooling_params is a {type(params).__name__}, not PoolingParams")
    if truncate is not None:
        params = dataclasses.replace(params, truncate_prompt_tokens=truncate)
    params.check(engine.pooler, engine.hidden_size, engine.max_model_len)
    return params


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int | np.integer) for t in prompts):
        return [prompts]
    return prompts


def _inputs(engine: PoolingEngine, prompts: list[Prompt], params: PoolingParams,
            prompt_name: str | None) -> list[Input]:
    out = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str | list | tuple | np.ndarray):
            raise TypeError(f"prompt {index} is a {type(prompt).__name__}; expected str "
                            "or token ids")
        try:
            out.append(engine.inputs(prompt, params=params, prompt_name=prompt_name))
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}") from None
    return out
