"""Attention metadata (`AttentionMetadata`), the paged KV cache pytree (one
[P, K, W, packing, L] array per layer, or `QuantizedPages` with per-token scales for an
8-bit KV dtype; the heads' feature store), and the attention block. See docs/kernels.md
(#kv-layout, #kv-quantization) and docs/kv_cache.md#page-groups-the-hybrid-kv-cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion, invariance, layers, sharding
from jaxinfer.pallas import (
    DEFAULT_SETTINGS,
    AttentionSettings,
    kv_layout,
    kv_quant,
    online_softmax,
    ragged_paged_attention,
    reference,
    resolve_impl,
)

KV_PAGES_SPEC = P(None, None, sharding.MODEL_AXIS, None, None)  # split by KV head (words)
KV_SCALES_SPEC = P(None, None, sharding.MODEL_AXIS)  # split by KV head, like the pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer of an 8-bit KV cache: values and their per-token scales."""

    pages: jax.Array  # int8/fp8[P, K, W, packing, L]
    scales: jax.Array  # f32[P, K, 2G]: K scale of head g at 2g, V scale at 2g + 1


KVCache = list[jax.Array] | list[QuantizedPages]  # L layers


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
    # With several KV page groups (engine/core/kv_groups.py; each group's KV arrays have
    # their own page ids), every group's slot mapping i32[G, T] and page table
    # i32[G, S, pages_per_seq], the fields above being group 0's; None with one group
    # (the structure is fixed per engine, as the KV cache's).
    group_slot_mapping: jax.Array | None = None
    group_page_indices: jax.Array | None = None
    group_windows: tuple[int | None, ...] = dataclasses.field(  # each group's (page_group)
        default=(None,), metadata={"static": True})
    # The attention settings the engine chose (the kernel: impl, interpret), static;
    # `attention_block` adds each layer's scale, window, soft cap and heads.
    attention: AttentionSettings = dataclasses.field(
        default=DEFAULT_SETTINGS, metadata={"static": True})
    # i32[T]: each token's LoRA adapter slot, -1 for the base model (model/lora.py)
    adapters: jax.Array | None = None

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer of `window` attends with: its page group's pages."""
        group = page_group(window, self.group_windows)
        if self.group_slot_mapping is None or group == 0:
            return self
        return dataclasses.replace(self, slot_mapping=self.group_slot_mapping[group],
                                   page_indices=self.group_page_indices[group])


def page_group(window: int | None, group_windows: Sequence[int | None]) -> int:
    """The KV page group a layer of `window` reads and writes: the one kept for its
    window, else group 0, which keeps every page of a request's tokens. `group_windows`:
    each group's window, None for group 0."""
    return group_windows.index(window) if window in group_windows[1:] else 0


def kv_storage_dtype(dtype: jnp.dtype, backend: str | None = None) -> jnp.dtype:
    """The page dtype that holds KV of `dtype` on `backend` (default: JAX's default
    backend; give the target's when compiling for another one): bfloat16 is kept as its
    uint16 bits on CPU (see pallas/reference.py); every other dtype is stored as itself."""
    backend = backend or jax.default_backend()
    if jnp.dtype(dtype) == jnp.bfloat16 and backend == "cpu":
        return jnp.dtype(reference.BF16_STORAGE)
    return jnp.dtype(dtype)


def kv_cache_spec(cfg: ModelConfig, *, num_pages: int | Sequence[int], page_size: int,
                  dtype: jnp.dtype | str = jnp.float32, backend: str | None = None,
                  shards: int = 1, group_windows: Sequence[int | None] = (None,),
                  feature_size: int = 0) -> list:
    """Shapes and storage dtypes of the cache's L layers, [P, K, W, packing, L] each
    (a `QuantizedPages` with scales f32[P, K, 2G] for 8-bit `dtype`, "int8" or "fp8");
    with `shards` devices on the model axis, W is each device's words (its G / shards
    heads, padded to whole words) times `shards`, so a split of W gives whole heads.
    `num_pages`: P of each KV page group (engine/core/kv_groups.py), whose windows are
    `group_windows`; a layer has its `page_group`'s. `feature_size` > 0: then the feature
    store the step keeps for speculative heads (ModelOptions.feature_size)."""
    num_pages = (num_pages,) if isinstance(num_pages, int) else tuple(num_pages)
    if len(num_pages) != len(group_windows):
        raise ValueError(f"{len(num_pages)} page counts for {len(group_windows)} groups")
    stored = kv_storage_dtype(kv_quant.storage_dtype(dtype), backend)

    def layer(count: int) -> jax.ShapeDtypeStruct | QuantizedPages:
        pages, size, words, packing, lanes = kv_layout.kv_cache_shape(
            count, page_size, cfg.num_kv_heads // shards, cfg.head_dim, stored)
        spec = jax.ShapeDtypeStruct((pages, size, words * shards, packing, lanes), stored)
        if kv_quant.is_quantized(stored):
            scales = kv_quant.scales_shape(count, page_size, cfg.num_kv_heads)
            spec = QuantizedPages(spec, jax.ShapeDtypeStruct(scales, jnp.float32))
        return spec

    groups = [layer(count) for count in num_pages]
    spec = [groups[page_group(cfg.layer_window(i), group_windows)]
            for i in range(cfg.num_layers)]
    if feature_size:  # the feature store (ModelOptions.feature_layers), by KV slot
        spec.append(jax.ShapeDtypeStruct((num_pages[0] * page_size, feature_size),
                                         feature_dtype(dtype, backend)))
    return spec


def feature_dtype(kv_dtype: jnp.dtype | str, backend: str | None = None) -> jnp.dtype:
    """The feature store's dtype: float32 beside a float32 KV cache, else bfloat16, kept
    as its uint16 bits on CPU as bf16 pages are (`kv_storage_dtype`)."""
    wide = jnp.dtype(kv_quant.storage_dtype(kv_dtype)) == jnp.float32
    return kv_storage_dtype(jnp.float32 if wide else jnp.bfloat16, backend)


def write_features(store: jax.Array, slot_mapping: jax.Array, features: jax.Array
                   ) -> jax.Array:
    """The store with rows `slot_mapping` set to `features` f32[T, F]."""
    if store.dtype == reference.BF16_STORAGE:
        values = jax.lax.bitcast_convert_type(features.astype(jnp.bfloat16), store.dtype)
    else:
        values = features.astype(store.dtype)
    return store.at[slot_mapping].set(values)


def read_features(store: jax.Array, slots: jax.Array) -> jax.Array:
    """f32[..., F]: the store's rows `slots`, moved as stored and widened after."""
    rows = store[slots]
    if rows.dtype == reference.BF16_STORAGE:
        rows = jax.lax.bitcast_convert_type(rows, jnp.bfloat16)
    return rows.astype(jnp.float32)


def kv_cache_shardings(mesh: jax.sharding.Mesh, kv_cache: object) -> object:
    """NamedShardings of a KV cache tree (arrays or specs): pages and scales split by
    KV head over the model axis, a feature store replicated; stacked by pipeline stage
    (one more leading axis, model/pipeline.py) split by stage."""
    def named(x: object) -> jax.sharding.NamedSharding:
        spec = {5: KV_PAGES_SPEC, 2: P(), 3: KV_SCALES_SPEC,
                6: P(sharding.STAGE_AXIS, *KV_PAGES_SPEC),  # by pipeline stage
                4: P(sharding.STAGE_AXIS, *KV_SCALES_SPEC)}[len(x.shape)]
        return jax.sharding.NamedSharding(mesh, spec)

    return jax.tree.map(named, kv_cache)


def init_kv_cache(cfg: ModelConfig, *, num_pages: int | Sequence[int], page_size: int,
                  dtype: jnp.dtype | str = jnp.float32, shards: int = 1,
                  group_windows: Sequence[int | None] = (None,),
                  feature_size: int = 0) -> KVCache:
    """Zeroed cache: L layers of [P, K, W, packing, L] in the storage dtype of `dtype`
    (with their scales for 8-bit KV; jit it with out_shardings to build a sharded cache
    without a whole copy), and the feature store with `feature_size` (kv_cache_spec)."""
    return jax.tree.map(lambda spec: jnp.zeros(spec.shape, spec.dtype),
                        kv_cache_spec(cfg, num_pages=num_pages, page_size=page_size,
                                      dtype=dtype, shards=shards,
                                      group_windows=group_windows,
                                      feature_size=feature_size))


def project_qkv(layer: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig,
                rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
    """q f32[..., N, H], k and v f32[..., G, H] of normed x f[..., D]: one fused matmul
    (grouped by KV head, model/fusion.py), q/k norms when configured, then RoPE. In
    batch-invariant mode all of it by blocks of rows: RoPE fused into the attention that
    reads it rounds by that program (docs/rl.md#batch-invariant-mode)."""
    if invariance.active():
        cos, sin = (jnp.broadcast_to(t, (*x.shape[:-1], *t.shape[-2:])) for t in rope)
        with invariance.rows_in_blocks(False):
            return invariance.map_rows(
                lambda rows, c, s: project_qkv(layer, rows, cfg, (c, s)), x, cos, sin)
    q, k, v = fusion.split_qkv(layers.linear(x, layer["wqkv"], layer.get("bqkv")), cfg)
    if cfg.qk_norm:
        q = layers.norm(q, layer["q_norm"], cfg)
        k = layers.norm(k, layer["k_norm"], cfg)
    return layers.apply_rope(q, rope), layers.apply_rope(k, rope), v


def attention_block(
    layer: dict[str, jax.Array],
    x: jax.Array,  # f32[T, D], already normed
    kv_pages: jax.Array | QuantizedPages,  # [P, K, W, packing, L] (and scales)
    md: AttentionMetadata,
    cfg: ModelConfig,
    *,
    rope: tuple[jax.Array, jax.Array],  # cos, sin f32[T, 1, H] (layers.rope_tables)
    max_q_len: int = 0,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array | QuantizedPages]:
    """Self-attention of this step's tokens within the layer's `window` (None: all of
    them); returns (f32[T, D], new kv_pages)."""
    tokens = x.shape[0]
    md = md.for_window(window)
    q, k, v = project_qkv(layer, x, cfg, rope)
    shards = sharding.model_axis_size()
    attend = functools.partial(_write_and_attend, cfg=cfg, max_q_len=max_q_len,
                               num_kv_heads=cfg.num_kv_heads // shards, window=window)
    # gpt-oss's sink logits f32[N]: under tensor parallelism each device its heads' own
    sinks = () if "sinks" not in layer else (layer["sinks"].astype(jnp.float32),)
    if shards > 1:  # each device: its own KV heads, their pages, no communication
        heads = P(None, sharding.MODEL_AXIS, None)
        kv_spec = KV_PAGES_SPEC
        if isinstance(kv_pages, QuantizedPages):
            kv_spec = QuantizedPages(KV_PAGES_SPEC, KV_SCALES_SPEC)
        sink_specs = (P(sharding.MODEL_AXIS),) * len(sinks)
        attend = jax.shard_map(attend, in_specs=(heads, heads, heads, kv_spec, P(),
                                                 *sink_specs),
                               out_specs=(heads, kv_spec), check_vma=False)
    out, kv_pages = attend(q, k, v, kv_pages, md, *sinks)
    out = out.reshape(tokens, cfg.num_heads * cfg.head_dim)
    return layers.linear(out, layer["wo"], layer.get("bo")), kv_pages


def _write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array,
                      kv_pages: jax.Array | QuantizedPages, md: AttentionMetadata,
                      sinks: jax.Array | None = None, *, cfg: ModelConfig, max_q_len: int,
                      num_kv_heads: int, window: int | None
                      ) -> tuple[jax.Array, jax.Array | QuantizedPages]:
    """Write this step's K/V, then attend: (f[T, N, H], new kv_pages); on one device's
    heads under tensor parallelism. 8-bit pages: quantized per token and head, queries
    in float32."""
    kv_scales = None
    if isinstance(kv_pages, QuantizedPages):
        pages, kv_scales = kv_quant.write_quantized_kv(kv_pages.pages, kv_pages.scales, k,
                                                       v, md.slot_mapping)
        query_dtype = jnp.float32
    else:
        compiled_tpu = (resolve_impl(md.attention.impl) == "tpu"
                        and not md.attention.interpret)
        pages = reference.write_kv_pages(kv_pages, k, v, md.slot_mapping,
                                         word_rows=compiled_tpu)
        stored_bits = pages.dtype == reference.BF16_STORAGE
        query_dtype = jnp.float32 if stored_bits else pages.dtype
    settings = dataclasses.replace(
        md.attention, sm_scale=cfg.attention_scale(), sliding_window=window,
        soft_cap=cfg.attn_logit_softcapping, num_kv_heads=num_kv_heads, max_q_len=max_q_len,
        fixed_order=invariance.active())
    out = ragged_paged_attention(
        q.astype(query_dtype), pages, md.kv_lens, md.page_indices, md.cu_q_lens,
        md.num_seqs, settings, kv_scales=kv_scales, sinks=sinks)
    return out, pages if kv_scales is None else QuantizedPages(pages, kv_scales)


def dense_causal_attention(
    layer: dict[str, jax.Array],
    x: jax.Array,  # f32[B, T, D], already normed
    cfg: ModelConfig,
    window: int | None = None,
    rope_kind: str = "global",
) -> jax.Array:
    """Full causal self-attention without a cache (training, reference checks), within
    `window` tokens when given, rotated by RoPE `rope_kind` (ModelConfig.layer_rope)."""
    batch, tokens, _ = x.shape
    positions = jnp.arange(tokens, dtype=jnp.int32)
    rope = layers.rope_tables(positions, layers.rope_inv_freq(cfg, rope_kind),
                              layers.rope_scale(cfg, rope_kind))
    q, k, v = project_qkv(layer, x, cfg, rope)
    dtype = layer["wqkv"].dtype
    if invariance.active():  # as the step computes it: K/V stored in the weights' dtype
        out = online_softmax.causal_attention_by_blocks(
            q, k.astype(dtype), v.astype(dtype), sm_scale=cfg.attention_scale(),
            sliding_window=window, soft_cap=cfg.attn_logit_softcapping,
            sinks=layer["sinks"].astype(jnp.float32) if "sinks" in layer else None)
    elif cfg.attn_logit_softcapping is None and "sinks" not in layer:
        out = jax.nn.dot_product_attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), is_causal=True,
            scale=cfg.attention_scale(),
            local_window_size=None if window is None else (window - 1, 0))
    else:  # dot_product_attention has neither a soft cap nor sinks
        out = _soft_capped_attention(q, k, v, cfg, window, layer.get("sinks"))
    return layers.linear(out.reshape(batch, tokens, -1), layer["wo"], layer.get("bo"))


def _soft_capped_attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: ModelConfig,
                           window: int | None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of q f32[B, T, N, H] over k, v f32[B, T, G, H] with scores
    capped to cap * tanh(scores / cap) before the mask, as HF's eager Gemma 2 does (when
    configured), and gpt-oss's sink logit f[N] as one more softmax column per head."""
    batch, tokens, heads, head_dim = q.shape
    groups = cfg.num_kv_heads
    qg = q.reshape(batch, tokens, groups, heads // groups, head_dim)
    scores = jnp.einsum("btgrh,bsgh->bgrts", qg, k) * cfg.attention_scale()
    cap = cfg.attn_logit_softcapping
    if cap is not None:
        scores = cap * jnp.tanh(scores / cap)
    query, key = jnp.arange(tokens)[:, None], jnp.arange(tokens)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    scores = jnp.where(allowed, scores, -jnp.inf)
    if sinks is not None:  # the sink's weight is dropped: it attends to nothing
        sink = sinks.astype(jnp.float32).reshape(1, groups, heads // groups, 1, 1)
        scores = jnp.concatenate(
            [scores, jnp.broadcast_to(sink, (*scores.shape[:-1], 1))], axis=-1)
    weights = jax.nn.softmax(scores, axis=-1)[..., :tokens]
    out = jnp.einsum("bgrts,bsgh->btgrh", weights, v)
    return out.reshape(batch, tokens, heads, head_dim)
