"""Gemma 2 and Gemma 3 (text) in an HF `config.json`: the fields `ModelConfig` takes.

Both families run the decoder block with Gemma's numerics: RMSNorm scaled by (1 + w),
norms after attention and after the MLP as well as before, GeGLU with tanh-approximated
GELU, embeddings scaled by sqrt(hidden_size), a tied head, and layers alternating
between a sliding window and global attention (`layer_types`). Gemma 2 soft-caps
attention scores and final logits; Gemma 3 has q/k norms and separate RoPE for its
local (sliding) and global layers, the global ones scaled (linear factor 8 from 4B up).
A `Gemma3ForConditionalGeneration` config serves its text tower (`text_config`); the
checkpoint reader drops the vision weights (checkpoint/text_tower.py).
Imports nothing from config/model.py (which imports this); the RoPE reader is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
MODEL_TYPES = {"gemma3": "gemma3_text"}  # our architecture -> HF's model_type
ARCHITECTURE_OF_MODEL_TYPE = {v: k for k, v in MODEL_TYPES.items()}
MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
GELU_TANH = "gelu_pytorch_tanh"
# Gemma3TextConfig's defaults: the text_config of a Hub checkpoint names only what differs.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    max_position_embeddings=131_072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
    sliding_window=4096)
# transformers' layer patterns when config.json has no layer_types: every n-th layer
# global (Gemma 2: every other one; Gemma 3: `sliding_window_pattern`, default 6).
DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma 3's defaults

RopeReader = Callable[..., tuple[float, Any]]  # config/model.py's _rope_from_hf


def text_tower_config(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The text model's config.json dict of a multimodal Gemma 3 config (its
    `text_config` with transformers' defaults filled in); None for any other config."""
    archs = hf.get("architectures") or []
    multimodal = any(a in MULTIMODAL_ARCHITECTURES for a in archs) or (
        not archs and hf.get("model_type") == "gemma3")
    if not multimodal:
        return None
    if not isinstance(hf.get("text_config"), dict):
        raise ValueError("config.json of Gemma3ForConditionalGeneration has no text_config")
    text = GEMMA3_TEXT_DEFAULTS | hf["text_config"]
    text["architectures"] = ["Gemma3ForCausalLM"]
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    return text


def gemma_fields_from_hf(arch: str, hf: dict[str, Any],
                         read_rope: RopeReader) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2 or Gemma 3 config.json, beyond the common shape."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH
    if act != GELU_TANH:
        raise ValueError(f"config.json hidden_activation={act!r} is not supported "
                         f"(only {GELU_TANH!r})")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true is not supported "
                         "(causal attention only)")
    if hf.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true is not supported for {arch}")
    fields = {
        "hidden_act": act,
        "norm_weight_offset": 1.0,
        "post_norms": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
        "sliding_window": hf.get("sliding_window", 4096),
        "layer_types": _layer_types(arch, hf),
    }
    if arch == "gemma2":
        theta, scaling = read_rope(hf)
        return fields | {
            "rope_theta": theta, "rope_scaling": scaling,
            "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0)}
    # Gemma 3: transformers' Gemma3Attention never applies attn_logit_softcapping.
    return fields | _gemma3_rope(hf, read_rope) | {
        "qk_norm": True, "final_logit_softcapping": hf.get("final_logit_softcapping")}


def _layer_types(arch: str, hf: dict[str, Any]) -> tuple[str, ...]:
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    every = hf.get("sliding_window_pattern") or DEFAULT_PATTERN[arch]
    return pattern_layer_types(hf["num_hidden_layers"], every)


def pattern_layer_types(num_layers: int, every: int) -> tuple[str, ...]:
    """Every `every`-th layer global, the others sliding (HF's `sliding_window_pattern`)."""
    if not isinstance(every, int) or every <= 0:
        raise ValueError(f"sliding_window_pattern={every!r} must be a positive int")
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(num_layers))


def _gemma3_rope(hf: dict[str, Any], read_rope: RopeReader) -> dict[str, Any]:
    """Global and local RoPE: `rope_parameters` per layer type (transformers >= 5), else
    the legacy rope_theta and rope_scaling (global) and rope_local_base_freq (local)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        global_rope = params.get("full_attention") or {}
        local_rope = params.get("sliding_attention") or {}
    else:
        global_rope = {**(hf.get("rope_scaling") or {}), **params}
        global_rope.setdefault("rope_theta", hf.get("rope_theta", GLOBAL_THETA))
        local_rope = {"rope_theta": hf.get("rope_local_base_freq", LOCAL_THETA)}
    theta, scaling = read_rope({"rope_parameters": global_rope}, GLOBAL_THETA)
    local_theta, local_scaling = read_rope({"rope_parameters": local_rope}, LOCAL_THETA)
    if local_scaling is not None:
        raise ValueError(f"config.json rope_parameters.sliding_attention rope_type="
                         f"{local_scaling.rope_type!r} is not supported (only 'default')")
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def gemma_to_hf(cfg: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """The Gemma fields of `ModelConfig.to_hf` (`rope`: the global layers' parameters)."""
    layer_types = cfg.layer_types or tuple(
        "sliding_attention" if cfg.sliding_window else "full_attention"
        for _ in range(cfg.num_layers))
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    out = {
        "hidden_activation": cfg.hidden_act,
        # transformers' strict config takes an int here (168, 256)
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(layer_types),
    }
    if cfg.architecture == "gemma3":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    return out
