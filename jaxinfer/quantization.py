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
The LM head is quantized too, in the same mode, with one scale per vocabulary row
(`lm_head`, value [V, D]): at batch 1 it is the largest single read of a small model
(SmolLM-135M: 28 M of its 135 M parameters). With tied embeddings that is a second,
quantized copy of the table: the embedding itself stays in the model's dtype, since a
step gathers only its rows (T x D bytes) and a quantized gather would save nothing.
Whether the head's rounding costs accuracy is measured by eval_ppl (README).

A quantized weight is a registered dataclass (`QuantizedWeight`: value [O, I],
scale [O]) inside the usual params dict, so jit, sharding and orbax handle it like
any array pair; `partition_specs` derives its specs from the float weight's (the
value as the weight, transposed, the scale along the output columns).

Why values are stored [O, I] (HF's layout, the transpose of the float weights'
[I, O]): every matmul then contracts the weight's minor, contiguous axis, which
XLA:CPU's few-row dots read 1.2-1.7x faster than the [I, O] layout, for int8 x int8
and for bfloat16 alike (`benchmarks/bench_matvec.py --layouts`, 30 SmolLM-135M layers:
at 2 rows int8 13.7 vs 22.6 ms, bf16 30.8 vs 46.7 ms; at 4 rows 1.18x and 1.40x).
The float weights keep [I, O]: changing them touches every loader and sharding rule,
and is left for later. Imports jax, numpy and ml_dtypes and jaxinfer.config.
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
HEAD = "lm_head"  # quantized in every mode, a copy of a tied embedding table
LAYOUT_VERSION = 2  # 2: values [O, I] and a quantized head; written beside orbax params
STORAGE = {"int8": jnp.int8, "w8a8": jnp.int8, "fp8": jnp.float8_e4m3fn}
INT8_MAX = 127.0
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight w[I, O] ~= (value * scale[:, None]).T (value stored [O, I])."""

    value: jax.Array  # int8 | float8_e4m3fn [O, I]
    scale: jax.Array  # f32[O]
    mode: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight's shape [I, O]."""
        return self.value.shape[::-1]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the weight computes in (activations cast to it): bfloat16."""
        return jnp.dtype(jnp.bfloat16)


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"quantization={mode!r} must be one of {MODES} or None")


def quantize(w: jax.Array, mode: str) -> QuantizedWeight:
    """w [I, O] -> QuantizedWeight with per-column scales (a zero column gets scale 1),
    its value stored [O, I]."""
    w = w.astype(jnp.float32).T
    top = INT8_MAX if STORAGE[mode] == jnp.int8 else FP8_MAX
    amax = jnp.max(jnp.abs(w), axis=1)
    # times the reciprocal, as XLA rewrites a division by a constant: numpy can match it
    scale = jnp.where(amax > 0, amax * np.float32(1 / top), 1.0).astype(jnp.float32)
    scaled = w / scale[:, None]
    if STORAGE[mode] == jnp.int8:
        value = jnp.clip(jnp.round(scaled), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    else:
        value = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return QuantizedWeight(value, scale, mode)


def quantize_numpy(w: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The numpy twin of `quantize` (value [O, I], scale [O]), for exactness tests."""
    w = w.astype(np.float32).T
    top = np.float32(INT8_MAX if STORAGE[mode] == jnp.int8 else FP8_MAX)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax * np.float32(1 / top), np.float32(1)).astype(np.float32)
    scaled = w / scale[:, None]
    if STORAGE[mode] == jnp.int8:
        return np.clip(np.round(scaled), -127, 127).astype(np.int8), scale
    return np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn), scale


def dequantize(w: QuantizedWeight) -> jax.Array:
    """The f32 [I, O] weight a quantized one stands for."""
    return (w.value.astype(jnp.float32) * w.scale[:, None]).T


def quantize_params(params: dict, mode: str) -> dict:
    """The params with every layer's linear weights and the LM head quantized
    (jittable); a tied head becomes a quantized copy of the embedding table."""
    layers = [{name: quantize(value, mode) if name in QUANTIZED_WEIGHTS else value
               for name, value in layer.items()} for layer in params["layers"]]
    head = params[HEAD] if HEAD in params else params["embed"].T  # [D, V]
    return params | {"layers": layers, HEAD: quantize(head, mode)}


def partition_specs(specs: dict, mode: str | None) -> dict:
    """The float params' specs (transformer.param_partition_specs) for quantized params:
    a quantized weight's value [O, I] is split as the weight transposed, its scale as
    the weight's columns."""
    if mode is None:
        return specs
    layers = [{name: _weight_spec(spec, mode) if name in QUANTIZED_WEIGHTS else spec
               for name, spec in layer.items()} for layer in specs["layers"]]
    head = specs[HEAD] if HEAD in specs else P(*reversed(tuple(specs["embed"])))
    return specs | {"layers": layers, HEAD: _weight_spec(head, mode)}


def _weight_spec(spec: P, mode: str) -> QuantizedWeight:
    rows, columns = (tuple(spec) + (None, None))[:2]
    return QuantizedWeight(P(columns, rows), P(columns), mode)


def linear(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x f[..., I] @ w -> f32[..., O], by the weight's mode (see the module docstring)."""
    if w.mode == "w8a8":
        x = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
        xq = jnp.clip(jnp.round(x / x_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        y = jnp.einsum("...i,oi->...o", xq, w.value, preferred_element_type=jnp.int32)
        return y.astype(jnp.float32) * x_scale * w.scale
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.bfloat16), w.value.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y * w.scale


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def mode_of(params: dict) -> str | None:
    """The quantization of a params tree (arrays or specs), None when float."""
    weights = [w for layer in params["layers"] for w in layer.values()]
    modes = {w.mode for w in [*weights, params.get(HEAD)] if is_quantized(w)}
    if len(modes) > 1:
        raise ValueError(f"params mix quantization modes {sorted(modes)}")
    return modes.pop() if modes else None
