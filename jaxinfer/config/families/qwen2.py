"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama's block with biases on q, k and v.
Qwen's per-layer sliding windows (use_sliding_window) are refused.
docs/architecture.md#model-families.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config.families import llama
from jaxinfer.config.families.base import Family, HFConfig


def no_layer_windows(hf: HFConfig) -> None:
    """Raise for Qwen's use_sliding_window (windows on some layers), which we do not run."""
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true (per-layer windows) is "
                         "not supported for Qwen models")


def from_hf(hf: HFConfig) -> dict[str, Any]:
    no_layer_windows(hf)
    return llama.dense_fields(hf, qkv_bias=True)


FAMILY = Family(name="qwen2", architectures=("Qwen2ForCausalLM",), model_type="qwen2",
                from_hf=from_hf, to_hf=llama.no_fields_to_hf, presets=("qwen2-7b",))
