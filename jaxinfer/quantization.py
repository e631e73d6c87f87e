"""Quantized linear weights: the pytree, quantize_params(), and the matmuls that use them.

Modes (`EngineConfig.quantization`), all symmetric with one float32 scale per output
channel, applied to the four linear weights of every layer (`wqkv`, `wo`,
`w_gate_up`, `w_down`):
- "int8": int8 weights, weight-only: the matmul dequantizes them to bfloat16 inside
  the dot (activations bfloat16, f32 accumulation). XLA fuses the convert into the dot
  on TPU and GPU; XLA:CPU materializes the converted weight every step, so on CPU
  use "w8a8".
- "w8a8": int8 weights, and activations quantized per token on the fly (symmetric,
  max |x| / 127), `int8 x int8 -> int32` dots, rescaled by both scales: the fast path
  on CPU (JAX_ON_CPU.md) and on the MXU of TPU v5e/v6e.
- "fp8": float8_e4m3fn weights (max 448), weight-only like "int8".
The embedding and the LM head stay in the model's dtype: the embedding is a gather
(a step reads only its rows), and a tied table serves as both, so quantizing the head
would add a second copy; its logits also set every sampling decision.

A quantized weight is a registered dataclass (`QuantizedWeight`: value [I, O],
scale [O]) inside the usual params dict, so jit, sharding and orbax handle it like
any array pair; `partition_specs` derives its specs from the float weight's (the
value as the weight, the scale along the output columns). Imports jax, numpy and
ml_dtypes and jaxinfer.config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.config import QUANTIZATION_MODES

MODES = QUANTIZATION_MODES
QUANTIZED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")
STORAGE = {"int8": jnp.int8, "w8a8": jnp.int8, "fp8": jnp.float8_e4m3fn}
INT8_MAX = 127.0
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight w[I, O] ~= value * scale (per output column)."""

    value: jax.Array  # int8 | float8_e4m3fn [I, O]
    scale: jax.Array  # f32[O]
    mode: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the weight computes in (activations cast to it): bfloat16."""
        return jnp.dtype(jnp.bfloat16)


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"quantization={mode!r} must be one of {MODES} or None")


def quantize(w: jax.Array, mode: str) -> QuantizedWeight:
    """w [I, O] -> QuantizedWeight with per-column scales (a zero column gets scale 1)."""
    w = w.astype(jnp.float32)
    top = INT8_MAX if STORAGE[mode] == jnp.int8 else FP8_MAX
    amax = jnp.max(jnp.abs(w), axis=0)
    # times the reciprocal, as XLA rewrites a division by a constant: numpy can match it
    scale = jnp.where(amax > 0, amax * np.float32(1 / top), 1.0).astype(jnp.float32)
    scaled = w / scale
    if STORAGE[mode] == jnp.int8:
        value = jnp.clip(jnp.round(scaled), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    else:
        value = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return QuantizedWeight(value, scale, mode)


def quantize_numpy(w: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The numpy twin of `quantize` (value, scale), for exactness tests."""
    w = w.astype(np.float32)
    top = np.float32(INT8_MAX if STORAGE[mode] == jnp.int8 else FP8_MAX)
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax * np.float32(1 / top), np.float32(1)).astype(np.float32)
    scaled = w / scale
    if STORAGE[mode] == jnp.int8:
        return np.clip(np.round(scaled), -127, 127).astype(np.int8), scale
    return np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn), scale


def dequantize(w: QuantizedWeight) -> jax.Array:
    return w.value.astype(jnp.float32) * w.scale


def quantize_params(params: dict, mode: str) -> dict:
    """The params with every layer's linear weights quantized (jittable)."""
    layers = [{name: quantize(value, mode) if name in QUANTIZED_WEIGHTS else value
               for name, value in layer.items()} for layer in params["layers"]]
    return params | {"layers": layers}


def partition_specs(specs: dict, mode: str | None) -> dict:
    """The float params' specs (transformer.param_partition_specs) for quantized params:
    a quantized weight's value is split as the weight, its scale as its columns."""
    if mode is None:
        return specs
    layers = [{name: _weight_spec(spec, mode) if name in QUANTIZED_WEIGHTS else spec
               for name, spec in layer.items()} for layer in specs["layers"]]
    return specs | {"layers": layers}


def _weight_spec(spec: P, mode: str) -> QuantizedWeight:
    columns = spec[1] if len(spec) > 1 else None
    return QuantizedWeight(spec, P(columns), mode)


def linear(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x f[..., I] @ w -> f32[..., O], by the weight's mode (see the module docstring)."""
    if w.mode == "w8a8":
        x = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
        xq = jnp.clip(jnp.round(x / x_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        y = jnp.matmul(xq, w.value, preferred_element_type=jnp.int32)
        return y.astype(jnp.float32) * x_scale * w.scale
    y = jnp.matmul(x.astype(jnp.bfloat16), w.value.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y * w.scale


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def mode_of(params: dict) -> str | None:
    """The quantization of a params tree (arrays or specs), None when float."""
    modes = {w.mode for layer in params["layers"] for w in layer.values() if is_quantized(w)}
    if len(modes) > 1:
        raise ValueError(f"params mix quantization modes {sorted(modes)}")
    return modes.pop() if modes else None
