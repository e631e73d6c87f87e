"""The public entry point: dispatch by `impl`, and validators that name the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from cases import SCENARIOS, check, make_case

from jaxinfer.pallas import AttentionSettings, ragged_paged_attention, reference, resolve_impl


def _args(**layout):
    return list(make_case(SCENARIOS["mixed"], **layout))


def test_auto_is_reference_on_cpu():
    assert jax.default_backend() == "cpu"
    assert resolve_impl("auto") == "reference"
    args = _args()
    settings = AttentionSettings(sm_scale=0.2)
    out = ragged_paged_attention(*args, settings)
    check(out, reference.ragged_paged_attention(*args, settings), 19, jnp.float32)


def test_kernels_need_interpret_on_cpu():
    with pytest.raises(Exception, match="(?i)interpret"):
        jax.block_until_ready(ragged_paged_attention(*_args(), AttentionSettings(impl="gpu")))


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match="impl='cuda' must be one of"):
        ragged_paged_attention(*_args(), AttentionSettings(impl="cuda"))


def _replace(index, value):
    args = _args()
    args[index] = value
    return args


@pytest.mark.parametrize("index, value, message", [
    (0, jnp.zeros((4, 8)), r"queries must be \[T, N, H\]"),
    (0, jnp.zeros((24, 8, 48)), "kv_pages lanes 128 are not whole heads of the queries "
     "head_dim 48"),
    (0, jnp.zeros((24, 7, 32)), "queries heads 7 must be a multiple of kv heads 2"),
    (0, jnp.zeros((24, 8, 32), jnp.int32), "queries dtype int32 must be float32 or bfloat16"),
    (1, jnp.zeros((9, 16, 4, 1, 32), jnp.float16), "kv_pages dtype float16 must be one of"),
    (1, jnp.zeros((9, 16, 2, 2, 32)), r"must be \[P, K, W, packing=1, L\] for float32"),
    (1, jnp.zeros((9, 16, 4, 32)), r"kv_pages must be \[P, K, W, packing=1, L\]"),
    (1, jnp.zeros((9, 16, 3, 2, 32), jnp.bfloat16),
     "queries heads 8 must be a multiple of kv heads 3"),
    (2, jnp.zeros((6,), jnp.float32), "kv_lens dtype float32 must be int32"),
    (2, jnp.zeros((6, 1), jnp.int32), r"kv_lens must be \[S\]"),
    (3, jnp.zeros((5, 5), jnp.int32), r"page_indices must be \[S=6, pages_per_seq\]"),
    (4, jnp.zeros((6,), jnp.int32), r"cu_q_lens must be \[S \+ 1 = 7\]"),
    (5, jnp.zeros((2,), jnp.int32), r"num_seqs must be \[1\]"),
])
def test_validator_names_the_argument(index, value, message):
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*_replace(index, value))


@pytest.mark.parametrize("settings, message", [
    ({"sm_scale": 0.0}, "sm_scale=0.0 must be a positive number"),
    ({"sliding_window": 0}, "sliding_window=0 must be a positive int"),
    ({"soft_cap": -1.0}, "soft_cap=-1.0 must be > 0"),
    ({"mask_value": 1.0}, "mask_value=1.0 must be negative"),
    ({"k_scale": -2.0}, "k_scale=-2.0 must be > 0"),
])
def test_validator_names_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*_args(), AttentionSettings(**settings))


def test_validator_checks_num_kv_heads_against_the_words():
    match = (r"num_kv_heads=3 and head_dim=32 need \[W, packing, L\] = \(6, 1, 32\) for "
             r"float32 pages \(kv_layout.py\), kv_pages has \(1, 1, 128\)")
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*_args(), AttentionSettings(num_kv_heads=3))


@pytest.mark.parametrize("sinks, message", [
    (jnp.zeros((4,), jnp.float32), r"sinks must be \[N\] = \(8,\), one per query head, got "
     r"shape \(4,\)"),
    (jnp.zeros((2, 4), jnp.float32), r"sinks must be \[N\] = \(8,\)"),
    (jnp.zeros((8,), jnp.bfloat16), "sinks dtype bfloat16 must be float32"),
    ([0.0] * 8, "sinks must be an f32.N. array, got list"),
])
def test_validator_checks_sinks(sinks, message):
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*_args(), sinks=sinks)


def test_quantized_pages_need_scales():
    args = _args(kv_dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"k_scale \(or kv_scales\) is required for int8 "
                       "kv_pages"):
        ragged_paged_attention(*args)


def test_package_exports_the_function_not_the_module():
    import jaxinfer.pallas as pallas
    from jaxinfer.pallas import dispatch

    assert callable(pallas.ragged_paged_attention)
    assert pallas.ragged_paged_attention is dispatch.ragged_paged_attention


def test_settings_are_one_hashable_record():
    """jit can take the record as a static argument: equal settings, one compilation."""
    settings = AttentionSettings(sm_scale=0.2, sliding_window=9, soft_cap=20.0)
    assert settings == AttentionSettings(soft_cap=20.0, sliding_window=9, sm_scale=0.2)
    assert hash(settings) == hash(AttentionSettings(sm_scale=0.2, sliding_window=9,
                                                    soft_cap=20.0))
    attend = jax.jit(ragged_paged_attention, static_argnums=6)
    args = _args()
    check(attend(*args, settings), reference.ragged_paged_attention(*args, settings), 19,
          jnp.float32)
    assert attend._cache_size() == 1
    attend(*args, AttentionSettings(sm_scale=0.2, sliding_window=9, soft_cap=20.0))
    assert attend._cache_size() == 1
