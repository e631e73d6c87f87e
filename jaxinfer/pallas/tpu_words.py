"""K and V out of the 32-bit words the TPU kernel copies (see `kv_layout.py`).

The Mosaic kernel copies whole 32-bit words of KV pages into VMEM and reads them as
uint32 (`pltpu.bitcast`): a word holds one float32 combined head, or two bfloat16 ones
(K in the low half, V in the high half), or four 8-bit ones (K0, V0, K1, V1 from the
low byte up); `dequantize` then applies the scale (scalar or per token). Unpacking with shifts keeps
every load and vector op 32-bit, which Mosaic compiles on v5e, v5p and v6e, and which
the TPU interpreter runs on CPU. `fold` flattens a query block the same packing-aware
way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu


def unpack_kv(words: list[jax.Array], head: int, dtype: jnp.dtype
              ) -> tuple[jax.Array, jax.Array]:
    """K and V of the program's `head`-th KV head from its u32 words, as stored (f32 for
    32/16-bit pages, the 8-bit dtype for 8-bit pages). See the module doc for the packing.
    """
    if len(words) == 2:  # float32: one word each
        return pltpu.bitcast(words[0], jnp.float32), pltpu.bitcast(words[1], jnp.float32)
    (word,) = words
    if jnp.dtype(dtype).itemsize == 2:  # bfloat16: K low half, V high half; exact in f32
        k = pltpu.bitcast(lax.shift_left(word, jnp.uint32(16)), jnp.float32)
        return k, pltpu.bitcast(word & jnp.uint32(0xFFFF0000), jnp.float32)

    def byte(index: int) -> jax.Array:
        shifted = lax.shift_right_logical(word, jnp.uint32(8 * index))
        return pltpu.bitcast(shifted.astype(jnp.uint8), dtype)

    return byte(2 * head), byte(2 * head + 1)


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
