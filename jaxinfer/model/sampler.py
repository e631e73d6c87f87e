"""Next-token sampling on device, one batched call for every request row (vLLM's sampling
set, logit_bias, structured-output masks, a proposed token's logprob), and `pack` /
`unpack`, the step's one int32 output array. See docs/sampling.md#sampling-parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import invariance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling settings (R rows); padding rows are greedy with no penalties."""

    temperature: jax.Array  # f32[R]; 0 = greedy
    top_k: jax.Array  # i32[R]; 0 = off
    top_p: jax.Array  # f32[R]; 1 = off
    min_p: jax.Array  # f32[R]; 0 = off
    repetition_penalty: jax.Array  # f32[R]; 1 = off; ids in prompt or output
    presence_penalty: jax.Array  # f32[R]; 0 = off; ids in output
    frequency_penalty: jax.Array  # f32[R]; 0 = off; per occurrence in output
    seeds: jax.Array  # u32[R]
    counters: jax.Array  # i32[R]: tokens the request generated before this row's
    history: jax.Array  # i32[H, W]: token ids by position, one row per request
    history_rows: jax.Array  # i32[R]: the history row of each sampling row
    prompt_lens: jax.Array  # i32[R]: prompt tokens at the start of history
    history_lens: jax.Array  # i32[R]: prompt + output tokens in history
    ban_stop: jax.Array  # bool[R]: True while the request has < min_tokens outputs
    stop_ids: jax.Array  # i32[R, E]: ids that end the request, padded with -1
    logprobs: jax.Array  # i32[R]: top logprobs the row wants; 0 = none
    # logit_bias (OpenAI's): token ids, -1 padding, and the values added to their logits;
    # None where the caller has no bias (a draft model's rows)
    bias_ids: jax.Array | None = None  # i32[R, B]
    bias_values: jax.Array | None = None  # f32[R, B]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """One sampled token per row (jax arrays on device, numpy after `unpack`).

    Shapes are those of a step's R rows; `unpack` gives them the packed array's leading
    dimensions (the step's [S, Q]) in place of R.
    """

    token_ids: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R]: raw logprob of the chosen token
    top_ids: jax.Array  # i32[R, k]
    top_logprobs: jax.Array  # f32[R, k]
    proposed_logprobs: jax.Array  # f32[R]: raw logprob of the row's proposed id; -inf if none


def sample(logits: jax.Array, inputs: SamplingInputs, *, num_logprobs: int,
           proposed_ids: jax.Array | None = None, token_mask: jax.Array | None = None
           ) -> SampleOutput:
    """Pick one token per row of f32[R, V] logits; score the i32[R] `proposed_ids`
    (-1 = none; None = no row proposes); `token_mask`: i32[R, ceil(V / 32)] allowed-token
    bits (`constrain`), None or all ones for no constraint."""
    logits = logits.astype(jnp.float32)
    penalized = constrain(penalize(logits, inputs), token_mask)
    greedy = first_argmax(penalized)
    is_random = inputs.temperature > 0
    # Greedy-only batches skip the draw; greedy rows take `greedy` either way.
    sampled = jax.lax.cond(jnp.any(is_random), _draw, lambda _l, _i: greedy, penalized, inputs)
    token_ids = jnp.where(is_random, sampled, greedy)
    return describe(logits, token_ids, inputs, num_logprobs=num_logprobs,
                    proposed_ids=proposed_ids)


def describe(logits: jax.Array, token_ids: jax.Array, inputs: SamplingInputs, *,
             num_logprobs: int, proposed_ids: jax.Array | None = None) -> SampleOutput:
    """The SampleOutput of tokens i32[R] chosen from f32[R, V] raw logits: their logprobs,
    the top ones where rows ask, and the proposed ids' logprobs."""
    log_total = (invariance.logsumexp(logits) if invariance.active()  # f32[R]
                 else jax.nn.logsumexp(logits, axis=-1))  # logprobs = logits - it
    chosen = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0] - log_total
    num_rows = logits.shape[0]
    skipped = (jnp.full((num_rows, num_logprobs), -jnp.inf),
               jnp.full((num_rows, num_logprobs), -1, jnp.int32))
    top_logits, top_ids = jax.lax.cond(
        jnp.any(inputs.logprobs > 0), lambda x: tuple(jax.lax.top_k(x, num_logprobs)),
        lambda _x: skipped, logits)
    return SampleOutput(token_ids, chosen, top_ids.astype(jnp.int32),
                        top_logits - log_total[:, None],
                        _proposed_logprobs(logits, log_total, proposed_ids))


def _proposed_logprobs(logits: jax.Array, log_total: jax.Array,
                       proposed_ids: jax.Array | None) -> jax.Array:
    """f32[R]: each row's raw logprob of its proposed id; -inf where it has none."""
    if proposed_ids is None:
        return jnp.full(logits.shape[:1], -jnp.inf)
    proposed = proposed_ids.astype(jnp.int32)
    found = jnp.take_along_axis(logits, jnp.maximum(proposed, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(proposed >= 0, found - log_total, -jnp.inf)


def constrain(logits: jax.Array, token_mask: jax.Array | None) -> jax.Array:
    """f32[R, V] logits with the tokens a row's grammar forbids at -inf (structured
    outputs). `token_mask` i32[R, W], W = ceil(V / 32): bit v % 32 of word v // 32 set
    where token v is allowed (llguidance's layout); -1 words (all ones) constrain
    nothing, and a step with no constrained row skips the [R, V] work (`lax.cond`).
    Applied after penalties and logit_bias, before temperature and filtering, so every
    sampling method draws among allowed tokens; logprobs stay the raw ones."""
    if token_mask is None:
        return logits

    def apply(x: jax.Array) -> jax.Array:
        num_rows, vocab = x.shape
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = (token_mask[:, :, None] >> shifts) & 1  # i32[R, W, 32]
        allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0  # bool[R, V]
        masked = jnp.where(allowed, x, -jnp.inf)
        # A row left with nothing (min_tokens banning the only allowed stop id) samples
        # among its allowed tokens evenly rather than from NaNs.
        empty = jnp.all(masked == -jnp.inf, axis=-1, keepdims=True)
        return jnp.where(empty, jnp.where(allowed, 0.0, -jnp.inf), masked)

    return jax.lax.cond(jnp.any(token_mask != -1), apply, lambda x: x, logits)


def first_argmax(x: jax.Array) -> jax.Array:
    """i32[R]: the first index of each row's maximum (as jnp.argmax, NaN-free rows)."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1).astype(jnp.int32)


def penalize(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """f32[R, V] logits after the penalties and the min_tokens ban on stop ids.

    The [R, V] token counts are built only when some row has a penalty on.
    """
    logits = apply_logit_bias(logits, inputs)
    any_penalty = (jnp.any(inputs.repetition_penalty != 1)
                   | jnp.any(inputs.presence_penalty != 0)
                   | jnp.any(inputs.frequency_penalty != 0))
    logits = jax.lax.cond(any_penalty, _apply_penalties, lambda l, _i: l, logits, inputs)
    return _ban_stop_ids(logits, inputs)


def apply_logit_bias(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """f32[R, V] logits plus each row's logit_bias, added before the penalties (vLLM's
    order); a scatter-add run only when some row has a bias."""
    if inputs.bias_ids is None:
        return logits
    ids, values = inputs.bias_ids, inputs.bias_values

    def add(x: jax.Array) -> jax.Array:
        num_rows, vocab = x.shape
        rows = jnp.broadcast_to(jnp.arange(num_rows, dtype=jnp.int32)[:, None], ids.shape)
        # Padding (-1) points one past the vocab and is dropped.
        return x.at[rows, jnp.where(ids >= 0, ids, vocab)].add(values, mode="drop")

    return jax.lax.cond(jnp.any(ids >= 0), add, lambda x: x, logits)


def _apply_penalties(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """vLLM's penalties: repetition (prompt or output ids), then frequency, then presence."""
    num_rows, vocab = logits.shape
    ids = inputs.history[inputs.history_rows]  # i32[R, W], gathered only when penalized
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    seen = (pos < inputs.history_lens[:, None]) & (ids >= 0) & (ids < vocab)
    is_output = seen & (pos >= inputs.prompt_lens[:, None])
    rows = jnp.broadcast_to(jnp.arange(num_rows, dtype=jnp.int32)[:, None], ids.shape)
    # Masked entries point one past the vocab and are dropped.
    counts = jnp.zeros((num_rows, vocab), jnp.int32).at[
        rows, jnp.where(is_output, ids, vocab)].add(1, mode="drop")  # i32[R, V]
    present = jnp.zeros((num_rows, vocab), jnp.bool_).at[
        rows, jnp.where(seen, ids, vocab)].set(True, mode="drop")  # bool[R, V]
    rep = inputs.repetition_penalty[:, None]
    logits = jnp.where(present, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - inputs.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - inputs.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def _ban_stop_ids(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """Set the stop ids' logits to -inf in rows with ban_stop (fewer than min_tokens)."""
    num_rows, vocab = logits.shape
    stop_ids = inputs.stop_ids  # i32[R, E]
    banned = inputs.ban_stop[:, None] & (stop_ids >= 0)
    rows = jnp.broadcast_to(jnp.arange(num_rows, dtype=jnp.int32)[:, None], stop_ids.shape)
    return logits.at[rows, jnp.where(banned, stop_ids, vocab)].set(-jnp.inf, mode="drop")


def _draw(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """i32[R] tokens drawn after temperature, top-k, top-p and min-p: an inverse CDF in
    vocab order over `filtered_weights`, so the draw is the same whether or not the
    batch needed the sort (skipped when no row uses top-k or top-p)."""
    u = jax.vmap(uniform)(inputs.seeds, inputs.counters)
    return inverse_cdf(filtered_weights(logits, inputs), u)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """i32[R]: per row, the first id whose running sum of f32[R, V] non-negative weights
    passes u * total, u in [0, 1) f32[R]; never an id of weight 0."""
    cdf = jnp.cumsum(weights, axis=-1)
    pick = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1, dtype=jnp.int32)
    # u * total can round up to total: fall back to the last kept id, never a dropped one.
    ids = jax.lax.broadcasted_iota(jnp.int32, weights.shape, 1)
    last = jnp.max(jnp.where(weights > 0, ids, 0), -1)
    return jnp.minimum(pick, last)


def filtered_weights(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """f32[R, V] unnormalized probabilities after temperature, top-k, top-p and min-p
    (0 where filtered out): the filters become one floor per row on the scaled logits."""
    num_rows, vocab = logits.shape
    temperature = jnp.where(inputs.temperature > 0, inputs.temperature, 1.0)[:, None]
    # The maximum goes before the division: the top logit scales to exactly 0 and the
    # rest to <= 0 at any temperature. Scaling first and subtracting the scaled row's
    # maximum lets XLA round the two divisions apart (a reciprocal in one fusion), and
    # at tiny temperatures every weight, the top one too, underflowed to 0.
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    scaled = (logits - row_max) / temperature  # f32[R, V], <= 0
    needs_sort = jnp.any((inputs.top_k > 0) & (inputs.top_k < vocab)) | jnp.any(inputs.top_p < 1)
    floor = jax.lax.cond(needs_sort, _top_k_top_p_floor,
                         lambda _s, _i: jnp.full((num_rows,), -jnp.inf), scaled, inputs)
    # min-p: prob >= min_p * max_prob, i.e. scaled logit >= 0 + log(min_p).
    floor = jnp.maximum(floor, jnp.log(inputs.min_p))[:, None]
    weights = jnp.exp(scaled)  # f32[R, V], unnormalized probs; 1 at the maximum
    keep = ((scaled >= floor) & (weights > 0)) | (scaled >= 0)
    return jnp.where(keep, weights, 0.0)


def _top_k_top_p_floor(scaled: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """f32[R]: the lowest scaled logit top-k then top-p keep (ties at it kept too, as vLLM)."""
    ranked = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)  # f32[R, V], descending; one sort
    rank = jax.lax.broadcasted_iota(jnp.int32, ranked.shape, 1)
    top_k, top_p = inputs.top_k[:, None], inputs.top_p[:, None]
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)  # after top-k
    above = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))  # mass above rank
    keep &= (above < top_p) | (top_p >= 1) | (rank == 0)
    num_kept = jnp.sum(keep, axis=-1, dtype=jnp.int32)  # a prefix of the ranks, >= 1
    return jnp.take_along_axis(ranked, (num_kept - 1)[:, None], axis=-1)[:, 0]


def uniform(seed: jax.Array, counter: jax.Array, stream: int = 0) -> jax.Array:
    """f32[] in [0, 1) from the row's key fold_in(key(seed), counter), or for another
    `stream` (> 0: speculative decoding's, model/rejection.py) the key folded with it."""
    key = jax.random.fold_in(jax.random.key(seed), counter)
    return jax.random.uniform(key if stream == 0 else jax.random.fold_in(key, stream))


def pack(out: SampleOutput) -> jax.Array:
    """i32[..., 3 + 2k]: token id, logprob bits, proposed-id logprob bits, k top ids,
    k top-logprob bits (float32 bits, exact); leading dimensions kept."""

    def bits(x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

    return jnp.concatenate([out.token_ids[..., None].astype(jnp.int32),
                            bits(out.logprobs)[..., None], bits(out.proposed_logprobs)[..., None],
                            out.top_ids.astype(jnp.int32), bits(out.top_logprobs)], axis=-1)


def unpack(packed: np.ndarray, num_logprobs: int) -> SampleOutput:
    """The numpy SampleOutput of a `pack`ed i32[..., 3 + 2k] array (host side)."""
    packed = np.asarray(packed)
    k = num_logprobs
    if packed.dtype != np.int32 or packed.ndim < 2 or packed.shape[-1] != 3 + 2 * k:
        raise ValueError(f"{packed.shape=} {packed.dtype=} must be int32[..., {3 + 2 * k}]")

    def floats(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).view(np.float32)

    return SampleOutput(token_ids=packed[..., 0].copy(), logprobs=floats(packed[..., 1]),
                        top_ids=packed[..., 3:3 + k].copy(),
                        top_logprobs=floats(packed[..., 3 + k:]),
                        proposed_logprobs=floats(packed[..., 2]))
