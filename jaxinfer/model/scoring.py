"""Prompt scoring on device for `SamplingParams.prompt_logprobs`: the scoring step's
logits reduced to each position's logprob of the next prompt token, its rank and the
top k, packed into one i32[T, 2 + 2k] array (`pack`/`unpack`).
See docs/sampling.md#sampling-parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreInputs:
    """Which positions of the step are scored, and against which token."""

    target_ids: jax.Array  # i32[T]: the prompt token after each position; -1 = not scored
    num_top: jax.Array  # i32[1]: the most top logprobs a scored position wants; 0 = none


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreOutput:
    """Per position of the step (jax arrays on device, numpy after `unpack`)."""

    logprobs: jax.Array  # f32[T]: raw logprob of the target; 0 where not scored
    ranks: jax.Array  # i32[T]: the target's rank, >= 1; 0 where not scored
    top_ids: jax.Array  # i32[T, k]: -1 when the step wanted no top logprobs
    top_logprobs: jax.Array  # f32[T, k]


def score(logits: jax.Array, inputs: ScoreInputs, *, num_logprobs: int) -> ScoreOutput:
    """Score f32[T, V] logits against `inputs.target_ids`; top `num_logprobs` per row."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # f32[T, V]
    scored = inputs.target_ids >= 0
    target = jnp.maximum(inputs.target_ids, 0)[:, None]
    chosen = jnp.take_along_axis(logprobs, target, axis=-1)  # f32[T, 1]
    ranks = 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)
    num_rows = logits.shape[0]
    skipped = (jnp.full((num_rows, num_logprobs), -jnp.inf),
               jnp.full((num_rows, num_logprobs), -1, jnp.int32))
    top_logprobs, top_ids = jax.lax.cond(
        inputs.num_top[0] > 0, lambda x: tuple(jax.lax.top_k(x, num_logprobs)),
        lambda _x: skipped, logprobs)
    return ScoreOutput(logprobs=jnp.where(scored, chosen[:, 0], 0.0),
                       ranks=jnp.where(scored, ranks, 0),
                       top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)


def pack(out: ScoreOutput) -> jax.Array:
    """i32[T, 2 + 2k]: logprob bits, rank, k top ids, k top-logprob bits (float32 bits)."""

    def bits(x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

    return jnp.concatenate([bits(out.logprobs)[:, None], out.ranks[:, None].astype(jnp.int32),
                            out.top_ids, bits(out.top_logprobs)], axis=-1)


def unpack(packed: np.ndarray, num_logprobs: int) -> ScoreOutput:
    """The numpy ScoreOutput of a `pack`ed i32[T, 2 + 2k] array (host side)."""
    packed = np.asarray(packed)
    k = num_logprobs
    if packed.dtype != np.int32 or packed.ndim != 2 or packed.shape[1] != 2 + 2 * k:
        raise ValueError(f"{packed.shape=} {packed.dtype=} must be int32[T, {2 + 2 * k}]")

    def floats(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).view(np.float32)

    return ScoreOutput(logprobs=floats(packed[:, 0]), ranks=packed[:, 1].copy(),
                       top_ids=packed[:, 2:2 + k].copy(), top_logprobs=floats(packed[:, 2 + k:]))
