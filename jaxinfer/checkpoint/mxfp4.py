"""MXFP4 checkpoints (gpt-oss): `decoded_tensors` replaces each `P_blocks`/`P_scales` pair
by an `MXFP4Tensor` that looks like HF's float tensor [E, I, O] to the loader and
decodes, bit-exact with transformers, only the blocks a device's slice covers.
See docs/moe.md#gpt-oss.
"""

from __future__ import annotations

import numpy as np

METHOD = "mxfp4"
BLOCK = 32  # inputs per scale
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


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
    exponent the smallest that fits its largest |w| under 6, codes rounded to the
    nearest fp4 value. Writes the layout `decode` reads (test checkpoints)."""
    w = np.asarray(w, np.float32)
    groups = w.reshape(*w.shape[:-1], -1, BLOCK)
    peak = np.max(np.abs(groups), axis=-1)
    exponent = np.ceil(np.log2(np.maximum(peak, 1e-30) / 6.0)).astype(np.int32)
    exponent = np.clip(exponent, -127, 127)
    scaled = groups / np.exp2(exponent.astype(np.float32))[..., None]
    positive = FP4_VALUES[:8]
    nearest = np.argmin(np.abs(np.abs(scaled)[..., None] - positive), axis=-1)
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
