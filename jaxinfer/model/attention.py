"""Attention metadata, the paged KV cache pytree, and the attention block.

The KV cache is a list with one array per layer, each [P, K, W, packing, H]
(`pallas/kv_layout.py`): K and V interleaved on the combined-head axis (K at
even, V at odd, JAX's `ref_ragged_paged_attention` order), packed into 32-bit
words so TPU copies of one head's words are tile-aligned. Page 0 is the trash
page that padding tokens write into. Imports jax, jaxinfer.config,
jaxinfer.pallas, model.layers and model.fusion.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer import sharding
from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion, layers
from jaxinfer.pallas import kv_layout, ragged_paged_attention, reference

KVCache = list[jax.Array]  # L x [P, K, W, packing, H]
KV_PAGES_SPEC = P(None, None, sharding.MODEL_AXIS, None, None)  # split by KV head (words)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens sit: ragged requests over the paged KV cache."""

    positions: jax.Array  # i32[T]: position of each token in its request
    slot_mapping: jax.Array  # i32[T]: page * K + offset to write K/V; padding -> page 0
    page_indices: jax.Array  # i32[S, pages_per_seq]: page table
    kv_lens: jax.Array  # i32[S]: KV length of each request including this step
    cu_q_lens: jax.Array  # i32[S + 1]: prefix sums of tokens per request
    num_seqs: jax.Array  # i32[1]: requests in use; the rest of S is padding
    logits_indices: jax.Array  # i32[R]: token rows whose logits are returned


def kv_storage_dtype(dtype: jnp.dtype, backend: str | None = None) -> jnp.dtype:
    """The page dtype that holds KV of `dtype` on `backend` (default: JAX's default
    backend; give the target's when compiling for another one): bfloat16 is kept as its
    uint16 bits on CPU (see pallas/reference.py); every other dtype is stored as itself."""
    backend = backend or jax.default_backend()
    if jnp.dtype(dtype) == jnp.bfloat16 and backend == "cpu":
        return jnp.dtype(reference.BF16_STORAGE)
    return jnp.dtype(dtype)


def kv_cache_spec(cfg: ModelConfig, *, num_pages: int, page_size: int,
                  dtype: jnp.dtype = jnp.float32, backend: str | None = None,
                  shards: int = 1) -> list[jax.ShapeDtypeStruct]:
    """Shapes and storage dtypes of the cache's L arrays, [P, K, W, packing, H] each;
    with `shards` devices on the model axis, W is each device's words (its G / shards
    heads, padded to whole words) times `shards`, so a split of W gives whole heads."""
    stored = kv_storage_dtype(dtype, backend)
    pages, size, words, packing, head_dim = kv_layout.kv_cache_shape(
        num_pages, page_size, cfg.num_kv_heads // shards, cfg.head_dim, stored)
    shape = (pages, size, words * shards, packing, head_dim)
    return [jax.ShapeDtypeStruct(shape, stored) for _ in range(cfg.num_layers)]


def init_kv_cache(cfg: ModelConfig, *, num_pages: int, page_size: int,
                  dtype: jnp.dtype = jnp.float32, shards: int = 1) -> KVCache:
    """Zeroed cache: L arrays of [P, K, W, packing, H] in the storage dtype of `dtype`
    (jit it with out_shardings to build a sharded cache without a whole copy)."""
    return [jnp.zeros(spec.shape, spec.dtype)
            for spec in kv_cache_spec(cfg, num_pages=num_pages, page_size=page_size,
                                      dtype=dtype, shards=shards)]


def project_qkv(layer: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig,
                rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
    """q f32[..., N, H], k and v f32[..., G, H] of normed x f[..., D]: one fused matmul
    (grouped by KV head, model/fusion.py), q/k norms when configured, then RoPE."""
    q, k, v = fusion.split_qkv(layers.linear(x, layer["wqkv"], layer.get("bqkv")), cfg)
    if cfg.qk_norm:
        q = layers.rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = layers.rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    return layers.apply_rope(q, rope), layers.apply_rope(k, rope), v


def attention_block(
    layer: dict[str, jax.Array],
    x: jax.Array,  # f32[T, D], already normed
    kv_pages: jax.Array,  # [P, K, W, packing, H]
    md: AttentionMetadata,
    cfg: ModelConfig,
    *,
    rope: tuple[jax.Array, jax.Array],  # cos, sin f32[T, 1, H] (layers.rope_tables)
    decode_only: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Self-attention of this step's tokens; returns (f32[T, D], new kv_pages)."""
    tokens = x.shape[0]
    q, k, v = project_qkv(layer, x, cfg, rope)
    shards = sharding.model_axis_size()
    attend = functools.partial(_write_and_attend, cfg=cfg, decode_only=decode_only,
                               num_kv_heads=cfg.num_kv_heads // shards)
    if shards > 1:  # each device: its own KV heads, their pages, no communication
        heads = P(None, sharding.MODEL_AXIS, None)
        attend = jax.shard_map(attend, in_specs=(heads, heads, heads, KV_PAGES_SPEC, P()),
                               out_specs=(heads, KV_PAGES_SPEC), check_vma=False)
    out, kv_pages = attend(q, k, v, kv_pages, md)
    out = out.reshape(tokens, cfg.num_heads * cfg.head_dim)
    return layers.linear(out, layer["wo"]), kv_pages


def _write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: jax.Array,
                      md: AttentionMetadata, *, cfg: ModelConfig, decode_only: bool,
                      num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """Write this step's K/V, then attend: (f[T, N, H], new kv_pages); on one device's
    heads under tensor parallelism."""
    kv_pages = reference.write_kv_pages(kv_pages, k, v, md.slot_mapping)
    stored_bits = kv_pages.dtype == reference.BF16_STORAGE
    out = ragged_paged_attention(
        q.astype(jnp.float32 if stored_bits else kv_pages.dtype), kv_pages, md.kv_lens,
        md.page_indices, md.cu_q_lens, md.num_seqs, sm_scale=cfg.head_dim ** -0.5,
        sliding_window=cfg.sliding_window, num_kv_heads=num_kv_heads,
        impl=cfg.attention_impl, interpret=cfg.attention_interpret,
        decode_only=decode_only)
    return out, kv_pages


def dense_causal_attention(
    layer: dict[str, jax.Array],
    x: jax.Array,  # f32[B, T, D], already normed
    cfg: ModelConfig,
) -> jax.Array:
    """Full causal self-attention without a cache (training, reference checks)."""
    batch, tokens, _ = x.shape
    rope = layers.rope_tables(jnp.arange(tokens, dtype=jnp.int32), layers.rope_inv_freq(cfg))
    q, k, v = project_qkv(layer, x, cfg, rope)
    dtype = layer["wqkv"].dtype
    out = jax.nn.dot_product_attention(
        q.astype(dtype), k.astype(dtype), v.astype(dtype), is_causal=True,
        local_window_size=None if cfg.sliding_window is None else (cfg.sliding_window - 1, 0))
    return layers.linear(out.reshape(batch, tokens, -1), layer["wo"])
