"""The model's shape and numerics: `ModelConfig`, HF `config.json` reading, TOML presets.

`ModelConfig.from_hf` reads the dict of an HF `config.json` for the decoder family we
serve (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3's text tower:
config/gemma.py, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE:
config/moe.py); anything else is refused with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib
import tomllib
from typing import Any

from jaxinfer.config import gemma, gpt_oss
from jaxinfer.config.moe import MoEConfig, moe_from_hf

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
ROPE_TYPES = ("default", "llama3", "linear")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # SwiGLU; GeGLU with tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names
ATTENTION_IMPLS = ("auto", "tpu", "gpu", "reference")  # as in pallas/dispatch.py
FINAL_NORMED = -1  # a feature layer: the last layer's output after the final norm
# Model shapes by name (llama3.1-8b, ...), package data: installed with the wheel.
PRESET_DIR = importlib.resources.files("jaxinfer.config") / "presets"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Frequency scaling of RoPE: Llama-3's (`rope_type = "llama3"`, the factors below) or
    linear position interpolation (`"linear"`: every frequency divided by `factor`)."""

    rope_type: str = "llama3"
    factor: float
    low_freq_factor: float | None = None  # llama3 only, as the two below
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"{self.rope_type=} must be one of {ROPE_TYPES[1:]}")
        if self.factor <= 0:
            raise ValueError(f"{self.factor=} must be > 0")
        if self.rope_type == "llama3":
            self._check_llama3()

    def _check_llama3(self) -> None:
        names = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"llama3 rope scaling lacks {missing}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"{self.high_freq_factor=} must be > {self.low_freq_factor=}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"{self.original_max_position_embeddings=} must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of one decoder-only transformer."""

    architecture: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | gpt_oss.YarnScaling | None = None
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
    expert_parallel: bool = False
    """Each device holds whole experts (E / tensor_parallel_size of them) instead of a
    slice of every expert. The engine sets it from `EngineConfig.enable_expert_parallel`;
    checkpoints never do."""
    attention_impl: str = "auto"
    """Attention kernel ("auto": the backend's kernel, else the reference). The engine sets
    it from `EngineConfig.attention_impl`; checkpoints never do (`from_hf` ignores it)."""
    attention_interpret: bool = False  # run the Pallas kernel in interpret mode (CPU tests)
    feature_layers: tuple[int, ...] = ()
    """Hidden features the step keeps for speculative heads (EAGLE, Medusa): each entry
    i in [0, num_layers] is the residual stream entering layer i (num_layers: after the
    last one), FINAL_NORMED (-1) the last layer's output after the final norm (what the
    LM head reads). When set, the KV cache has one more entry, the feature store
    [pages * page_size, len * hidden_size], written at each computed token's KV slot.
    The engine sets it from the speculative heads' config; checkpoints never do."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ValueError(
                f"{self.architecture=} must be one of {sorted(ARCHITECTURES.values())}")
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
        if self.expert_parallel and self.moe is None:
            raise ValueError(f"enable_expert_parallel=True needs a mixture-of-experts "
                             f"model; {self.architecture} has no experts")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"{self.attention_impl=} must be one of {ATTENTION_IMPLS}")
        bad = [i for i in self.feature_layers if not FINAL_NORMED <= i <= self.num_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} must be in [{FINAL_NORMED}, "
                             f"{self.num_layers}] for a {self.num_layers}-layer model")

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
        if self.architecture == "gemma3" and self.attn_logit_softcapping is not None:
            raise ValueError(f"{self.attn_logit_softcapping=} must be None for gemma3 "
                             "(transformers' Gemma 3 never applies it)")

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

    @property
    def feature_size(self) -> int:
        """Width of the features the step keeps per token (0: none kept)."""
        return len(self.feature_layers) * self.hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts in place of its MLP."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF `config.json`; errors name the field."""
        return cls(**_fields_from_hf(hf))

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `from_hf` reads back to this config."""
        arch = {v: k for k, v in ARCHITECTURES.items()}[self.architecture]
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            scaling = dataclasses.asdict(self.rope_scaling)
            rope |= {k: v for k, v in scaling.items() if v is not None}
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": gemma.MODEL_TYPES.get(self.architecture, self.architecture),
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
        if self.architecture in ("mistral", "mixtral"):
            out["sliding_window"] = self.sliding_window
        if self.moe is not None:
            out |= self.moe.to_hf(self.architecture)
        if self.architecture in gemma.GEMMA_ARCHITECTURES:
            out |= gemma.gemma_to_hf(self, rope)
        if self.architecture == gpt_oss.ARCHITECTURE:
            out |= gpt_oss.to_hf(self)
        return out


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    hf = gemma.text_tower_config(hf) or hf
    archs = hf.get("architectures") or []
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    model_type = gemma.ARCHITECTURE_OF_MODEL_TYPE.get(hf.get("model_type"),
                                                      hf.get("model_type"))
    if not archs and model_type in ARCHITECTURES.values():
        known = [model_type]
    if not known:
        raise ValueError(
            f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
            f"supported: {sorted(ARCHITECTURES)}")
    arch = known[0]
    if arch in gemma.GEMMA_ARCHITECTURES:
        return _common_fields(arch, hf) | gemma.gemma_fields_from_hf(arch, hf, _rope_from_hf)
    if arch == gpt_oss.ARCHITECTURE:
        hf = gpt_oss.with_defaults(hf)
        return _common_fields(arch, hf) | gpt_oss.fields_from_hf(hf, _rope_from_hf) | {
            "moe": moe_from_hf(arch, hf)}
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
    theta, scaling = _rope_from_hf(hf)
    return _common_fields(arch, hf) | {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "qkv_bias": arch in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias", False)),
        "qk_norm": arch in ("qwen3", "qwen3_moe"),
        "sliding_window": _sliding_window_from_hf(arch, hf),
        "moe": moe_from_hf(arch, hf),
    }


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
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings",
                                           arch in gemma.GEMMA_ARCHITECTURES)),
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
    }


def _rope_from_hf(hf: dict[str, Any], default_theta: float = 10000.0
                  ) -> tuple[float, RopeScaling | None]:
    """Reads `rope_parameters` (transformers >= 5) or `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    params = {**legacy, **params}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        return float(theta), gpt_oss.yarn_from_hf(params)
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json rope_type={kind!r} is not supported; use one of "
                         f"{ROPE_TYPES}")
    if kind == "default":
        return float(theta), None
    names = [f.name for f in dataclasses.fields(RopeScaling) if f.name != "rope_type"]
    if kind == "linear":
        names = ["factor"]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"config.json {kind} rope scaling lacks {missing}")
    return float(theta), RopeScaling(rope_type=kind, **{n: params[n] for n in names})


def _sliding_window_from_hf(arch: str, hf: dict[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if arch in ("mistral", "mixtral"):
        return window
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true (per-layer windows) is "
                         "not supported for Qwen models")
    return None


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
        scaling = model["rope_scaling"]
        yarn = scaling.get("rope_type") == "yarn"
        model["rope_scaling"] = (gpt_oss.YarnScaling if yarn else RopeScaling)(**scaling)
    if "moe" in model:
        model["moe"] = MoEConfig(**model["moe"])
    if "layer_types" in model:
        model["layer_types"] = tuple(model["layer_types"])
    if "sliding_window_pattern" in model:  # HF's name: every n-th layer global
        every = model.pop("sliding_window_pattern")
        model["layer_types"] = gemma.pattern_layer_types(model["num_layers"], every)
    return ModelConfig(**model)
