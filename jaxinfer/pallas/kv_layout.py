"""The layout of KV pages, `[P, K, W, packing, L]`: K and V of every KV head interleaved
on a combined-head axis and packed into 32-bit words, `fold` heads to a row's lanes for
head_dim below 128; row-major, a free reshape of `[P, K, 2G, H]` (`combined_view`).
What each axis holds and why packing and fold: docs/kernels.md#kv-layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 128  # the TPU's lane tile: the minor dimension is padded to a multiple of it


def packing(dtype: jnp.dtype) -> int:
    """Combined heads per 32-bit word: 1 (32-bit), 2 (16-bit), 4 (8-bit)."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise ValueError(f"KV dtype {jnp.dtype(dtype).name} must be 8, 16 or 32 bits wide")
    return 4 // itemsize


def fold(num_kv_heads: int, head_dim: int, dtype: jnp.dtype) -> int:
    """Combined heads side by side on a row's lanes: 128 // H for H < 128 when the
    combined heads fill whole words so, else 1."""
    lanes = LANES // head_dim if head_dim < LANES and LANES % head_dim == 0 else 1
    return lanes if (2 * num_kv_heads) % (packing(dtype) * lanes) == 0 else 1


def num_words(num_kv_heads: int, dtype: jnp.dtype, head_dim: int = LANES) -> int:
    """W: words per token holding the K and V rows of `num_kv_heads` heads."""
    per_word = packing(dtype) * fold(num_kv_heads, head_dim, dtype)
    return -(-2 * num_kv_heads // per_word)


def padded_heads_for(num_kv_heads: int, dtype: jnp.dtype, head_dim: int = LANES) -> int:
    """Combined heads stored per token for `num_kv_heads` heads: W * packing * fold."""
    return (num_words(num_kv_heads, dtype, head_dim) * packing(dtype)
            * fold(num_kv_heads, head_dim, dtype))


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: jnp.dtype) -> tuple[int, int, int, int, int]:
    """The shape of one layer's pages: (P, K, W, packing, fold * H)."""
    lanes = fold(num_kv_heads, head_dim, dtype) * head_dim
    return (num_pages, page_size, num_words(num_kv_heads, dtype, head_dim), packing(dtype),
            lanes)


def combined_view(kv_pages: jax.Array, head_dim: int) -> jax.Array:
    """[P, K, W, packing, L] -> [P, K, C, H]: the combined-head axis, padding included
    (a free reshape in row-major order)."""
    return kv_pages.reshape(*kv_pages.shape[:2], -1, head_dim)


def padded_heads(kv_pages: jax.Array, head_dim: int) -> int:
    """Combined heads the pages have room for, padding included: W * packing * fold."""
    return kv_pages.shape[2] * kv_pages.shape[3] * kv_pages.shape[4] // head_dim
