"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms) with Qwen2-MoE's
experts (qwen2_moe.py) and no shared expert. docs/moe.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config.families import qwen2_moe, qwen3
from jaxinfer.config.families.base import Family, HFConfig

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

NAME = "qwen3_moe"


def from_hf(hf: HFConfig) -> dict[str, Any]:
    return qwen3.from_hf(hf) | {"moe": qwen2_moe.qwen_moe_from_hf(hf, NAME, shared=False)}


def to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    return qwen2_moe.qwen_moe_to_hf(cfg.moe, shared=False)


FAMILY = Family(name=NAME, architectures=("Qwen3MoeForCausalLM",), model_type=NAME,
                from_hf=from_hf, to_hf=to_hf, rows=qwen2_moe.EXPERT_ROWS,
                presets=("qwen3-30b-a3b",))
