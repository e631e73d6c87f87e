"""Pooling models on the engine: embeddings, classification and scores (`LLM.embed`,
`LLM.classify`, `LLM.score`), for encoders (BERT, XLM-RoBERTa) packed into dense steps
and for decoders through the paged engine. See docs/pooling.md.
"""

from jaxinfer.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxinfer.pooling.params import PoolingParams

__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "PoolingParams", "ScoringOutput", "ScoringRequestOutput"]
