"""MXFP4 expert stacks on the device: two FP4 (e2m1) codes a byte and an e8m0 exponent
per 32 inputs, the layout gpt-oss checkpoints publish, decoded inside the step
(`decode`, bit-exact with checkpoint/mxfp4.py's numpy decoder) and encoded from float
experts (`encode`). quantization.py wraps them as `QuantizedWeight`s of mode "mxfp4".
See docs/quantization.md#weights and docs/moe.md#gpt-oss.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MODE = "mxfp4"
BLOCK = 32  # inputs per scale
BYTES_PER_BLOCK = BLOCK // 2  # two codes a byte
FP4_MAX = 6.0
# nearest-code boundaries between the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def decode(blocks: jax.Array, scales: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """blocks u8[..., I / 2] and scales u8[..., I / 32] -> dtype[..., I]: each byte's low
    nibble, then its high nibble, an e2m1 value times 2 ** (scale - 127), built as its
    float32 bits (exact as transformers' ldexp, subnormals and overflow to infinity
    included, whatever the backend does with subnormal arithmetic), then cast (exact in
    bfloat16 but for results below its subnormals)."""
    # Every step runs over the output's own [..., I] shape, the bytes and scales repeated
    # along it: no reshape of the minor axis mid-way, which on TPU copies each
    # intermediate into another tiling (a whole layer's int32 temporaries).
    inputs = 2 * blocks.shape[-1]
    byte = jnp.repeat(blocks, 2, axis=-1).astype(jnp.int32)
    odd = (jnp.arange(inputs, dtype=jnp.int32) & 1) * 4  # the high nibble of odd inputs
    codes = (byte >> odd) & 15
    scale = jnp.repeat(scales, BLOCK, axis=-1).astype(jnp.int32)
    e2m1_exponent, mantissa = (codes >> 1) & 3, codes & 1
    # the value is (1 + fraction / 2) * 2 ** (exponent - 127); the e2m1 subnormal (0.5)
    # is 1.0 one exponent down
    subnormal = e2m1_exponent == 0
    exponent = jnp.where(subnormal, scale - 1, e2m1_exponent + scale - 1)
    fraction = jnp.where(subnormal, 0, mantissa)
    normal_bits = jnp.where(exponent >= 255, 255 << 23, (exponent << 23) | (fraction << 22))
    tiny_bits = (2 + fraction) << jnp.clip(exponent + 21, 0, 21)  # exponent is 0 or -1
    bits = jnp.where(exponent >= 1, normal_bits, tiny_bits)
    bits = jnp.where((codes & 7) == 0, 0, bits).astype(jnp.uint32)
    bits = bits | ((codes >> 3).astype(jnp.uint32) << 31)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def encode(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f[..., I] -> (blocks u8[..., I / 2], scales u8[..., I / 32]): each block's exponent
    the smallest that fits its largest |w| under 6 (127 below the block's smallest for
    an all-zero block, clipped to [-127, 127]), codes the nearest e2m1 value (a tie to
    the smaller magnitude). The same bytes as checkpoint/mxfp4.py's numpy `encode`."""
    inputs = w.shape[-1]
    if inputs % BLOCK:
        raise ValueError(f"mxfp4 needs input sizes divisible by {BLOCK}; got {inputs}")
    groups = w.astype(jnp.float32).reshape(*w.shape[:-1], inputs // BLOCK, BLOCK)
    peak = jnp.max(jnp.abs(groups), axis=-1)
    # peak = m * 2 ** x with m in [0.5, 1): 6 * 2 ** (x - 3) = 0.75 * 2 ** x fits m <= 0.75
    m, x = jnp.frexp(peak)
    exponent = jnp.where(m <= 0.75, x - 3, x - 2)
    exponent = jnp.clip(jnp.where(peak > 0, exponent, -127), -127, 127)
    half = -exponent // 2  # two exact steps of at most 2 ** 64: no subnormal factor
    scaled = groups * _power_of_two(half)[..., None] * _power_of_two(-exponent - half)[
        ..., None]
    magnitude = jnp.abs(scaled)
    code = sum((magnitude > mid).astype(jnp.uint8) for mid in MIDPOINTS)
    code = code + 8 * (scaled < 0).astype(jnp.uint8)
    pairs = code.reshape(*code.shape[:-1], BYTES_PER_BLOCK, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)
    return (blocks.reshape(*w.shape[:-1], inputs // 2),
            (exponent + 127).astype(jnp.uint8))


def _power_of_two(e: jax.Array) -> jax.Array:
    """f32 2 ** e for integers e in [-126, 127], built from its bits (exact; exp2 need
    not be on every backend)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of a float weight of `shape` [..., I]."""
    *lead, inputs = shape
    return (*lead, inputs // 2), (*lead, inputs // BLOCK)


def check_split(name: str, shape: tuple[int, ...], spec: P, tp: int) -> None:
    """ValueError unless each of `tp` devices holds whole blocks of 32 inputs of the
    stack `name` [E, O, I] split by `spec` (the down projection splits its inputs)."""
    inputs = shape[-1]
    if inputs % BLOCK:
        raise ValueError(f"mxfp4 needs {name}'s input size divisible by {BLOCK}; got "
                         f"{inputs}")
    split_inputs = len(spec) == len(shape) and spec[-1] is not None
    if split_inputs and (inputs // BLOCK) % tp:
        raise ValueError(f"mxfp4 blocks of {BLOCK} inputs straddle the {tp} devices' shares "
                         f"of {name} {list(shape)} (split by inputs): tensor_parallel_size="
                         f"{tp} must divide its {inputs // BLOCK} blocks, or enable expert "
                         "parallelism (whole experts a device)")


def packed_bytes(name: str, shape: tuple[int, ...], spec: P, tp: int) -> int:
    """Bytes on one of `tp` devices of the stack `name` [E, O, I] split by `spec`, packed:
    half a byte an element and a byte per 32 inputs."""
    check_split(name, shape, spec, tp)
    split = sum(axis is not None for axis in tuple(spec))
    elements = math.prod(shape) // tp ** split
    return elements // 2 + elements // BLOCK
