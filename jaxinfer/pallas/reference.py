"""Pure-jnp twins of the Pallas kernels: the path the engine runs on CPU/XLA.

Imports only jax and numpy (nothing from jaxinfer), like the kernels beside it.

`ragged_paged_attention` keeps the contract of JAX's
`ref_ragged_paged_attention` (tpu-inference's layout): queries f[T, N, H]; KV
pages [P, K, 2G, H] with K at even and V at odd combined heads; `kv_lens`
counts this step's tokens; causal masking aligns each request's queries to the
end of its KV. It is vectorised: every token gathers the pages of its own
request, in blocks of tokens sized to bound the gathered bytes, so any mix of
prefill chunks and decode tokens runs in one call with no loop over requests.
Rows past `cu_q_lens[num_seqs]` are padding and come back as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
GATHER_BYTES_PER_BLOCK = 128 * 1024 * 1024  # bound on KV gathered per token block


def write_kv_pages(
    kv_pages: jax.Array,  # [P, K, 2G, H]
    new_k: jax.Array,  # [T, G, H]
    new_v: jax.Array,  # [T, G, H]
    slot_mapping: jax.Array,  # i32[T], page * K + offset; padding rows -> page 0
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """Scatter this step's K/V into their page slots, K/V interleaved on heads."""
    num_pages, page_size, combined, head_dim = kv_pages.shape
    tokens = new_k.shape[0]
    new_k = _quantize(new_k, k_scale, kv_pages.dtype)
    new_v = _quantize(new_v, v_scale, kv_pages.dtype)
    kv = jnp.stack([new_k, new_v], axis=2).reshape(tokens, combined, head_dim)
    flat = kv_pages.reshape(num_pages * page_size, combined, head_dim)
    flat = flat.at[slot_mapping].set(kv, mode="drop")
    return flat.reshape(kv_pages.shape)


def _quantize(x: jax.Array, scale: float | None, dtype: jnp.dtype) -> jax.Array:
    if scale is not None:
        x = x.astype(jnp.float32) / scale
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        x = jnp.clip(jnp.round(x), info.min, info.max)
    return x.astype(dtype)


def ragged_paged_attention(
    queries: jax.Array,  # f[T, N, H]
    kv_pages: jax.Array,  # [P, K, 2G, H]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:  # f[T, N, H]
    """Attention of each token over the paged KV of its own request."""
    tokens, num_heads, head_dim = queries.shape
    _, page_size, combined, _ = kv_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    context = pages_per_seq * page_size
    token = jnp.arange(tokens, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)
    req = jnp.minimum(req, num_slots - 1)  # i32[T]
    q_start = cu_q_lens[req]
    q_len = cu_q_lens[req + 1] - q_start
    kv_len = jnp.where(token < cu_q_lens[num_seqs[0]], kv_lens[req], 0)  # padding: none
    q_pos = kv_len - q_len + token - q_start  # i32[T], position of the query in its KV
    rows = page_indices[req]  # i32[T, pages_per_seq]
    settings = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                    mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value,
                    k_scale=k_scale, v_scale=v_scale, num_kv_heads=combined // 2)
    block = _token_block(tokens, context * combined * head_dim * kv_pages.dtype.itemsize)

    def attend_block(xs: tuple[jax.Array, ...]) -> jax.Array:
        return _attend_tokens(*xs, kv_pages, **settings)

    xs = (queries, rows, kv_len, q_pos)
    if block == tokens:
        return attend_block(xs)
    blocked = jax.tree.map(lambda x: x.reshape(tokens // block, block, *x.shape[1:]), xs)
    out = jax.lax.map(attend_block, blocked)
    return out.reshape(tokens, num_heads, head_dim)


def _token_block(tokens: int, bytes_per_token: int) -> int:
    """All tokens if their gathered KV fits the budget, else a power-of-two divisor."""
    if tokens * bytes_per_token <= GATHER_BYTES_PER_BLOCK:
        return tokens
    block = tokens & -tokens  # largest power of two dividing `tokens`
    while block > 1 and block * bytes_per_token > GATHER_BYTES_PER_BLOCK:
        block //= 2
    return block


def _attend_tokens(
    q: jax.Array,  # f[Tb, N, H]
    rows: jax.Array,  # i32[Tb, pages_per_seq]
    kv_len: jax.Array,  # i32[Tb]
    q_pos: jax.Array,  # i32[Tb]
    kv_pages: jax.Array,  # [P, K, 2G, H]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    k_scale: float | None,
    v_scale: float | None,
    num_kv_heads: int,
) -> jax.Array:
    tokens, num_heads, head_dim = q.shape
    kv = kv_pages[rows]  # [Tb, pages_per_seq, K, 2G, H]
    kv = kv.reshape(tokens, -1, 2 * num_kv_heads, head_dim)  # [Tb, C, 2G, H]
    pos = jnp.arange(kv.shape[1], dtype=jnp.int32)[None, :]  # [1, C]
    present = pos < kv_len[:, None]  # [Tb, C]: slots holding real KV
    k = _dequantize(kv[:, :, 0::2], k_scale, q.dtype)
    v = _dequantize(kv[:, :, 1::2], v_scale, q.dtype)
    v = jnp.where(present[:, :, None, None], v, 0)  # unused slots may hold NaN
    qg = q.reshape(tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("tgrh,tcgh->tgrc", qg, k, preferred_element_type=jnp.float32)
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    visible = present & (pos <= q_pos[:, None])
    if sliding_window is not None:
        visible &= pos > q_pos[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, mask_value)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("tgrc,tcgh->tgrh", probs, v, preferred_element_type=jnp.float32)
    out = jnp.where((kv_len > 0)[:, None, None, None], out, 0)
    return out.reshape(tokens, num_heads, head_dim).astype(q.dtype)


def _dequantize(x: jax.Array, scale: float | None, dtype: jnp.dtype) -> jax.Array:
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale).astype(dtype)
