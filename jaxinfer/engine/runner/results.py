"""What a step gives back to the host: samples per chunk, prompt scores, and a pooling
model's pooled hidden states."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

import numpy as np

from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.engine.request import MAX_LOGPROBS
from jaxinfer.engine.runner.inputs import ScoreSpan
from jaxinfer.model import sampler, scoring


class Sample(typing.NamedTuple):
    """A token sampled at one position of a request in one step, with its logprobs (a
    tuple: a step makes one per request, on the host's critical path)."""

    token_id: int
    logprob: float
    top_ids: np.ndarray  # i32[MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[MAX_LOGPROBS]
    proposed_logprob: float  # of the token the chunk fed after this position; -inf if none


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """One chunk's scored prompt positions `first` .. `first + n - 1` (position p: prompt
    token p + 1), numpy, from the scoring step."""

    first: int
    logprobs: np.ndarray  # f32[n]: raw logprob of the prompt token
    ranks: np.ndarray  # i32[n]: its rank, >= 1
    top_ids: np.ndarray  # i32[n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[n, MAX_LOGPROBS]


class StepResult(typing.NamedTuple):
    """What `Runner.execute` returns: per chunk, its samples and its prompt scores."""

    bucket: Bucket
    samples: list[list[Sample]]
    prompt_scores: list[PromptScores | None]
    pooled: list[ChunkPools] | None = None  # a pooling runner's, per chunk


class ChunkPools(typing.NamedTuple):
    """A chunk's hidden states pooled by a pooling runner's step (model/pooling.py)."""

    first: np.ndarray  # f32[D]: the chunk's first token
    last: np.ndarray  # f32[D]: its last token
    total: np.ndarray  # f32[D]: the sum over its tokens
    scores: np.ndarray  # f32[num_labels]: the score head on its last token ([0]: none)


def samples(packed: np.ndarray, chunks: Sequence) -> list[list[Sample]]:
    """Per chunk, a Sample for each of its `num_samples` positions of the step's packed
    i32[S, Q, 3 + 2k] output."""
    out = sampler.unpack(packed, MAX_LOGPROBS)  # fields [S, Q, ...]
    # Python scalars in one conversion each, not one numpy scalar per sample.
    token_ids, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
    proposed = out.proposed_logprobs.tolist()
    return [[Sample(token_ids[i][q], logprobs[i][q], out.top_ids[i, q], out.top_logprobs[i, q],
                    proposed[i][q])
             for q in range(chunk.num_samples)] for i, chunk in enumerate(chunks)]


def pooled(pools: np.ndarray, scores: np.ndarray, chunks: Sequence) -> list[ChunkPools]:
    """Per chunk, its row of a pooling step's f32[S, 3, D] pools and f32[S, L] scores."""
    return [ChunkPools(pools[i, 0], pools[i, 1], pools[i, 2], scores[i])
            for i in range(len(chunks))]


def prompt_scores(packed: np.ndarray, spans: Sequence[ScoreSpan | None]
                   ) -> list[PromptScores | None]:
    """Per chunk, its rows of the step's packed i32[T, 2 + 2k] scores."""
    out = scoring.unpack(packed, MAX_LOGPROBS)
    result: list[PromptScores | None] = []
    for span in spans:
        if span is None:
            result.append(None)
            continue
        rows = slice(span.row, span.row + span.count)
        result.append(PromptScores(first=span.first, logprobs=out.logprobs[rows],
                                   ranks=out.ranks[rows], top_ids=out.top_ids[rows],
                                   top_logprobs=out.top_logprobs[rows]))
    return result
