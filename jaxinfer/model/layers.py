"""Transformer building blocks: RMSNorm, RoPE, SwiGLU/GeGLU MLP, embedding, linear.

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
from jaxinfer.model import fusion, invariance, lora, quantization, yarn
from jaxinfer.model.quantization import QuantizedWeight
from jaxinfer.pallas.row_sum import row_sum


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
    its mode says (jaxinfer/model/quantization.py), an adapted one adds each token's
    LoRA delta (model/lora.py). In batch-invariant mode, by blocks of rows
    (model/invariance.py)."""
    if isinstance(w, lora.AdaptedWeight):
        return linear(x, w.base, b) + w.delta(x)
    if invariance.active():
        with invariance.rows_in_blocks(False):
            return invariance.map_rows(lambda rows: linear(rows, w, b), x)
    if isinstance(w, QuantizedWeight):
        y = quantization.linear(x, w)
    else:
        y = jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return y if b is None else y + b.astype(jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis scaled by (offset + weight), computed in float32 as HF
    does (Gemma: offset 1)."""
    x = x.astype(jnp.float32)
    mean_square = row_sum(x * x)[..., None] / x.shape[-1]
    x = x * jax.lax.rsqrt(mean_square + eps)
    return x * (offset + weight.astype(jnp.float32))


def norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The model's RMSNorm: cfg's epsilon and weight offset."""
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_weight_offset)


def embed(table: jax.Array, token_ids: jax.Array, scale: bool = False) -> jax.Array:
    """Rows of the embedding table [V, D] for `token_ids` -> f32[..., D]; with `scale`,
    times sqrt(D) rounded to the table's dtype first, as HF's Gemma does (55.5, not
    55.4256, for D = 3072 in bfloat16), and multiplied in that dtype."""
    rows = table[token_ids]
    if scale:
        rows = rows * jnp.asarray(np.float32(table.shape[-1] ** 0.5), rows.dtype)
    return rows.astype(jnp.float32)


def mlp(layer: dict[str, jax.Array], x: jax.Array, act: str = "silu") -> jax.Array:
    """A dense layer's gated MLP: SwiGLU, or GeGLU with `act` gelu_pytorch_tanh."""
    return swiglu(x, layer["w_gate_up"], layer["w_down"], act)


def swiglu(x: jax.Array, w_gate_up: jax.Array | QuantizedWeight,
           w_down: jax.Array | QuantizedWeight, act: str = "silu") -> jax.Array:
    """down(act(gate(x)) * up(x)), gate and up from one fused matmul whose columns
    interleave them in blocks (model/fusion.py): [..., F / B, 2, B]. `act`: silu, or
    gelu_pytorch_tanh (jax's approximate GELU is the same tanh formula)."""
    f = w_down.shape[0]
    block = fusion.mlp_block(f)
    gate_up = linear(x, w_gate_up).reshape(*x.shape[:-1], f // block, 2, block)
    gate = gate_up[..., 0, :]
    gate = jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)
    hidden = gate * gate_up[..., 1, :]
    return linear(hidden.reshape(*x.shape[:-1], f), w_down)


def rope_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The distinct RoPE kinds of cfg's layers (ModelConfig.layer_rope), in layer order."""
    return tuple(dict.fromkeys(cfg.layer_rope(i) for i in range(cfg.num_layers)))


def rope_inv_freq(cfg: ModelConfig, kind: str = "global") -> np.ndarray:
    """Inverse frequencies f32[H/2] of the layers of RoPE `kind`: "global" with cfg's
    scaling (Llama-3's or linear) when configured, "local" at rope_local_theta unscaled."""
    half = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32)
    theta = cfg.rope_local_theta if kind == "local" else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (half / cfg.head_dim))
    scaling = None if kind == "local" else cfg.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "yarn":
        return yarn.inv_freq(cfg.head_dim, theta, scaling)
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


def rope_scale(cfg: ModelConfig, kind: str = "global") -> float:
    """The factor on cos and sin of RoPE `kind`: YaRN's attention factor, else 1."""
    scaling = None if kind == "local" else cfg.rope_scaling
    return scaling.cos_sin_scale() if scaling is not None and scaling.rope_type == "yarn" \
        else 1.0


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[..., 1, H] of positions i32[...], times `scale` (rope_scale):
    computed once per step and RoPE kind, shared by that kind's layers."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE of x f[..., heads, H] with `rope_tables` of its positions -> f32."""
    cos, sin = rope
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
