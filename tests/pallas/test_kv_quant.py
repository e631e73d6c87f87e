"""8-bit KV pages with a scale per token and head (pallas/kv_quant.py): the cache update
against a numpy reference, and the reference, TPU (interpreted) and GPU (interpreted)
kernels reading `kv_scales` against float attention over the dequantized pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCENARIOS, as_pages, check, make_scaled_case
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxinfer.pallas import AttentionSettings, kv_layout, kv_quant
from jaxinfer.pallas.dispatch import ragged_paged_attention

KV_DTYPES = [jnp.int8, jnp.float8_e4m3fn]


def _written(kv_dtype, num_kv_heads=3, tokens=40, page_size=8, head_dim=16, seed=0):
    """Write `tokens` random K/V rows (one all zero, one with an outlier) to permuted
    page slots; returns (k, v, pages [P, K, C, H] as written, scales, slot_mapping)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = 3 * rng.standard_normal((tokens, num_kv_heads, head_dim)).astype(np.float32)
    k[5] = 0.0
    v[7, 1, 3] = 200.0
    num_pages = tokens // page_size + 3
    slots = rng.permutation(np.arange(page_size, num_pages * page_size))[:tokens]
    shape = kv_layout.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim, kv_dtype)
    pages, scales = jax.jit(kv_quant.write_quantized_kv)(
        jnp.zeros(shape, kv_dtype),
        jnp.zeros(kv_quant.scales_shape(num_pages, page_size, num_kv_heads), jnp.float32),
        jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots, jnp.int32))
    return (k, v, np.asarray(kv_layout.combined_view(pages, head_dim)), np.asarray(scales),
            slots)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_quantized_kv_matches_numpy_reference(kv_dtype):
    k, v, pages, scales, slots = _written(kv_dtype)
    page, offset = slots // pages.shape[1], slots % pages.shape[1]
    for index, x in ((0, k), (1, v)):
        want_values, want_scales = kv_quant.quantize_numpy(x, kv_dtype)
        got_values = pages[page, offset][:, index:2 * x.shape[1]:2]  # [T, G, H]
        np.testing.assert_array_equal(got_values.view(np.uint8),
                                      want_values.view(np.uint8))  # bit-exact
        np.testing.assert_array_equal(scales[page, offset][:, index::2], want_scales)
    assert (scales[page[5], offset[5]][0::2] == 1.0).all()  # an all-zero K row: scale 1
    unused = np.ones(pages.shape[:2], bool)
    unused[page, offset] = False
    assert (pages[unused] == 0).all() and (scales[unused] == 0).all()  # nothing else


def _read_back(pages, scales, slots, num_kv_heads):
    """Dequantized K and V f32[T, G, H] of the written slots, and their scales."""
    page, offset = slots // pages.shape[1], slots % pages.shape[1]
    values = pages[page, offset][:, :2 * num_kv_heads].astype(np.float32)
    rows = scales[page, offset]
    return [(values[:, i::2] * rows[:, i::2, None], rows[:, i::2]) for i in (0, 1)]


def test_int8_pages_read_back_within_half_a_scale_step():
    k, v, pages, scales, slots = _written(jnp.int8)
    for x, (got, scale) in zip((k, v), _read_back(pages, scales, slots, 3), strict=True):
        error = np.abs(got - x)
        assert (error <= scale[..., None] / 2 * (1 + 1e-6)).all()
        assert error.max() > 0  # real rounding happened
        np.testing.assert_allclose(np.abs(got).max(-1), np.abs(x).max(-1),
                                   rtol=1e-6)  # each row's maximum: 127 steps, no clipping


def test_fp8_pages_read_back_within_three_mantissa_bits():
    k, v, pages, scales, slots = _written(jnp.float8_e4m3fn)
    for x, (got, scale) in zip((k, v), _read_back(pages, scales, slots, 3), strict=True):
        assert (np.abs(got - x) <= np.abs(x) / 16 + scale[..., None] * 2.0 ** -9).all()


def _run(args, kv_scales, impl, num_kv_heads):
    def attend(*a, kv_scales):
        return ragged_paged_attention(*a, AttentionSettings(
            sm_scale=0.2, impl=impl, interpret=True, num_kv_heads=num_kv_heads),
            kv_scales=kv_scales)

    return jax.jit(attend)(*args, kv_scales=kv_scales)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("impl, kv_dtype, scenario, heads", [
    ("reference", jnp.int8, "mixed", (8, 2)),
    pytest.param("reference", jnp.float8_e4m3fn, "prefix_hit", (5, 1), marks=SLOW),
    pytest.param("tpu", jnp.int8, "mixed", (8, 2), marks=SLOW),
    ("tpu", jnp.int8, "page_boundary", (6, 3)),
    ("tpu", jnp.float8_e4m3fn, "decode_only", (5, 1)),
    ("gpu", jnp.int8, "mixed", (6, 3)),
    pytest.param("gpu", jnp.float8_e4m3fn, "page_boundary", (8, 2), marks=SLOW),
])
def test_kernels_read_per_token_scales(impl, kv_dtype, scenario, heads):
    """The kernel over 8-bit pages + kv_scales equals float attention (ours; JAX's too
    in the slow reference case) over the dequantized float32 pages; unused slots hold NaN scales."""
    num_heads, num_kv_heads = heads
    seq_lens = SCENARIOS[scenario]
    quantized, kv_scales, dequantized = make_scaled_case(
        seq_lens, kv_dtype=kv_dtype, num_heads=num_heads, num_kv_heads=num_kv_heads)
    out = _run(quantized, kv_scales, impl, num_kv_heads)
    real = sum(q for q, _ in seq_lens)
    float_attention = jax.jit(lambda *a: ragged_paged_attention(*a, AttentionSettings(
        sm_scale=0.2, impl="reference")))
    check(out, float_attention(*dequantized), real, jnp.float32)
    if impl == "reference" and kv_dtype == jnp.float8_e4m3fn:  # the slow case: JAX's, eager
        combined = (dequantized[0], kv_layout.combined_view(dequantized[1],
                                                            dequantized[0].shape[2]),
                    *dequantized[2:])
        check(out, ref_ragged_paged_attention(*combined, sm_scale=0.2), real, jnp.float32)


def _case():
    return make_scaled_case(SCENARIOS["decode_only"], kv_dtype=jnp.int8)


@pytest.mark.parametrize("change, message", [
    (lambda q, s: ((*q[:1], as_pages(kv_layout.combined_view(q[1], q[0].shape[2])[
        :, :, :4].astype(jnp.float32)), *q[2:]), s),
     "kv_scales is for int8 or float8_e4m3fn kv_pages, not float32"),
    (lambda q, s: (q, s.astype(jnp.bfloat16)), "kv_scales dtype bfloat16 must be float32"),
    (lambda q, s: (q, s[:, :, :2]), r"kv_scales must be \[P, K, 2G\]"),
])
def test_kv_scales_validation_names_the_problem(change, message):
    quantized, kv_scales, _ = _case()
    args, kv_scales = change(quantized, kv_scales)
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*args, AttentionSettings(impl="reference"), kv_scales=kv_scales)


def test_scalar_scales_and_kv_scales_exclude_each_other():
    quantized, kv_scales, _ = _case()
    with pytest.raises(ValueError, match="k_scale=0.1 and kv_scales exclude each other"):
        ragged_paged_attention(*quantized, AttentionSettings(k_scale=0.1, impl="reference"),
                               kv_scales=kv_scales)
    with pytest.raises(ValueError, match=r"k_scale \(or kv_scales\) is required for int8"):
        ragged_paged_attention(*quantized, AttentionSettings(impl="reference"))


def test_names_of_8bit_kv_dtypes():
    assert kv_quant.storage_dtype("fp8") == jnp.float8_e4m3fn
    assert kv_quant.storage_dtype("int8") == jnp.int8
    assert kv_quant.storage_dtype("bfloat16") == jnp.bfloat16
    assert kv_quant.is_quantized("fp8") and not kv_quant.is_quantized(jnp.float32)


def test_tpu_kernel_scale_copies_have_no_dma_races(monkeypatch):
    """The scale copies share the KV slots' semaphores and double buffering: the TPU
    interpreter's race detector sees no conflict (KV blocks of one page: many blocks)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
    from jax.experimental.pallas import tpu as pltpu

    from jaxinfer.pallas import rpa_tpu

    monkeypatch.setattr(rpa_tpu, "KV_BLOCK_TOKENS", 16)
    seq_lens = SCENARIOS["prefix_hit"]
    quantized, kv_scales, dequantized = make_scaled_case(seq_lens, kv_dtype=jnp.int8)
    out = rpa_tpu.ragged_paged_attention(
        *quantized, AttentionSettings(sm_scale=0.2,
                                      interpret=pltpu.InterpretParams(detect_races=True)),
        kv_scales=kv_scales)
    assert not mosaic_interpret.races.races_found
    float_attention = jax.jit(lambda *a: ragged_paged_attention(*a, AttentionSettings(
        sm_scale=0.2, impl="reference")))
    check(out, float_attention(*dequantized), sum(q for q, _ in seq_lens), jnp.float32)
