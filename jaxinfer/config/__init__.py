"""Every config as a frozen, kw-only, hashable dataclass, and TOML presets: the model
(model.py, moe.py, rope.py, families/), the engine (engine.py), speculative heads
(heads.py), multi-host and the server (serving.py). Standard library only. See
docs/architecture.md (#model-families, #6-house-conventions).
"""

from jaxinfer.config.engine import (
    DEFAULT_MODEL,
    DTYPES,
    KV_CACHE_DTYPES,
    MAX_SPECULATIVE_TOKENS,
    PREQUANTIZED_METHODS,
    QUANTIZATION_MODES,
    SCHEDULERS,
    SPECULATIVE_METHODS,
    EngineConfig,
    SpeculativeConfig,
    checkpoint_dtype,
    served_dtype,
)
from jaxinfer.config.families import ARCHITECTURES, MOE_ARCHITECTURES
from jaxinfer.config.model import (
    ATTENTION_IMPLS,
    DEFAULT_OPTIONS,
    PRESET_DIR,
    ModelConfig,
    ModelOptions,
    load_preset,
    preset_names,
)
from jaxinfer.config.moe import MoEConfig
from jaxinfer.config.rope import ROPE_TYPES, RopeScaling
from jaxinfer.config.serving import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    DistributedConfig,
    ServerConfig,
)

__all__ = [
    "ARCHITECTURES", "ATTENTION_IMPLS", "DEFAULT_MODEL", "DEFAULT_OPTIONS", "DTYPES",
    "KV_CACHE_DTYPES", "MAX_SPECULATIVE_TOKENS", "MOE_ARCHITECTURES", "PREQUANTIZED_METHODS",
    "PRESET_DIR", "QUANTIZATION_MODES", "REASONING_PARSERS", "ROPE_TYPES", "SCHEDULERS",
    "SPECULATIVE_METHODS", "TOOL_CALL_PARSERS", "DistributedConfig", "EngineConfig",
    "MoEConfig", "ModelConfig", "ModelOptions", "RopeScaling", "ServerConfig",
    "SpeculativeConfig", "checkpoint_dtype", "load_preset", "preset_names", "served_dtype",
]
