"""The Mosaic attention kernel compiles for v5e, v5p and v6e with libtpu's compiler.

The matrix: queries f32/bf16; KV pages f32, bf16, int8, fp8_e4m3fn; head_dim 64/128/256;
pages of 16-256 tokens; GQA ratios 1, 2, 3, 4 and 8 (odd KV head counts pad 8-bit
pages); sliding window; soft cap. The default run compiles a pairwise-covering subset
on each generation; the full matrix is `slow`. Before the packed KV layout, every
bf16, int8 and fp8 cell failed here ("Offsets along tiled dimensions must be aligned
to tiles").
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from pairwise import covers_all_pairs, pairwise

from jaxinfer.pallas import kv_layout
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
TOKENS, SLOTS, CONTEXT = 128, 16, 2048
PAIRWISE = pairwise(MATRIX)
FULL = [dict(zip(MATRIX, values, strict=True)) for values in itertools.product(*MATRIX.values())]


def _case_id(case: dict) -> str:
    n, g = case["heads"]
    return (f"{case['dtype']}-{case['kv_dtype']}-h{case['head_dim']}-p{case['page_size']}"
            f"-n{n}g{g}-w{case['sliding_window']}-c{case['soft_cap']}")


def compile_kernel(case: dict, chip) -> str:
    """Compile the kernel for `chip`; returns the compiled HLO text."""
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

    def attend(*args):
        return ragged_paged_attention(
            *args, sm_scale=head_dim ** -0.5, sliding_window=case["sliding_window"],
            soft_cap=case["soft_cap"], num_kv_heads=num_kv_heads, impl="tpu", **scales)

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
