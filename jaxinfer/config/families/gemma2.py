"""Gemma 2 (`Gemma2ForCausalLM`): the decoder block with Gemma's numerics, which Gemma 3
(gemma3.py) keeps: (1 + w) RMSNorm, four norms a layer under HF names of their own,
GeGLU, scaled embeddings, a tied head, alternating sliding and global layers, soft caps.
See docs/models.md#gemma-2-and-gemma-3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config import rope
from jaxinfer.config.families.base import Family, HFConfig, pattern_layer_types
from jaxinfer.config.families.rows import Param, Part, hidden

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

GELU_TANH = "gelu_pytorch_tanh"
# transformers' layer pattern when config.json has no layer_types: every other layer global
DEFAULT_PATTERN = 2
NAME = "gemma2"


def _post_norms(cfg: ModelConfig, layer: int) -> bool:
    return cfg.post_norms


# HF's post_attention_layernorm is Gemma's attention output norm, where Llama's is the
# MLP's input norm (model/params_table.py's mlp_norm row, off with post_norms).
NORM_ROWS = (
    Param("post_attn_norm", (Part("post_attn_norm", "post_attention_layernorm.weight",
                                  lambda c: (hidden(c),)),), "whole", when=_post_norms),
    Param("mlp_norm", (Part("mlp_norm", "pre_feedforward_layernorm.weight",
                            lambda c: (hidden(c),)),), "whole", when=_post_norms),
    Param("post_mlp_norm", (Part("post_mlp_norm", "post_feedforward_layernorm.weight",
                                 lambda c: (hidden(c),)),), "whole", when=_post_norms),
)


def with_defaults(hf: HFConfig) -> HFConfig:
    """Gemma ties its LM head to the embedding unless config.json says otherwise."""
    return {"tie_word_embeddings": True} | hf


def gemma_fields(hf: HFConfig, family: str, default_pattern: int) -> dict[str, Any]:
    """The fields Gemma 2 and Gemma 3 read alike (`default_pattern`: every n-th layer
    global when config.json has neither layer_types nor sliding_window_pattern)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH
    if act != GELU_TANH:
        raise ValueError(f"config.json hidden_activation={act!r} is not supported "
                         f"(only {GELU_TANH!r})")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true is not supported "
                         "(causal attention only)")
    if hf.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true is not supported for {family}")
    if hf.get("layer_types"):
        layer_types = tuple(hf["layer_types"])
    else:
        every = hf.get("sliding_window_pattern") or default_pattern
        layer_types = pattern_layer_types(hf["num_hidden_layers"], every)
    return {
        "hidden_act": act,
        "norm_weight_offset": 1.0,
        "post_norms": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
        "sliding_window": hf.get("sliding_window", 4096),
        "layer_types": layer_types,
    }


def from_hf(hf: HFConfig) -> dict[str, Any]:
    theta, scaling = rope.rope_from_hf(hf)
    return gemma_fields(hf, NAME, DEFAULT_PATTERN) | {
        "rope_theta": theta, "rope_scaling": scaling,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0)}


def to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    """The Gemma fields of a config.json (Gemma 3's as well, but for its RoPE)."""
    layer_types = cfg.layer_types or tuple(
        "sliding_attention" if cfg.sliding_window else "full_attention"
        for _ in range(cfg.num_layers))
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    return {
        "hidden_activation": cfg.hidden_act,
        # transformers' strict config takes an int here (168, 256)
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(layer_types),
    }


FAMILY = Family(name=NAME, architectures=("Gemma2ForCausalLM",), model_type="gemma2",
                from_hf=from_hf, to_hf=to_hf, rows=NORM_ROWS, presets=("gemma-2-9b",),
                with_defaults=with_defaults)
