"""The layout of KV pages: `[P, K, W, packing, L]`, K and V of each head in 32-bit words.

A KV page holds `K` tokens; each token's K and V rows of every KV head form the
combined-head axis `C = 2G` (K of head g at `2g`, V at `2g + 1`, the order of JAX's
`ref_ragged_paged_attention`). In row-major order the pages are always `[P, K, C, H]`
(padding included); that axis is cut into `W` words of `packing` rows of `L` lanes:

    kv_pages: [P, K, W, packing, L],  L = fold * H,  W = ceil(2G / (packing * fold))

`packing = 4 // itemsize` (1 for float32, 2 for bfloat16 and its uint16 storage, 4 for
int8 and float8_e4m3fn) combined heads share a 32-bit word; `fold` consecutive combined
heads sit side by side on the lanes of one row: 1, or 128 // H for a head_dim below 128
(gpt-oss's 64: K of a head in lanes 0-63, its V in lanes 64-127). So combined head
`c = (w * packing + p) * fold + j` is lanes `[j * H, (j + 1) * H)` of row `p` of word `w`.

Why packing. On a TPU the two minor dimensions of an array are tiled, and a packed dtype
keeps `packing` rows of the second-minor dimension in one 32-bit word. With `[P, K, 2G,
H]`, copying one KV head's K rows sliced the tiled combined-head axis at an offset that
is not a whole tile, which Mosaic rejects for every dtype but float32 ("Offsets along
tiled dimensions must be aligned to tiles"). With the packing axis second-minor, a copy
selects whole words (an untiled axis) and the kernel unpacks K and V from the 32-bit
words with shifts. tpu-inference and JAX's RPA v3 store pages the same way.

Why fold. The minor dimension is tiled by 128 lanes. With H = 64 as the minor dimension,
the row-major layout the Mosaic kernel and the K/V scatter need pads every row to 128
lanes (twice the pool), so XLA:TPU kept the donated pool in a compact layout of its own
(pages on the minor axis) and copied it whole into the padded layout and back each step:
two pools of temporaries per layer. With L = 128 nothing pads and nothing is copied.

Because every layout is a reshape of `[P, K, C, H]`, on CPU and GPU the reference and
the Triton kernel read the combined-head axis through a free reshape (`combined_view`).
Padding exists only for 8-bit pages with an odd number of KV heads (per shard, under
tensor parallelism): the padded heads are written as zeros and never read. `fold` stays
1 where it would add padding, so a fold never costs memory.
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
