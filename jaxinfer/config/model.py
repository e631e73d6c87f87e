"""The model's shape and numerics: `ModelConfig`, HF `config.json` reading, TOML presets.

`ModelConfig.from_hf` reads the dict of an HF `config.json` of a family we serve: the
fields every family reads alike here, the rest in the family's own module, looked up
in the registry (config/families/); anything else is refused with a message naming the
field. docs/architecture.md#model-families.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib
import tomllib
from typing import Any

from jaxinfer.config import families, pipeline
from jaxinfer.config.families.base import pattern_layer_types
from jaxinfer.config.lora import LoraSlots
from jaxinfer.config.moe import MoEConfig
from jaxinfer.config.rope import RopeScaling, YarnScaling, rope_to_hf, scaling_of

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # SwiGLU; GeGLU with tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names
HEADS = ("lm", "none", "score")  # ModelConfig.head
ATTENTION_IMPLS = ("auto", "tpu", "gpu", "reference")  # as in pallas/settings.py
FINAL_NORMED = -1  # a feature layer: the last layer's output after the final norm
# Model shapes by name (llama3.1-8b, ...), package data: installed with the wheel.
PRESET_DIR = importlib.resources.files("jaxinfer.config") / "presets"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of one decoder-only transformer."""

    architecture: str = families.DEFAULT_ARCHITECTURE  # a family's name (config/families/)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    o_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    attention_sinks: bool = False  # a learned softmax sink logit per query head (gpt-oss)
    hidden_act: str = "silu"  # the MLP's gate: one of HIDDEN_ACTS
    norm_weight_offset: float = 0.0
    """Every RMSNorm scales by (offset + weight), in float32: Gemma's 1.0. Weights stay as
    stored; 1 + w baked into bfloat16 weights would lose w's low bits."""
    post_norms: bool = False
    """Gemma's extra norms: the attention's and the MLP's outputs are normed before their
    residual adds (post_attn_norm, post_mlp_norm); the MLP's input norm is HF's
    pre_feedforward_layernorm."""
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the table dtype
    query_pre_attn_scalar: float | None = None  # scores scaled by it ** -0.5; None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None
    """The RoPE base of the sliding-window layers, unscaled (Gemma 3's local 10k); None:
    every layer uses rope_theta and rope_scaling."""
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    """Each layer's attention, "sliding_attention" (the window above) or "full_attention",
    as HF's `layer_types`; None: every layer attends within `sliding_window` (Mistral) or
    to everything (no window)."""
    max_position_embeddings: int = 2048
    moe: MoEConfig | None = None  # experts in place of the MLP (config/moe.py)
    head: str = "lm"
    """What reads the last hidden states: "lm" the LM head, "none" nothing (an embedding
    model, pooled: docs/pooling.md), "score" a classifier of `num_labels` outputs
    (HF's *ForSequenceClassification `score`)."""
    num_labels: int = 0

    def __post_init__(self) -> None:
        family = families.family(self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"{self.sliding_window=} must be > 0 or None")
        self._check_layer_types()
        self._check_numerics()
        if self.rms_norm_eps <= 0:
            raise ValueError(f"{self.rms_norm_eps=} must be > 0")
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r} must be one of {HEADS}")
        if (self.head == "score") != (self.num_labels > 0):
            raise ValueError(f"num_labels={self.num_labels} must be > 0 exactly when "
                             f"head is 'score' (head={self.head!r})")
        if self.moe is not None and not family.has_experts:
            raise ValueError(f"moe given for {self.architecture}, a family without experts")
        family.check(self)

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers=}")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"layer_types has {sorted(unknown)}; known: {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but "
                             "sliding_window is None")

    def _check_numerics(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"{self.hidden_act=} must be one of {HIDDEN_ACTS}")
        if self.moe is not None and self.hidden_act != "silu":
            raise ValueError(f"{self.hidden_act=} with experts: experts run SwiGLU only")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 or None")

    def attention_scale(self) -> float:
        """The factor on q.k scores: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim's."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> str:
        """Which RoPE layer `layer` rotates with: "local" (rope_local_theta, unscaled) for a
        sliding-window layer of a model with one, else "global"."""
        local = self.rope_local_theta is not None and self.layer_window(layer) is not None
        return "local" if local else "global"

    def layer_window(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer` (None: it sees every token)."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def sliding_layers(self) -> tuple[int, ...]:
        """The layers whose attention sees only the last `sliding_window` tokens."""
        return tuple(i for i in range(self.num_layers) if self.layer_window(i) is not None)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts in place of its MLP."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF `config.json`; errors name the field."""
        return cls(**_fields_from_hf(hf))

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `from_hf` reads back to this config."""
        family = families.family(self.architecture)
        rope = rope_to_hf(self.rope_theta, self.rope_scaling)
        out: dict[str, Any] = {
            "architectures": [_hf_architecture(family.architectures[0], self.head)],
            "model_type": family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.qkv_bias,
        }
        if self.head == "score":
            out["num_labels"] = self.num_labels
        return out | family.to_hf(self, rope)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """How the engine runs a model, passed beside its `ModelConfig`: what the engine
    chooses and no checkpoint says (hashable: jit takes it as a static argument)."""

    expert_parallel: bool = False
    """Each device holds whole experts (E / tensor_parallel_size of them) instead of a
    slice of every expert; from `EngineConfig.enable_expert_parallel`."""
    feature_layers: tuple[int, ...] = ()
    """Hidden features the step keeps for speculative heads (EAGLE, Medusa): each entry
    i in [0, num_layers] is the residual stream entering layer i (num_layers: after the
    last one), FINAL_NORMED (-1) the last layer's output after the final norm (what the
    LM head reads). When set, the KV cache has one more entry, the feature store
    [pages * page_size, len * hidden_size], written at each computed token's KV slot.
    From the speculative heads' config."""
    batch_invariant: bool = False
    """Matmuls and RoPE by fixed blocks of rows, so a token's logits do not depend on
    the step it ran in, and the dense forward rounds as the paged one
    (model/invariance.py); from `EngineConfig.batch_invariant`."""
    lora: LoraSlots | None = None
    """LoRA adapter slots on the device (model/lora.py), from `EngineConfig.enable_lora`,
    `max_loras` and `max_lora_rank`; None: no adapters."""
    pipeline_stages: int = 1
    """Stages the layers are split into over the mesh's stage axis (model/pipeline.py),
    from `EngineConfig.pipeline_parallel_size`."""
    pipeline_microbatches: int = 0
    """Microbatches a pipelined step's tokens flow in (0: one per stage)."""

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError, naming the field, unless these options suit `cfg`."""
        if self.expert_parallel and cfg.moe is None:
            raise ValueError(f"enable_expert_parallel=True needs a mixture-of-experts "
                             f"model; {cfg.architecture} has no experts")
        if self.batch_invariant and cfg.moe is not None:
            raise ValueError(f"batch_invariant=True covers dense models; "
                             f"{cfg.architecture} routes tokens to experts, whose "
                             f"grouped matmuls are not made invariant")
        if self.lora is not None and self.batch_invariant:
            raise ValueError("enable_lora=True and batch_invariant=True: the adapters' "
                             "matmuls are not made invariant")
        if self.pipeline_stages > 1 and (self.lora or self.feature_layers
                                         or self.batch_invariant):
            raise ValueError(f"pipeline_parallel_size={self.pipeline_stages}: LoRA slots, "
                             "speculative heads' features and batch_invariant are not "
                             "pipelined")
        pipeline.check_model(cfg, self.pipeline_stages)
        bad = [i for i in self.feature_layers if not FINAL_NORMED <= i <= cfg.num_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} must be in [{FINAL_NORMED}, "
                             f"{cfg.num_layers}] for a {cfg.num_layers}-layer model")

    def feature_size(self, cfg: ModelConfig) -> int:
        """Width of the features the step keeps per token (0: none kept)."""
        return len(self.feature_layers) * cfg.hidden_size


DEFAULT_OPTIONS = ModelOptions()  # a single request's engine: nothing split or kept


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    hf = families.text_model_config(hf)
    family = families.family_of(hf)
    hf = family.with_defaults(hf)
    return _common_fields(family.name, hf) | family.from_hf(hf)


def _hf_architecture(causal_lm: str, head: str) -> str:
    """The HF class name of a family's model with `head` (families.HEAD_SUFFIXES)."""
    suffix = next(s for s, h in families.HEAD_SUFFIXES.items() if h == head)
    return causal_lm.removesuffix("ForCausalLM") + suffix


def _head_fields(hf: dict[str, Any]) -> dict[str, Any]:
    head = families.head_of(hf)
    if head != "score":
        return {"head": head}
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # HF's default
    return {"head": head, "num_labels": int(labels)}


def _common_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The fields every family reads alike."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"config.json has no {key!r}")
    heads = hf["num_attention_heads"]
    return {
        "architecture": arch,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
    } | _head_fields(hf)


def preset_names() -> list[str]:
    """The presets' names, sorted."""
    return sorted(p.name.removesuffix(".toml") for p in PRESET_DIR.iterdir()
                  if p.name.endswith(".toml"))


def load_preset(name_or_path: str) -> ModelConfig:
    """A `ModelConfig` from a TOML preset: a name in PRESET_DIR or a file path."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = PRESET_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"no preset {name_or_path!r}; known presets: {preset_names()}")
    data = tomllib.loads(path.read_text())
    model = dict(data.get("model", data))
    if "rope_scaling" in model:
        model["rope_scaling"] = scaling_of(model["rope_scaling"])
    if "moe" in model:
        model["moe"] = MoEConfig(**model["moe"])
    if "layer_types" in model:
        model["layer_types"] = tuple(model["layer_types"])
    if "sliding_window_pattern" in model:  # HF's name: every n-th layer global
        every = model.pop("sliding_window_pattern")
        model["layer_types"] = pattern_layer_types(model["num_layers"], every)
    return ModelConfig(**model)
