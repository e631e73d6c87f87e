"""jaxinfer: LLM inference on JAX. Public names only, loaded lazily, so host-side modules
can be imported and unit-tested without importing jax (docs/architecture.md#2-layout).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
_WHERE = {"LLM": "jaxinfer.api", "EngineConfig": "jaxinfer.config",
          "LoRARequest": "jaxinfer.lora.request",
          "RequestOutput": "jaxinfer.engine.request", "SamplingParams": "jaxinfer.engine.request",
          "StructuredOutputsParams": "jaxinfer.engine.structured"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
