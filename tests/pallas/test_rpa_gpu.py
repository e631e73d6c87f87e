"""The GPU (Triton) ragged paged attention kernel: interpret mode on CPU, export for CUDA.

Every interpret case goes through the public entry (impl="gpu", interpret=True)
unless it needs a hand-picked tuning, and is compared with both the jnp twin
(`reference.py`) and JAX's `ref_ragged_paged_attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCENARIOS, check, combined, make_case, make_sinks, split_settings
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxinfer.pallas import AttentionSettings, kv_layout, reference, rpa_gpu
from jaxinfer.pallas.dispatch import ragged_paged_attention

TRITON_CALL = "__gpu$xla.gpu.triton"
LONG_DECODE = [(1, 256), (1, 200), (3, 130), (1, 9)]  # context <= 256, several KV blocks


def _run_case(seq_lens, dtype=jnp.float32, kv_dtype=None, settings=None, tuning=None,
              nan_padding=False, **layout):
    settings = settings or {}
    args = make_case(seq_lens, dtype=dtype, kv_dtype=kv_dtype, **layout)
    real = sum(q for q, _ in seq_lens)
    if nan_padding:  # garbage in padding queries must not reach real rows
        args = (args[0].at[real:].set(jnp.nan), *args[1:])
    static, arrays = split_settings(settings)
    gpu = dataclasses.replace(static, impl="gpu", interpret=True)
    if tuning is None:
        def kernel(*a):
            return ragged_paged_attention(*a, gpu, **arrays)
    else:
        def kernel(*a):
            return rpa_gpu.ragged_paged_attention(*a, gpu, **arrays, tuning=tuning)
    out = jax.jit(kernel)(*args)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    ours = jax.jit(lambda *a: reference.ragged_paged_attention(*a, static, **arrays))(*args)
    check(out, ours, real, dtype)
    if "sinks" not in settings:  # JAX's has none (ours is held to the dense formula)
        check(out, _jax_reference(args, settings), real, dtype)
    return out


def _jax_reference(args, settings):
    """JAX's `ref_ragged_paged_attention`, jitted with the metadata as constants."""
    args = combined(args)
    metadata = tuple(np.asarray(a) for a in args[2:])  # its Python loop needs concrete values

    def attend(queries, kv_pages):
        return ref_ragged_paged_attention(queries, kv_pages, *metadata, **settings)

    return jax.jit(attend)(*args[:2])


@pytest.mark.parametrize("name", SCENARIOS)
def test_rpa_gpu_matches_references(name):
    _run_case(SCENARIOS[name], settings={"sm_scale": 32 ** -0.5})


def test_rpa_gpu_choose_tuning():
    shape = dict(context=2048, num_kv_heads=8, head_dim=128)
    assert rpa_gpu.choose_tuning(tokens=256, slots=64, itemsize=2, **shape) == rpa_gpu.GpuTuning(
        block_rows=64, block_kv=64, k_splits=1)  # mixed step, 512 programs: no split
    assert rpa_gpu.choose_tuning(tokens=256, slots=64, itemsize=4, **shape).block_kv == 32
    assert rpa_gpu.choose_tuning(tokens=8, slots=8, itemsize=2, **shape) == rpa_gpu.GpuTuning(
        block_rows=16, block_kv=64, k_splits=4)  # long decode of 8 requests: split KV


def test_rpa_gpu_decode_bucket_uses_small_blocks():
    assert rpa_gpu.choose_tuning(tokens=4, slots=6, context=80, num_kv_heads=2, head_dim=32,
                                 itemsize=4).block_rows == rpa_gpu.DECODE_BLOCK_ROWS
    _run_case(SCENARIOS["decode_only"], pad_tokens=0, settings={"sm_scale": 0.2})


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1), (6, 2)])
def test_rpa_gpu_gqa_ratios(num_heads, num_kv_heads):  # R = 1, 4, 8 and 3 (padded to 4)
    _run_case(SCENARIOS["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads,
              settings={"sm_scale": 0.2})


@pytest.mark.parametrize("head_dim, page_size", [(64, 16), (128, 32)])
def test_rpa_gpu_head_dims_and_page_sizes(head_dim, page_size):
    _run_case(SCENARIOS["page_boundary"], head_dim=head_dim, page_size=page_size,
              num_heads=4, num_kv_heads=1, settings={"sm_scale": head_dim ** -0.5})


def test_rpa_gpu_bfloat16():
    _run_case(SCENARIOS["mixed"], dtype=jnp.bfloat16, head_dim=64,
              settings={"sm_scale": 64 ** -0.5})


@pytest.mark.parametrize("dtype, kv_dtype", [(jnp.float32, jnp.int8),
                                             (jnp.bfloat16, jnp.float8_e4m3fn)])
def test_rpa_gpu_quantized_kv(dtype, kv_dtype):
    _run_case(SCENARIOS["mixed"], dtype=dtype, kv_dtype=kv_dtype,
              settings={"k_scale": 1 / 32, "v_scale": 1 / 32, "sm_scale": 0.2})


def test_rpa_gpu_sliding_window_and_soft_cap():
    _run_case(SCENARIOS["mixed"], settings={"sliding_window": 9, "soft_cap": 20.0,
                                            "sm_scale": 0.3})


def test_rpa_gpu_sliding_window_skips_early_kv_blocks():
    tuning = rpa_gpu.GpuTuning(block_rows=16, block_kv=16)
    # window 49: the first key rows 255 and 127 see is the LAST key of a KV block
    _run_case(LONG_DECODE, settings={"sliding_window": 49, "sm_scale": 0.2}, tuning=tuning)


def test_rpa_gpu_split_k_long_decode(monkeypatch):
    monkeypatch.setattr(rpa_gpu, "MIN_KV_PER_SPLIT", 32)  # a 256 context splits 8 ways
    tuning = rpa_gpu.choose_tuning(tokens=11, slots=6, context=272, num_kv_heads=2,
                                   head_dim=32, itemsize=4)
    assert tuning.k_splits == 8  # 5 KV blocks of 64: some splits are empty
    _run_case(LONG_DECODE, settings={"sm_scale": 0.2, "soft_cap": 30.0})


def test_rpa_gpu_split_k_with_sliding_window_and_quantized_kv():
    tuning = rpa_gpu.GpuTuning(block_rows=16, block_kv=16, k_splits=4)  # several steps each
    _run_case(LONG_DECODE, kv_dtype=jnp.int8, tuning=tuning,
              settings={"sliding_window": 100, "k_scale": 1 / 32, "v_scale": 1 / 32,
                        "sm_scale": 0.2})


@pytest.mark.parametrize("settings", [
    {"sm_scale": 32 ** -0.5},
    {"sliding_window": 9, "soft_cap": 20.0, "sm_scale": 0.3},
], ids=["plain", "window_and_soft_cap"])
def test_rpa_gpu_sinks(settings):
    _run_case(SCENARIOS["mixed"], settings={**settings, "sinks": make_sinks(8)})


def test_rpa_gpu_sinks_with_padded_heads_and_8bit_pages():
    """R = 3 query heads per KV head padded to 4 rows: each row takes its own head's
    sink, padded rows none that reach the output."""
    _run_case(SCENARIOS["page_boundary"], dtype=jnp.bfloat16, kv_dtype=jnp.int8,
              num_heads=6, num_kv_heads=2,
              settings={"k_scale": 1 / 32, "v_scale": 1 / 32, "sm_scale": 0.2,
                        "sinks": make_sinks(6)})


@pytest.mark.parametrize("window", [None, 100])
def test_rpa_gpu_split_k_sinks_counted_once(window):
    """Split-K: only split 0 holds the sink, and the merge carries it (some splits are
    empty, and padding blocks have every split empty)."""
    tuning = rpa_gpu.GpuTuning(block_rows=16, block_kv=16, k_splits=4)
    _run_case(LONG_DECODE, tuning=tuning,
              settings={"sliding_window": window, "sm_scale": 0.2, "sinks": make_sinks(8)})


def test_rpa_gpu_nan_padding_queries_stay_out_of_real_rows():
    out = _run_case(SCENARIOS["prefix_hit"], nan_padding=True, pad_tokens=7)
    assert not np.asarray(out[10:]).any()  # padding tokens form a request with no KV


@pytest.mark.parametrize("k_splits", [1, 2])
def test_rpa_gpu_partial_block_writes_only_its_own_rows(monkeypatch, k_splits):
    # Interpret mode leaves unwritten outputs NaN, so run only request 2's block
    # (5 tokens, rows 14..18, in a block of 16 tokens) and look at every row.
    block_table = rpa_gpu._block_table

    def only_request_2(*args, **kwargs):
        meta = block_table(*args, **kwargs)
        keep = (meta[:, 0] == 2) & (meta[:, 2] > 0)
        assert int(keep.sum()) == 1
        return meta.at[:, 2].set(jnp.where(keep, meta[:, 2], 0))

    monkeypatch.setattr(rpa_gpu, "_block_table", only_request_2)
    tuning = rpa_gpu.GpuTuning(block_rows=64, k_splits=k_splits)
    monkeypatch.setattr(rpa_gpu, "choose_tuning", lambda **_: tuning)
    partials = []
    combine = rpa_gpu._combine
    monkeypatch.setattr(rpa_gpu, "_combine", lambda *a: partials.extend(a[:3]) or combine(*a))
    args = make_case(SCENARIOS["mixed"])
    out = np.asarray(ragged_paged_attention(*args, AttentionSettings(impl="gpu",
                                                                     interpret=True)))
    ref = reference.ragged_paged_attention(*args)
    np.testing.assert_allclose(out[14:19], ref[14:19], atol=2e-5, rtol=2e-5)
    assert len(partials) == (0 if k_splits == 1 else 3)  # split partials: acc, m, l
    for array in (out, *(np.asarray(p[0]) for p in partials)):  # [T, ...] each
        assert np.isfinite(array[14:19]).all()
        assert np.isnan(np.delete(array, np.s_[14:19], axis=0)).all()


def test_rpa_gpu_block_table_covers_each_token_once():
    meta = rpa_gpu._block_table(jnp.array([0, 1, 6, 6, 6], jnp.int32),
                                jnp.array([5, 9, 0, 0], jnp.int32), jnp.array([2], jnp.int32),
                                tokens=8, bq=4)
    # request, first token, tokens, first query position, kv_len
    np.testing.assert_array_equal(meta[:4], [[0, 0, 1, 4, 5], [1, 1, 4, 4, 9], [1, 5, 1, 8, 9],
                                             [3, 6, 2, -2, 0]])
    assert meta.shape == (5, rpa_gpu.META_FIELDS) and meta[4, 2] == 0 and meta[4, 4] == 0


def test_rpa_gpu_rejects_bad_head_dim_and_tuning():
    args = make_case(SCENARIOS["decode_only"], head_dim=48)
    with pytest.raises(ValueError, match="head_dim=48 must be a power of two"):
        ragged_paged_attention(*args, AttentionSettings(impl="gpu", interpret=True))
    with pytest.raises(ValueError, match="block_rows=8 must be >= 16"):
        rpa_gpu.GpuTuning(block_rows=8)
    with pytest.raises(ValueError, match="k_splits=3 must be a positive power of two"):
        rpa_gpu.GpuTuning(k_splits=3)


def _export_text(tokens, slots, dtype, kv_dtype, *, num_heads=32, num_kv_heads=8, head_dim=128,
                 page_size=16, pages_per_seq=128, sinks=False):
    shapes = [((tokens, num_heads, head_dim), dtype),
              (kv_layout.kv_cache_shape(slots * pages_per_seq + 1, page_size, num_kv_heads,
                                        head_dim, kv_dtype), kv_dtype),
              ((slots,), jnp.int32), ((slots, pages_per_seq), jnp.int32),
              ((slots + 1,), jnp.int32), ((1,), jnp.int32)]
    shapes += [((num_heads,), jnp.float32)] if sinks else []
    scales = {} if kv_dtype in (jnp.float32, jnp.bfloat16) else {"k_scale": 0.1, "v_scale": 0.1}

    def attend(*args):
        *args, sink_logits = args if sinks else (*args, None)
        return ragged_paged_attention(*args, AttentionSettings(
            sm_scale=head_dim ** -0.5, impl="gpu", **scales), sinks=sink_logits)

    exported = jax.export.export(
        jax.jit(attend), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*(jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes))
    assert exported.out_avals[0].shape == (tokens, num_heads, head_dim)
    return exported.mlir_module()


@pytest.mark.parametrize("dtype, kv_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.bfloat16, jnp.bfloat16),
                                             (jnp.bfloat16, jnp.int8),
                                             (jnp.bfloat16, jnp.float8_e4m3fn)])
def test_rpa_gpu_exports_for_cuda(dtype, kv_dtype):
    text = _export_text(256, 64, dtype, kv_dtype)  # 2k context, 64 requests
    assert TRITON_CALL in text
    assert "grid_x = 76, grid_y = 8, grid_z = 1" in text.replace(" : i32", "")


def test_rpa_gpu_exports_sinks_for_cuda():
    text = _export_text(256, 64, jnp.bfloat16, jnp.int8, sinks=True)
    assert TRITON_CALL in text
    assert "grid_x = 76, grid_y = 8, grid_z = 1" in text.replace(" : i32", "")


@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks"])
def test_rpa_gpu_exports_split_k_for_long_decode(sinks):
    text = _export_text(8, 8, jnp.bfloat16, jnp.bfloat16, sinks=sinks)  # 2k context
    assert TRITON_CALL in text and "_z4" in text  # the default tuning splits KV 4 ways
    assert "grid_x = 8, grid_y = 8, grid_z = 4" in text.replace(" : i32", "")


@pytest.mark.slow
def test_rpa_gpu_larger_case():
    _run_case([(1, 1000), (64, 300), (1, 517), (30, 30)], num_heads=16, num_kv_heads=4,
              head_dim=128, dtype=jnp.bfloat16, settings={"sm_scale": 128 ** -0.5})
