"""Medusa heads as pure functions: H heads on the target's final normed hidden state, head
h proposing the token h + 1 places after the one the target just sampled.
See docs/speculative_decoding.md#head-checkpoints-and-the-heads-step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config.heads import HeadConfig
from jaxinfer.model import draft, layers
from jaxinfer.model.attention import read_features
from jaxinfer.model.draft import DraftInputs

Params = dict


def head_logits(params: Params, features: jax.Array, *, cfg: HeadConfig,
                vocab_size: int) -> jax.Array:
    """f32[R, H, vocab_size]: every head's logits of features f[R, D] (the target's
    final normed hidden states); ids outside a truncated vocabulary are -inf. A loop
    over the heads of [R, D] matmuls: XLA:CPU has no bfloat16 dot with a batch axis
    (DotThunk refuses BF16 x BF16 = F32), and a head's matmuls are its own anyway."""
    rows = features.shape[0]
    min_rows = layers.min_matmul_rows(params["blocks_w"].dtype)
    x = features.astype(jnp.float32)
    if rows < min_rows:  # see layers.min_matmul_rows
        x = jnp.pad(x, ((0, min_rows - rows), (0, 0)))
    lm = params["lm_heads"]
    out = []
    for h in range(cfg.num_heads):
        y = x
        for j in range(cfg.num_layers):
            bias = params["blocks_b"][h, j] if "blocks_b" in params else None
            y = y + jax.nn.silu(layers.linear(y, params["blocks_w"][h, j], bias))
        out.append(layers.linear(y, lm[0 if lm.shape[0] == 1 else h])[:rows])
    out = jnp.stack(out, axis=1)  # [R, H, V']
    if "token_map" in params:
        full = jnp.full((rows, cfg.num_heads, cfg.vocab_size), -jnp.inf, jnp.float32)
        out = full.at[:, :, params["token_map"]].set(out)
    return _fit_vocab(out, vocab_size)


def _fit_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """draft.fit_vocab over [R, H, V]."""
    rows, heads, vocab = logits.shape
    fitted = draft.fit_vocab(logits.reshape(rows * heads, vocab), vocab_size)
    return fitted.reshape(rows, heads, vocab_size)


def propose(params: Params, store: jax.Array, inputs: DraftInputs, *, cfg: HeadConfig,
            page_size: int, num_positions: int, vocab_size: int
            ) -> tuple[jax.Array, jax.Array]:
    """(i32[S, Q] drafts, f32[S, Q, vocab_size] their q), Q = num_positions = K + 1:
    every head reads the target's feature at positions[s] (the position before the
    last token, whose hidden state sampled it); draft h is drawn from head h's
    distribution under the request's settings with drafts 0..h-1 in the penalty
    history, as model/draft.py draws. `inputs.num_steps` = k <= num_heads drafts;
    columns from k on are unused (zeros)."""
    num_slots = inputs.positions.shape[0]
    md = draft.step_metadata(inputs, 0, page_size=page_size, num_tokens=num_slots)
    all_logits = head_logits(params, read_features(store, md.slot_mapping), cfg=cfg,
                             vocab_size=vocab_size)
    tokens = jnp.zeros((num_slots, num_positions), jnp.int32)
    probs = jnp.zeros((num_slots, num_positions, vocab_size), jnp.float32)

    def body(h: jax.Array, carry: tuple) -> tuple:
        sampling, tokens, probs = carry
        head = jax.lax.dynamic_index_in_dim(all_logits, h, axis=1, keepdims=False)
        token, q = draft._draw(head, sampling)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, h))
        probs = jax.lax.dynamic_update_slice(probs, q[:, None, :], (0, h, 0))
        return draft._advance(sampling, token), tokens, probs

    steps = jnp.minimum(inputs.num_steps, cfg.num_heads)
    _, tokens, probs = jax.lax.fori_loop(0, steps, body, (inputs.sampling, tokens, probs))
    return tokens, probs
