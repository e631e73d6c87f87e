"""The MXFP4 decoders (the host's, for checkpoints served in another mode, and the
device's, inside the step) against transformers' own (`convert_moe_packed_tensors`),
bit for bit, on every code and every exponent, the overflowing and subnormal ones
included; the host and device encoders write the same bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxinfer.checkpoint import mxfp4
from jaxinfer.model import mxfp4 as device_mxfp4


def _random_pair(seed: int, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (*shape, 16), dtype=np.uint8),
            rng.integers(0, 256, shape, dtype=np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_is_bit_exact_with_transformers(dtype):
    """[E, O, G, 16] bytes -> HF's [E, I, O] floats, in the dtype each side serves."""
    blocks, scales = _random_pair(0, (3, 40, 4))
    torch_dtype = getattr(torch, dtype)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch_dtype)
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    want = want.view(bits).numpy()
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    got = np.asarray(mxfp4.MXFP4Tensor(blocks, scales, "w")).astype(np_dtype)
    assert got.shape == want.shape == (3, 128, 40)
    np.testing.assert_array_equal(got.view(want.dtype), want)


def _every_code_and_scale() -> tuple[np.ndarray, np.ndarray]:
    """blocks [1, 256, 16, 16] holding every byte under every scale 0..255."""
    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16),
                             (1, 256, 16, 16))
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (1, 256, 16))
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_decode_is_bit_exact_with_transformers(dtype):
    """model/mxfp4.py's decoder, jitted on this backend (XLA:CPU flushes subnormal
    arithmetic, which building the float bits avoids), against transformers' [E, I, O]
    transposed back to our [E, O, I]."""
    blocks, scales = _every_code_and_scale()
    torch_dtype = getattr(torch, dtype)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch_dtype).transpose(-1, -2).contiguous()
    want = want.view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy()
    decode = jax.jit(lambda b, s: device_mxfp4.decode(b, s, jnp.dtype(dtype)))
    got = np.asarray(decode(blocks.reshape(1, 256, 256), scales))
    assert got.shape == want.shape == (1, 256, 512)
    np.testing.assert_array_equal(got.view(want.dtype), want)


def test_device_encode_writes_the_host_encoders_bytes():
    """Normal weights over 60 binades, an all-zero block, a block peaking exactly at
    6 * 2 ** e and one near float32's top: the same blocks and scales."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 8, 128)).astype(np.float32)
    w *= np.exp2(rng.integers(-30, 30, w.shape)).astype(np.float32)
    w[0, 0, :32] = 0
    w[0, 1, :32] = 6 * 2.0 ** -3
    w[0, 2, :32] = np.float32(3e38)
    blocks, scales = mxfp4.encode(w)
    got_blocks, got_scales = jax.jit(device_mxfp4.encode)(w)
    np.testing.assert_array_equal(np.asarray(got_blocks), blocks.reshape(3, 8, 64))
    np.testing.assert_array_equal(np.asarray(got_scales), scales)
    assert scales[0, 0, 0] == 0 and scales[0, 1, 0] == 127 - 3


def test_slices_decode_only_their_blocks_and_match_the_whole():
    blocks, scales = _random_pair(1, (4, 24, 3))
    scales = np.clip(scales, 100, 150)  # finite values, so equality means equal numbers
    tensor = mxfp4.MXFP4Tensor(blocks, scales, "w")
    whole = np.asarray(tensor)
    for index in [(slice(1, 3),), (slice(None), slice(40, 70), slice(5, 17)),
                  (slice(3, 4), slice(0, 96), slice(0, 24)), (slice(0, 2), slice(33, 34))]:
        np.testing.assert_array_equal(tensor[index], whole[index])


def test_encode_round_trips_representable_values():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, (5, 64))
    exponents = rng.integers(-8, 8, (5, 2))
    w = mxfp4.FP4_VALUES[codes] * np.exp2(np.repeat(exponents, 32, axis=1)).astype(np.float32)
    blocks, scales = mxfp4.encode(w)
    np.testing.assert_array_equal(mxfp4.decode(blocks, scales), w)


def test_decoded_tensors_pairs_blocks_with_scales():
    blocks, scales = _random_pair(3, (2, 8, 1))
    tensors = {"a.gate_up_proj_blocks": blocks, "a.gate_up_proj_scales": scales,
               "a.gate_up_proj_bias": np.zeros((2, 8), np.float32)}
    out = mxfp4.decoded_tensors(tensors)
    assert set(out) == {"a.gate_up_proj", "a.gate_up_proj_bias"}
    assert out["a.gate_up_proj"].shape == (2, 32, 8)
    with pytest.raises(ValueError, match="no a.gate_up_proj_scales"):
        mxfp4.decoded_tensors({"a.gate_up_proj_blocks": blocks})
    assert mxfp4.is_mxfp4({"quantization_config": {"quant_method": "mxfp4"}})
    assert not mxfp4.is_mxfp4({})
