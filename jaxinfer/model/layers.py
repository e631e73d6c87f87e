"""Transformer building blocks: RMSNorm, RoPE, SwiGLU MLP, embedding, linear.

Matmuls take weights in their storage dtype (float32 or bfloat16) and
accumulate in float32 (`preferred_element_type`), the fast path on CPU and the
accurate one everywhere; activations between blocks stay float32.
Imports jax, numpy and jaxinfer.config only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x f[..., I] @ w [I, O] (+ b [O]) -> f32[..., O]."""
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
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = linear(x, layer["w_gate"])
    up = linear(x, layer["w_up"])
    return linear(jax.nn.silu(gate) * up, layer["w_down"])


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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE of x f[T, heads, H] at positions i32[T] -> f32."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # f32[T, 1, H]
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)
