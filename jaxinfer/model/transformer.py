"""The decoder family (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3; Mixtral, Qwen2-MoE,
Qwen3-MoE and gpt-oss with model/moe.py) as pure functions over a params dict whose
leaves, shapes and splits are the rows of model/params_table.py. See
docs/architecture.md#params-and-the-kv-cache and docs/models.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import DEFAULT_OPTIONS, ModelConfig, ModelOptions
from jaxinfer.config import pipeline as stage_rules
from jaxinfer.config.model import FINAL_NORMED
from jaxinfer.model import invariance, layers, lora, moe, pipeline, sharding
from jaxinfer.model.attention import (
    AttentionMetadata,
    KVCache,
    attention_block,
    dense_causal_attention,
    write_features,
)
from jaxinfer.model.params_table import param_shapes

Params = dict


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                std: float = 0.02) -> Params:
    """Random init: normal(std) matrices, norms scaling by one (weights of
    1 - norm_weight_offset), zeros for biases."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys, strict=True):
        if "norm" in path:
            out.append(jnp.full(shape, 1.0 - cfg.norm_weight_offset, dtype))
        elif len(shape) == 1:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def forward(
    params: Params,
    kv_cache: KVCache,
    token_ids: jax.Array,  # i32[T]
    md: AttentionMetadata,
    *,
    cfg: ModelConfig,
    options: ModelOptions = DEFAULT_OPTIONS,
    max_q_len: int = 0,
    routing: bool = False,
    hidden: bool = False,
) -> tuple:
    """One step over ragged requests: writes K/V, returns (kv_cache, f32[R, V]), and with
    `routing` the tokens each MoE layer sent to each expert, i32[L_moe, E].
    `options`: the engine's (experts split by expert, features kept for heads).
    `max_q_len`: the caller promises no request has more tokens (1 in a decode bucket,
    k + 1 in a verify bucket), so attention takes its slot-by-slot path alone.
    `options.batch_invariant`: each token rounded alike in any step. `hidden`: every
    token's final-normed hidden state f32[T, D] in place of the logits (pooling)."""
    with invariance.rows_in_blocks(options.batch_invariant):
        return _paged(params, kv_cache, token_ids, md, cfg, options, max_q_len, routing,
                      hidden)


def _paged(params: Params, kv_cache: KVCache, token_ids: jax.Array, md: AttentionMetadata,
           cfg: ModelConfig, options: ModelOptions, max_q_len: int, routing: bool,
           hidden: bool = False) -> tuple:
    if options.pipeline_stages > 1:
        return _pipelined(params, kv_cache, token_ids, md, cfg, options, max_q_len, routing,
                          hidden)
    x = layers.embed(params["embed"], token_ids, cfg.scale_embeddings)  # f32[T, D]
    ropes = rope_tables(md.positions, cfg)
    kv_cache, store = split_feature_store(kv_cache, options)
    new_cache, routed, captured = [], [], {}
    adapters = _adapter_select(params, md)
    for index, (layer, kv_pages) in enumerate(zip(params["layers"], kv_cache, strict=True)):
        if adapters is not None:
            layer = lora.bind(layer, params["lora"][index], adapters, cfg)
        if index in options.feature_layers:
            captured[index] = x
        x, kv_pages, experts = decoder_layer(layer, x, kv_pages, md, cfg, options, ropes,
                                             index=index, max_q_len=max_q_len)
        if experts is not None:
            routed.append(experts)
        new_cache.append(kv_pages)
    if store is not None:
        captured[cfg.num_layers] = x
        features = gather_features(captured, params, cfg, options.feature_layers)
        new_cache.append(write_features(store, md.slot_mapping, features))
    if hidden:
        logits = layers.norm(x, params["final_norm"], cfg).astype(jnp.float32)
    else:
        logits = compute_logits(params, x[md.logits_indices], cfg)
    if not routing:
        return new_cache, logits
    return new_cache, logits, jnp.stack(routed) if routed else jnp.zeros((0, 0), jnp.int32)


def _pipelined(params: Params, kv_cache: KVCache, token_ids: jax.Array,
               md: AttentionMetadata, cfg: ModelConfig, options: ModelOptions,
               max_q_len: int, routing: bool, hidden: bool) -> tuple:
    """`_paged` with the layers in pipeline stages (model/pipeline.py): params["layers"]
    and the KV cache by slot, stacked by stage; embedding and head on every stage."""
    stages = options.pipeline_stages
    x = layers.embed(params["embed"], token_ids, cfg.scale_embeddings)  # f32[T, D]
    rows = jnp.arange(x.shape[0]) if hidden else md.logits_indices
    like = [stage_rules.slot_layers(cfg.num_layers, stages, slot)[0]
            for slot in range(len(params["layers"]))]  # each slot's layers are alike

    def layer_fn(layer: Params, h: jax.Array, pages: object, md_micro: AttentionMetadata,
                 ropes: dict, slot: int) -> tuple:
        return decoder_layer(layer, h, pages, md_micro, cfg, options, ropes,
                             index=like[slot], max_q_len=max_q_len)

    out, kv_cache, counts = pipeline.run_stages(
        layer_fn, params["layers"], kv_cache, x, md, rope_tables(md.positions, cfg),
        stages=stages, microbatches=options.pipeline_microbatches or stages,
        num_layers=cfg.num_layers, rows=rows)
    if hidden:
        logits = layers.norm(out, params["final_norm"], cfg).astype(jnp.float32)
    else:
        logits = compute_logits(params, out, cfg)
    if not routing:
        return kv_cache, logits
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    return kv_cache, logits, pipeline.layer_order(counts, cfg.num_layers, stages,
                                                  moe_layers)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> dict:
    """Each RoPE kind's (cos, sin) of the step's positions: once per step, not per layer."""
    return {kind: layers.rope_tables(positions, layers.rope_inv_freq(cfg, kind),
                                     layers.rope_scale(cfg, kind))
            for kind in layers.rope_kinds(cfg)}


def decoder_layer(layer: Params, x: jax.Array, kv_pages: object, md: AttentionMetadata,
                  cfg: ModelConfig, options: ModelOptions, ropes: dict, *, index: int,
                  max_q_len: int = 0) -> tuple[jax.Array, object, jax.Array | None]:
    """Decoder layer `index` over this step's tokens x f32[T, D]: (x, its new KV pages,
    tokens each expert got i32[E] in a MoE layer, else None)."""
    h = layers.norm(x, layer["attn_norm"], cfg)
    attn, kv_pages = attention_block(layer, h, kv_pages, md, cfg,
                                     rope=ropes[cfg.layer_rope(index)],
                                     max_q_len=max_q_len, window=cfg.layer_window(index))
    x = x + post_norm(layer, "post_attn_norm", attn, cfg)
    h = layers.norm(x, layer["mlp_norm"], cfg)
    counts = None
    if "w_router" in layer:
        y, experts = moe.moe_block(layer, h, cfg, expert_parallel=options.expert_parallel,
                                   with_experts=True)
        real_tokens = md.cu_q_lens[md.num_seqs[0]]
        counts = moe.expert_counts(experts, real_tokens, cfg.moe.num_experts)
    else:
        y = layers.mlp(layer, h, cfg.hidden_act)
    return x + post_norm(layer, "post_mlp_norm", y, cfg), kv_pages, counts


def _adapter_select(params: Params, md: AttentionMetadata) -> jax.Array | None:
    """f32[T, max_loras]: each token's LoRA slot, one-hot (model/lora.py); None when the
    params hold no adapter slots."""
    if "lora" not in params or md.adapters is None:
        return None
    max_loras = params["lora"][0]["q"]["a"].shape[1]
    return lora.token_select(md.adapters, max_loras)


def split_feature_store(kv_cache: KVCache, options: ModelOptions) -> tuple[KVCache, object]:
    """(the layers' KV pages, the feature store or None): with `options.feature_layers`
    the cache's last entry is the store, f[pages * page_size, feature_size]."""
    if not options.feature_layers:
        return kv_cache, None
    return kv_cache[:-1], kv_cache[-1]


def gather_features(captured: dict[int, jax.Array], params: Params, cfg: ModelConfig,
                    feature_layers: tuple[int, ...]) -> jax.Array:
    """f32[..., feature_size]: the residual streams named by `feature_layers`
    (`captured[i]`: the stream entering layer i, i = L after the last layer), in order;
    FINAL_NORMED is the last one after the final norm."""
    def one(index: int) -> jax.Array:
        if index == FINAL_NORMED:
            return layers.norm(captured[cfg.num_layers], params["final_norm"], cfg)
        return captured[index]

    return jnp.concatenate([one(i).astype(jnp.float32) for i in feature_layers], -1)


def forward_dense(params: Params, token_ids: jax.Array, *, cfg: ModelConfig,
                  options: ModelOptions = DEFAULT_OPTIONS, with_features: bool = False
                  ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal forward over whole sequences i32[B, T] without a cache -> f32[B, T, V];
    `with_features`: (logits, f32[B, T, feature_size]) of `options.feature_layers`.
    `options.batch_invariant`: rounded as the paged forward rounds each token."""
    with invariance.rows_in_blocks(options.batch_invariant):
        return _dense(params, token_ids, cfg, options, with_features)


def _dense(params: Params, token_ids: jax.Array, cfg: ModelConfig, options: ModelOptions,
           with_features: bool) -> jax.Array | tuple[jax.Array, jax.Array]:
    x = layers.embed(params["embed"], token_ids, cfg.scale_embeddings)
    captured = {}
    for index, layer in enumerate(params["layers"]):
        captured[index] = x
        h = layers.norm(x, layer["attn_norm"], cfg)
        attn = dense_causal_attention(layer, h, cfg, cfg.layer_window(index),
                                      cfg.layer_rope(index))
        x = x + post_norm(layer, "post_attn_norm", attn, cfg)
        y = mlp(layer, layers.norm(x, layer["mlp_norm"], cfg), cfg, options.expert_parallel)
        x = x + post_norm(layer, "post_mlp_norm", y, cfg)
    if not with_features:
        return compute_logits(params, x, cfg)
    captured[cfg.num_layers] = x
    return compute_logits(params, x, cfg), gather_features(captured, params, cfg,
                                                           options.feature_layers)


def mlp(layer: Params, x: jax.Array, cfg: ModelConfig, expert_parallel: bool = False
        ) -> jax.Array:
    """The layer's MLP: its experts in a MoE layer (model/moe.py), else dense SwiGLU or
    GeGLU."""
    if "w_router" in layer:
        return moe.moe_block(layer, x, cfg, expert_parallel=expert_parallel)
    return layers.mlp(layer, x, cfg.hidden_act)


def post_norm(layer: Params, key: str, y: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A block's output normed by `key` before its residual add where the layer has that
    norm (Gemma's post_attn_norm, post_mlp_norm), else as it is."""
    return layers.norm(y, layer[key], cfg) if key in layer else y


def compute_logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and LM head (tied to the embedding when configured) -> f32[..., V],
    soft-capped to cap * tanh(logits / cap) when configured (Gemma 2)."""
    x = layers.norm(x, params["final_norm"], cfg)
    head = params.get("lm_head", params["embed"])  # a quantized model always has one
    rows = x.shape[0] if x.ndim == 2 else None
    min_rows = layers.min_matmul_rows(head.dtype)
    if invariance.active():
        with invariance.rows_in_blocks(False):
            logits = invariance.map_rows(lambda block: lm_head(params, block), x)
    elif rows is not None and rows < min_rows:  # see layers.min_matmul_rows
        logits = lm_head(params, jnp.pad(x, ((0, min_rows - rows), (0, 0))))
    else:
        logits = lm_head(params, x)
    logits = sharding.split_vocab(logits)
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = cap * jnp.tanh(logits / cap)
    return logits if rows is None else logits[:rows]


def lm_head(params: Params, x: jax.Array) -> jax.Array:
    """Normed x f[..., D] -> f32[..., V] by the LM head, or the embedding when tied."""
    if "lm_head" in params:
        return layers.linear(x, params["lm_head"])
    # Contract with the [V, D] table as stored: `x @ embed.T` made XLA:CPU convert the
    # whole bf16 table to f32 every step (27 ms vs 5 ms on the SmolLM shape).
    table = params["embed"]
    return jnp.einsum("...d,vd->...v", x.astype(table.dtype), table,
                      preferred_element_type=jnp.float32)
