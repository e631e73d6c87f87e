"""One KV block of an online softmax (`kv_block_update`, from `init_carry`), the
arithmetic the reference's paged attention runs on every path, and the same over whole
sequences for the batch-invariant dense forward (`causal_attention_by_blocks`). See
docs/kernels.md#the-entry-point and docs/rl.md#batch-invariant-mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.pallas.row_sum import row_sum

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# KV positions per step of the online softmax, one size on every path: the running max
# and sum are rescaled at block boundaries, so a size per path rounded a token's
# attention differently with the path its batching sent it down.
KV_BLOCK_TOKENS = 32


def init_carry(shape: tuple[int, ...], mask_value: float, sinks: jax.Array | None
                ) -> tuple[jax.Array, ...]:
    """(running max, sum, acc) before the first KV block, for queries f[..., G, Q * R, H]
    (row q * R + r of KV head g is query head g * R + r).

    A sink is one more logit with no value. Starting the running max at it and the sum
    at exp(sink - sink) = 1 makes every later rescale carry it, so the result is exact
    (the max is taken over the keys and the sink, as in transformers), and the sum is
    never below 1, also for rows that see no key (their output stays 0).
    """
    if sinks is None:
        return (jnp.full(shape[:-1], mask_value, jnp.float32),
                jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape, jnp.float32))
    num_kv_heads, rows = shape[-3], shape[-2]
    per_row = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, -1),
                       (1, rows * num_kv_heads // sinks.shape[0]))  # [G, Q * R]
    return (jnp.broadcast_to(per_row, shape[:-1]), jnp.ones(shape[:-1], jnp.float32),
            jnp.zeros(shape, jnp.float32))


def kv_block_update(
    carry: tuple[jax.Array, ...],  # running max f32[Tb, G, R], sum f32[Tb, G, R], acc
    qg: jax.Array,  # f[Tb, G, R, H]
    k: jax.Array,  # f32[Tb, Cb, G, H] per token, or f32[Cb, G, H] shared by all rows
    v: jax.Array,  # like k
    pos: jax.Array,  # i32[Cb]: KV positions of this block
    kv_len: jax.Array,  # i32[Tb]
    q_pos: jax.Array,  # i32[Tb], or i32[Tb, Q]: R = Q x query heads per KV head
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    k_scale: float | None,
    v_scale: float | None,
    kv_scales: jax.Array | None,
    fixed_order: bool = False,
) -> tuple[jax.Array, ...]:
    """One KV block of the online softmax, per-token KV or one block shared by all rows;
    `fixed_order`: its two dots as products summed by `row_sum`, whose rounding no
    shape changes (XLA:CPU's dots with a head_dim under 64 round by the batch)."""
    del k_scale, v_scale, kv_scales  # applied by _gather_kv
    running_max, total, acc = carry
    shared = k.ndim == 3
    present = pos[None, :] < kv_len[:, None]  # [Tb, Cb]: slots holding real KV
    v = jnp.where((present[0] if shared else present)[..., None, None], v, 0.0)  # NaN-safe
    # Scores as [Tb, G, R, Cb]: with these operand orders both dots lower to XLA:CPU's
    # fast (ynn) path; other orders fall back to a loop of small dots several times slower.
    spec = "tgrh,cgh->tgrc" if shared else "tgrh,tcgh->tgrc"
    if fixed_order:
        kt = (k.transpose(1, 0, 2) if shared else k.transpose(0, 2, 1, 3))[..., None, :, :]
        scores = row_sum(qg.astype(jnp.float32)[..., None, :] * kt) * sm_scale
    else:
        scores = jnp.einsum(spec, qg.astype(jnp.float32), k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    q_pos = q_pos if q_pos.ndim == 2 else q_pos[:, None]  # [Tb, Q]
    visible = present[:, None, :] & (pos <= q_pos[..., None])  # [Tb, Q, Cb]
    if sliding_window is not None:
        visible &= pos > q_pos[..., None] - sliding_window
    tokens, num_queries, block = visible.shape
    if num_queries == 1:
        visible = visible[:, :, None, :]  # [Tb, 1, 1, Cb]
    else:  # [Tb, 1, Q x R, Cb]: query q's R heads share its row
        group = qg.shape[2] // num_queries
        visible = jnp.broadcast_to(visible[:, None, :, None, :], (
            tokens, 1, num_queries, group, block)).reshape(tokens, 1, -1, block)
    scores = jnp.where(visible, scores, mask_value)
    new_max = jnp.maximum(running_max, scores.max(axis=3))  # [Tb, G, R]
    probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
    scale = jnp.exp(running_max - new_max)
    total = total * scale + row_sum(probs)
    if fixed_order:  # [Tb, G, R, H, Cb] products, summed over the block's keys
        vt = (v.transpose(1, 2, 0) if shared else v.transpose(0, 2, 3, 1))[..., None, :, :]
        update = row_sum(probs[..., None, :] * vt)
    else:
        update = jnp.einsum("tgrc,cgh->tgrh" if shared else "tgrc,tcgh->tgrh", probs, v)
    return new_max, total, acc * scale[..., None] + update


def causal_attention_by_blocks(
    q: jax.Array,  # f32[B, T, N, H]
    k: jax.Array,  # f32[B, T, G, H]
    v: jax.Array,  # f32[B, T, G, H]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]
    fixed_order: bool = True,
) -> jax.Array:  # f32[B, T, N, H]
    """Causal attention over whole sequences with the paged path's arithmetic: the same
    online softmax over KV blocks of KV_BLOCK_TOKENS, each query with its own copy of
    the block's KV, so a token's output rounds as the engine's step rounds it (the
    batch-invariant dense forward, docs/rl.md#batch-invariant-mode)."""
    batch, tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    num_blocks = -(-tokens // KV_BLOCK_TOKENS)
    pad = ((0, 0), (0, num_blocks * KV_BLOCK_TOKENS - tokens), (0, 0), (0, 0))
    k, v = jnp.pad(k.astype(jnp.float32), pad), jnp.pad(v.astype(jnp.float32), pad)
    qg = q.reshape(batch * tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    q_pos = jnp.tile(jnp.arange(tokens, dtype=jnp.int32), batch)
    kv_len = jnp.full((batch * tokens,), tokens, jnp.int32)
    carry = init_carry(qg.shape, DEFAULT_MASK_VALUE, sinks)
    for b in range(num_blocks):
        pos = b * KV_BLOCK_TOKENS + jnp.arange(KV_BLOCK_TOKENS, dtype=jnp.int32)
        k_own, v_own = (_each_token_block(x, b, tokens) for x in (k, v))
        carry = kv_block_update(carry, qg, k_own, v_own, pos, kv_len, q_pos,
                                 sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, mask_value=DEFAULT_MASK_VALUE,
                                 k_scale=None, v_scale=None, kv_scales=None,
                                 fixed_order=fixed_order)
    _, total, acc = carry
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(batch, tokens, num_heads, head_dim)


def _each_token_block(x: jax.Array, block: int, tokens: int) -> jax.Array:
    """KV block `block` of x f32[B, T', G, H], one copy per query token:
    f32[B * tokens, KV_BLOCK_TOKENS, G, H] (the step's per-token gather)."""
    rows = x[:, None, block * KV_BLOCK_TOKENS:(block + 1) * KV_BLOCK_TOKENS]
    batch, _, width, heads, head_dim = rows.shape
    return jnp.broadcast_to(rows, (batch, tokens, width, heads, head_dim)).reshape(
        batch * tokens, width, heads, head_dim)
