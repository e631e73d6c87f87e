"""MXFP4 checkpoints (gpt-oss): `decoded_tensors` replaces each `P_blocks`/`P_scales` pair
by an `MXFP4Tensor` that looks like HF's float tensor [E, I, O] to the loader's checks.
Served in mode "mxfp4" (the default), `packed_weight` reads each device's slice of the
blocks and scales as they are (model/mxfp4.py decodes them in the step); served in
another mode, the tensor decodes, bit-exact with transformers, only the blocks a
device's slice covers. See docs/moe.md#gpt-oss.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxinfer.model import fusion, quantization
from jaxinfer.model import mxfp4 as device_mxfp4

METHOD = "mxfp4"
MODE = device_mxfp4.MODE  # the quantization mode its experts are served in, packed
BLOCK = 32  # inputs per scale
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
PACKED_LAYOUTS = ("interleaved_gate_up", "experts_transposed")  # gpt-oss's expert rows


def is_mxfp4(hf: dict) -> bool:
    """Whether a config.json dict describes an MXFP4 checkpoint."""
    qc = hf.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == METHOD


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8[..., G, 16] and scales u8[..., G] -> f32[..., G * 32]: each byte's low
    nibble, then its high nibble, times 2 ** (scale - 127) in float32."""
    blocks = np.asarray(blocks, np.uint8)
    if blocks.shape[:-1] != np.shape(scales) or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"mxfp4 blocks {blocks.shape} and scales {np.shape(scales)} do not "
                         f"match (blocks must be [..., G, {BLOCK // 2}], scales [..., G])")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]
    values = FP4_VALUES[codes].reshape(*blocks.shape[:-1], BLOCK)
    exponent = np.asarray(scales, np.int32)[..., None] - 127
    with np.errstate(over="ignore"):  # scale 255 and code 6: infinite, as in torch
        out = np.ldexp(values, exponent)  # exact, as torch.ldexp: 0.5 * 2 ** 128 is finite
    return out.reshape(*blocks.shape[:-2], -1)


def encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f[..., I] -> (blocks u8[..., I / 32, 16], scales u8[..., I / 32]): each block's
    exponent the smallest that fits its largest |w| under 6 (-127 for an all-zero
    block), codes rounded to the nearest fp4 value (a tie to the smaller magnitude).
    Writes the layout `decode` reads (test checkpoints); the same bytes as
    model/mxfp4.py's `encode` on the device."""
    w = np.asarray(w, np.float32)
    groups = w.reshape(*w.shape[:-1], -1, BLOCK)
    peak = np.max(np.abs(groups), axis=-1)
    mantissa, power = np.frexp(peak)  # peak = m * 2 ** x, m in [0.5, 1): 6 * 2 ** e fits
    exponent = np.where(mantissa <= 0.75, power - 3, power - 2)
    exponent = np.clip(np.where(peak > 0, exponent, -127), -127, 127).astype(np.int32)
    scaled = groups * np.ldexp(np.float32(1), -exponent)[..., None]
    midpoints = (FP4_VALUES[:7] + FP4_VALUES[1:8]) / 2
    nearest = np.sum(np.abs(scaled)[..., None] > midpoints, axis=-1)
    codes = (nearest + 8 * (scaled < 0)).astype(np.uint8)
    pairs = codes.reshape(*codes.shape[:-1], BLOCK // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return blocks, (exponent + 127).astype(np.uint8)


class MXFP4Tensor:
    """HF's float tensor [E, I, O] of a blocks/scales pair over [E, O, I]; indexing with
    slices decodes only the blocks the slice covers."""

    dtype = np.dtype(np.float32)

    def __init__(self, blocks: np.ndarray, scales: np.ndarray, name: str) -> None:
        experts, outputs, groups, half = blocks.shape
        if scales.shape != (experts, outputs, groups) or half != BLOCK // 2:
            raise ValueError(f"{name}: mxfp4 blocks {blocks.shape} and scales "
                             f"{scales.shape} do not match")
        self.blocks, self.scales, self.name = blocks, scales, name
        self.shape = (experts, groups * BLOCK, outputs)
        self.ndim = 3

    def __getitem__(self, index: object) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (3 - len(index))
        if not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            raise TypeError(f"{self.name}: only contiguous slices are supported")
        (e0, e1, _), (i0, i1, _), (o0, o1, _) = (
            i.indices(n) for i, n in zip(index, self.shape, strict=True))
        g0, g1 = i0 // BLOCK, -(-i1 // BLOCK)
        values = decode(self.blocks[e0:e1, o0:o1, g0:g1], self.scales[e0:e1, o0:o1, g0:g1])
        return values[..., i0 - g0 * BLOCK:i1 - g0 * BLOCK].swapaxes(-1, -2)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        whole = self[:, :, :]
        return whole if dtype is None else whole.astype(dtype)


def decoded_tensors(tensors: dict[str, np.ndarray]) -> dict[str, object]:
    """`tensors` with each `P_blocks`/`P_scales` pair replaced by `P`, an MXFP4Tensor."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(BLOCKS_SUFFIX)]:
        base = name.removesuffix(BLOCKS_SUFFIX)
        scales = out.pop(base + SCALES_SUFFIX, None)
        if scales is None:
            raise ValueError(f"mxfp4 checkpoint has {name} but no {base + SCALES_SUFFIX}")
        for tensor in (out[name], scales):
            if tensor.dtype != np.uint8:
                raise ValueError(f"mxfp4 tensor of {base} has dtype {tensor.dtype}, "
                                 "expected uint8")
        out[base] = MXFP4Tensor(out.pop(name), scales, base)
    return out


def kept_packed(hf: dict, quantization_mode: str | None) -> bool:
    """Whether a checkpoint of config.json `hf` served in `quantization_mode` keeps its
    MXFP4 experts packed: an MXFP4 checkpoint served as it is (None or "mxfp4"); any
    other mode decodes them to floats as they are read, for quantize_params."""
    return is_mxfp4(hf) and quantization_mode in (None, MODE)


def packed_weight(tensor: MXFP4Tensor, kind: str, shape: tuple[int, int, int],
                  spec: quantization.QuantizedWeight, mesh: Mesh,
                  record: Callable[[str, tuple, int], None] | None = None
                  ) -> quantization.QuantizedWeight:
    """The expert stack [E, O, I] (`shape`, our rows) of an MXFP4 tensor as a packed
    QuantizedWeight placed by `spec` on `mesh`: each device reads its slice of the
    blocks and scales, rows de-interleaved for gate/up (`kind`, the leaf's layout);
    nothing is decoded. `record(name, index, bytes)`: each read, for ReadLog."""
    if kind not in PACKED_LAYOUTS:
        raise ValueError(f"{tensor.name}: MXFP4 experts in layout {kind!r} are not read "
                         f"packed (only {PACKED_LAYOUTS})")
    value_shape, scale_shape = device_mxfp4.packed_shapes(shape)
    block = fusion.mlp_block(shape[1] // 2) if kind == "interleaved_gate_up" else 0

    def part(stored: np.ndarray, per_group: int, index: tuple) -> np.ndarray:
        (e0, e1), (o0, o1), (c0, c1) = (_bounds(i, n) for i, n in zip(
            index, (shape[0], shape[1], stored.shape[2] * per_group), strict=True))
        if c0 % per_group or c1 % per_group:
            raise ValueError(f"{tensor.name}: a device's share [{c0}, {c1}) cuts an MXFP4 "
                             f"block of {BLOCK} inputs")
        got = np.asarray(stored[e0:e1, o0:o1, c0 // per_group:c1 // per_group])
        if record is not None:
            record(tensor.name, index, got.nbytes)
        if block:  # HF's rows interleave gate and up (even, odd): ours are in blocks
            if o0 % (2 * block) or o1 % (2 * block):
                raise ValueError(f"a gate/up shard [{o0}, {o1}) must hold whole block "
                                 f"pairs of {2 * block} rows")
            pairs = got.reshape(e1 - e0, (o1 - o0) // (2 * block), block, 2, *got.shape[2:])
            got = pairs.swapaxes(2, 3)
        return np.ascontiguousarray(got).reshape(e1 - e0, o1 - o0, -1)

    value = jax.make_array_from_callback(
        value_shape, NamedSharding(mesh, spec.value),
        lambda index: part(tensor.blocks, BLOCK // 2, _full(index, 3)),
        dtype=tensor.blocks.dtype)
    scale = jax.make_array_from_callback(
        scale_shape, NamedSharding(mesh, spec.scale),
        lambda index: part(tensor.scales[..., None], 1, _full(index, 3)),
        dtype=tensor.scales.dtype)
    return quantization.QuantizedWeight(value, scale, MODE)


def _full(index: tuple, ndim: int) -> tuple[slice, ...]:
    return tuple(index) + (slice(None),) * (ndim - len(index))


def _bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError(f"strided shard index {index} is not supported")
    return start, stop
