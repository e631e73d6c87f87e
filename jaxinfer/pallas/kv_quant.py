"""8-bit KV pages (int8, float8_e4m3fn) with a float32 scale per token and combined head,
`kv_scales` f32[P, K, 2G] laid out like the pages; the cache update quantizes each new
token from its own row (`write_quantized_kv`). Why per token and what it costs:
docs/quantization.md#kv-cache, docs/kernels.md#kv-quantization and
docs/benchmarks.md#kv-cache-scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.pallas import reference

QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
NAMES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}


def is_quantized(dtype: jnp.dtype | str) -> bool:
    """Whether KV of `dtype` (a dtype, or a config name such as "fp8") is 8-bit."""
    return storage_dtype(dtype) in QMAX


def storage_dtype(dtype: jnp.dtype | str) -> jnp.dtype:
    """The page dtype a config name or dtype stands for ("fp8" -> float8_e4m3fn)."""
    if isinstance(dtype, str) and dtype in NAMES:
        return NAMES[dtype]
    return jnp.dtype(dtype)


def scales_shape(num_pages: int, page_size: int, num_kv_heads: int) -> tuple[int, int, int]:
    """(P, K, C): the scales of one layer's pages, C = 2 * num_kv_heads."""
    return (num_pages, page_size, 2 * num_kv_heads)


def row_scales(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """f32[...]: max|x| over the last axis / QMAX[dtype]; an all-zero row gets 1. (Times
    the f32 reciprocal, which XLA would substitute anyway: numpy gets the same bits.)"""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    return jnp.where(amax > 0, amax * np.float32(1 / QMAX[jnp.dtype(dtype)]), 1.0)


def quantize(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x f[..., H] / scale f32[...] rounded into `dtype` (int8: round half to even, then
    clipped to +-127; fp8: clipped to +-448, then cast, which rounds to nearest)."""
    qmax = QMAX[jnp.dtype(dtype)]
    y = jnp.clip(x.astype(jnp.float32) / scale[..., None], -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype)


def write_quantized_kv(
    kv_pages: jax.Array,  # int8/fp8[P, K, W, packing, L]
    kv_scales: jax.Array,  # f32[P, K, C]
    new_k: jax.Array,  # f[T, G, H]
    new_v: jax.Array,  # f[T, G, H]
    slot_mapping: jax.Array,  # i32[T], page * K + offset; padding rows -> page 0
) -> tuple[jax.Array, jax.Array]:
    """Quantize this step's K/V with their own scales and scatter values and scales into
    their page slots: (pages, scales)."""
    dtype = kv_pages.dtype
    tokens, num_kv_heads, _ = new_k.shape
    page_size = kv_pages.shape[1]
    k_scale, v_scale = row_scales(new_k, dtype), row_scales(new_v, dtype)  # f32[T, G]
    # Values already on the 8-bit grid, as f32: the float write below keeps them exact.
    k = quantize(new_k, k_scale, dtype).astype(jnp.float32)
    v = quantize(new_v, v_scale, dtype).astype(jnp.float32)
    kv_pages = reference.write_kv_pages(kv_pages, k, v, slot_mapping)
    scales = jnp.stack([k_scale, v_scale], axis=2).reshape(tokens, 2 * num_kv_heads)
    kv_scales = kv_scales.at[slot_mapping // page_size, slot_mapping % page_size].set(
        scales, mode="drop")
    return kv_pages, kv_scales


def quantize_numpy(x: np.ndarray, dtype: jnp.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The numpy twin of `row_scales` + `quantize`: (values in `dtype`, f32 scales)."""
    qmax = QMAX[jnp.dtype(dtype)]
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax > 0, amax * np.float32(1 / qmax), np.float32(1)).astype(np.float32)
    y = np.clip(x / scale[..., None], -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        y = np.round(y)
    return y.astype(dtype), scale
