"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention with experts of
`moe_intermediate_size` on every `decoder_sparse_step`-th layer but `mlp_only_layers`,
top-k renormalised when `norm_topk_prob`, and a shared expert behind a sigmoid gate.
Qwen3-MoE reads and stores its experts the same way (qwen3_moe.py). docs/moe.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config.families import qwen2
from jaxinfer.config.families.base import Family, HFConfig
from jaxinfer.config.families.rows import Param, Part, expert_rows, hidden
from jaxinfer.config.moe import MoEConfig, experts_from_hf

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

NAME = "qwen2_moe"
EXPERT_ROWS = expert_rows("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                          "mlp.experts.{e}.up_proj.weight",
                          "mlp.experts.{e}.down_proj.weight")


def _shared_size(cfg: ModelConfig) -> int:
    return cfg.moe.shared_expert_intermediate_size


def _shared(cfg: ModelConfig, layer: int) -> bool:
    return cfg.is_moe_layer(layer) and _shared_size(cfg) > 0


SHARED_EXPERT_ROWS = (
    Param("ws_gate_up", (Part("ws_gate", "mlp.shared_expert.gate_proj.weight",
                              lambda c: (hidden(c), _shared_size(c)), True),
                         Part("ws_up", "mlp.shared_expert.up_proj.weight",
                              lambda c: (hidden(c), _shared_size(c)), True)),
          "columns", layout="gate_up", quantized=True, when=_shared),
    Param("ws_down", (Part("ws_down", "mlp.shared_expert.down_proj.weight",
                           lambda c: (_shared_size(c), hidden(c)), True),),
          "rows", quantized=True, when=_shared),
    Param("w_shared_gate", (Part("w_shared_gate", "mlp.shared_expert_gate.weight",
                                 lambda c: (hidden(c), 1), True),), "whole", when=_shared),
)


def qwen_moe_from_hf(hf: HFConfig, family: str, *, shared: bool) -> MoEConfig:
    """The experts of a Qwen MoE config.json; `shared`: it may have a shared expert."""
    experts, top_k = experts_from_hf(hf, family)
    if "moe_intermediate_size" not in hf:
        raise ValueError(f"config.json of a {family} model has no 'moe_intermediate_size'")
    shared_size = hf.get("shared_expert_intermediate_size", 0) if shared else 0
    return MoEConfig(num_experts=experts, num_experts_per_tok=top_k,
                     intermediate_size=hf["moe_intermediate_size"],
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     shared_expert_intermediate_size=shared_size or 0,
                     decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
                     mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def qwen_moe_to_hf(moe: MoEConfig, *, shared: bool) -> HFConfig:
    """The config.json fields `qwen_moe_from_hf` reads back to `moe`."""
    out = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
           "moe_intermediate_size": moe.intermediate_size,
           "norm_topk_prob": moe.norm_topk_prob,
           "decoder_sparse_step": moe.decoder_sparse_step,
           "mlp_only_layers": list(moe.mlp_only_layers)}
    if shared:
        out["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return out


def from_hf(hf: HFConfig) -> dict[str, Any]:
    return qwen2.from_hf(hf) | {"moe": qwen_moe_from_hf(hf, NAME, shared=True)}


def to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    return qwen_moe_to_hf(cfg.moe, shared=True)


FAMILY = Family(name=NAME, architectures=("Qwen2MoeForCausalLM",), model_type=NAME,
                from_hf=from_hf, to_hf=to_hf, rows=EXPERT_ROWS + SHARED_EXPERT_ROWS)
