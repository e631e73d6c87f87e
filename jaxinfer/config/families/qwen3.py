"""Qwen3 (`Qwen3ForCausalLM`): Llama's block with RMSNorm on each head's q and k
(`qk_norm`). docs/architecture.md#model-families.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config.families import llama, qwen2
from jaxinfer.config.families.base import Family, HFConfig


def from_hf(hf: HFConfig) -> dict[str, Any]:
    qwen2.no_layer_windows(hf)
    return llama.dense_fields(hf, qk_norm=True)


FAMILY = Family(name="qwen3", architectures=("Qwen3ForCausalLM",), model_type="qwen3",
                from_hf=from_hf, to_hf=llama.no_fields_to_hf, presets=("qwen3-0.6b",))
