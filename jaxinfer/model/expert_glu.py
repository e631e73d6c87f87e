"""The experts' gated activation over gate/up outputs interleaved in blocks (model/fusion.py):
`Glu` (static) holds the block size and the activation, "swiglu" or gpt-oss's
"clamped_swiglu" in transformers' order of operations (`GptOssExperts._apply_gate`).
See docs/moe.md#gpt-oss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion


class Glu(NamedTuple):
    """How gate/up columns become the down projection's input."""

    block: int  # gate/up interleave block (fusion.mlp_block)
    activation: str = "swiglu"  # config.moe.ACTIVATIONS
    alpha: float = 1.702
    limit: float = 7.0


def glu_of(cfg: ModelConfig) -> Glu:
    """The experts' Glu of a MoE config."""
    moe = cfg.moe
    return Glu(fusion.mlp_block(moe.intermediate_size), moe.activation, moe.swiglu_alpha,
               moe.swiglu_limit)


def gated(h: jax.Array, glu: Glu | int) -> jax.Array:
    """f32[..., 2F] gate/up outputs in blocks -> f32[..., F]; a bare block size means
    plain SwiGLU."""
    glu = glu if isinstance(glu, Glu) else Glu(glu)
    f = h.shape[-1] // 2
    pair = h.reshape(*h.shape[:-1], f // glu.block, 2, glu.block)
    gate, up = pair[..., 0, :], pair[..., 1, :]
    if glu.activation == "clamped_swiglu":
        gate = jnp.minimum(gate, glu.limit)
        up = jnp.clip(up, -glu.limit, glu.limit)
        hidden = (up + 1) * (gate * jax.nn.sigmoid(gate * glu.alpha))
    else:
        hidden = jax.nn.silu(gate) * up
    return hidden.reshape(*h.shape[:-1], f)
