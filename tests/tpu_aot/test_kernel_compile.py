"""The Mosaic attention kernel compiles for v5e, v5p and v6e with libtpu's compiler.

The matrix: queries f32/bf16; KV pages f32, bf16, int8, fp8_e4m3fn; head_dim 64/128/256;
pages of 16-256 tokens; GQA ratios 1, 2, 3, 4 and 8 (odd KV head counts pad 8-bit
pages); sliding window; soft cap. The default run compiles a pairwise-covering subset
on each generation; the full matrix is `slow`. Attention sinks compile in a few cells of
their own (`SINKS`). Before the packed KV layout, every bf16, int8 and fp8 cell failed
here ("Offsets along tiled dimensions must be aligned to tiles").
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from pairwise import covers_all_pairs, pairwise

from jaxinfer.pallas import AttentionSettings, kv_layout, kv_quant
from jaxinfer.pallas.dispatch import ragged_paged_attention

MATRIX = {
    "dtype": ["float32", "bfloat16"],
    "kv_dtype": ["float32", "bfloat16", "int8", "float8_e4m3fn"],
    "head_dim": [64, 128, 256],
    "page_size": [16, 32, 64, 128, 256],
    "heads": [(4, 4), (16, 8), (9, 3), (32, 8), (8, 1)],  # (query, KV): R = 1, 2, 3, 4, 8
    "sliding_window": [None, 128],
    "soft_cap": [None, 30.0],
}
GENERATIONS = ["v5e", "v5p", "v6e"]
# 8-bit pages with a scale per token and head (kv_scales): the engine's quantized cache.
SCALED = [dict(dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, page_size=page_size,
               heads=heads, sliding_window=window, soft_cap=None)
          for dtype, kv_dtype, head_dim, page_size, heads, window in [
              ("float32", "int8", 64, 16, (5, 1), None),  # the demo model's shape
              ("bfloat16", "int8", 128, 64, (32, 8), 128),
              ("float32", "float8_e4m3fn", 128, 16, (16, 8), None),
              ("bfloat16", "float8_e4m3fn", 64, 128, (9, 3), None)]]
# Attention sinks f32[N] (gpt-oss), with the window, the soft cap and 8-bit pages.
SINKS = [dict(dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, page_size=page_size,
              heads=heads, sliding_window=window, soft_cap=cap)
         for dtype, kv_dtype, head_dim, page_size, heads, window, cap in [
             ("bfloat16", "bfloat16", 64, 16, (64, 8), 128, None),  # gpt-oss's heads
             ("float32", "float32", 128, 32, (16, 8), None, 30.0),
             ("bfloat16", "int8", 128, 64, (9, 3), 128, 30.0)]]
TOKENS, SLOTS, CONTEXT = 128, 16, 2048
PAIRWISE = pairwise(MATRIX)
FULL = [dict(zip(MATRIX, values, strict=True)) for values in itertools.product(*MATRIX.values())]


def _case_id(case: dict) -> str:
    n, g = case["heads"]
    return (f"{case['dtype']}-{case['kv_dtype']}-h{case['head_dim']}-p{case['page_size']}"
            f"-n{n}g{g}-w{case['sliding_window']}-c{case['soft_cap']}")


def compile_kernel(case: dict, chip, per_token_scales: bool = False, sinks: bool = False
                   ) -> str:
    """Compile the kernel for `chip`; returns the compiled HLO text. `per_token_scales`:
    8-bit pages read with kv_scales f32[P, K, 2G] (pallas/kv_quant.py); `sinks`: with
    attention sinks f32[N] (the last argument)."""
    sharding = jax.sharding.SingleDeviceSharding(chip)
    num_heads, num_kv_heads = case["heads"]
    kv_dtype, head_dim, page_size = jnp.dtype(case["kv_dtype"]), case["head_dim"], case["page_size"]
    pages_per_seq = CONTEXT // page_size
    shape = kv_layout.kv_cache_shape(SLOTS * pages_per_seq + 1, page_size, num_kv_heads,
                                     head_dim, kv_dtype)
    specs = [((TOKENS, num_heads, head_dim), jnp.dtype(case["dtype"])), (shape, kv_dtype),
             ((SLOTS,), jnp.int32), ((SLOTS, pages_per_seq), jnp.int32),
             ((SLOTS + 1,), jnp.int32), ((1,), jnp.int32)]
    scales = {"k_scale": 0.05, "v_scale": 0.05} if kv_dtype.itemsize == 1 else {}
    if per_token_scales:
        specs.append((kv_quant.scales_shape(shape[0], page_size, num_kv_heads), jnp.float32))
        scales = {}
    if sinks:
        specs.append(((num_heads,), jnp.float32))
    settings = AttentionSettings(
        sm_scale=head_dim ** -0.5, sliding_window=case["sliding_window"],
        soft_cap=case["soft_cap"], num_kv_heads=num_kv_heads, impl="tpu", **scales)

    def attend(*args):
        arrays = {}
        if sinks:
            *args, arrays["sinks"] = args
        if per_token_scales:
            *args, arrays["kv_scales"] = args
        return ragged_paged_attention(*args, settings, **arrays)

    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in specs]
    compiled = jax.jit(attend, in_shardings=sharding, out_shardings=sharding).lower(
        *args).compile()
    return compiled.as_text()


def test_pairwise_subset_covers_every_pair():
    assert covers_all_pairs(MATRIX, PAIRWISE)
    assert len(PAIRWISE) < len(FULL) // 20


def _check(case: dict, chip) -> None:
    text = compile_kernel(case, chip)
    assert text.count("tpu_custom_call") >= 2  # the prefill and decode passes, Mosaic
    assert "rpa_prefill" in text and "rpa_decode" in text


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("case", PAIRWISE, ids=_case_id)
def test_kernel_compiles_pairwise(case, generation, chips):
    _check(case, chips[generation])


@pytest.mark.slow
@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("case", FULL, ids=_case_id)
def test_kernel_compiles_full_matrix(case, generation, chips):
    _check(case, chips[generation])


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("case", SCALED, ids=_case_id)
def test_kernel_with_per_token_scales_compiles(case, generation, chips):
    text = compile_kernel(case, chips[generation], per_token_scales=True)
    assert text.count("tpu_custom_call") >= 2
    assert "rpa_prefill" in text and "rpa_decode" in text


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("case", SINKS, ids=_case_id)
def test_kernel_with_sinks_compiles(case, generation, chips):
    """8-bit pages read with kv_scales (the engine's quantized cache)."""
    per_token_scales = jnp.dtype(case["kv_dtype"]).itemsize == 1
    text = compile_kernel(case, chips[generation], per_token_scales=per_token_scales,
                          sinks=True)
    assert text.count("tpu_custom_call") >= 2
    assert "rpa_prefill" in text and "rpa_decode" in text
