"""Next-token sampling on device, one batched call for every request row.

Greedy (temperature 0), temperature, top-k and top-p. Each row draws from its
own key, folded from the request's seed and its count of generated tokens, so
a request's tokens never depend on what else is in the batch. Logprobs are the
log-softmax of the raw logits (vLLM's default), before temperature or top-k/p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling settings; padding rows are greedy."""

    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    seeds: jax.Array  # u32[S]
    counters: jax.Array  # i32[S]: tokens the request has generated so far


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: logprob of the chosen token
    top_ids: jax.Array  # i32[S, k]
    top_logprobs: jax.Array  # f32[S, k]


def sample(logits: jax.Array, inputs: SamplingInputs, *, num_logprobs: int) -> SampleOutput:
    """Pick one token per row of f32[S, V] logits."""
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = jax.vmap(_sample_row)(logits, inputs.temperature, inputs.top_k, inputs.top_p,
                                    inputs.seeds, inputs.counters)
    token_ids = jnp.where(inputs.temperature > 0, sampled, greedy)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return SampleOutput(token_ids, chosen, top_ids.astype(jnp.int32), top_logprobs)


def _sample_row(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array, seed: jax.Array, counter: jax.Array) -> jax.Array:
    """Sample from one row f32[V] after temperature, top-k and top-p."""
    vocab = logits.shape[0]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(vocab)
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    before = jnp.cumsum(probs) - probs  # mass strictly above this rank
    keep &= (before < top_p) | (rank == 0)
    key = jax.random.fold_in(jax.random.key(seed), counter)
    pick = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    return order[pick].astype(jnp.int32)
