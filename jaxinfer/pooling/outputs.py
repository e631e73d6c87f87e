"""What the pooling calls return, named and shaped as vLLM's: a request output per input
whose `outputs` is an EmbeddingOutput (`embedding`), ClassificationOutput (`probs`) or
ScoringOutput (`score`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]  # one vector; with pooling "all", its rows flattened

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(frozen=True)
class ClassificationOutput:
    probs: list[float]  # per label: softmax (sigmoid for one label), or raw logits

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass(frozen=True)
class ScoringOutput:
    score: float  # cosine for an embedding model; the classifier's for a cross-encoder


@dataclasses.dataclass(frozen=True)
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: object
    finished: bool = True


@dataclasses.dataclass(frozen=True)
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput


@dataclasses.dataclass(frozen=True)
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


@dataclasses.dataclass(frozen=True)
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput
