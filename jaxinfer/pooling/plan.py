"""`plan` for an encoder (BERT, XLM-RoBERTa): its weights and its largest packed step,
with no KV cache (an encoder keeps nothing between steps). Decoder pooling models plan
as generating ones do: their KV pages live for a request's prompt only. See
docs/pooling.md#planning.
"""

from __future__ import annotations

import math

import jax

from jaxinfer.config.encoder import EncoderConfig
from jaxinfer.model import encoder
from jaxinfer.pooling import packing

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def encoder_plan(cfg: EncoderConfig, *, dtype: str, max_num_batched_tokens: int,
                 max_model_len: int | None = None,
                 memory_bytes: int | None = None) -> dict[str, object]:
    """Bytes of the weights and of the largest step's activations (the step's float32
    hidden states and one layer's attention scores and MLP), and whether they fit
    `memory_bytes` if given."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPE_BYTES)}")
    max_len = min(max_model_len or cfg.max_len, cfg.max_len)
    shapes = jax.tree.leaves(encoder.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    weights = sum(math.prod(shape) for shape in shapes) * DTYPE_BYTES[dtype]
    ladder = packing.buckets(max_len, max_num_batched_tokens)
    largest = max(ladder, key=lambda b: (b.num_tokens, b.row_len))
    tokens, width = largest.num_tokens, cfg.hidden_size
    scores = largest.rows * cfg.num_heads * largest.row_len ** 2 * 4 * 2  # scores, probs
    hidden = tokens * (4 * width + cfg.intermediate_size) * 4  # x, qkv, MLP
    plan: dict[str, object] = {
        "kind": "encoder", "architecture": cfg.architecture, "dtype": dtype,
        "weight_bytes": weights, "kv_cache_bytes": 0, "max_model_len": max_len,
        "buckets": len(ladder),
        "largest_step": {"rows": largest.rows, "row_len": largest.row_len,
                         "tokens": tokens, "inputs": largest.max_inputs},
        "step_activation_bytes": scores + hidden,
        "total_bytes": weights + scores + hidden,
        "matmul_flops_per_token": 2 * cfg.num_layers * (
            4 * width * width + 2 * width * cfg.intermediate_size)}
    if memory_bytes is not None:
        plan["memory_bytes"] = memory_bytes
        plan["fits"] = plan["total_bytes"] <= memory_bytes
    return plan
