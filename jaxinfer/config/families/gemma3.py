"""Gemma 3 (`Gemma3ForCausalLM`, and the text tower of `Gemma3ForConditionalGeneration`):
Gemma 2's block (gemma2.py) with q/k norms, no attention soft cap, and separate RoPE for
its local (sliding) and global layers, the global ones scaled (linear factor 8 from 4B
up). A multimodal config serves its text tower (`text_config`); the checkpoint reader
drops the vision weights (checkpoint/text_tower.py). docs/architecture.md#model-families.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config import rope
from jaxinfer.config.families import gemma2
from jaxinfer.config.families.base import Family, HFConfig

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

NAME = "gemma3"
ARCHITECTURE = "Gemma3ForCausalLM"
MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
MULTIMODAL_MODEL_TYPE = "gemma3"  # the text model's is "gemma3_text"
# Gemma3TextConfig's defaults: the text_config of a Hub checkpoint names only what differs.
TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    max_position_embeddings=131_072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
    sliding_window=4096)
DEFAULT_PATTERN = 6  # every 6th layer global (transformers' sliding_window_pattern)
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


def text_tower_config(hf: HFConfig) -> HFConfig | None:
    """The text model's config.json dict of a multimodal Gemma 3 config (its
    `text_config` with transformers' defaults filled in); None for any other config."""
    archs = hf.get("architectures") or []
    multimodal = any(a in MULTIMODAL_ARCHITECTURES for a in archs) or (
        not archs and hf.get("model_type") == MULTIMODAL_MODEL_TYPE)
    if not multimodal:
        return None
    if not isinstance(hf.get("text_config"), dict):
        raise ValueError(f"config.json of {MULTIMODAL_ARCHITECTURES[0]} has no text_config")
    text = TEXT_DEFAULTS | hf["text_config"]
    text["architectures"] = [ARCHITECTURE]
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    return text


def from_hf(hf: HFConfig) -> dict[str, Any]:
    # transformers' Gemma3Attention never applies attn_logit_softcapping
    return gemma2.gemma_fields(hf, NAME, DEFAULT_PATTERN) | _rope(hf) | {
        "qk_norm": True, "final_logit_softcapping": hf.get("final_logit_softcapping")}


def _rope(hf: HFConfig) -> dict[str, Any]:
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
    theta, scaling = rope.rope_from_hf({"rope_parameters": global_rope}, GLOBAL_THETA)
    local_theta, local_scaling = rope.rope_from_hf({"rope_parameters": local_rope},
                                                   LOCAL_THETA)
    if local_scaling is not None:
        raise ValueError(f"config.json rope_parameters.sliding_attention rope_type="
                         f"{local_scaling.rope_type!r} is not supported (only 'default')")
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return gemma2.to_hf(cfg, rope_parameters) | {"rope_parameters": {
        "full_attention": rope_parameters, "sliding_attention": local}}


def check(cfg: ModelConfig) -> None:
    if cfg.attn_logit_softcapping is not None:
        raise ValueError(f"attn_logit_softcapping={cfg.attn_logit_softcapping!r} must be "
                         f"None for {NAME} (transformers' Gemma 3 never applies it)")


FAMILY = Family(name=NAME, architectures=(ARCHITECTURE,), model_type="gemma3_text",
                from_hf=from_hf, to_hf=to_hf, rows=gemma2.NORM_ROWS,
                presets=("gemma-3-27b",), with_defaults=gemma2.with_defaults,
                text_config=text_tower_config, check=check)
