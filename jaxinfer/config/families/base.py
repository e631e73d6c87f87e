"""`Family`: what one model family module declares, and the config.json readers several
families share. docs/architecture.md#model-families.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxinfer.config.families.rows import Param

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

HFConfig = dict[str, Any]


def _unchanged(hf: HFConfig) -> HFConfig:
    return hf


def _no_wrapper(hf: HFConfig) -> HFConfig | None:
    return None


def _no_check(cfg: ModelConfig) -> None:
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: how its HF config.json reads into a `ModelConfig` and back, and
    the parameter rows only it has (model/params_table.py holds the shared ones)."""

    name: str  # ModelConfig.architecture
    architectures: tuple[str, ...]  # the HF `architectures` names it reads
    model_type: str  # HF's `model_type` (read when a config.json has no architectures)
    from_hf: Callable[[HFConfig], dict[str, Any]]
    """ModelConfig fields of a config.json beyond the common shape (config/model.py reads
    sizes, heads, norm epsilon, tied embeddings and context length alike for all)."""
    to_hf: Callable[[ModelConfig, dict[str, Any]], HFConfig]
    """config.json fields of a config beyond the common ones, given its rope_parameters;
    they override the common ones."""
    rows: tuple[Param, ...] = ()  # layer rows only this family has, after the shared
    presets: tuple[str, ...] = ()  # config/presets/*.toml of this family
    with_defaults: Callable[[HFConfig], HFConfig] = _unchanged
    """A config.json with transformers' defaults for what it leaves out, before reading."""
    text_config: Callable[[HFConfig], HFConfig | None] = _no_wrapper
    """The text model's config.json of a wrapper config (a multimodal model served as
    text), else None."""
    check: Callable[[ModelConfig], None] = _no_check  # raises for what it never runs

    @property
    def has_experts(self) -> bool:
        """Whether its layers may hold experts (a mixture-of-experts family)."""
        return any(row.experts for row in self.rows)


def silu_only(hf: HFConfig) -> None:
    """Raise unless the MLP is SwiGLU (config.json hidden_act silu)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")


def pattern_layer_types(num_layers: int, every: int) -> tuple[str, ...]:
    """Every `every`-th layer global, the others sliding (HF's `sliding_window_pattern`)."""
    if not isinstance(every, int) or every <= 0:
        raise ValueError(f"sliding_window_pattern={every!r} must be a positive int")
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(num_layers))
