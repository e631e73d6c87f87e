"""The jittable entry points the runner compiles; no jit here.

`step(params, kv_cache, inputs, *, cfg, num_logprobs) -> (kv_cache, out)` runs
the model over one ragged batch of tokens, then samples one token for each
request row from the logits at `md.logits_indices`, packed into one int32 array.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.model import sampler, transformer
from jaxinfer.model.attention import AttentionMetadata, KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # i32[T]
    md: AttentionMetadata
    sampling: sampler.SamplingInputs


def step(params: transformer.Params, kv_cache: KVCache, inputs: StepInputs, *,
         cfg: ModelConfig, num_logprobs: int, decode_only: bool = False
         ) -> tuple[KVCache, jax.Array]:
    """Forward, then sample each row; returns (kv_cache, i32[S, 2 + 2 * num_logprobs]).
    `decode_only`: every request has one token (a decode bucket; see transformer)."""
    kv_cache, logits = transformer.forward(params, kv_cache, inputs.token_ids, inputs.md,
                                           cfg=cfg, decode_only=decode_only)
    out = sampler.sample(logits, inputs.sampling, num_logprobs=num_logprobs)
    return kv_cache, sampler.pack(out)


def logits(params: transformer.Params, kv_cache: KVCache, token_ids: jax.Array,
           md: AttentionMetadata, *, cfg: ModelConfig) -> tuple[KVCache, jax.Array]:
    """The forward pass alone: (kv_cache, f32[R, V]) for parity checks and scoring."""
    return transformer.forward(params, kv_cache, token_ids, md, cfg=cfg)
