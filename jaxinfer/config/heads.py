"""Speculative heads' config.json: EAGLE-1/2 ("eagle"), EAGLE-3 ("eagle3") and Medusa
("medusa"). `infer_method` names the head a config.json describes (None: an ordinary
draft model); `head_config` reads it into a `HeadConfig` checked against the target,
with the feature layers it reads. Which configs are heads, what is refused, and where
EAGLE-3's capture ids point: docs/speculative_decoding.md
(#heads-on-the-targets-hidden-states-eagle-12-eagle-3-medusa).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.config.families import llama
from jaxinfer.config.model import FINAL_NORMED, ModelConfig

HEAD_METHODS = ("eagle", "eagle3", "medusa")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("EAGLEModel", "EagleLlamaForCausalLM")
MEDUSA_ARCHITECTURES = ("MedusaModel",)
MEDUSA_DEFAULTS = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5,
                   "num_hidden_layers": 1}  # vLLM's MedusaConfig defaults
NESTED_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"
TOP_IDS = "eagle_aux_hidden_state_layer_ids"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """One speculative head's shape, fitted to its target."""

    method: str  # one of HEAD_METHODS
    feature_layers: tuple[int, ...]  # the target's capture points (docs/speculative_decoding.md)
    vocab_size: int  # the target's vocabulary
    target_hidden_size: int  # the target's hidden size: features are this wide each
    layer: ModelConfig | None = None
    """eagle/eagle3: the drafter's decoder layer as a 1-layer Llama config (the target's
    vocab_size, the head's own widths, heads, eps, RoPE); None for medusa."""
    draft_vocab_size: int = 0  # eagle3's reduced vocabulary, medusa's truncated one
    num_heads: int = 0  # medusa heads (0 otherwise)
    num_layers: int = 0  # medusa residual blocks per head (0 otherwise)
    fc_bias: bool = False  # eagle: fc has a bias; medusa: each block's linear has one
    norm_before_residual: bool = False  # eagle3: hidden_norm applied before the residual
    shared_lm_head: bool = False  # medusa original_lm_head: one LM head for every head

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"method={self.method!r} must be one of {HEAD_METHODS}")
        if (self.layer is None) != (self.method == "medusa"):
            raise ValueError(f"{self.method} head: layer must be "
                             f"{'None' if self.method == 'medusa' else 'a ModelConfig'}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in "
                             f"[1, vocab_size={self.vocab_size}]")
        if self.method == "medusa" and (self.num_heads <= 0 or self.num_layers < 0):
            raise ValueError(f"medusa num_heads={self.num_heads} must be > 0 and "
                             f"num_hidden_layers={self.num_layers} >= 0")
        if not self.feature_layers:
            raise ValueError("feature_layers must not be empty")

    @property
    def hidden_size(self) -> int:
        """D: the head's own width (medusa: the target's)."""
        return self.target_hidden_size if self.layer is None else self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        """F: the width of the target features the head reads per token."""
        return len(self.feature_layers) * self.target_hidden_size


def infer_method(hf: dict[str, Any]) -> str | None:
    """The head a config.json dict describes, from its architectures / model_type /
    speculators_model_type; None for an ordinary model (SafeAILab's EAGLE-1 configs look
    like one: docs/speculative_decoding.md)."""
    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    speculators = hf.get("speculators_model_type")
    if speculators in ("eagle", "eagle3"):
        return speculators
    if any(a in EAGLE3_ARCHITECTURES for a in archs):
        return "eagle3"
    if any(a in MEDUSA_ARCHITECTURES for a in archs) or model_type == "medusa":
        return "medusa"
    if any(a in EAGLE_ARCHITECTURES for a in archs) or model_type == "eagle":
        return "eagle"
    return None


def head_config(hf: dict[str, Any], target: ModelConfig, method: str | None = None
                ) -> HeadConfig:
    """The HeadConfig of a head's config.json dict for `target`; `method` (one of
    HEAD_METHODS) must agree with what the config says when it says anything."""
    found = infer_method(hf)
    if method is not None and method not in HEAD_METHODS:
        raise ValueError(f"method={method!r} must be one of {HEAD_METHODS}")
    if method is not None and found is not None and method != found:
        raise ValueError(
            f"method={method!r} does not match the checkpoint: its config.json "
            f"(architectures={hf.get('architectures')}, model_type="
            f"{hf.get('model_type')!r}) is a {found!r} head")
    method = method or found
    if method is None:
        raise ValueError(
            f"config.json (architectures={hf.get('architectures')}) is not a speculative "
            f"head; pass method= one of {HEAD_METHODS} for a SafeAILab EAGLE checkpoint")
    if "speculators_model_type" in hf:
        raise ValueError("config.json is in the speculators format "
                         "(speculators_model_type); only the original layouts load")
    return {"eagle": _eagle, "eagle3": _eagle3, "medusa": _medusa}[method](hf, target)


def _eagle(hf: dict[str, Any], target: ModelConfig) -> HeadConfig:
    nested = hf.get("model")
    fields = dict(hf)
    if isinstance(nested, dict):  # vLLM's EAGLEConfig: the layer's fields under "model"
        fields = nested | {k: v for k, v in hf.items() if k != "model"}
    if fields.get("add_para_norm"):
        raise ValueError("config.json add_para_norm=true (HASS's extra norms) is not "
                         "supported")
    truncated = fields.get("truncated_vocab_size")
    if truncated is not None and truncated != fields.get("vocab_size"):
        raise ValueError(f"config.json truncated_vocab_size={truncated} (an EAGLE token "
                         "map) is not supported")
    _check_width("hidden_size", fields.get("hidden_size"), target)
    layer = _layer_config(fields, target)
    return HeadConfig(method="eagle", feature_layers=(FINAL_NORMED,), layer=layer,
                      vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
                      draft_vocab_size=target.vocab_size,
                      fc_bias=bool(fields.get("bias", fields.get("eagle_fc_bias", False))))


def _eagle3(hf: dict[str, Any], target: ModelConfig) -> HeadConfig:
    eagle_config = hf.get("eagle_config") or {}
    if not eagle_config.get("use_aux_hidden_state", True):
        raise ValueError("config.json eagle_config.use_aux_hidden_state=false (EAGLE-3 "
                         "without fc over the target's layers) is not supported")
    if "target_hidden_size" in hf:
        _check_width("target_hidden_size", hf["target_hidden_size"], target)
    else:
        _check_width("hidden_size", hf.get("hidden_size"), target)
    layer = _layer_config(hf, target)
    draft_vocab = hf.get("draft_vocab_size") or target.vocab_size
    return HeadConfig(method="eagle3", feature_layers=eagle3_feature_layers(hf, target),
                      layer=layer, vocab_size=target.vocab_size,
                      target_hidden_size=target.hidden_size, draft_vocab_size=draft_vocab,
                      norm_before_residual=bool(hf.get("norm_before_residual", False)))


def eagle3_feature_layers(hf: dict[str, Any], target: ModelConfig) -> tuple[int, ...]:
    """EAGLE-3's capture points in the target's convention (docs/speculative_decoding.md)."""
    count = target.num_layers
    top = hf.get(TOP_IDS)
    nested = (hf.get("eagle_config") or {}).get(TOP_IDS)
    if top:
        field, ids, low, high = TOP_IDS, tuple(int(i) for i in top), 0, count
    elif nested:
        field, ids, low, high = NESTED_IDS, tuple(int(i) + 1 for i in nested), 1, count
    else:
        if count < 3:
            raise ValueError(f"EAGLE-3's default capture layers (2, L // 2, L - 3) need a "
                             f"target of >= 3 layers, not {count}; set {TOP_IDS}")
        return (2, count // 2, count - 3)
    bad = [i for i in ids if not low <= i <= high]
    if bad:
        raw = list(top or nested)
        raise ValueError(f"config.json {field}={raw} is out of range for a {count}-layer "
                         f"target")
    return ids


def _medusa(hf: dict[str, Any], target: ModelConfig) -> HeadConfig:
    fields = dict(MEDUSA_DEFAULTS)
    for key, value in hf.items():  # vLLM's renaming (FasterDecoding's medusa_num_heads)
        if "num" in key and "heads" in key:
            fields["num_heads"] = value
        elif "num" in key and "layers" in key:
            fields["num_hidden_layers"] = value
        else:
            fields[key] = value
    _check_width("hidden_size", fields["hidden_size"], target)
    _check_vocab(fields["vocab_size"], target)
    truncated = fields.get("truncated_vocab_size") or fields["vocab_size"]
    return HeadConfig(method="medusa", feature_layers=(FINAL_NORMED,),
                      vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
                      draft_vocab_size=truncated, num_heads=fields["num_heads"],
                      num_layers=fields["num_hidden_layers"],
                      fc_bias=bool(fields.get("medusa_fc_bias", False)),
                      shared_lm_head=bool(fields.get("original_lm_head", False)))


def _check_width(field: str, value: object, target: ModelConfig) -> None:
    if value != target.hidden_size:
        raise ValueError(f"config.json {field}={value!r} does not match the target's "
                         f"hidden_size={target.hidden_size}")


def _check_vocab(value: object, target: ModelConfig) -> None:
    if value != target.vocab_size:
        raise ValueError(f"config.json vocab_size={value!r} does not match the target's "
                         f"vocab_size={target.vocab_size}")


def _layer_config(fields: dict[str, Any], target: ModelConfig) -> ModelConfig:
    """The drafter's decoder layer as a 1-layer Llama ModelConfig (its own widths and
    RoPE, the target's vocabulary)."""
    _check_vocab(fields.get("vocab_size"), target)
    layers = fields.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"config.json num_hidden_layers={layers}: only one-layer heads "
                         "are supported")
    if fields.get("attention_bias") or fields.get("mlp_bias"):
        raise ValueError("config.json attention_bias/mlp_bias=true is not supported in "
                         "a head's layer")
    layer = {k: v for k, v in fields.items()
             if k not in ("architectures", "model_type", "tie_word_embeddings")}
    layer |= {"architectures": [llama.FAMILY.architectures[0]], "num_hidden_layers": 1}
    return ModelConfig.from_hf(layer)


def head_to_hf(head: HeadConfig, target: ModelConfig) -> dict[str, Any]:
    """The config.json dict of `head` in its published layout (what `head_config`
    reads back): SafeAILab's EAGLE-3 and EAGLE configs, vLLM's MedusaConfig."""
    if head.method == "medusa":
        out = {"architectures": list(MEDUSA_ARCHITECTURES), "model_type": "medusa",
               "hidden_size": head.hidden_size, "vocab_size": head.vocab_size,
               "num_heads": head.num_heads, "num_hidden_layers": head.num_layers,
               "medusa_fc_bias": head.fc_bias, "original_lm_head": head.shared_lm_head}
        if head.draft_vocab_size != head.vocab_size:
            out["truncated_vocab_size"] = head.draft_vocab_size
        return out
    out = _layer_to_hf(head.layer)
    if head.method == "eagle":
        return out | {"bias": head.fc_bias}
    out |= {"architectures": [EAGLE3_ARCHITECTURES[0]],
            "draft_vocab_size": head.draft_vocab_size,
            "target_hidden_size": head.target_hidden_size,
            "norm_before_residual": head.norm_before_residual}
    if target.num_layers < 3 or head.feature_layers != eagle3_feature_layers({}, target):
        out[TOP_IDS] = list(head.feature_layers)  # vLLM's convention: entry i as it is
    return out


def _layer_to_hf(layer: ModelConfig) -> dict[str, Any]:
    """A Llama config.json with the legacy rope_theta / rope_scaling keys, as the
    published heads write them."""
    out = layer.to_hf()
    rope = out.pop("rope_parameters")
    out["rope_theta"] = rope.pop("rope_theta")
    if layer.rope_scaling is not None:
        out["rope_scaling"] = rope
    out.pop("attention_bias", None)
    return out
