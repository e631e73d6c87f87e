"""The layout of KV pages: `[P, K, W, packing, H]`, K and V of each head in one 32-bit word.

A KV page holds `K` tokens; each token's K and V rows of every KV head form the
combined-head axis `C = 2G` (K of head g at `2g`, V at `2g + 1`, the order of JAX's
`ref_ragged_paged_attention`). That axis is split into `W` words of `packing`
combined heads, where `packing = 4 // itemsize` (1 for float32, 2 for bfloat16 and its
uint16 storage, 4 for int8 and float8_e4m3fn), padded up to whole words. So

    kv_pages: [P, K, W, packing, H],  W = ceil(2G / packing)

Why. On a TPU the two minor dimensions of an array are tiled, and a packed dtype keeps
`packing` rows of the second-minor dimension in one 32-bit word. With the old
`[P, K, 2G, H]` layout, copying one KV head's K rows sliced the tiled combined-head
axis at an offset that is not a whole tile, which Mosaic rejects for every dtype but
float32 ("Offsets along tiled dimensions must be aligned to tiles"). With the packing
axis as the second-minor dimension, a copy selects whole words (an untiled axis) and the
kernel unpacks K and V from the 32-bit words with shifts. tpu-inference and JAX's RPA v3
store pages the same way.

In row-major order `[P, K, W, packing, H]` is `[P, K, W * packing, H]`: on CPU and GPU
the reference and the Triton kernel see the familiar combined-head axis through a free
reshape (`combined_view`). Padding exists only for 8-bit pages with an odd number of KV
heads (per shard, under tensor parallelism): the padded heads are written as zeros and
never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packing(dtype: jnp.dtype) -> int:
    """Combined heads per 32-bit word: 1 (32-bit), 2 (16-bit), 4 (8-bit)."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise ValueError(f"KV dtype {jnp.dtype(dtype).name} must be 8, 16 or 32 bits wide")
    return 4 // itemsize


def num_words(num_kv_heads: int, dtype: jnp.dtype) -> int:
    """W: words per token holding the K and V rows of `num_kv_heads` heads."""
    return -(-2 * num_kv_heads // packing(dtype))


def padded_heads_for(num_kv_heads: int, dtype: jnp.dtype) -> int:
    """Combined heads stored per token for `num_kv_heads` heads: W * packing."""
    return num_words(num_kv_heads, dtype) * packing(dtype)


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: jnp.dtype) -> tuple[int, int, int, int, int]:
    """The shape of one layer's pages: (P, K, W, packing, H)."""
    return (num_pages, page_size, num_words(num_kv_heads, dtype), packing(dtype), head_dim)


def combined_view(kv_pages: jax.Array) -> jax.Array:
    """[P, K, W, packing, H] -> [P, K, W * packing, H]: the combined-head axis, padding
    included (a free reshape)."""
    pages, page_size, words, pack, head_dim = kv_pages.shape
    return kv_pages.reshape(pages, page_size, words * pack, head_dim)


def padded_heads(kv_pages: jax.Array) -> int:
    """Combined heads the pages have room for, padding included: W * packing."""
    return kv_pages.shape[2] * kv_pages.shape[3]
