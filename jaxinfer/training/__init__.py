"""What a trainer needs from the engine's model: per-token logprobs of given sequences
on the engine's own forward, differentiable w.r.t. params. See
docs/rl.md#logprobs-that-match-the-trainers.
"""

from jaxinfer.training.logprobs import (
    llm_sequence_logprobs,
    sampled_sequences,
    sequence_logprobs,
)

__all__ = ["llm_sequence_logprobs", "sampled_sequences", "sequence_logprobs"]
