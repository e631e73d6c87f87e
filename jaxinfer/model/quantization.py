"""Quantized linear weights: the `QuantizedWeight` pytree, `quantize_params` (int8, w8a8,
fp8, int4; the LM head too; MoE experts via `quantize_experts`; mxfp4: the experts alone,
packed as gpt-oss publishes them, model/mxfp4.py), their partition specs and byte counts,
and the matmuls that use them. Modes, layouts and why: docs/quantization.md#weights;
measured: docs/benchmarks.md#quantization.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.config import QUANTIZATION_MODES, ModelConfig
from jaxinfer.model import mxfp4, params_table

MODES = QUANTIZATION_MODES
QUANTIZED_WEIGHTS = params_table.QUANTIZED
EXPERT_WEIGHTS = params_table.EXPERTS
HEAD = "lm_head"  # quantized in every mode, a copy of a tied embedding table
LAYOUT_VERSION = 2  # 2: values [O, I] and a quantized head; written beside orbax params
STORAGE = {"int8": jnp.int8, "w8a8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8,
           "mxfp4": jnp.uint8}
EXPERTS_ONLY = (mxfp4.MODE,)  # modes that quantize the experts and leave the rest float
LINEAR_MODES = tuple(m for m in MODES if m not in EXPERTS_ONLY)  # every linear weight
INT8_MAX = 127.0
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
INT4_GROUPS = (128, 64, 32)  # rows per int4 group: the first that divides the input size
INT4_TOP = 15  # int4 codes 0..15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight w[I, O] ~= (value * scale[:, None]).T (value stored [O, I]);
    int4: see `quantize_int4`. An expert stack [E, O, I] (`quantize_experts`) keeps
    that layout with a scale per expert and row; mxfp4 (experts only): model/mxfp4.py."""

    value: jax.Array  # int8 | float8_e4m3fn [O, I]; int4: uint8[I / 2, O] (two rows a byte)
    # mxfp4: uint8[E, O, I / 2] (two inputs a byte, the first in the low nibble)
    scale: jax.Array  # f32[O]; int4: bf16[2, I / group, O] (step, offset)
    # mxfp4: uint8[E, O, I / 32] (e8m0: 2 ** (scale - 127) per 32 inputs)
    mode: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight's shape [I, O]; mxfp4: the stack's [E, O, I]."""
        if self.mode == "int4":
            return (2 * self.value.shape[0], self.value.shape[1])
        if self.mode == mxfp4.MODE:
            return (*self.value.shape[:-1], 2 * self.value.shape[-1])
        return self.value.shape[::-1]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the weight computes in (activations cast to it): bfloat16; mxfp4
        experts compute in the model's float dtype (model/moe.py)."""
        return jnp.dtype(jnp.bfloat16)


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"quantization={mode!r} must be one of {MODES} or None")


def check_applies(mode: str | None, cfg: ModelConfig) -> None:
    """ValueError unless `mode` can quantize `cfg`'s model: mxfp4 needs experts."""
    if mode in EXPERTS_ONLY and cfg.moe is None:
        raise ValueError(f"quantization={mode!r} quantizes mixture-of-experts weights "
                         f"(gpt-oss's MXFP4 experts); {cfg.architecture} has no experts")


def quantize(w: jax.Array, mode: str) -> QuantizedWeight:
    """w [I, O] -> QuantizedWeight with per-column scales (a zero column gets scale 1),
    its value stored [O, I]; int4: per group of rows and column (`quantize_int4`)."""
    if mode in EXPERTS_ONLY:
        raise ValueError(f"{mode} quantizes experts only, not a linear weight {w.shape}")
    if mode == "int4":
        return quantize_int4(w)
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


def quantize_experts(w: jax.Array, mode: str) -> QuantizedWeight:
    """A stack of expert weights [E, O, I] (stored as HF stores each, model/moe.py) ->
    value [E, O, I] and scale f32[E, O]: each expert as `quantize` makes a weight;
    mxfp4: packed blocks and scales (model/mxfp4.py). An mxfp4 stack is decoded first."""
    if is_quantized(w):  # an MXFP4 checkpoint's experts served in another mode
        w = dequantize_experts(w)
    if mode == mxfp4.MODE:
        return QuantizedWeight(*mxfp4.encode(w), mode)
    if mode == "int4":
        raise ValueError("int4 does not apply to experts: use int8, w8a8, fp8 or mxfp4")
    quantized = jax.vmap(lambda x: quantize(x.T, mode))(w)
    return QuantizedWeight(quantized.value, quantized.scale, mode)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w8a8's activations: x f[..., I] -> int8 values and f32[..., 1] scales per row."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    return jnp.clip(jnp.round(x / x_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), x_scale


def quantize_numpy(w: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The numpy twin of `quantize` (value [O, I], scale [O]), for exactness tests."""
    if mode == "int4":
        return _quantize_int4_with(np, w, ml_dtypes.bfloat16)
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
    if w.mode == "int4":
        return _dequantize_int4_with(jnp, w.value, w.scale)
    return (w.value.astype(jnp.float32) * w.scale[:, None]).T


def dequantize_experts(w: QuantizedWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The [E, O, I] stack in `dtype` a quantized expert stack stands for (mxfp4: decoded
    exactly, model/mxfp4.py)."""
    if w.mode == mxfp4.MODE:
        return mxfp4.decode(w.value, w.scale, dtype)
    return (w.value.astype(jnp.float32) * w.scale[..., None]).astype(dtype)


def int4_group(rows: int) -> int:
    """Rows per int4 group for a weight of `rows` inputs: the first of INT4_GROUPS that
    divides it."""
    for group in INT4_GROUPS:
        if rows % group == 0:
            return group
    raise ValueError(f"int4 needs a linear weight's input size divisible by one of "
                     f"{INT4_GROUPS}; got {rows}")


def quantize_int4(w: jax.Array) -> QuantizedWeight:
    """w [I, O] -> int4 codes packed two a byte, with a bf16 step and offset per group
    of `int4_group(I)` rows and column (docs/quantization.md#weights)."""
    value, scale = _quantize_int4_with(jnp, w, jnp.bfloat16)
    return QuantizedWeight(value, scale, "int4")


def dequantize_numpy(value: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The numpy twin of `dequantize` for int4 (value, scale as `quantize_numpy` gives)."""
    return _dequantize_int4_with(np, value, scale)


def _quantize_int4_with(xp: Any, w: Any, bfloat16: Any) -> tuple[Any, Any]:
    """`quantize_int4` written once for jax.numpy and numpy (bit-exact twins, eager or
    under jit): the step and offset are rounded to bf16 first, and the codes computed
    from the rounded values; a constant group gets step 1 and codes 0."""
    rows, columns = w.shape
    groups = w.astype(xp.float32).reshape(rows // int4_group(rows), -1, columns)
    low, high = groups.min(axis=1), groups.max(axis=1)
    step = _to_bf16_precision(xp, (high - low) * xp.float32(1 / INT4_TOP), bfloat16)
    step = xp.where(step > 0, step, xp.float32(1))
    offset = _to_bf16_precision(xp, low, bfloat16)
    # times the reciprocal: under jit XLA rewrites a division by a broadcast so
    inverse = xp.float32(1) / step
    codes = xp.clip(xp.round((groups - offset[:, None]) * inverse[:, None]), 0, INT4_TOP)
    codes = codes.astype(xp.uint8).reshape(rows // 2, 2, columns)
    value = codes[:, 0] | (codes[:, 1] << 4)
    return value, xp.stack([step, offset]).astype(bfloat16)


def _to_bf16_precision(xp: Any, x: Any, bfloat16: Any) -> Any:
    """f32 x rounded to the nearest bfloat16 (ties to even), kept f32. Under jit XLA
    drops an f32 -> bf16 -> f32 round trip (it allows excess precision), so jax rounds
    with reduce_precision, which it keeps."""
    if xp is np:
        return x.astype(bfloat16).astype(np.float32)
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def _dequantize_int4_with(xp: Any, value: Any, scale: Any) -> Any:
    """f32 [I, O] = codes * step + offset, per group (the product is exact in f32)."""
    rows, columns = 2 * value.shape[0], value.shape[1]
    codes = xp.stack([value & 15, value >> 4], axis=1).astype(xp.float32)
    step, offset = scale.astype(xp.float32)
    groups = codes.reshape(step.shape[0], -1, columns)
    return (groups * step[:, None] + offset[:, None]).reshape(rows, columns)


def quantized_bytes(name: str, shape: tuple[int, int], spec: P, mode: str,
                    tensor_parallel_size: int = 1) -> int:
    """Bytes on one of `tensor_parallel_size` devices of the float weight `name` of
    `shape`, split by `spec` (model/params_table.py), quantized in `mode`.
    int4: a weight split by input rows must give each device whole groups."""
    rows, columns = shape
    tp = tensor_parallel_size
    split_rows = len(spec) > 0 and spec[0] is not None
    split_columns = len(spec) > 1 and spec[1] is not None
    if mode != "int4":
        return rows * columns // tp ** (split_rows + split_columns) + 4 * (
            columns // tp if split_columns else columns)
    group = int4_group(rows)
    if split_rows and (rows // tp) % group:
        raise ValueError(f"int4 groups of {group} rows straddle the {tp} devices' shares "
                         f"of {name} [{rows}, {columns}] (split by input rows, {rows // tp} "
                         f"each): tensor_parallel_size={tp} must divide {rows // group}")
    elements = rows * columns // tp ** (split_rows + split_columns)
    return elements // 2 + 4 * elements // group


def quantize_params(params: dict, mode: str, head: bool = True) -> dict:
    """The params with every layer's linear weights and the LM head quantized
    (jittable); a tied head becomes a quantized copy of the embedding table. `head=False`
    leaves the head as it is (what a pre-quantized checkpoint that keeps it float
    serves: `checkpoint.quantized_head`). mxfp4 quantizes the experts alone (a model
    without experts is refused); already packed experts are decoded for another mode."""
    check_quantizes(params, mode)
    params = params | {"layers": quantize_layers(params["layers"], mode)}
    return quantize_head(params, mode) if head else params


def check_quantizes(params: dict, mode: str) -> None:
    """ValueError unless `mode` quantizes something of `params` (mxfp4: experts)."""
    if mode in EXPERTS_ONLY and not any(name in EXPERT_WEIGHTS for layer in params["layers"]
                                        for name in layer):
        raise ValueError(f"quantization={mode!r} quantizes mixture-of-experts weights "
                         "(gpt-oss's MXFP4 experts); this model has no experts")


def quantize_layers(layer_list: list, mode: str) -> list:
    """Each layer's linear weights (and experts) quantized to `mode` (jittable)."""
    return [{name: _quantize_leaf(name, value, mode) for name, value in layer.items()}
            for layer in layer_list]


def quantize_head(params: dict, mode: str) -> dict:
    """The params with the LM head quantized (a tied one as a quantized copy of the
    embedding table) where `mode` quantizes heads (jittable)."""
    if head_mode(mode) is None:
        return params
    head_weight = params[HEAD] if HEAD in params else params["embed"].T  # [D, V]
    return params | {HEAD: quantize(head_weight, head_mode(mode))}


def _quantize_leaf(name: str, value: jax.Array, mode: str) -> jax.Array | QuantizedWeight:
    if name in EXPERT_WEIGHTS:
        return quantize_experts(value, mode)
    quantized = name in QUANTIZED_WEIGHTS and mode not in EXPERTS_ONLY
    return quantize(value, mode) if quantized else value


def has_quantized_head(params: dict) -> bool:
    """Whether a params tree (arrays or specs) holds a quantized LM head."""
    return is_quantized(params.get(HEAD))


def head_mode(mode: str) -> str | None:
    """The LM head's mode in a model quantized in `mode` (int4: int8, weight-only; None:
    float, for modes that quantize the experts alone)."""
    if mode in EXPERTS_ONLY:
        return None
    return "int8" if mode == "int4" else mode


def linear_mode(mode: str | None) -> str | None:
    """The mode of the layers' linear weights (QUANTIZED_WEIGHTS) in a model quantized in
    `mode`: None (float) for modes that quantize the experts alone."""
    return None if mode in EXPERTS_ONLY else mode


def partition_specs(specs: dict, mode: str | None, head: bool = True) -> dict:
    """The float params' specs (params_table.param_partition_specs) for quantized params:
    a quantized weight's value [O, I] is split as the weight transposed, its scale as
    the weight's columns. `head=False`: the LM head left as the float params have it
    (see `quantize_params`)."""
    if mode is None:
        return specs
    dense = linear_mode(mode)
    layers = [{name: expert_spec(spec, mode) if name in EXPERT_WEIGHTS
               else _weight_spec(spec, dense) if dense and name in QUANTIZED_WEIGHTS
               else spec for name, spec in layer.items()} for layer in specs["layers"]]
    if not head or head_mode(mode) is None:
        return specs | {"layers": layers}
    head_spec = specs[HEAD] if HEAD in specs else P(*reversed(tuple(specs["embed"])))
    return specs | {"layers": layers, HEAD: _weight_spec(head_spec, head_mode(mode))}


def expert_spec(spec: P, mode: str) -> QuantizedWeight:
    """Experts keep their [E, O, I] layout; the scale [E, O] splits as the first two
    (mxfp4: blocks [E, O, I / 2] and scales [E, O, I / 32] split as the stack)."""
    if mode == mxfp4.MODE:
        return QuantizedWeight(spec, spec, mode)
    return QuantizedWeight(spec, P(*(tuple(spec) + (None, None))[:2]), mode)


def expert_bytes(name: str, shape: tuple[int, ...], spec: P, mode: str,
                 tensor_parallel_size: int = 1) -> int:
    """Bytes on one of `tensor_parallel_size` devices of the expert stack `name`
    [E, O, I] split by `spec`, quantized in `mode` (`quantize_experts`): a byte an
    element and a float32 scale per expert and row held; mxfp4 packed (model/mxfp4.py:
    blocks of 32 inputs may not straddle devices)."""
    tp = tensor_parallel_size
    if mode == mxfp4.MODE:
        return mxfp4.packed_bytes(name, shape, spec, tp)
    split = sum(axis is not None for axis in tuple(spec))
    rows_split = sum(axis is not None for axis in tuple(spec)[:2])
    return math.prod(shape) // tp ** split + 4 * shape[0] * shape[1] // tp ** rows_split


def _weight_spec(spec: P, mode: str) -> QuantizedWeight:
    rows, columns = (tuple(spec) + (None, None))[:2]
    if mode == "int4":  # packed rows as the weight's rows; scale [2, groups, O]
        return QuantizedWeight(P(rows, columns), P(None, rows, columns), mode)
    return QuantizedWeight(P(columns, rows), P(columns), mode)


def linear(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x f[..., I] @ w -> f32[..., O], by the weight's mode (docs/quantization.md#weights)."""
    if w.mode == "w8a8":
        xq, x_scale = quantize_rows(x)
        y = jnp.einsum("...i,oi->...o", xq, w.value, preferred_element_type=jnp.int32)
        return y.astype(jnp.float32) * x_scale * w.scale
    if w.mode == "int4":  # weight-only: unpack and scale to bf16 inside the step
        # float32 scales (an AWQ/GPTQ checkpoint's, exact: checkpoint/prequantized_int4/)
        # compute in float32, as the float model of those weights does
        dtype = jnp.float32 if w.scale.dtype == jnp.float32 else jnp.bfloat16
        return jnp.matmul(x.astype(dtype), dequantize(w).astype(dtype),
                          preferred_element_type=jnp.float32)
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.bfloat16), w.value.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y * w.scale


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def mode_of(params: dict) -> str | None:
    """The quantization of a params tree (arrays or specs), None when float; the head's
    mode must be `head_mode` of the layers'."""
    modes = {w.mode for layer in params["layers"] for w in layer.values() if is_quantized(w)}
    head = params.get(HEAD)
    if is_quantized(head) and {head_mode(m) for m in modes} != {head.mode}:
        modes.add(head.mode)
    if len(modes) > 1:
        raise ValueError(f"params mix quantization modes {sorted(modes)}")
    return modes.pop() if modes else None
