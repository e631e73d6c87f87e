"""8-bit KV pages with dynamic scales per token and KV head: quantize on write.

int8 and float8_e4m3fn pages keep one float32 scale per token and combined head, in an
array laid out like the pages without the head dim (`kv_layout.py`):

    kv_scales: f32[P, K, C],  C = 2G: the K scale of head g at 2g, the V scale at 2g + 1

Page slot (p, k) of the scales belongs to page slot (p, k) of the pages, so whatever
moves, shares or frees a page (prefix caching, preemption) carries its scales along.
The cache update (`write_quantized_kv`) computes each new token's scale from its own
row, `max|x| / 127` (int8) or `max|x| / 448` (fp8; a zero row gets scale 1), and never
touches earlier tokens. Readers multiply a K or V row by its scale after unpacking it.
Only the real heads have scales (the padded heads of 8-bit pages with an odd head count
are never read).

Why per token and head, not per page and head. Measured on the bundled demo model
(checkpoints/demo, G=1, H=64, pages of 16 tokens) over the float K/V of all 6 layers
for 4 held-out windows of 256 tokens (`benchmarks/kv_quant_accuracy.py --mode=scales`;
errors are rms relative to the float rms; "attention": causal attention output with
each position's key as its query):

    scales               int8 K/V   int8 attention   fp8 K/V   fp8 attention
    per token and head    0.89%       0.83%           2.30%     3.61%
    per page and head     1.11%       1.13%           2.61%     5.28%

Per-page scales were measured at their best, as if every page's maximum were known
when its first token is written; a real per-page scheme must either re-quantize a
page's earlier tokens when a later token raises its maximum (a read-modify-write of the
page every step) or fix the scale ahead (calibration, which clips outliers). Per-token
scales are both more accurate (one outlier token no longer coarsens its 15 neighbours;
fp8's attention error drops by a third) and simpler: a write touches only its own
slot. Held-out loss through the engine (`--mode=loss`, 16 windows of 256 tokens):
perplexity 7.2689 float32, 7.2652 int8 (-0.05%), 7.2798 fp8 (+0.15%). They cost 4 bytes
per token and combined head beside H bytes of values: for H=128 an int8 token takes
132/256 of a bf16 one (1.94x the pages for the same memory, `planner.kv_bytes_per_token`;
the demo's single KV head pads to a 4-head word, so there int8 saves nothing).

TPU cost of this layout (measured with libtpu's AOT compiler, tests/tpu_aot): XLA keeps
f32[P, K, 2G] with its minor axis padded to 128 lanes around the scatter and the
kernel, so a step holds a temporary the size of one layer's scales x 128 / 2G (246 MB for
Qwen3-0.6B's shape with a 2 GB pool; the whole-chip pool runs out of HBM). A layout with
the keys on lanes (e.g. [P, 2G, K] with K >= 128, or the scales packed into the page
words) would avoid it; not done yet.

Why a new array input beside the scalar `k_scale`/`v_scale`, not in their place. The
scalar pair is the contract of JAX's `ref_ragged_paged_attention` (static, calibrated
scales) and stays as it is; `kv_scales` is the engine's dynamic path. The two are
exclusive (`dispatch.validate_inputs`): 8-bit pages need one or the other.
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
