"""Encoder models (BERT, XLM-RoBERTa, RoBERTa) as config: `EncoderConfig` read from an
HF config.json, and `is_encoder`. Standard library only. See docs/pooling.md#encoder-models.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# HF architecture -> (our architecture, the classification head it carries)
ARCHITECTURES = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert_pooler"),
    "XLMRobertaModel": ("xlm_roberta", None),
    "XLMRobertaForSequenceClassification": ("xlm_roberta", "roberta_head"),
    "RobertaModel": ("xlm_roberta", None),
    "RobertaForSequenceClassification": ("xlm_roberta", "roberta_head"),
}
ENCODER_ARCHITECTURES = tuple(ARCHITECTURES)
MODEL_TYPES = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel",
               "roberta": "RobertaModel"}
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh")  # exact erf; tanh approximations


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """Shape and numerics of one post-LN bidirectional encoder."""

    architecture: str  # "bert" or "xlm_roberta"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    position_offset: int  # XLM-R's positions start after its padding id; BERT's at 0
    num_labels: int = 0  # 0: no classification head
    head: str | None = None  # "bert_pooler", "roberta_head" or None

    def __post_init__(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"config.json hidden_act={self.hidden_act!r} is not supported "
                             f"(one of {HIDDEN_ACTS})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"config.json hidden_size={self.hidden_size} must divide by "
                             f"num_attention_heads={self.num_heads}")
        if (self.head is None) != (self.num_labels == 0):
            raise ValueError(f"num_labels={self.num_labels} with head={self.head!r}: a "
                             "classification head has labels, and only it")
        if self.max_len <= 0:
            raise ValueError(f"config.json max_position_embeddings="
                             f"{self.max_position_embeddings} leaves no positions")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_len(self) -> int:
        """The longest input: the positions after the offset."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> EncoderConfig:
        """Read an HF config.json dict; what the forward does not run is refused, naming
        the field."""
        name = _architecture(hf)
        arch, head = ARCHITECTURES[name]
        for key, wanted in (("position_embedding_type", "absolute"), ("is_decoder", False),
                            ("add_cross_attention", False)):
            if hf.get(key, wanted) != wanted:
                raise ValueError(f"config.json {key}={hf[key]!r} is not supported "
                                 f"(only {wanted!r})")
        pad = int(hf.get("pad_token_id") or 0)
        labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels") or 2)
        return cls(architecture=arch, vocab_size=hf["vocab_size"],
                   hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                   num_heads=hf["num_attention_heads"],
                   intermediate_size=hf["intermediate_size"],
                   max_position_embeddings=hf["max_position_embeddings"],
                   type_vocab_size=hf.get("type_vocab_size", 2),
                   layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
                   hidden_act=hf.get("hidden_act", "gelu"), pad_token_id=pad,
                   position_offset=pad + 1 if arch == "xlm_roberta" else 0,
                   num_labels=labels if head else 0, head=head)


def _architecture(hf: dict[str, Any]) -> str:
    for name in hf.get("architectures") or []:
        if name in ARCHITECTURES:
            return name
    if not hf.get("architectures") and hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    raise ValueError(f"config.json architectures={hf.get('architectures')} "
                     f"(model_type={hf.get('model_type')!r}) is not an encoder this engine "
                     f"runs (supported: {list(ARCHITECTURES)})")


def is_encoder(hf: dict[str, Any]) -> bool:
    """Whether a config.json is an encoder's (its architecture or model_type)."""
    names = hf.get("architectures") or []
    if names:
        return any(name in ARCHITECTURES for name in names)
    return hf.get("model_type") in MODEL_TYPES
