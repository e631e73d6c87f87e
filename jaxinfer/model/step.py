"""The jittable entry points the runner compiles; no jit here: `step` (forward, then
sample Q positions of each request row, packed into one int32 array), `verify_step`
(rejection sampling of proposed tokens), `score_step` (prompt logprobs),
`pool_step` (a pooling model's hidden states) and `draft_prefill` (a draft model's K/V
only). See docs/architecture.md#one-step,
docs/speculative_decoding.md#a-speculative-step and docs/sampling.md#sampling-parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import DEFAULT_OPTIONS, ModelConfig, ModelOptions
from jaxinfer.model import (
    invariance,
    pooling,
    rejection,
    sampler,
    scoring,
    sharding,
    transformer,
)
from jaxinfer.model.attention import AttentionMetadata, KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # i32[T]
    md: AttentionMetadata  # logits_indices: i32[S * Q]
    sampling: sampler.SamplingInputs  # S * Q rows, row s * Q + q for position q of slot s
    proposed_ids: jax.Array  # i32[S, Q]: token to verify at each position; -1 = none


def step(params: transformer.Params, kv_cache: KVCache, inputs: StepInputs, *,
         cfg: ModelConfig, options: ModelOptions = DEFAULT_OPTIONS, num_logprobs: int,
         decode_only: bool = False, token_mask: jax.Array | None = None
         ) -> tuple[KVCache, jax.Array]:
    """Forward, then sample each position; returns (kv_cache, i32[S, Q, 3 + 2k]).
    `decode_only`: every request has one token (a decode bucket; see transformer).
    `token_mask`: i32[S, W] allowed-token bits per request (structured outputs,
    `sampler.constrain`), applied at each of its positions; None: no constraint."""
    with invariance.rows_in_blocks(options.batch_invariant):  # the sampler's logprobs too
        return _step(params, kv_cache, inputs, cfg, options, num_logprobs, decode_only,
                     token_mask)


def _step(params: transformer.Params, kv_cache: KVCache, inputs: StepInputs,
          cfg: ModelConfig, options: ModelOptions, num_logprobs: int, decode_only: bool,
          token_mask: jax.Array | None) -> tuple[KVCache, jax.Array]:
    kv_cache, logits, *routed = transformer.forward(
        params, kv_cache, inputs.token_ids, inputs.md, cfg=cfg, options=options,
        max_q_len=int(decode_only), routing=cfg.moe is not None)  # f32[S * Q, V]
    logits = sharding.replicate(logits)  # vocab-split LM head: whole rows to sample from
    return kv_cache, _sample_packed(logits, inputs, num_logprobs, token_mask), *routed


def verify_step(params: transformer.Params, kv_cache: KVCache, inputs: StepInputs,
                draft_probs: jax.Array | None = None, *, cfg: ModelConfig,
                options: ModelOptions = DEFAULT_OPTIONS, num_logprobs: int,
                token_mask: jax.Array | None = None) -> tuple[KVCache, jax.Array]:
    """`step` with rejection sampling of each position's proposed token: returns
    (kv_cache, i32[S, Q, 3 + 2k]) whose token at a position is the proposal where
    accepted. draft_probs f32[S, Q, V]: q of each position's proposal; None: certain."""
    num_slots, num_positions = inputs.proposed_ids.shape
    kv_cache, logits, *routed = transformer.forward(
        params, kv_cache, inputs.token_ids, inputs.md, cfg=cfg, options=options,
        max_q_len=num_positions, routing=cfg.moe is not None)  # f32[S * Q, V]
    logits = sharding.replicate(logits)
    if draft_probs is not None:
        draft_probs = draft_probs.reshape(num_slots * num_positions, -1)
    out = rejection.verify(logits, inputs.sampling, inputs.proposed_ids.reshape(-1),
                           draft_probs, num_logprobs=num_logprobs,
                           token_mask=_per_position(token_mask, num_positions))
    return kv_cache, sampler.pack(out).reshape(num_slots, num_positions, -1), *routed


def draft_prefill(params: transformer.Params, kv_cache: KVCache, token_ids: jax.Array,
                  md: AttentionMetadata, *, cfg: ModelConfig) -> KVCache:
    """A draft model's forward over ragged chunks for their K/V alone (no logits)."""
    kv_cache, _ = transformer.forward(params, kv_cache, token_ids, md, cfg=cfg)
    return kv_cache


def score_step(params: transformer.Params, kv_cache: KVCache, inputs: StepInputs,
               score_inputs: scoring.ScoreInputs, *, cfg: ModelConfig,
               options: ModelOptions = DEFAULT_OPTIONS, num_logprobs: int,
               token_mask: jax.Array | None = None) -> tuple[KVCache, jax.Array, jax.Array]:
    """`step` that also scores every token position (prompt logprobs): returns
    (kv_cache, i32[S, Q, 3 + 2k] samples, i32[T, 2 + 2k] scores, see model/scoring.py).

    A variant, not a branch of `step`: the LM head runs over all T tokens here (f32[T, V]
    logits, then a log-softmax and a rank count over them), work the ordinary step never
    does. The runner compiles it per mixed bucket only when the engine is made with
    `enable_prompt_logprobs`, and runs it only for steps that score some position. The
    sampled rows are taken from the same [T, V] logits, so sampling is unchanged (up to
    float rounding of a matmul of another shape)."""
    num_tokens = inputs.token_ids.shape[0]
    every_token = dataclasses.replace(inputs.md, logits_indices=jnp.arange(
        num_tokens, dtype=jnp.int32))
    kv_cache, logits, *routed = transformer.forward(
        params, kv_cache, inputs.token_ids, every_token, cfg=cfg, options=options,
        routing=cfg.moe is not None)  # f32[T, V]
    logits = sharding.replicate(logits)
    scores = scoring.pack(scoring.score(logits, score_inputs, num_logprobs=num_logprobs))
    sampled = _sample_packed(logits[inputs.md.logits_indices], inputs, num_logprobs,
                             token_mask)
    return kv_cache, sampled, scores, *routed


def pool_step(params: transformer.Params, kv_cache: KVCache, inputs: StepInputs, *,
              cfg: ModelConfig, options: ModelOptions = DEFAULT_OPTIONS, num_logprobs: int,
              decode_only: bool = False, token_mask: jax.Array | None = None
              ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """A pooling model's step (docs/pooling.md#decoder-models): K/V written as `step`
    writes them, no LM head; returns (kv_cache, i32[S, Q, 3 + 2k] zeros in place of
    samples, f32[S, 3, D] each request row's chunk pooled (first token, last token, sum),
    f32[S, num_labels] the score head on the last token, [S, 0] without one)."""
    del token_mask  # nothing is sampled
    num_slots, num_positions = inputs.proposed_ids.shape
    kv_cache, hidden, *routed = transformer.forward(
        params, kv_cache, inputs.token_ids, inputs.md, cfg=cfg, options=options,
        max_q_len=int(decode_only), routing=cfg.moe is not None, hidden=True)  # f32[T, D]
    pools = pooling.chunk_pools(hidden, inputs.md.cu_q_lens)
    scores = pooling.score_head(params, pools[:, pooling.LAST], cfg)
    samples = jnp.zeros((num_slots, num_positions, 3 + 2 * num_logprobs), jnp.int32)
    return kv_cache, samples, pools, scores, *routed


def _sample_packed(logits: jax.Array, inputs: StepInputs, num_logprobs: int,
                   token_mask: jax.Array | None = None) -> jax.Array:
    """i32[S, Q, 3 + 2k]: the samples of f32[S * Q, V] logits, packed."""
    num_slots, num_positions = inputs.proposed_ids.shape
    out = sampler.sample(logits, inputs.sampling, num_logprobs=num_logprobs,
                         proposed_ids=inputs.proposed_ids.reshape(-1),
                         token_mask=_per_position(token_mask, num_positions))
    return sampler.pack(out).reshape(num_slots, num_positions, -1)


def _per_position(token_mask: jax.Array | None, num_positions: int) -> jax.Array | None:
    """i32[S * Q, W]: each request's mask row at each of its Q positions."""
    if token_mask is None or num_positions == 1:
        return token_mask
    return jnp.repeat(token_mask, num_positions, axis=0)
