"""Mixture-of-experts shape and routing, `MoEConfig`: the experts, top-k routing
(softmax then top-k, or gpt-oss's top-k then softmax), a shared expert, which layers
are MoE, the experts' activation. Each family reads it from config.json in its own
module (config/families/). See docs/moe.md (#routing, #gpt-oss).
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROUTINGS = ("softmax_topk", "topk_softmax")  # softmax then top-k, or top-k logits softmaxed
ACTIVATIONS = ("swiglu", "clamped_swiglu")  # silu(g) * u; gpt-oss's (u + 1) * g * sigmoid(a g)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The experts of a mixture-of-experts model."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    routing: str = "softmax_topk"  # one of ROUTINGS
    router_bias: bool = False  # a bias on the router's logits
    expert_bias: bool = False  # biases on each expert's gate/up and down outputs
    activation: str = "swiglu"  # one of ACTIVATIONS
    swiglu_alpha: float = 1.702  # clamped_swiglu: the sigmoid's gain
    swiglu_limit: float = 7.0  # clamped_swiglu: gate clamped above, up to [-limit, limit]

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "intermediate_size",
                     "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe.{name}={value!r} must be a positive int")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"moe.num_experts_per_tok={self.num_experts_per_tok} must be "
                             f"at most moe.num_experts={self.num_experts}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"moe.shared_expert_intermediate_size="
                             f"{self.shared_expert_intermediate_size} must be >= 0")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name, known in (("routing", ROUTINGS), ("activation", ACTIVATIONS)):
            if getattr(self, name) not in known:
                raise ValueError(f"moe.{name}={getattr(self, name)!r} must be one of {known}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"moe.swiglu_limit={self.swiglu_limit} must be > 0")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) has experts (transformers' rule)."""
        return (layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


def experts_from_hf(hf: dict[str, Any], family: str) -> tuple[int, int]:
    """(num_experts, num_experts_per_tok) of a `family` model's config.json, which names
    the first `num_local_experts` or `num_experts`; errors name the field."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ValueError(f"config.json of a {family} model has no 'num_experts' "
                         "(or 'num_local_experts')")
    if "num_experts_per_tok" not in hf:
        raise ValueError("config.json has no 'num_experts_per_tok'")
    return experts, hf["num_experts_per_tok"]
