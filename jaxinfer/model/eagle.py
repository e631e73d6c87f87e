"""EAGLE-1/2 ("eagle") and EAGLE-3 ("eagle3") heads as pure functions: one decoder layer
over the target's embeddings and hidden features, with its own paged KV; `prefill`
catches up from the feature store, `propose` drafts k tokens in one device call.
See docs/speculative_decoding.md#head-checkpoints-and-the-heads-step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config.heads import HeadConfig
from jaxinfer.model import draft, layers
from jaxinfer.model.attention import (
    AttentionMetadata,
    attention_block,
    dense_causal_attention,
    read_features,
)
from jaxinfer.model.draft import DraftInputs

Params = dict


def forward(params: Params, shared: Params, kv_pages: jax.Array, token_ids: jax.Array,
            features: jax.Array, md: AttentionMetadata, *, cfg: HeadConfig,
            from_target: bool, max_q_len: int = 0) -> tuple[jax.Array, jax.Array]:
    """One step over token_ids i32[T] with features f[T, W] (W = cfg.feature_size
    `from_target`, else the head's own hidden width D): writes the head's K/V at
    md.slot_mapping, returns (kv_pages, f32[T, D] the hidden the next step feeds)."""
    x, residual = _layer_input(params, shared, token_ids, features, cfg, from_target)
    rope = layers.rope_tables(md.positions, layers.rope_inv_freq(cfg.layer),
                              layers.rope_scale(cfg.layer))
    attn, kv_pages = attention_block(params["layer"], x, kv_pages, md, cfg.layer,
                                     rope=rope, max_q_len=max_q_len)
    return kv_pages, _finish(params["layer"], attn, residual, cfg)


def forward_dense(params: Params, shared: Params, token_ids: jax.Array,
                  features: jax.Array, *, cfg: HeadConfig, from_target: bool = True
                  ) -> jax.Array:
    """Causal forward over whole sequences i32[B, T] (position t at t) without a
    cache -> f32[B, T, D], the hidden `forward` returns."""
    x, residual = _layer_input(params, shared, token_ids, features, cfg, from_target)
    attn = dense_causal_attention(params["layer"], x, cfg.layer)
    return _finish(params["layer"], attn, residual, cfg)


def _layer_input(params: Params, shared: Params, token_ids: jax.Array,
                 features: jax.Array, cfg: HeadConfig, from_target: bool
                 ) -> tuple[jax.Array, jax.Array]:
    """(attention input f32[..., D_in], residual f32[..., D]) of one step."""
    layer = params["layer"]
    embeds = layers.embed(params.get("embed", shared["embed"]), token_ids)
    features = features.astype(jnp.float32)
    if cfg.method == "eagle":
        x = layers.linear(jnp.concatenate([embeds, features], -1), params["fc"],
                          params.get("fc_bias"))
        return x, x
    h = layers.linear(features, params["fc"]) if from_target else features
    normed = layers.norm(h, layer["hidden_norm"], cfg.layer)
    residual = normed if cfg.norm_before_residual else h
    x = jnp.concatenate([layers.norm(embeds, layer["attn_norm"], cfg.layer), normed], -1)
    return x, residual


def _finish(layer: Params, attn: jax.Array, residual: jax.Array, cfg: HeadConfig
            ) -> jax.Array:
    """The rest of the layer after attention: residual add, MLP, residual add."""
    x = attn + residual
    return x + layers.mlp(layer, layers.norm(x, layer["mlp_norm"], cfg.layer))


def logits(params: Params, shared: Params, hidden: jax.Array, *, cfg: HeadConfig,
           vocab_size: int) -> jax.Array:
    """f32[R, vocab_size] of hidden f32[R, D] (what `forward` returns): eagle through
    the target's LM head (or tied embedding), eagle3 through its own over the draft
    vocabulary, scattered to the target's ids (-inf for ids it cannot propose)."""
    rows = hidden.shape[0]
    if cfg.method == "eagle3":
        head = params["lm_head"]
        x = layers.norm(hidden, params["final_norm"], cfg.layer)
    else:
        head = shared.get("lm_head", shared["embed"])
        x = hidden
    min_rows = layers.min_matmul_rows(head.dtype)
    if rows < min_rows:  # see layers.min_matmul_rows
        x = jnp.pad(x, ((0, min_rows - rows), (0, 0)))
    if cfg.method == "eagle3":
        draft_logits = layers.linear(x, head)[:rows]
        target_ids = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32) + params["d2t"]
        out = jnp.full((rows, cfg.vocab_size), -jnp.inf, jnp.float32)
        return draft.fit_vocab(out.at[:, target_ids].set(draft_logits), vocab_size)
    if "lm_head" in shared:
        out = layers.linear(x, head)
    else:  # the tied [V, D] table as stored (see transformer.compute_logits)
        out = jnp.einsum("...d,vd->...v", x.astype(head.dtype), head,
                         preferred_element_type=jnp.float32)
    return draft.fit_vocab(out[:rows], vocab_size)


def prefill(params: Params, shared: Params, kv_pages: jax.Array, store: jax.Array,
            token_ids: jax.Array, md: AttentionMetadata, *, cfg: HeadConfig) -> jax.Array:
    """Catch-up: token t (the token after position md.positions[t]) with the target's
    feature at that position, store[md.slot_mapping[t]]; writes the head's K/V there
    and returns kv_pages. Padding tokens map to page 0 and write only there."""
    features = read_features(store, md.slot_mapping)
    kv_pages, _ = forward(params, shared, kv_pages, token_ids, features, md, cfg=cfg,
                          from_target=True)
    return kv_pages


def propose(params: Params, shared: Params, kv_pages: jax.Array, store: jax.Array,
            first_ids: jax.Array, first_md: AttentionMetadata, inputs: DraftInputs, *,
            cfg: HeadConfig, page_size: int, num_positions: int, vocab_size: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(kv_pages, i32[S, Q] drafts, f32[S, Q, vocab_size] their q), Q = num_positions
    = K + 1. Iteration 0 is ragged (`first_ids`, `first_md`, as build_metadata lays out
    a prefill, one logits row a slot): slot s's positions the head has not seen up to
    positions[s] (the one before its last token), each with the target's feature there
    and the token after it, so the catch-up over the last step's accepted tokens and
    the first draft are one forward; iteration i > 0 feeds the draft drawn at i - 1 at
    positions[s] + i with the head's previous hidden. `inputs.num_steps` = k <= K
    iterations; columns from k on are unused (zeros)."""
    num_slots, num_tokens = inputs.positions.shape[0], inputs.token_ids.shape[0]
    kv_pages, hidden = forward(params, shared, kv_pages, first_ids,
                               read_features(store, first_md.slot_mapping), first_md,
                               cfg=cfg, from_target=True, max_q_len=num_positions)
    last = hidden[first_md.logits_indices]  # [S, D]: each slot's position before its token
    token, q = draft._draw(logits(params, shared, last, cfg=cfg, vocab_size=vocab_size),
                           inputs.sampling)
    hidden = jnp.zeros((num_tokens, last.shape[-1]), last.dtype).at[:num_slots].set(last)
    drafting = inputs.num_steps > 0
    tokens = jnp.zeros((num_slots, num_positions), jnp.int32)
    probs = jnp.zeros((num_slots, num_positions, vocab_size), jnp.float32)
    tokens = tokens.at[:, 0].set(jnp.where(drafting, token, 0))
    probs = probs.at[:, 0].set(jnp.where(drafting, q, 0.0))

    def body(i: jax.Array, carry: tuple) -> tuple:
        kv, token_ids, hidden, sampling, tokens, probs = carry
        md = draft.step_metadata(inputs, i, page_size=page_size, num_tokens=num_tokens)
        kv, hidden = forward(params, shared, kv, token_ids, hidden, md, cfg=cfg,
                             from_target=False, max_q_len=1)
        token, q = draft._draw(logits(params, shared, hidden[:num_slots], cfg=cfg,
                                      vocab_size=vocab_size), sampling)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
        probs = jax.lax.dynamic_update_slice(probs, q[:, None, :], (0, i, 0))
        token_ids = token_ids.at[:num_slots].set(token)
        return kv, token_ids, hidden, draft._advance(sampling, token), tokens, probs

    carry = (kv_pages, inputs.token_ids.at[:num_slots].set(token), hidden,
             draft._advance(inputs.sampling, token), tokens, probs)
    kv_pages, _, _, _, tokens, probs = jax.lax.fori_loop(1, inputs.num_steps, body, carry)
    return kv_pages, tokens, probs
