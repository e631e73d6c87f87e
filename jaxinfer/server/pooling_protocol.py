"""The pooling routes' request bodies (pydantic, strict, as protocol.py's): OpenAI's
embeddings with vLLM's extras, vLLM's score and classify, the Jina / Cohere rerank; and
how a body's inputs are listed and named in errors. See docs/pooling.md#serving.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic

from jaxinfer.server.protocol import APIError, Body

TokenIds = Annotated[list[int], pydantic.Field(min_length=1)]
Texts = Annotated[list[str], pydantic.Field(min_length=1)]
# one text, one input's token ids, or a list of either (OpenAI's `input`)
Inputs = str | TokenIds | list[str] | list[TokenIds]


class EmbeddingRequest(Body):
    model: str | None = None
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian f32
    dimensions: int | None = None  # a Matryoshka size (PoolingParams')
    # vLLM's extras, and sentence-transformers' prompt_name (the model's prompts)
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    prompt_name: str | None = None


class ClassifyRequest(Body):
    model: str | None = None
    input: Inputs
    truncate_prompt_tokens: int | None = None


class ScoreRequest(Body):
    """vLLM's /score: one text against each of `text_2`, or two lists item by item."""

    model: str | None = None
    text_1: str | Texts
    text_2: str | Texts
    truncate_prompt_tokens: int | None = None


class RerankRequest(Body):
    """Jina's and Cohere's rerank, as vLLM serves it."""

    model: str | None = None
    query: str
    documents: Texts
    top_n: Annotated[int, pydantic.Field(ge=1)] | None = None  # None: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


def listed(value: str | list, field: str) -> tuple[list[str | list[int]], list[str]]:
    """The inputs of `value` (a text, token ids, or a list of either) and the name each
    has in an error (`input`, or `input.3` in a list); a 400 for an empty list or text."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        inputs, names = [value], [field]
    else:
        inputs, names = list(value), [f"{field}.{i}" for i in range(len(value))]
    if not inputs:
        raise APIError(400, f"{field}: the list is empty; give at least one input",
                       param=field)
    for item, name in zip(inputs, names, strict=True):
        if item == "":
            raise APIError(400, f"{name}: an empty string has no tokens to pool",
                           param=name)
    return inputs, names


def paired(first: str | list[str], second: str | list[str]
           ) -> list[tuple[str, str, str, str]]:
    """/score's (text, text, field of the first, field of the second) pairs, paired as
    vLLM pairs them (pooling/calls.py score_pairs)."""
    texts_1, names_1 = listed(first, "text_1")
    texts_2, names_2 = listed(second, "text_2")
    if len(texts_1) == 1:
        texts_1, names_1 = texts_1 * len(texts_2), names_1 * len(texts_2)
    if len(texts_1) != len(texts_2):
        raise APIError(400, f"text_2: text_1 has {len(texts_1)} texts and text_2 "
                       f"{len(texts_2)}; give one text_1, or lists of one length",
                       param="text_2")
    return list(zip(texts_1, texts_2, names_1, names_2, strict=True))
