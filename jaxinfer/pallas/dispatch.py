"""Ragged paged attention's one entry point (`ragged_paged_attention`): JAX's
`ref_ragged_paged_attention` contract with packed pages, static input validation at
trace time (`validate_inputs`), and the pick of the TPU or GPU kernel or the reference
by `AttentionSettings.impl`. See docs/kernels.md#the-entry-point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.pallas import kv_layout, kv_quant, reference
from jaxinfer.pallas.settings import DEFAULT_SETTINGS, IMPLS, AttentionSettings

KV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn,
             reference.BF16_STORAGE)  # the last: bf16 bits, reference only
QUERY_DTYPES = (jnp.float32, jnp.bfloat16)


def validate_inputs(
    queries: jax.Array,  # f[T, N, H]
    kv_pages: jax.Array,  # [P, K, W, packing, L]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    settings: AttentionSettings = DEFAULT_SETTINGS,
    *,
    kv_scales: jax.Array | None = None,  # f32[P, K, 2G]
    sinks: jax.Array | None = None,  # f32[N]
) -> None:
    """Trace-time checks of shapes, dtypes and settings; errors name the argument."""
    num_kv_heads = settings.num_kv_heads
    if queries.ndim != 3:
        raise ValueError(f"queries must be [T, N, H], got shape {queries.shape}")
    if queries.dtype not in QUERY_DTYPES:
        raise ValueError(f"queries dtype {queries.dtype} must be float32 or bfloat16")
    if kv_pages.dtype not in KV_DTYPES:
        raise ValueError(f"kv_pages dtype {kv_pages.dtype} must be one of "
                         f"{[jnp.dtype(d).name for d in KV_DTYPES]}")
    _validate_layout(queries, kv_pages, num_kv_heads)
    _validate_metadata(kv_lens, page_indices, cu_q_lens, num_seqs)
    _validate_settings(kv_pages.dtype, settings, per_token=kv_scales is not None)
    if kv_scales is not None:
        _validate_kv_scales(kv_pages, kv_scales,
                            num_kv_heads or kv_layout.padded_heads(
                                kv_pages, queries.shape[2]) // 2)
    if sinks is not None:
        _validate_sinks(sinks, queries.shape[1])


def _validate_sinks(sinks: jax.Array, num_heads: int) -> None:
    """sinks is f32[N], one logit per query head."""
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise ValueError(f"sinks must be an f32[N] array, got {type(sinks).__name__}")
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [N] = ({num_heads},), one per query head, got "
                         f"shape {sinks.shape}")
    if sinks.dtype != jnp.float32:
        raise ValueError(f"sinks dtype {sinks.dtype} must be float32")


def _validate_kv_scales(kv_pages: jax.Array, kv_scales: jax.Array, num_kv_heads: int
                        ) -> None:
    """kv_scales is f32[P, K, 2G] beside 8-bit pages (kv_quant.py)."""
    if kv_pages.dtype not in (jnp.int8, jnp.float8_e4m3fn):
        raise ValueError(f"kv_scales is for int8 or float8_e4m3fn kv_pages, not "
                         f"{jnp.dtype(kv_pages.dtype).name}")
    if kv_scales.dtype != jnp.float32:
        raise ValueError(f"kv_scales dtype {kv_scales.dtype} must be float32")
    want = kv_quant.scales_shape(kv_pages.shape[0], kv_pages.shape[1], num_kv_heads)
    if kv_scales.shape != want:
        raise ValueError(f"kv_scales must be [P, K, 2G] = {want} for these kv_pages and "
                         f"num_kv_heads={num_kv_heads}, got shape {kv_scales.shape}")


def _validate_layout(queries: jax.Array, kv_pages: jax.Array, num_kv_heads: int | None
                     ) -> None:
    """kv_pages is [P, K, W, packing, L] for its dtype and holds `num_kv_heads` heads."""
    packing = kv_layout.packing(kv_pages.dtype)
    if kv_pages.ndim != 5 or kv_pages.shape[3] != packing:
        raise ValueError(f"kv_pages must be [P, K, W, packing={packing}, L] for "
                         f"{jnp.dtype(kv_pages.dtype).name} pages (see kv_layout.py), got "
                         f"shape {kv_pages.shape}")
    _, num_heads, head_dim = queries.shape
    if kv_pages.shape[4] % head_dim:
        raise ValueError(f"kv_pages lanes {kv_pages.shape[4]} are not whole heads of the "
                         f"queries head_dim {head_dim}")
    num_kv_heads = num_kv_heads or kv_layout.padded_heads(kv_pages, head_dim) // 2
    want = kv_layout.kv_cache_shape(1, 1, num_kv_heads, head_dim, kv_pages.dtype)[2:]
    if tuple(kv_pages.shape[2:]) != want:
        raise ValueError(f"num_kv_heads={num_kv_heads} and head_dim={head_dim} need "
                         f"[W, packing, L] = {want} for {jnp.dtype(kv_pages.dtype).name} "
                         f"pages (kv_layout.py), kv_pages has {tuple(kv_pages.shape[2:])}")
    if num_heads % num_kv_heads:
        raise ValueError(f"queries heads {num_heads} must be a multiple of kv heads "
                         f"{num_kv_heads}")


def _validate_metadata(kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                       num_seqs: jax.Array) -> None:
    for name, array in (("kv_lens", kv_lens), ("page_indices", page_indices),
                        ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} dtype {array.dtype} must be int32")
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [S], got shape {kv_lens.shape}")
    slots = kv_lens.shape[0]
    if page_indices.ndim != 2 or page_indices.shape[0] != slots:
        raise ValueError(f"page_indices must be [S={slots}, pages_per_seq], "
                         f"got shape {page_indices.shape}")
    if cu_q_lens.shape != (slots + 1,):
        raise ValueError(f"cu_q_lens must be [S + 1 = {slots + 1}], got shape {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got shape {num_seqs.shape}")


def _validate_settings(kv_dtype: jnp.dtype, settings: AttentionSettings,
                       per_token: bool = False) -> None:
    sm_scale, window = settings.sm_scale, settings.sliding_window
    if not isinstance(sm_scale, int | float) or sm_scale <= 0:
        raise ValueError(f"sm_scale={sm_scale!r} must be a positive number")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"sliding_window={window!r} must be a positive int or None")
    if settings.soft_cap is not None and not settings.soft_cap > 0:
        raise ValueError(f"soft_cap={settings.soft_cap!r} must be > 0 or None")
    if settings.mask_value is not None and not settings.mask_value < 0:
        raise ValueError(f"mask_value={settings.mask_value!r} must be negative or None")
    quantized = kv_dtype in (jnp.int8, jnp.float8_e4m3fn)
    for name, scale in (("k_scale", settings.k_scale), ("v_scale", settings.v_scale)):
        if scale is not None and not scale > 0:
            raise ValueError(f"{name}={scale!r} must be > 0 or None")
        if per_token and scale is not None:
            raise ValueError(f"{name}={scale!r} and kv_scales exclude each other: give "
                             "one scale per cache or one per token")
        if quantized and scale is None and not per_token:
            raise ValueError(f"{name} (or kv_scales) is required for "
                             f"{jnp.dtype(kv_dtype).name} kv_pages")


def resolve_impl(impl: str) -> str:
    """The implementation `impl` names on this backend ("auto" resolved)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    if impl != "auto":
        return impl
    return {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(), "reference")


def ragged_paged_attention(
    queries: jax.Array,  # f[T, N, H]
    kv_pages: jax.Array,  # [P, K, W, packing, L]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    settings: AttentionSettings = DEFAULT_SETTINGS,
    *,
    kv_scales: jax.Array | None = None,  # f32[P, K, 2G]: per token and head, 8-bit pages
    sinks: jax.Array | None = None,  # f32[N]: a softmax sink logit per query head
) -> jax.Array:  # f[T, N, H]
    """Attention of each token over its own request's paged KV (see module doc).
    `settings.max_q_len`: a static promise that no request has more query tokens
    (decode buckets: 1, speculative verify buckets: k + 1); the reference then attends
    slot by slot alone (the kernels need no hint)."""
    args = (queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, settings)
    arrays = dict(kv_scales=kv_scales, sinks=sinks)
    validate_inputs(*args, **arrays)
    chosen = resolve_impl(settings.impl)
    if kv_pages.dtype == reference.BF16_STORAGE and chosen != "reference":
        raise ValueError(f"kv_pages dtype uint16 (bfloat16 bits, the CPU storage) is read "
                         f"by the reference only, not impl={settings.impl!r}: give bfloat16 "
                         "pages")
    if chosen == "reference":
        return reference.ragged_paged_attention(*args, **arrays)
    if chosen == "tpu":
        from jaxinfer.pallas import rpa_tpu

        return rpa_tpu.ragged_paged_attention(*args, **arrays)
    from jaxinfer.pallas import rpa_gpu

    return rpa_gpu.ragged_paged_attention(*args, **arrays)
