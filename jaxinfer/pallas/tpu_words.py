"""K and V out of the 32-bit words the TPU kernel copies, read as uint32 and unpacked
with lane slices and shifts (every load and vector op stays 32-bit); `dequantize`
applies a scalar or per-token scale, `fold` folds a query block alike. See
docs/kernels.md (#kv-layout, #the-tpu-kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu


def unpack_kv(words: list[jax.Array], head: int, dtype: jnp.dtype, head_dim: int
              ) -> tuple[jax.Array, jax.Array]:
    """K and V [kv_block, H] of the program's `head`-th KV head from its u32 words
    [kv_block, L], as stored (f32 for 32/16-bit pages, the 8-bit dtype for 8-bit pages).
    Combined head c of the program is lanes [j * H, (j + 1) * H) of row p of word w,
    c = (w * packing + p) * fold + j (kv_layout.py)."""
    return (_combined(words, 2 * head, dtype, head_dim),
            _combined(words, 2 * head + 1, dtype, head_dim))


def _combined(words: list[jax.Array], index: int, dtype: jnp.dtype, head_dim: int
              ) -> jax.Array:
    """The program's combined head `index` out of its words (see `unpack_kv`)."""
    itemsize = jnp.dtype(dtype).itemsize
    fold = words[0].shape[1] // head_dim
    word, rest = divmod(index, (4 // itemsize) * fold)
    row, part = divmod(rest, fold)
    x = words[word]
    if fold > 1:  # a static lane slice: the head's H lanes of the row
        x = x[:, part * head_dim:(part + 1) * head_dim]
    if itemsize == 4:
        return pltpu.bitcast(x, jnp.float32)
    if itemsize == 2:  # bfloat16 bits into the high half of an f32: exact
        high = lax.shift_left(x, jnp.uint32(16)) if row == 0 else x & jnp.uint32(0xFFFF0000)
        return pltpu.bitcast(high, jnp.float32)
    shifted = lax.shift_right_logical(x, jnp.uint32(8 * row))
    return pltpu.bitcast(shifted.astype(jnp.uint8), dtype)


def dequantize(x: jax.Array, scale: float | jax.Array | None, dtype: jnp.dtype
               ) -> jax.Array:
    """Unpacked K or V in the queries' dtype, times its scale (8-bit pages): a scalar, or
    a column f32[rows, 1] of per-token scales."""
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale).astype(dtype)


def scale_columns(block: jax.Array, head: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K and V scale columns f32[kv_block, 1] of KV head `head` (dynamic: a program id)
    from a block's scales of every head f32[kv_block, C] (K of head g at lane 2g, V at
    2g + 1): a masked lane sum, as a dynamic lane slice does not lower."""
    lane = lax.broadcasted_iota(jnp.int32, block.shape, 1)

    def column(index: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(lane == index, block, 0.0), axis=1, keepdims=True)

    return column(2 * head), column(2 * head + 1)


def fold(x: jax.Array) -> jax.Array:
    """f[bq, R, H] -> f[bq * R, H] (through f32 when R splits packed rows)."""
    tokens, heads, head_dim = x.shape
    if tokens == 1:
        return x.reshape(heads, head_dim)
    packing = 4 // x.dtype.itemsize
    if heads % packing:
        return x.astype(jnp.float32).reshape(tokens * heads, head_dim).astype(x.dtype)
    return x.reshape(tokens * heads, head_dim)
