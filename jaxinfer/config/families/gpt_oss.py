"""gpt-oss (`GptOssForCausalLM`): experts with biases and a clamped SwiGLU behind a
biased top-k-softmax router, q/k/v/o biases, attention sinks, alternating sliding and
full layers, YaRN RoPE, HF's stacked interleaved expert tensors, and `GptOssConfig`'s
defaults for what a Hub config.json leaves out. See docs/moe.md#gpt-oss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.config import rope
from jaxinfer.config.families.base import Family, HFConfig
from jaxinfer.config.families.rows import Param, Part, expert_size, hidden, moe_layer
from jaxinfer.config.moe import MoEConfig, experts_from_hf

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

NAME = "gpt_oss"
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088,
                hidden_size=2880, intermediate_size=2880, head_dim=64,
                num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
                max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4,
                swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True)

ROWS = (
    Param("w_router", (Part("w_router", "mlp.router.weight",
                            lambda c: (hidden(c), c.moe.num_experts), True),), "whole",
          when=moe_layer),
    Param("b_router", (Part("b_router", "mlp.router.bias",
                            lambda c: (c.moe.num_experts,)),), "whole", when=moe_layer),
    Param("we_gate_up", (Part("we_gate_up_interleaved", "mlp.experts.gate_up_proj",
                              lambda c: (hidden(c), 2 * expert_size(c))),),
          "expert_outputs", layout="interleaved_gate_up", when=moe_layer, experts=True),
    Param("be_gate_up", (Part("be_gate_up_interleaved", "mlp.experts.gate_up_proj_bias",
                              lambda c: (2 * expert_size(c),)),),
          "expert_vectors", layout="interleaved_gate_up", when=moe_layer, experts=True),
    Param("we_down", (Part("we_down_transposed", "mlp.experts.down_proj",
                           lambda c: (expert_size(c), hidden(c))),),
          "expert_inputs", layout="experts_transposed", when=moe_layer, experts=True),
    # added once after the devices' shares are summed (model/moe.py): replicated
    Param("be_down", (Part("be_down", "mlp.experts.down_proj_bias", lambda c: (hidden(c),)),),
          "whole", when=moe_layer, experts=True),
)


def with_defaults(hf: HFConfig) -> HFConfig:
    """`hf` with GptOssConfig's defaults for the fields it leaves out (rope included)."""
    out = DEFAULTS | {k: v for k, v in hf.items() if v is not None}
    if not (out.get("rope_parameters") or out.get("rope_scaling")):
        out["rope_parameters"] = DEFAULT_ROPE | {"rope_theta": out.get("rope_theta",
                                                                       DEFAULT_THETA)}
    return out


def from_hf(hf: HFConfig) -> dict[str, Any]:
    """The fields beyond the common shape (`hf` with GptOssConfig's defaults filled in)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r} is not supported "
                         f"for {NAME} (its experts' clamped SwiGLU is fixed)")
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    theta, scaling = rope.rope_from_hf(hf, DEFAULT_THETA)
    bias = bool(hf["attention_bias"])
    return {"rope_theta": theta, "rope_scaling": scaling, "qkv_bias": bias,
            "o_bias": bias, "attention_sinks": True, "sliding_window": hf["sliding_window"],
            "layer_types": tuple(layer_types), "moe": _experts(hf)}


def _experts(hf: HFConfig) -> MoEConfig:
    """Experts of `intermediate_size` in every layer, routed and activated gpt-oss's way."""
    experts, top_k = experts_from_hf(hf, NAME)
    return MoEConfig(num_experts=experts, num_experts_per_tok=top_k,
                     intermediate_size=hf["intermediate_size"], routing="topk_softmax",
                     router_bias=True, expert_bias=True, activation="clamped_swiglu",
                     swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def to_hf(cfg: ModelConfig, rope_parameters: dict[str, Any]) -> HFConfig:
    return {"num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.num_experts_per_tok,
            "swiglu_alpha": cfg.moe.swiglu_alpha, "swiglu_limit": cfg.moe.swiglu_limit,
            "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
            "attention_bias": cfg.qkv_bias}


FAMILY = Family(name=NAME, architectures=("GptOssForCausalLM",), model_type=NAME,
                from_hf=from_hf, to_hf=to_hf, rows=ROWS,
                presets=("gpt-oss-20b", "gpt-oss-120b"), with_defaults=with_defaults)
