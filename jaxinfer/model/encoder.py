"""The encoder family (BERT, XLM-RoBERTa) as pure functions over a params dict: post-LN
blocks with bidirectional attention over packed rows, each input a segment attending to
itself alone (pooling/packing.py), and the classification heads of their
*ForSequenceClassification. Linear weights are [in, out], q/k/v fused. See
docs/pooling.md#encoder-models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config.encoder import EncoderConfig

Params = dict
MASKED = -1e30  # a score no softmax weight survives (finite: no NaN in padding rows)
KEY_BLOCK = 128  # keys a step of the online softmax reads (64 and 256 ran slower)


def param_shapes(cfg: EncoderConfig) -> Params:
    """The params' structure, with each leaf's shape."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    layer = {"wqkv": (d, 3 * d), "bqkv": (3 * d,), "wo": (d, d), "bo": (d,),
             "attn_norm": (d,), "attn_norm_bias": (d,), "w_in": (d, f), "b_in": (f,),
             "w_out": (f, d), "b_out": (d,), "mlp_norm": (d,), "mlp_norm_bias": (d,)}
    shapes: Params = {
        "word_embed": (cfg.vocab_size, d), "position_embed": (cfg.max_position_embeddings, d),
        "type_embed": (cfg.type_vocab_size, d), "embed_norm": (d,), "embed_norm_bias": (d,),
        "layers": [dict(layer) for _ in range(cfg.num_layers)]}
    if cfg.head is not None:
        shapes["head"] = {"w_dense": (d, d), "b_dense": (d,), "w_out": (d, cfg.num_labels),
                          "b_out": (cfg.num_labels,)}
    return shapes


def init_params(cfg: EncoderConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                std: float = 0.02) -> Params:
    """Random init: normal(std) matrices and embeddings, norms scaling by one, zero biases."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    out = []
    for path, shape, k in zip(paths, leaves, jax.random.split(key, len(leaves)), strict=True):
        if "norm" in path and "bias" not in path:
            out.append(jnp.ones(shape, dtype))
        elif len(shape) == 1:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def forward(params: Params, token_ids: jax.Array, token_type_ids: jax.Array,
            positions: jax.Array, segment_ids: jax.Array, *, cfg: EncoderConfig
            ) -> jax.Array:
    """i32[R, L] packed inputs -> f32[R, L, D] last hidden states. `positions`: 0-based
    within each input; `segment_ids`: 1, 2, ... per input in its row, 0 padding."""
    x = (_take(params["word_embed"], token_ids)
         + _take(params["position_embed"], positions + cfg.position_offset)
         + _take(params["type_embed"], token_type_ids))
    x = layer_norm(x, params["embed_norm"], params["embed_norm_bias"], cfg.layer_norm_eps)
    # [R, 1, L, L]: a query sees the keys of its own input, never padding
    mask = ((segment_ids[:, :, None] == segment_ids[:, None, :])
            & (segment_ids[:, None, :] > 0))[:, None]
    bias = jnp.where(mask, 0.0, MASKED).astype(jnp.float32)
    for layer in params["layers"]:
        x = _block(layer, x, bias, cfg)
    return x


def _block(layer: Params, x: jax.Array, bias: jax.Array, cfg: EncoderConfig) -> jax.Array:
    """One post-LN block: x + attention, normed; then x + MLP, normed."""
    attn = linear(_attention(layer, x, bias, cfg), layer["wo"], layer["bo"])
    x = layer_norm(x + attn, layer["attn_norm"], layer["attn_norm_bias"], cfg.layer_norm_eps)
    h = _gelu(linear(x, layer["w_in"], layer["b_in"]), cfg.hidden_act)
    y = linear(h, layer["w_out"], layer["b_out"])
    return layer_norm(x + y, layer["mlp_norm"], layer["mlp_norm_bias"], cfg.layer_norm_eps)


def _attention(layer: Params, x: jax.Array, bias: jax.Array, cfg: EncoderConfig
               ) -> jax.Array:
    """Self-attention of packed rows; `bias` f32[R, 1, L, L] is 0 where a query may see
    a key, MASKED elsewhere. The softmax runs online over blocks of KEY_BLOCK keys (as
    flash attention does): a [R, H, L, L] float32 score array read and written whole
    cost XLA:CPU 1.4x the time (docs/pooling.md#encoder-models)."""
    rows, length, _ = x.shape
    dtype = layer["wqkv"].dtype
    qkv = linear(x, layer["wqkv"], layer["bqkv"]).astype(dtype).reshape(
        rows, length, 3, cfg.num_heads, cfg.head_dim)
    q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # each [R, H, L, Dh]: batch axes first
    q = q * jnp.asarray(cfg.head_dim ** -0.5, dtype)
    block = KEY_BLOCK if length % KEY_BLOCK == 0 else length
    top = jnp.full((rows, cfg.num_heads, length, 1), MASKED, jnp.float32)
    total = jnp.zeros_like(top)
    out = jnp.zeros((rows, cfg.num_heads, length, cfg.head_dim), jnp.float32)
    for start in range(0, length, block):
        keys = slice(start, start + block)
        scores = jnp.matmul(q, k[:, :, keys].swapaxes(-1, -2),
                            preferred_element_type=jnp.float32) + bias[..., keys]
        new_top = jnp.maximum(top, scores.max(-1, keepdims=True))
        weights, rescale = jnp.exp(scores - new_top), jnp.exp(top - new_top)
        total = total * rescale + weights.sum(-1, keepdims=True)
        out = out * rescale + jnp.matmul(weights.astype(dtype), v[:, :, keys],
                                         preferred_element_type=jnp.float32)
        top = new_top
    out = out / total
    return out.transpose(0, 2, 1, 3).reshape(rows, length, cfg.hidden_size)


def classify(params: Params, cls_hidden: jax.Array, *, cfg: EncoderConfig) -> jax.Array:
    """f32[N, num_labels] logits of the classification head on each input's first
    token: BERT's tanh pooler then `classifier`; XLM-R's `classifier.dense`, tanh,
    `out_proj` (the same arithmetic, the weights named apart)."""
    head = params["head"]
    pooled = jnp.tanh(linear(cls_hidden, head["w_dense"], head["b_dense"]))
    return linear(pooled, head["w_out"], head["b_out"])


def linear(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """x @ w + b in the weight dtype, accumulated and returned in float32."""
    y = jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return y + b.astype(jnp.float32)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32."""
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return ((x - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
            + bias.astype(jnp.float32))


def _gelu(x: jax.Array, act: str) -> jax.Array:
    return jax.nn.gelu(x, approximate=act != "gelu")


def _take(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0, mode="clip").astype(jnp.float32)
