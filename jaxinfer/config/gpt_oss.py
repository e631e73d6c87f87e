"""gpt-oss (`GptOssForCausalLM`) in an HF `config.json`: YaRN RoPE and the fields
`ModelConfig` and `MoEConfig` take.

gpt-oss is a mixture of experts with: biases on q/k/v and on the attention output, a
learned attention-sink logit per query head, layers alternating between a sliding
window (128) and full attention (`layer_types`), YaRN RoPE, a router with a bias whose
top-k logits are softmaxed, experts with biases and a clamped SwiGLU
(`(up + 1) * gate * sigmoid(alpha * gate)`, gate clamped above and up on both sides at
`swiglu_limit`), and no shared expert. Defaults are `GptOssConfig`'s (transformers
5.23), which a Hub config.json relies on for the fields it leaves out.
Imports nothing from config/model.py (which imports this).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ARCHITECTURE = "gpt_oss"
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088,
                hidden_size=2880, intermediate_size=2880, head_dim=64,
                num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
                max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4,
                swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN RoPE (`rope_type = "yarn"`), as transformers' `_compute_yarn_parameters`:
    inverse frequencies blended between the original and the `factor`-interpolated ones
    by a linear ramp over the dimensions whose rotations within the original context
    fall between `beta_slow` and `beta_fast`, and cos/sin scaled by `attention_factor`
    (None: 0.1 * ln(factor) + 1, or the mscale ratio when both mscales are given)."""

    rope_type: str = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # transformers' default when config.json leaves it out
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type != "yarn":
            raise ValueError(f"{self.rope_type=} must be 'yarn'")
        if not self.factor > 0:
            raise ValueError(f"yarn {self.factor=} must be > 0")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"yarn {self.original_max_position_embeddings=} must be > 0")

    def cos_sin_scale(self) -> float:
        """The factor on cos and sin (transformers' `attention_scaling`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


def yarn_from_hf(params: dict[str, Any]) -> YarnScaling:
    """YarnScaling of a config.json's merged rope parameters; errors name the field."""
    missing = [n for n in ("factor", "original_max_position_embeddings") if n not in params]
    if missing:
        raise ValueError(f"config.json yarn rope scaling lacks {missing}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json partial_rotary_factor is not supported with yarn")
    names = [f.name for f in dataclasses.fields(YarnScaling) if f.name != "rope_type"]
    given = {n: params[n] for n in names if params.get(n) is not None}
    # transformers: `beta_fast or 32`, `beta_slow or 1` (a 0 means the default too)
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        given[name] = float(given.get(name) or default)
    return YarnScaling(**given)


def fields_from_hf(hf: dict[str, Any], read_rope: Any) -> dict[str, Any]:
    """ModelConfig fields of a gpt-oss config.json beyond the common shape (`hf` with
    GptOssConfig's defaults filled in by `with_defaults`)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r} is not supported "
                         "for gpt_oss (its experts' clamped SwiGLU is fixed)")
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    theta, scaling = read_rope(hf, DEFAULT_THETA)
    bias = bool(hf["attention_bias"])
    return {"rope_theta": theta, "rope_scaling": scaling, "qkv_bias": bias,
            "o_bias": bias, "attention_sinks": True, "sliding_window": hf["sliding_window"],
            "layer_types": tuple(layer_types)}


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with GptOssConfig's defaults for the fields it leaves out (rope included)."""
    out = DEFAULTS | {k: v for k, v in hf.items() if v is not None}
    if not (out.get("rope_parameters") or out.get("rope_scaling")):
        out["rope_parameters"] = DEFAULT_ROPE | {"rope_theta": out.get("rope_theta",
                                                                       DEFAULT_THETA)}
    return out


def to_hf(cfg: Any) -> dict[str, Any]:
    """The gpt-oss fields of `cfg`'s config.json beyond the common ones."""
    return {"sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
            "attention_bias": cfg.qkv_bias}
