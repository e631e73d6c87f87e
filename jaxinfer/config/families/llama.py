"""Llama 2 and 3 (`LlamaForCausalLM`): the plain decoder block (SwiGLU MLP, RMSNorm
before attention and before the MLP, RoPE, optionally Llama 3's frequency scaling) that
Mistral and Qwen extend, and the layer of the EAGLE drafters (config/heads.py).
docs/architecture.md#model-families.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config import rope
from jaxinfer.config.families.base import Family, HFConfig, silu_only

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig


def dense_fields(hf: HFConfig, *, qkv_bias: bool = False, qk_norm: bool = False
                 ) -> dict[str, Any]:
    """The fields of a SwiGLU decoder's config.json beyond the common shape: its RoPE, and
    q/k/v biases (`qkv_bias`, or config.json's attention_bias) and q/k norms."""
    silu_only(hf)
    theta, scaling = rope.rope_from_hf(hf)
    return {"rope_theta": theta, "rope_scaling": scaling,
            "qkv_bias": qkv_bias or bool(hf.get("attention_bias", False)),
            "qk_norm": qk_norm}


def no_fields_to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    """A family whose config.json has only the common fields."""
    return {}


FAMILY = Family(
    name="llama", architectures=("LlamaForCausalLM",), model_type="llama",
    from_hf=dense_fields, to_hf=no_fields_to_hf,
    presets=("llama2-7b", "llama3.1-8b", "llama3.1-70b", "smollm-135m"))
