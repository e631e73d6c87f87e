"""Mistral (`MistralForCausalLM`): Llama's block with every layer attending within one
sliding window (config.json's sliding_window; none when it is null).
docs/architecture.md#model-families.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config.families import llama
from jaxinfer.config.families.base import Family, HFConfig

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig


def from_hf(hf: HFConfig) -> dict[str, Any]:
    return llama.dense_fields(hf) | {"sliding_window": hf.get("sliding_window")}


def to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    return {"sliding_window": cfg.sliding_window}


FAMILY = Family(name="mistral", architectures=("MistralForCausalLM",), model_type="mistral",
                from_hf=from_hf, to_hf=to_hf, presets=("mistral-7b",))
