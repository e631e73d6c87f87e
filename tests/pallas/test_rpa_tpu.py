"""The TPU (Mosaic) ragged paged attention kernel: TPU interpreter runs and TPU export.

Interpreted cases go through the public entry (`impl="tpu", interpret=True`) and are
compared with our jnp reference and with JAX's `ref_ragged_paged_attention`. Shapes stay
small: the TPU interpreter is about 100x slower than the HLO one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
    SCENARIOS,
    check,
    combined,
    make_case,
    make_scaled_case,
    make_sinks,
    split_settings,
)
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxinfer.pallas import AttentionSettings, kv_layout, reference, rpa_tpu
from jaxinfer.pallas.dispatch import ragged_paged_attention

QUANT = {"k_scale": 1 / 32, "v_scale": 1 / 32, "sm_scale": 0.2}


def _use_small_blocks(monkeypatch):
    """Blocks of 2 tokens (R = 4) and 1 page: several query and KV blocks per request."""
    monkeypatch.setattr(rpa_tpu, "PREFILL_QUERY_ROWS", 8)
    monkeypatch.setattr(rpa_tpu, "KV_BLOCK_TOKENS", 16)


@pytest.fixture
def small_blocks(monkeypatch):
    _use_small_blocks(monkeypatch)


def _kernel(args, settings):
    static, arrays = split_settings(settings, impl="tpu", interpret=True)
    run = jax.jit(lambda *a: ragged_paged_attention(*a, static, **arrays))
    return run(*args)


def _references(args, settings):
    """Our jnp reference, and JAX's when the pages hold no padded heads and there are no
    sinks (JAX's has none; ours is held to the dense formula in test_reference.py)."""
    static, arrays = split_settings(settings)
    ours = jax.jit(lambda *a: reference.ragged_paged_attention(*a, static, **arrays))(*args)
    if "num_kv_heads" in settings or "sinks" in settings:
        return (ours,)
    return ours, ref_ragged_paged_attention(*combined(args), **settings)


def _run_case(seq_lens, dtype=jnp.float32, kv_dtype=None, settings=None, **layout):
    settings = settings or {}
    args = make_case(seq_lens, dtype=dtype, kv_dtype=kv_dtype, **layout)
    out = _kernel(args, settings)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    real = sum(q for q, _ in seq_lens)
    for ref in _references(args, settings):
        check(out, ref, real, dtype)
    return out


@pytest.mark.parametrize("blocks", ["default", "small"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_rpa_tpu_scenarios(name, blocks, monkeypatch):
    if blocks == "small":
        _use_small_blocks(monkeypatch)
    _run_case(SCENARIOS[name], settings={"sm_scale": 32 ** -0.5})


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_rpa_tpu_gqa_ratios(num_heads, num_kv_heads):
    _run_case(SCENARIOS["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads,
              settings={"sm_scale": 0.2})


@pytest.mark.parametrize("head_dim, page_size, dtype", [
    (64, 16, jnp.float32),
    (128, 32, jnp.float32),
    (128, 16, jnp.bfloat16),
])
def test_rpa_tpu_head_dims_and_page_sizes(head_dim, page_size, dtype):
    seq_lens = [(1, 200), (24, 120), (3, 256), (1, 31)]  # several KV blocks per request
    _run_case(seq_lens, dtype=dtype, head_dim=head_dim, page_size=page_size, num_heads=8,
              num_kv_heads=2, settings={"sm_scale": head_dim ** -0.5})


@pytest.mark.parametrize("dtype, kv_dtype, num_kv_heads, settings", [
    (jnp.bfloat16, jnp.bfloat16, 2, {"sm_scale": 0.125, "sinks": make_sinks(8),
                                     "sliding_window": 20}),
    (jnp.bfloat16, jnp.int8, 4, dict(QUANT, num_kv_heads=4)),
], ids=["bf16_sinks", "int8"])
def test_rpa_tpu_head_dim_64_folds_two_heads_on_a_row(dtype, kv_dtype, num_kv_heads,
                                                      settings, small_blocks):
    """head_dim 64: K in lanes 0-63, V in lanes 64-127 of a row (kv_layout.py); a bf16
    word serves two KV heads a program, an int8 word four."""
    args = make_case(SCENARIOS["mixed"], dtype=dtype, kv_dtype=kv_dtype, head_dim=64,
                     num_heads=8, num_kv_heads=num_kv_heads)
    assert args[1].shape[2:] == (1, kv_layout.packing(kv_dtype), 128)
    out = _kernel(args, settings)
    for ref in _references(args, settings):
        check(out, ref, sum(q for q, _ in SCENARIOS["mixed"]), dtype)


def test_rpa_tpu_bfloat16(small_blocks):
    _run_case(SCENARIOS["mixed"], dtype=jnp.bfloat16, settings={"sm_scale": 32 ** -0.5})


@pytest.mark.parametrize("dtype, kv_dtype", [
    (jnp.float32, jnp.int8),
    (jnp.bfloat16, jnp.int8),
    (jnp.float32, jnp.float8_e4m3fn),
    (jnp.bfloat16, jnp.float8_e4m3fn),
])
def test_rpa_tpu_quantized_kv(dtype, kv_dtype):
    _run_case(SCENARIOS["mixed"], dtype=dtype, kv_dtype=kv_dtype, settings=QUANT)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 1), (6, 3), (8, 4)])
def test_rpa_tpu_8bit_pages_pack_two_heads_per_word(num_heads, num_kv_heads):
    """One program serves the two KV heads of a word; an odd head count pads the last
    word (its padded heads hold 99 and are never read)."""
    settings = dict(QUANT, num_kv_heads=num_kv_heads)
    out = _run_case(SCENARIOS["page_boundary"], dtype=jnp.bfloat16, kv_dtype=jnp.int8,
                    num_heads=num_heads, num_kv_heads=num_kv_heads, settings=settings)
    assert out.shape[1] == num_heads


@pytest.mark.parametrize("settings", [
    {"sliding_window": 9, "sm_scale": 0.3},
    {"soft_cap": 5.0, "sm_scale": 0.5},
    {"sliding_window": 20, "soft_cap": 20.0, "sm_scale": 0.3},
], ids=["window", "soft_cap", "window_and_soft_cap"])
def test_rpa_tpu_sliding_window_and_soft_cap(settings, small_blocks):
    _run_case(SCENARIOS["mixed"], settings=settings)


@pytest.mark.parametrize("settings", [
    {"sm_scale": 32 ** -0.5},
    {"sliding_window": 9, "sm_scale": 0.3},
    {"sliding_window": 20, "soft_cap": 20.0, "sm_scale": 0.3},
], ids=["plain", "window", "window_and_soft_cap"])
def test_rpa_tpu_sinks(settings, small_blocks):
    """Several query and KV blocks per request: the sinks start each query block's
    softmax and survive every rescale."""
    _run_case(SCENARIOS["mixed"], settings={**settings, "sinks": make_sinks(8)})


def test_rpa_tpu_sinks_with_8bit_pages_two_heads_per_program():
    """Each program serves two KV heads (a word of int8 K0, V0, K1, V1) and reads the
    sinks of both heads' query heads; the odd head count pads a program."""
    settings = dict(QUANT, num_kv_heads=3, sinks=make_sinks(6))
    _run_case(SCENARIOS["page_boundary"], dtype=jnp.bfloat16, kv_dtype=jnp.int8,
              num_heads=6, num_kv_heads=3, settings=settings)


def test_rpa_tpu_sinks_with_per_token_scales(small_blocks):
    quantized, kv_scales, _ = make_scaled_case(SCENARIOS["prefix_hit"], kv_dtype=jnp.int8)
    sinks = make_sinks(8)
    settings = AttentionSettings(sm_scale=0.2, sliding_window=30)
    tpu = dataclasses.replace(settings, impl="tpu", interpret=True)
    out = jax.jit(lambda *a, s: ragged_paged_attention(*a, tpu, kv_scales=s, sinks=sinks))(
        *quantized, s=kv_scales)
    ref = reference.ragged_paged_attention(*quantized, settings, kv_scales=kv_scales,
                                           sinks=sinks)
    check(out, ref, sum(q for q, _ in SCENARIOS["prefix_hit"]), jnp.float32)


@pytest.mark.parametrize("window", [None, 20])
def test_rpa_tpu_never_fetches_pages_no_query_sees(window, small_blocks, monkeypatch):
    """Page-table entries before every window or past kv_len point outside the pool:
    the interpreter raises on any copy from them (see the test below). KV blocks of 2
    pages, so both whole blocks and pages inside a block are skipped."""
    monkeypatch.setattr(rpa_tpu, "KV_BLOCK_TOKENS", 32)
    seq_lens, page_size = [(3, 90), (1, 70), (12, 64)], 16
    settings = {"sliding_window": window, "sm_scale": 0.3}
    args = make_case(seq_lens, page_size=page_size)
    expected = _references(args, settings)
    page_indices = np.asarray(args[3]).copy()
    bad = args[1].shape[0] + 7
    for i, (q_len, kv_len) in enumerate(seq_lens):
        first_key = 0 if window is None else max(kv_len - q_len - window + 1, 0)
        page_indices[i, :first_key // page_size] = bad
        page_indices[i, -(-kv_len // page_size):] = bad
    assert (page_indices == bad).sum() >= (12 if window else 5)
    out = _kernel((*args[:3], jnp.asarray(page_indices), *args[4:]), settings)
    for ref in expected:
        check(out, ref, sum(q for q, _ in seq_lens), jnp.float32)


def test_rpa_tpu_interpreter_raises_on_fetching_a_bad_page():
    args = make_case([(1, 17)])
    page_indices = np.asarray(args[3]).copy()
    page_indices[0, 1] = args[1].shape[0] + 7  # the page holding key 16
    try:
        with pytest.raises(Exception, match="Out-of-bounds read"):
            _kernel((*args[:3], jnp.asarray(page_indices), *args[4:]), {}).block_until_ready()
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def test_rpa_tpu_ignores_requests_past_num_seqs(small_blocks):
    """Slots past num_seqs (here a real-looking one) are padding: finite, not read."""
    seq_lens = SCENARIOS["mixed"]
    args = list(make_case(seq_lens))
    args[5] = jnp.array([3], jnp.int32)  # the fourth request and its token are padding
    kv_lens = np.asarray(args[2]).copy()
    kv_lens[4:] = 20  # padding slots claim KV on NaN pages (page 0 is never used)
    args[2] = jnp.asarray(kv_lens)
    out = _kernel(args, {"sm_scale": 0.2})
    real = sum(q for q, _ in seq_lens[:3])
    check(out, ref_ragged_paged_attention(*combined(args), sm_scale=0.2), real, jnp.float32)


def test_rpa_tpu_no_dma_races(small_blocks):
    """The interpreter's race detector sees no conflict between the double-buffered
    copies and the reads of the VMEM slots."""
    seq_lens = SCENARIOS["mixed"]
    args = make_case(seq_lens)
    out = rpa_tpu.ragged_paged_attention(*args, AttentionSettings(
        sm_scale=0.2, interpret=pltpu.InterpretParams(detect_races=True)))
    assert not mosaic_interpret.races.races_found
    check(out, reference.ragged_paged_attention(*args, AttentionSettings(sm_scale=0.2)),
          sum(q for q, _ in seq_lens), jnp.float32)


def test_rpa_tpu_block_sizes_follow_tuning(monkeypatch):
    assert rpa_tpu.block_sizes(4, 16, 100) == (32, 8)
    assert rpa_tpu.block_sizes(4, 16, 3) == (32, 3)  # never more pages than a request has
    assert rpa_tpu.block_sizes(256, 64, 100) == (1, 2)
    monkeypatch.setattr(rpa_tpu, "KV_BLOCK_TOKENS", 512)
    assert rpa_tpu.block_sizes(8, 32, 100) == (16, 16)


def _export_shapes(dtype, kv_dtype):
    """Realistic serving shapes: 32/8 heads, head_dim 128, 256 tokens, 64 x 2k context."""
    tokens, num_heads, num_kv_heads, head_dim = 256, 32, 8, 128
    page_size, slots, pages_per_seq = 16, 64, 128
    sds = jax.ShapeDtypeStruct
    kv_shape = kv_layout.kv_cache_shape(slots * pages_per_seq + 1, page_size, num_kv_heads,
                                        head_dim, kv_dtype)
    return (sds((tokens, num_heads, head_dim), dtype), sds(kv_shape, kv_dtype),
            sds((slots,), jnp.int32), sds((slots, pages_per_seq), jnp.int32),
            sds((slots + 1,), jnp.int32), sds((1,), jnp.int32))


@pytest.mark.parametrize("dtype, kv_dtype", [
    (jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.int8),
    (jnp.bfloat16, jnp.float8_e4m3fn),
])
@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks"])
def test_rpa_tpu_exports_for_tpu(dtype, kv_dtype, sinks):
    quantized = kv_dtype in (jnp.int8, jnp.float8_e4m3fn)
    settings = QUANT if quantized else {"sm_scale": 128 ** -0.5, "sliding_window": 1024}
    shapes = _export_shapes(dtype, kv_dtype)
    if sinks:
        shapes += (jax.ShapeDtypeStruct((32,), jnp.float32),)

    def attend(*args):
        *args, sink_logits = args if sinks else (*args, None)
        return ragged_paged_attention(*args, AttentionSettings(**settings, impl="tpu"),
                                      sinks=sink_logits)

    exported = jax.export.export(jax.jit(attend), platforms=["tpu"])(*shapes)
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") == 2  # the prefill pass and the decode pass
    assert exported.out_avals[0].shape == (256, 32, 128)
    assert exported.out_avals[0].dtype == dtype
