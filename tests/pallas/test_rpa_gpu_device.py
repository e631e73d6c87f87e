"""The Triton kernel run for real on a GPU against the jnp reference (skipped elsewhere).

Marked `accelerator`: run with `pytest -m accelerator tests/pallas/test_rpa_gpu_device.py`
on a machine with a CUDA GPU (README: measured on an H100). Each case compiles the
kernel with Triton (interpret=False) and compares with `impl="reference"` on the same
inputs, including NaN-filled unused pages, padding tokens and padding requests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCENARIOS, make_case, make_sinks, split_settings

from jaxinfer.pallas.dispatch import ragged_paged_attention

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
]
QUANT = {"k_scale": 1 / 32, "v_scale": 1 / 32}
# float32 dots on a GPU run as TF32 (10-bit mantissa) in Triton and in XLA alike, so the
# two differ by ~1e-4 where the CPU's exact f32 agrees to 2e-5 (seen on an H100).
GPU_TOL = {jnp.dtype(jnp.float32): 1e-3, jnp.dtype(jnp.bfloat16): 2e-2}


def _run(seq_lens, settings, **layout):
    args = make_case(seq_lens, **layout)
    static, arrays = split_settings(settings)
    kernel = jax.jit(lambda *a: ragged_paged_attention(
        *a, dataclasses.replace(static, impl="gpu"), **arrays))
    reference = jax.jit(lambda *a: ragged_paged_attention(
        *a, dataclasses.replace(static, impl="reference"), **arrays))
    out = np.asarray(kernel(*args), np.float32)
    assert out.shape == args[0].shape
    assert np.isfinite(out).all(), "NaN or inf in the output"
    real, tol = sum(q for q, _ in seq_lens), GPU_TOL[jnp.dtype(args[0].dtype)]
    want = np.asarray(reference(*args), np.float32)
    np.testing.assert_allclose(out[:real], want[:real], atol=tol, rtol=tol)


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rpa_gpu_on_device_scenarios(name, dtype):
    _run(SCENARIOS[name], {"sm_scale": 32 ** -0.5}, dtype=dtype)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_rpa_gpu_on_device_quantized_pages(kv_dtype):
    _run(SCENARIOS["mixed"], dict(QUANT, sm_scale=0.2), dtype=jnp.bfloat16, kv_dtype=kv_dtype)


def test_rpa_gpu_on_device_llama_layer_shapes():
    """Llama-3.1-8B layer heads, long decodes (split KV) and a prefill chunk."""
    _run([(1, 2000), (128, 700), (1, 1500), (1, 9)], {"sm_scale": 128 ** -0.5},
         dtype=jnp.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128)


def test_rpa_gpu_on_device_window_and_soft_cap():
    _run(SCENARIOS["mixed"], {"sm_scale": 0.3, "sliding_window": 9, "soft_cap": 20.0})


def test_rpa_gpu_on_device_sinks_with_window_and_split_kv():
    """Attention sinks with a sliding window, on long decodes (split KV) and a chunk."""
    _run([(1, 2000), (64, 700), (1, 1500)],
         {"sm_scale": 64 ** -0.5, "sliding_window": 128, "sinks": make_sinks(64)},
         dtype=jnp.bfloat16, num_heads=64, num_kv_heads=8, head_dim=64)
