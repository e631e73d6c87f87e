"""Speculative verification on device: rejection sampling that keeps the target's
distribution exactly (Leviathan et al. 2023; Chen et al. 2023), given a draft model's
probabilities or certain proposals (n-gram lookup: none). Each row draws from its own
key, fold_in(fold_in(key(seed), counter), stream), its streams apart from the plain
draw's and the draft model's (`DRAFT_STREAM`), so no uniform is used twice.
See docs/speculative_decoding.md#a-speculative-step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.model import sampler
from jaxinfer.model.sampler import SampleOutput, SamplingInputs

ACCEPT_STREAM, RESIDUAL_STREAM, DRAFT_STREAM = 1, 2, 3


def probabilities(penalized: jax.Array, inputs: SamplingInputs,
                  weights: jax.Array | None = None) -> jax.Array:
    """f32[R, V]: the distribution each row samples from, given its penalized logits
    (one-hot at the argmax for greedy rows); `weights`: its `filtered_weights` if made."""
    if weights is None:
        weights = sampler.filtered_weights(penalized, inputs)
    one_hot = _one_hot(sampler.first_argmax(penalized), penalized.shape[-1])
    weights = jnp.where((inputs.temperature > 0)[:, None], weights, one_hot)
    return weights / jnp.sum(weights, axis=-1, keepdims=True)


def stream_uniforms(inputs: SamplingInputs, stream: int) -> jax.Array:
    """f32[R] in [0, 1): each row's uniform of `stream` (see the module docstring)."""
    return jax.vmap(lambda s, c: sampler.uniform(s, c, stream))(inputs.seeds, inputs.counters)


def verify(logits: jax.Array, inputs: SamplingInputs, proposed_ids: jax.Array,
           draft_probs: jax.Array | None, *, num_logprobs: int,
           token_mask: jax.Array | None = None) -> SampleOutput:
    """Each row's token: its proposal where accepted, else a draw from the residual
    (rows without one: the plain draw); with logprobs as `sampler.sample` gives them.

    logits f32[R, V] raw; proposed_ids i32[R] (-1: none); draft_probs f32[R, V] or None
    (proposals certain); token_mask i32[R, W] (`sampler.constrain`: a constrained
    request proposes nothing, so its row is a plain draw among allowed tokens)."""
    logits = logits.astype(jnp.float32)
    penalized = sampler.constrain(sampler.penalize(logits, inputs), token_mask)
    greedy = sampler.first_argmax(penalized)
    is_random = inputs.temperature > 0
    chosen = jax.lax.cond(
        jnp.any(is_random),
        lambda: _random_rows(penalized, inputs, proposed_ids, draft_probs),
        lambda: greedy)
    token_ids = jnp.where(is_random, chosen, greedy)
    return sampler.describe(logits, token_ids, inputs, num_logprobs=num_logprobs,
                            proposed_ids=proposed_ids)


def _random_rows(penalized: jax.Array, inputs: SamplingInputs, proposed_ids: jax.Array,
                 draft_probs: jax.Array | None) -> jax.Array:
    """i32[R]: the rejection sampler's token of every row (greedy rows' are overridden)."""
    weights = sampler.filtered_weights(penalized, inputs)
    p = probabilities(penalized, inputs, weights)
    proposed = jnp.maximum(proposed_ids, 0)
    q = _one_hot(proposed, p.shape[-1]) if draft_probs is None else draft_probs
    plain = sampler.inverse_cdf(weights, stream_uniforms(inputs, 0))  # the plain draw
    return rejection_tokens(p, q, proposed_ids, plain,
                            stream_uniforms(inputs, ACCEPT_STREAM),
                            stream_uniforms(inputs, RESIDUAL_STREAM))


def rejection_tokens(p: jax.Array, q: jax.Array, proposed_ids: jax.Array,
                     plain: jax.Array, u_accept: jax.Array, u_residual: jax.Array
                     ) -> jax.Array:
    """i32[R]: x where u_accept * q(x) < p(x) (accepted with probability min(1, p/q)),
    else a draw from max(0, p - q) normalised (p itself where that is all zero);
    `plain` where the row proposes nothing (x = -1). p, q f32[R, V] distributions."""
    x = jnp.maximum(proposed_ids, 0)
    px = jnp.take_along_axis(p, x[:, None], axis=-1)[:, 0]
    qx = jnp.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    accept = u_accept * qx < px
    residual = jnp.maximum(p - q, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
    resampled = sampler.inverse_cdf(residual, u_residual)
    return jnp.where(proposed_ids < 0, plain, jnp.where(accept, x, resampled))


def _one_hot(ids: jax.Array, vocab: int) -> jax.Array:
    return (jax.lax.broadcasted_iota(jnp.int32, (ids.shape[0], vocab), 1)
            == ids[:, None]).astype(jnp.float32)
