"""Pooling on the device: each input's (or each request chunk's) first-token, last-token
and summed hidden states, from which the host makes cls, last and mean vectors (a mean
over chunks is their sums' total over the length), and a decoder's score head. See
docs/pooling.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.config.encoder import EncoderConfig
from jaxinfer.model import encoder, layers

FIRST, LAST, SUM = 0, 1, 2  # rows of a pooled f32[..., 3, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EncoderInputs:
    """A packed encoder step's inputs (pooling/packing.py's PackedBatch)."""

    token_ids: jax.Array  # i32[R, L]
    type_ids: jax.Array  # i32[R, L]
    positions: jax.Array  # i32[R, L]: 0-based within each input
    segments: jax.Array  # i32[R, L]: 1, 2, ... per input in its row; 0 padding
    owners: jax.Array  # i32[R, L]: each token's input in [0, B); B for padding
    starts: jax.Array  # i32[B]: each input's first token in the flattened R * L
    lengths: jax.Array  # i32[B]: 0 for padding entries


def span_pools(hidden: jax.Array, starts: jax.Array, lengths: jax.Array,
               owners: jax.Array) -> jax.Array:
    """f32[B, 3, D]: first, last and summed rows of `hidden` f32[T, D] over each span
    [start, start + length); `owners` i32[T] is each token's span, B or more for none (a
    span of length 0, padding, pools to anything finite)."""
    num_tokens = hidden.shape[0]
    sums = jax.ops.segment_sum(hidden, owners, num_segments=starts.shape[0])
    first = hidden[jnp.clip(starts, 0, num_tokens - 1)]
    last = hidden[jnp.clip(starts + lengths - 1, 0, num_tokens - 1)]
    return jnp.stack([first, last, sums], axis=1)


def chunk_pools(hidden: jax.Array, cu_q_lens: jax.Array) -> jax.Array:
    """f32[S, 3, D] of a paged step: each request row's chunk pooled (`span_pools` over
    the rows of the step's prefix sums `cu_q_lens` i32[S + 1]; tokens past the last
    row's end are padding, owned by none)."""
    token = jnp.arange(hidden.shape[0], dtype=jnp.int32)
    owners = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)
    return span_pools(hidden, cu_q_lens[:-1], cu_q_lens[1:] - cu_q_lens[:-1], owners)


def encoder_step(params: dict, inputs: EncoderInputs, *, cfg: EncoderConfig,
                 all_tokens: bool = False) -> tuple[jax.Array, jax.Array]:
    """An encoder over packed inputs (pooling/packing.py): (f32[B, 3, D] each input
    pooled, or with `all_tokens` every token's f32[R * L, D]; f32[B, num_labels] the
    classifier on each input's first token, [B, 0] without one)."""
    hidden = encoder.forward(params, inputs.token_ids, inputs.type_ids, inputs.positions,
                             inputs.segments, cfg=cfg)
    flat = hidden.reshape(-1, hidden.shape[-1])
    first = flat[jnp.clip(inputs.starts, 0, flat.shape[0] - 1)]
    scores = (encoder.classify(params, first, cfg=cfg) if cfg.num_labels
              else jnp.zeros((first.shape[0], 0), jnp.float32))
    if all_tokens:
        return flat, scores
    return span_pools(flat, inputs.starts, inputs.lengths, inputs.owners.reshape(-1)), scores


def score_head(params: dict, last: jax.Array, cfg: ModelConfig) -> jax.Array:
    """f32[S, num_labels]: a sequence classifier's `score` on the last token's normed
    hidden state (HF's *ForSequenceClassification); [S, 0] for a model without one."""
    if cfg.head != "score":
        return jnp.zeros((last.shape[0], 0), jnp.float32)
    return layers.linear(last, params["score"]).astype(jnp.float32)
