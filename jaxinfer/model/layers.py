"""Transformer building blocks: RMSNorm, RoPE, SwiGLU MLP, embedding, linear.

Matmuls take weights in their storage dtype (float32 or bfloat16) and
accumulate in float32 (`preferred_element_type`), the fast path on CPU and the
accurate one everywhere; activations between blocks stay float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion, quantization
from jaxinfer.model.quantization import QuantizedWeight


def min_matmul_rows(dtype: jnp.dtype, quantization: str | None = None) -> int:
    """Fewest rows for a fast matmul with weights of `dtype` on XLA:CPU: a bf16 dot of one
    row converts the whole weight to f32 first (~13x slower, measured on the SmolLM
    shape); two rows take the fused bf16 path, and the same holds for int8 x int8 (one
    row 79 ms, two 6 ms for 30 gate/up matmuls of that shape). f32 needs no padding:
    extra rows only add compute (16 rows cost 2x one row at batch 1)."""
    return 2 if jnp.dtype(dtype) == jnp.bfloat16 or quantization is not None else 1


def linear(x: jax.Array, w: jax.Array | QuantizedWeight,
           b: jax.Array | None = None) -> jax.Array:
    """x f[..., I] @ w [I, O] (+ b [O]) -> f32[..., O]; a quantized weight computes as
    its mode says (jaxinfer/model/quantization.py)."""
    if isinstance(w, QuantizedWeight):
        y = quantization.linear(x, w)
    else:
        y = jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return y if b is None else y + b.astype(jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 as HF does."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * weight.astype(jnp.float32)


def embed(table: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Rows of the embedding table [V, D] for `token_ids` -> f32[..., D]."""
    return table[token_ids].astype(jnp.float32)


def mlp(layer: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A dense layer's SwiGLU MLP."""
    return swiglu(x, layer["w_gate_up"], layer["w_down"])


def swiglu(x: jax.Array, w_gate_up: jax.Array | QuantizedWeight,
           w_down: jax.Array | QuantizedWeight) -> jax.Array:
    """down(silu(gate(x)) * up(x)), gate and up from one fused matmul whose columns
    interleave them in blocks (model/fusion.py): [..., F / B, 2, B]."""
    f = w_down.shape[0]
    block = fusion.mlp_block(f)
    gate_up = linear(x, w_gate_up).reshape(*x.shape[:-1], f // block, 2, block)
    hidden = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
    return linear(hidden.reshape(*x.shape[:-1], f), w_down)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies f32[H/2], with Llama-3 scaling when configured."""
    half = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32)
    inv_freq = 1.0 / (cfg.rope_theta ** (half / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[..., 1, H] of positions i32[...]: computed once per step and
    shared by every layer."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE of x f[..., heads, H] with `rope_tables` of its positions -> f32."""
    cos, sin = rope
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
