"""A draft model's k proposals in one device call (speculative decoding): `propose` runs
the draft k + 1 times in a `lax.fori_loop` with its KV cache carried, sampling each
draft under the request's own settings, and returns the drafts and q for the target's
rejection sampler. See docs/speculative_decoding.md#proposers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model import rejection, sampler, transformer
from jaxinfer.model.attention import AttentionMetadata, KVCache
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """One proposal call over S request slots (a decode bucket's shapes)."""

    token_ids: jax.Array  # i32[T]: slot s's last token at row s; T >= S, the rest padding
    positions: jax.Array  # i32[S]: that token's position in its request
    page_indices: jax.Array  # i32[S, pages_per_seq]: the page table (the target's pages)
    num_seqs: jax.Array  # i32[1]: slots in use
    sampling: sampler.SamplingInputs  # S rows: history up to and including the last token
    num_steps: jax.Array  # i32[]: draft forwards to run, k + 1 <= K + 1
    attention: AttentionSettings = dataclasses.field(  # the engine's (AttentionMetadata's)
        default=DEFAULT_SETTINGS, metadata={"static": True})


def propose(params: transformer.Params, kv_cache: KVCache, inputs: DraftInputs, *,
            cfg: ModelConfig, page_size: int, num_positions: int, vocab_size: int
            ) -> tuple[KVCache, jax.Array, jax.Array]:
    """(kv_cache, i32[S, Q] drafted tokens, f32[S, Q, vocab_size] their q), Q =
    `num_positions` = K + 1; entries past `num_steps - 1` drafts are unused."""
    num_slots = inputs.positions.shape[0]
    tokens = jnp.zeros((num_slots, num_positions), jnp.int32)
    probs = jnp.zeros((num_slots, num_positions, vocab_size), jnp.float32)

    def body(i: jax.Array, carry: tuple) -> tuple:
        kv, token_ids, sampling, tokens, probs = carry
        md = step_metadata(inputs, i, page_size=page_size, num_tokens=token_ids.shape[0])
        kv, logits = transformer.forward(params, kv, token_ids, md, cfg=cfg, max_q_len=1)
        token, q = _draw(fit_vocab(logits, vocab_size), sampling)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
        probs = jax.lax.dynamic_update_slice(probs, q[:, None, :], (0, i, 0))
        return kv, token_ids.at[:num_slots].set(token), _advance(sampling, token), tokens, probs

    kv_cache, _, _, tokens, probs = jax.lax.fori_loop(
        0, inputs.num_steps, body, (kv_cache, inputs.token_ids, inputs.sampling, tokens, probs))
    return kv_cache, tokens, probs


def step_metadata(inputs: DraftInputs, step: jax.Array, *, page_size: int,
                  num_tokens: int) -> AttentionMetadata:
    """The attention metadata of draft iteration `step`: slot s's one token at position
    `positions[s] + step`, as `engine/runner/inputs.build_metadata` lays out a decode
    bucket (padding tokens write into the trash page 0)."""
    num_slots, pages_per_seq = inputs.page_indices.shape
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    real = slots < inputs.num_seqs[0]
    pos = jnp.where(real, inputs.positions + step, 0)
    page_no = pos // page_size
    page = jnp.where(real & (page_no < pages_per_seq),
                     inputs.page_indices[slots, jnp.minimum(page_no, pages_per_seq - 1)], 0)
    padding = jnp.arange(num_slots, num_tokens, dtype=jnp.int32)
    return AttentionMetadata(
        positions=jnp.concatenate([pos, jnp.zeros_like(padding)]),
        slot_mapping=jnp.concatenate([page * page_size + pos % page_size,
                                      padding % page_size]),
        page_indices=inputs.page_indices,
        kv_lens=jnp.where(real, jnp.minimum(pos + 1, pages_per_seq * page_size), 0),
        cu_q_lens=jnp.minimum(jnp.arange(num_slots + 1, dtype=jnp.int32),
                              inputs.num_seqs[0]),
        num_seqs=inputs.num_seqs, logits_indices=slots, attention=inputs.attention)


def fit_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """f32[S, V_draft] -> f32[S, vocab_size]: ids past the draft's are impossible (-inf),
    ids past the target's dropped."""
    extra = vocab_size - logits.shape[-1]
    if extra <= 0:
        return logits[:, :vocab_size]
    return jnp.pad(logits, ((0, 0), (0, extra)), constant_values=-jnp.inf)


def _draw(logits: jax.Array, sampling: sampler.SamplingInputs
          ) -> tuple[jax.Array, jax.Array]:
    """(i32[S] token, f32[S, V] q): a draw from the draft's distribution, and it."""
    penalized = sampler.penalize(logits.astype(jnp.float32), sampling)
    greedy = sampler.first_argmax(penalized)
    is_random = sampling.temperature > 0

    def random_rows() -> tuple[jax.Array, jax.Array]:
        q = rejection.probabilities(penalized, sampling)
        u = rejection.stream_uniforms(sampling, rejection.DRAFT_STREAM)
        return jnp.where(is_random, sampler.inverse_cdf(q, u), greedy), q

    def greedy_rows() -> tuple[jax.Array, jax.Array]:
        return greedy, (jax.lax.broadcasted_iota(jnp.int32, penalized.shape, 1)
                        == greedy[:, None]).astype(jnp.float32)

    return jax.lax.cond(jnp.any(is_random), random_rows, greedy_rows)


def _advance(sampling: sampler.SamplingInputs, token: jax.Array) -> sampler.SamplingInputs:
    """The rows' settings for the next position: `token` appended to the history, one
    more generated token counted."""
    width = sampling.history.shape[1]
    history = sampling.history.at[sampling.history_rows, sampling.history_lens].set(
        token, mode="drop")
    return dataclasses.replace(sampling, history=history,
                               history_lens=jnp.minimum(sampling.history_lens + 1, width),
                               counters=sampling.counters + 1)
