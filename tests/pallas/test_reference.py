"""The vectorised jnp ragged paged attention against JAX's shipped reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCENARIOS, TOL, as_pages, check, combined, dense_attention, make_case, make_sinks
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxinfer.pallas import AttentionSettings, kv_layout, reference


def _run_case(seq_lens, dtype=jnp.float32, kv_dtype=None, settings=None, **layout):
    settings = settings or {}
    args = make_case(seq_lens, dtype=dtype, kv_dtype=kv_dtype, **layout)
    ours = jax.jit(lambda *a: reference.ragged_paged_attention(
        *a, AttentionSettings(**settings)))(*args)
    theirs = ref_ragged_paged_attention(*combined(args), **settings)
    real = sum(q for q, _ in seq_lens)
    check(ours, theirs, real, dtype)
    assert not np.asarray(ours[real:], np.float32).any()  # padding rows are zeros


@pytest.mark.parametrize("name", SCENARIOS)
def test_reference_matches_jax_reference(name):
    _run_case(SCENARIOS[name], settings={"sm_scale": 32 ** -0.5})


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_reference_gqa_ratios(num_heads, num_kv_heads):
    _run_case(SCENARIOS["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads)


def test_reference_sliding_window_and_soft_cap():
    _run_case(SCENARIOS["mixed"], settings={"sliding_window": 9, "soft_cap": 20.0,
                                            "sm_scale": 0.3})


def test_reference_bfloat16():
    _run_case(SCENARIOS["mixed"], dtype=jnp.bfloat16, settings={"sm_scale": 32 ** -0.5})


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_reference_quantized_kv(kv_dtype):
    _run_case(SCENARIOS["mixed"], kv_dtype=kv_dtype,
              settings={"k_scale": 1 / 32, "v_scale": 1 / 32, "sm_scale": 0.2})


def test_reference_skips_padded_heads_of_8bit_pages():
    """Three KV heads in int8 pages: two words, the last two combined heads padding (99).
    The result equals the float32 pages' of the same values, which have no padding."""
    settings = {"k_scale": 1 / 32, "v_scale": 1 / 32, "sm_scale": 0.2}
    layout = dict(num_heads=6, num_kv_heads=3)
    q, kv, *meta = make_case(SCENARIOS["mixed"], kv_dtype=jnp.int8, **layout)
    assert kv.shape[2:4] == (2, 4)
    run = jax.jit(lambda *a: reference.ragged_paged_attention(
        *a, AttentionSettings(**settings, num_kv_heads=3)))
    unpadded = as_pages(kv_layout.combined_view(kv, q.shape[2])[:, :, :6].astype(jnp.float32))
    expected = jax.jit(lambda *a: reference.ragged_paged_attention(
        *a, AttentionSettings(**settings)))(
        q, unpadded, *meta)
    np.testing.assert_allclose(run(q, kv, *meta), expected, rtol=1e-6, atol=1e-6)


def test_reference_blocks_tokens_when_gather_is_large(monkeypatch):
    monkeypatch.setattr(reference, "GATHER_BYTES_PER_BLOCK", 4096)
    _run_case(SCENARIOS["mixed"], pad_tokens=12)  # 72 tokens -> blocks of 8


def test_write_kv_pages_interleaves_k_and_v():
    pages = jnp.zeros((3, 4, 4, 1, 2))  # float32: 2 heads, a word per combined head
    k = jnp.arange(2 * 2 * 2, dtype=jnp.float32).reshape(2, 2, 2) + 1
    v = -k
    out = reference.write_kv_pages(pages, k, v, jnp.array([9, 2]))  # page 2 slot 1, page 0 slot 2
    out = out[:, :, :, 0]
    np.testing.assert_array_equal(out[2, 1, 0::2], k[0])
    np.testing.assert_array_equal(out[2, 1, 1::2], v[0])
    np.testing.assert_array_equal(out[0, 2, 0::2], k[1])
    assert int((out != 0).sum()) == 16


def test_write_kv_pages_packs_k_and_v_of_a_head_into_one_word():
    pages = jnp.zeros((2, 4, 2, 2, 8), jnp.bfloat16)  # bfloat16: W = G = 2, packing 2
    k = jnp.arange(16, dtype=jnp.float32).reshape(1, 2, 8) + 1
    out = reference.write_kv_pages(pages, k, -k, jnp.array([6]))
    for head in range(2):
        np.testing.assert_array_equal(out[1, 2, head, 0], k[0, head].astype(jnp.bfloat16))
        np.testing.assert_array_equal(out[1, 2, head, 1], -k[0, head].astype(jnp.bfloat16))


def test_write_kv_pages_quantizes_with_scale_and_zeroes_padded_heads():
    pages = jnp.full((2, 4, 1, 4, 8), 7, jnp.int8)  # int8, one KV head: a word of 4, 2 padded
    k = jnp.full((1, 1, 8), 0.5)
    out = reference.write_kv_pages(pages, k, -k, jnp.array([5]), k_scale=1 / 64, v_scale=1 / 64)
    assert out[1, 1, 0, 0].tolist() == [32] * 8 and out[1, 1, 0, 1].tolist() == [-32] * 8
    assert out[1, 1, 0, 2:].tolist() == [[0] * 8] * 2  # padded combined heads
    assert int((out == 7).sum()) == out.size - 32  # nothing else written


@pytest.mark.parametrize("dtype, shape, num_kv_heads", [
    (jnp.float32, (5, 4, 6, 1, 8), 3), (jnp.bfloat16, (5, 4, 2, 2, 8), 2),
    (reference.BF16_STORAGE, (5, 4, 3, 2, 8), 3), (jnp.int8, (5, 4, 1, 4, 8), 1)])
def test_write_kv_pages_word_rows_is_the_same_write(dtype, shape, num_kv_heads):
    """The compiled TPU kernel's path (rows of the [P * K * W, packing, L] view) writes
    exactly what the 5-D scatter writes, padded heads and dropped slots included."""
    pages = jax.random.randint(jax.random.key(0), shape, 0, 100).astype(dtype)
    k = jax.random.normal(jax.random.key(1), (4, num_kv_heads, 8))
    slots = jnp.array([9, 2, 0, 5 * 4])  # the last past the pool: dropped
    scales = {"k_scale": 0.02, "v_scale": 0.03} if dtype == jnp.int8 else {}
    want = reference.write_kv_pages(pages, k, -k, slots, **scales)
    got = reference.write_kv_pages(pages, k, -k, slots, **scales, word_rows=True)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name", ["mixed", "decode_only", "page_boundary"])
def test_reference_bf16_bits_in_uint16_pages_equal_bf16_pages(name):
    q, kv, *meta = make_case(SCENARIOS[name], kv_dtype=jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(kv, reference.BF16_STORAGE)
    run = jax.jit(lambda q, kv, *m: reference.ragged_paged_attention(
        q, kv, *m, AttentionSettings(sm_scale=0.2)))
    stored = run(q, bits, *meta)
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(run(q, kv, *meta)))
    theirs = ref_ragged_paged_attention(*combined((q, kv.astype(jnp.float32), *meta)),
                                        sm_scale=0.2)
    check(stored, theirs, sum(n for n, _ in SCENARIOS[name]), jnp.float32)


def test_write_kv_pages_stores_bf16_bits_in_uint16_pages():
    pages = jnp.zeros((2, 4, 1, 2, 8), reference.BF16_STORAGE)
    k = jnp.full((1, 1, 8), 1.0 / 3.0)
    out = reference.write_kv_pages(pages, k, -k, jnp.array([5]))
    assert out.dtype == reference.BF16_STORAGE
    as_bf16 = jax.lax.bitcast_convert_type(out, jnp.bfloat16)[:, :, 0]
    np.testing.assert_array_equal(np.asarray(as_bf16[1, 1, 0], np.float32),
                                  np.full(8, np.float32(jnp.bfloat16(1.0 / 3.0))))
    np.testing.assert_array_equal(np.asarray(as_bf16[1, 1, 1], np.float32),
                                  -np.full(8, np.float32(jnp.bfloat16(1.0 / 3.0))))
    assert int((out != 0).sum()) == 16


@pytest.mark.parametrize("name", ["decode_only", "verify"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_per_token_matches_jax_reference(dtype, name):
    """`max_q_len` (decode buckets: one token per request; verify buckets: k + 1)
    compiles the slot-by-slot path alone and gives JAX's reference result, causal
    within each chunk; padding rows stay zero."""
    seq_lens = {"decode_only": SCENARIOS["decode_only"],
                "verify": [(3, 17), (5, 64), (1, 1), (4, 33)]}[name]
    max_q_len = max(q for q, _ in seq_lens)
    args = make_case(seq_lens, dtype=dtype, pad_tokens=2, pad_seqs=2)
    ours = jax.jit(lambda *a: reference.ragged_paged_attention(
        *a, AttentionSettings(sm_scale=32 ** -0.5, max_q_len=max_q_len)))(*args)
    theirs = ref_ragged_paged_attention(*combined(args), sm_scale=32 ** -0.5)
    real = sum(q for q, _ in seq_lens)
    check(ours, theirs, real, dtype)
    assert not np.asarray(ours[real:], np.float32).any()


SINK_SETTINGS = {
    "plain": {"sm_scale": 32 ** -0.5},
    "window": {"sliding_window": 9, "sm_scale": 0.3},
    "soft_cap": {"soft_cap": 5.0, "sm_scale": 0.5},
    "window_and_soft_cap": {"sliding_window": 20, "soft_cap": 20.0, "sm_scale": 0.3},
}


def test_dense_attention_matches_jax_reference_without_sinks():
    """The dense numpy attention the sink tests trust agrees with JAX's reference."""
    args = make_case(SCENARIOS["mixed"])
    settings = SINK_SETTINGS["window_and_soft_cap"]
    check(dense_attention(args, **settings), ref_ragged_paged_attention(
        *combined(args), **settings), 20, jnp.float32)


@pytest.mark.parametrize("name, setting", [
    *(("mixed", setting) for setting in SINK_SETTINGS),
    ("prefix_hit", "plain"), ("page_boundary", "window")])
def test_reference_sinks_follow_transformers(name, setting):
    """With sinks the reference equals attention written as gpt-oss's
    `eager_attention_forward` (sink in the max and the softmax, its column dropped),
    composed with the sliding window and the soft cap; padding rows stay zero."""
    seq_lens, settings = SCENARIOS[name], SINK_SETTINGS[setting]
    args = make_case(seq_lens)
    sinks = make_sinks(args[0].shape[1])
    ours = jax.jit(lambda *a, s: reference.ragged_paged_attention(
        *a, AttentionSettings(**settings), sinks=s))(
        *args, s=sinks)
    real = sum(q for q, _ in seq_lens)
    check(ours, dense_attention(args, **settings, sinks=sinks), real, jnp.float32)
    assert not np.asarray(ours[real:]).any()


def test_omitting_the_sinks_is_caught():
    """The sinks move every head's output well past the tolerance, so a kernel that drops
    them (or folds them in the wrong way) fails the comparisons above."""
    args = make_case(SCENARIOS["mixed"])
    settings = SINK_SETTINGS["window"]
    sinks = make_sinks(args[0].shape[1])
    with_sinks = dense_attention(args, **settings, sinks=sinks)[:20]
    for wrong in (dense_attention(args, **settings)[:20],  # no sink
                  dense_attention(args, **settings, sinks=sinks[::-1])[:20]):  # other heads'
        per_head = np.abs(with_sinks - wrong).max(axis=(0, 2))
        assert (per_head > 50 * TOL[jnp.dtype(jnp.float32)]).all()
    ours = reference.ragged_paged_attention(*args, AttentionSettings(**settings), sinks=sinks)
    with pytest.raises(AssertionError):
        check(ours, dense_attention(args, **settings), 20, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_sinks_slot_by_slot(dtype):
    """The `max_q_len` path (decode and verify buckets) carries the sinks too."""
    seq_lens = [(3, 17), (5, 64), (1, 1), (4, 33)]
    args = make_case(seq_lens, dtype=dtype, pad_tokens=2)
    sinks = make_sinks(args[0].shape[1])
    settings = {"sm_scale": 32 ** -0.5, "sliding_window": 12}
    ours = jax.jit(lambda *a, s: reference.ragged_paged_attention(
        *a, AttentionSettings(**settings, max_q_len=5), sinks=s))(*args, s=sinks)
    check(ours, dense_attention(args, **settings, sinks=sinks), 13, dtype)
    assert not np.asarray(ours[13:], np.float32).any()


def test_reference_sinks_with_8bit_pages():
    """Scalar-scaled int8 pages with sinks equal the dense formula over the dequantized
    pages."""
    settings = {"k_scale": 1 / 32, "v_scale": 1 / 32, "sm_scale": 0.2}
    q, kv, *meta = make_case(SCENARIOS["mixed"], kv_dtype=jnp.int8)
    sinks = make_sinks(q.shape[1])
    ours = reference.ragged_paged_attention(q, kv, *meta, AttentionSettings(**settings),
                                            sinks=sinks)
    dequantized = as_pages(kv_layout.combined_view(kv, q.shape[2]).astype(jnp.float32) / 32)
    check(ours, dense_attention((q, dequantized, *meta), sm_scale=0.2, sinks=sinks), 20,
          jnp.float32)
