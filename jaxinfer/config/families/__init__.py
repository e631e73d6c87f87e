"""The model families we serve, one module each, and the one list of them, `FAMILIES`,
with the lookups (`family`, `family_of`); config/model.py and the parameter table look
a family up here and never name one. What a family module declares and how to add one:
docs/architecture.md#model-families.
"""

from __future__ import annotations

from jaxinfer.config.families import (
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from jaxinfer.config.families.base import Family, HFConfig

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    gpt_oss.FAMILY,
)
BY_NAME = {family.name: family for family in FAMILIES}  # ModelConfig.architecture -> family
# The head an HF class name gives a family's decoder (ModelConfig.head): `XForCausalLM`'s
# LM head; the bare `XModel` (an embedding model) none; `XForSequenceClassification` a
# score head. The other two names are derived from each family's *ForCausalLM name.
HEAD_SUFFIXES = {"ForCausalLM": "lm", "Model": "none", "ForSequenceClassification": "score"}
ARCHITECTURES = {arch: family.name for family in FAMILIES  # HF architecture -> our name
                 for arch in family.architectures}
ARCHITECTURES |= {arch.removesuffix("ForCausalLM") + suffix: name
                  for arch, name in list(ARCHITECTURES.items()) if arch.endswith("ForCausalLM")
                  for suffix in HEAD_SUFFIXES}
MODEL_TYPES = {family.model_type: family.name for family in FAMILIES}
MOE_ARCHITECTURES = tuple(family.name for family in FAMILIES if family.has_experts)
DEFAULT_ARCHITECTURE = llama.FAMILY.name  # of a ModelConfig that names none: the plain block


def family(name: str) -> Family:
    """The family whose `ModelConfig.architecture` is `name`."""
    if name not in BY_NAME:
        raise ValueError(f"architecture={name!r} must be one of {sorted(BY_NAME)}")
    return BY_NAME[name]


def text_model_config(hf: HFConfig) -> HFConfig:
    """The config.json of the text model we serve: a wrapper's (a multimodal model's
    text tower) as its family reads it, else `hf` itself."""
    for each in FAMILIES:
        text = each.text_config(hf)
        if text is not None:
            return text
    return hf


def wraps_text_model(hf: HFConfig) -> bool:
    """Whether `hf` is a wrapper's config.json whose text model we serve (its
    checkpoint's tensors are renamed: checkpoint/text_tower.py)."""
    return any(each.text_config(hf) is not None for each in FAMILIES)


def head_of(hf: HFConfig) -> str:
    """The head of a config.json's first known architecture (HEAD_SUFFIXES); "lm"
    where it names none of them."""
    for arch in hf.get("architectures") or []:
        if arch in ARCHITECTURES:
            return next((head for suffix, head in HEAD_SUFFIXES.items()
                         if arch.endswith(suffix) and arch.removesuffix(suffix) + "ForCausalLM"
                         in ARCHITECTURES), "lm")
    return "lm"


def family_of(hf: HFConfig) -> Family:
    """The family of a text model's config.json: its first known `architectures` name,
    else (no architectures) its `model_type`; errors list what is supported."""
    archs = hf.get("architectures") or []
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not archs and hf.get("model_type") in MODEL_TYPES:
        known = [MODEL_TYPES[hf["model_type"]]]
    if not known:
        raise ValueError(
            f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
            f"supported: {sorted(ARCHITECTURES)}")
    return BY_NAME[known[0]]


__all__ = ["ARCHITECTURES", "BY_NAME", "DEFAULT_ARCHITECTURE", "FAMILIES", "MODEL_TYPES",
           "MOE_ARCHITECTURES", "Family", "HFConfig", "family", "family_of", "head_of",
           "text_model_config", "wraps_text_model"]
