"""Mixtral (`MixtralForCausalLM`): Mistral's attention with experts of the model's
`intermediate_size` in every layer, renormalised top-k, each expert's tensors stored
apart under `block_sparse_moe`. docs/moe.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config.families import mistral
from jaxinfer.config.families.base import Family, HFConfig
from jaxinfer.config.families.rows import expert_rows
from jaxinfer.config.moe import MoEConfig, experts_from_hf

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

NAME = "mixtral"
ROWS = expert_rows("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                   "block_sparse_moe.experts.{e}.w3.weight",
                   "block_sparse_moe.experts.{e}.w2.weight")


def from_hf(hf: HFConfig) -> dict[str, Any]:
    experts, top_k = experts_from_hf(hf, NAME)
    return mistral.from_hf(hf) | {"moe": MoEConfig(
        num_experts=experts, num_experts_per_tok=top_k,
        intermediate_size=hf["intermediate_size"])}


def to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    return mistral.to_hf(cfg, rope_parameters) | {
        "num_local_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.num_experts_per_tok}


FAMILY = Family(name=NAME, architectures=("MixtralForCausalLM",), model_type=NAME,
                from_hf=from_hf, to_hf=to_hf, rows=ROWS, presets=("mixtral-8x7b",))
