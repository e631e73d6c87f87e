"""Every config as a frozen, kw-only, hashable dataclass, and TOML presets.

Imports only the standard library. `ModelConfig.from_hf` reads the dict of an
HF `config.json` for the decoder family we serve (Llama 2/3, Mistral, Qwen2,
Qwen3); anything else is refused with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib
from typing import Any

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "llama3")
ATTENTION_IMPLS = ("auto", "tpu", "gpu", "reference")  # as in pallas/dispatch.py
PRESET_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency scaling of RoPE (`rope_type = "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"{self.factor=} must be > 0")
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
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 2048
    attention_impl: str = "auto"
    """Attention kernel ("auto": the backend's kernel, else the reference). The engine sets
    it from `EngineConfig.attention_impl`; checkpoints never do (`from_hf` ignores it)."""
    attention_interpret: bool = False  # run the Pallas kernel in interpret mode (CPU tests)

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
        if self.rms_norm_eps <= 0:
            raise ValueError(f"{self.rms_norm_eps=} must be > 0")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"{self.attention_impl=} must be one of {ATTENTION_IMPLS}")

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF `config.json`; errors name the field."""
        return cls(**_fields_from_hf(hf))

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `from_hf` reads back to this config."""
        arch = {v: k for k, v in ARCHITECTURES.items()}[self.architecture]
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope = {**rope, "rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.qkv_bias,
        }
        if self.architecture == "mistral":
            out["sliding_window"] = self.sliding_window
        return out


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    archs = hf.get("architectures") or []
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not archs and hf.get("model_type") in ARCHITECTURES.values():
        known = [hf["model_type"]]
    if not known:
        raise ValueError(
            f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
            f"supported: {sorted(ARCHITECTURES)}")
    arch = known[0]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"config.json has no {key!r}")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope_from_hf(hf)
    return {
        "architecture": arch,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": arch == "qwen2" or bool(hf.get("attention_bias", False)),
        "qk_norm": arch == "qwen3",
        "sliding_window": _sliding_window_from_hf(arch, hf),
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
    }


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads `rope_parameters` (transformers >= 5) or `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    params = {**legacy, **params}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json rope_type={kind!r} is not supported; use one of "
                         f"{ROPE_TYPES}")
    if kind == "default":
        return float(theta), None
    names = [f.name for f in dataclasses.fields(RopeScaling)]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"config.json llama3 rope scaling lacks {missing}")
    return float(theta), RopeScaling(**{n: params[n] for n in names})


def _sliding_window_from_hf(arch: str, hf: dict[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if arch == "mistral":
        return window
    if arch in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true (per-layer windows) is "
                         "not supported for Qwen models")
    return None


def load_preset(name_or_path: str) -> ModelConfig:
    """A `ModelConfig` from a TOML preset: a name in configs/ or a file path."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = PRESET_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.toml"))
        raise FileNotFoundError(f"no preset {name_or_path!r}; known presets: {known}")
    data = tomllib.loads(path.read_text())
    model = dict(data.get("model", data))
    if "rope_scaling" in model:
        model["rope_scaling"] = RopeScaling(**model["rope_scaling"])
    return ModelConfig(**model)


DEFAULT_MODEL = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
SCHEDULERS = ("continuous", "static")
DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", *DTYPES, "int8", "fp8")  # 8-bit: pallas/kv_quant.py
QUANTIZATION_MODES = ("int8", "w8a8", "fp8", "int4")  # jaxinfer/quantization.py


SPECULATIVE_METHODS = ("draft_model", "ngram")
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): who proposes draft tokens and
    how many a step may verify per request (jaxinfer/engine/speculation.py)."""

    method: str  # "draft_model" (a small model with the target's tokenizer) or "ngram"
    num_speculative_tokens: int  # k: the most draft tokens a request verifies per step
    model: str | None = None  # draft_model: the draft's checkpoint directory
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched against earlier tokens
    prompt_lookup_max: int = 4  # ngram: longest suffix matched (the longest match wins)
    adaptive: bool = True  # choose per step whether (and how far) to speculate by cost

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} must be one of "
                             f"{SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}]")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"speculative_config model={self.model!r}: method='draft_model' "
                             "needs the draft's directory and 'ngram' takes none")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)) or \
                not 1 <= low <= high:
            raise ValueError(f"speculative_config prompt_lookup_min={low!r} and "
                             f"prompt_lookup_max={high!r} must be ints with 1 <= min <= max")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive={self.adaptive!r} must be a bool")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict, a JSON string (the CLI flag's), or None; an
        unknown key is an error naming it."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, not "
                             f"{type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        missing = sorted(k for k in ("method", "num_speculative_tokens") if k not in value)
        if missing:
            raise ValueError(f"speculative_config lacks {missing}")
        return cls(**value)


def _setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field of EngineConfig or DistributedConfig: its help text and allowed values feed
    the CLI's flags."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine batches, pads and sizes its KV cache. The CLI derives one flag per
    field from here: name, default, type, `choices` and `help` (see `_setting`)."""

    dtype: str = _setting("float32", "weights dtype", DTYPES)
    kv_cache_dtype: str = _setting("auto", "KV pages dtype; auto: the weights' dtype; "
                                   "int8, fp8 (float8_e4m3fn): 8-bit values with a float32 "
                                   "scale per token and KV head", KV_CACHE_DTYPES)
    max_num_seqs: int = _setting(32, "requests in flight")
    max_num_batched_tokens: int = _setting(512, "tokens per step (the top token bucket)")
    max_model_len: int | None = _setting(None, "prompt + output; default: the model's maximum")
    page_size: int = _setting(16, "tokens per KV page")
    kv_cache_memory_bytes: int | None = _setting(
        None, "KV cache size; default: sized from the device memory or the limits")
    scheduler: str = _setting("continuous", "batching policy; static: the benchmarks' "
                              "baseline (fill a batch, run it to completion)", SCHEDULERS)
    strict_compile: bool = _setting(False, "raise on any compilation after warm-up")
    compilation_cache_dir: str | None = _setting(
        None, "directory of JAX's persistent compilation cache, one per process (set by "
        "LLM and the CLI, not by Engine); default: ~/.cache/jaxinfer/xla; empty: off")
    seed: int = _setting(0, "draws the seeds of requests that give none")
    enable_prefix_caching: bool = _setting(True, "reuse KV pages of shared prompt prefixes")
    attention_impl: str = _setting("auto", "attention kernel; auto: the backend's kernel, "
                                   "else the pure-jnp reference", ATTENTION_IMPLS)
    skip_tokenizer_init: bool = _setting(
        False, "load no tokenizer: prompts must be token ids, outputs carry no text")
    quantization: str | None = _setting(
        None, "quantize the linear weights at load (jaxinfer/quantization.py): int8 "
        "(weight-only), w8a8 (int8 weights and activations; the fast path on CPU), fp8 "
        "(float8_e4m3fn weight-only), int4 (group-wise, activation-aware scales: "
        "jaxinfer/awq.py); default: none", QUANTIZATION_MODES)
    calibration_data: str | None = _setting(
        None, "int4: a JSONL file of {\"text\": ...} lines to choose the activation-aware "
        "scales on; default: windows of the bundled corpus's training files")
    enable_prompt_logprobs: bool = _setting(
        False, "compile a scoring variant of every mixed bucket at warm-up, so requests may "
        "ask for prompt_logprobs (eval_ppl sets it)")
    tensor_parallel_size: int = _setting(
        1, "devices the model is split over (tensor parallelism); must divide the query "
        "heads, and divide the KV heads or be a multiple of them")
    speculative_config: SpeculativeConfig | None = _setting(
        None, "speculative decoding as JSON (vLLM's): {\"method\": \"ngram\" or "
        "\"draft_model\", \"num_speculative_tokens\": k, \"model\": draft directory, "
        "\"prompt_lookup_min\"/\"prompt_lookup_max\": n-gram sizes, \"adaptive\": "
        "choose per step by cost (default true)}; default: off")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        for field in dataclasses.fields(self):
            choices, value = field.metadata["choices"], getattr(self, field.name)
            unset_allowed = value is None and field.default is None
            if choices and value not in choices and not unset_allowed:
                raise ValueError(f"{field.name}={getattr(self, field.name)!r} must be one "
                                 f"of {choices}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"{self.max_num_batched_tokens=} must be >= "
                             f"{self.max_num_seqs=}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"{self.max_model_len=} must be > 1 or None")
        if self.calibration_data is not None and self.quantization != "int4":
            raise ValueError(f"calibration_data={self.calibration_data!r} needs "
                             f"quantization='int4', not {self.quantization!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"{self.kv_cache_memory_bytes=} must be > 0 or None")

    @property
    def kv_dtype(self) -> str:
        """The KV pages' dtype, "auto" resolved to the weights' dtype. (On CPU bfloat16
        pages are stored as their uint16 bits, see model/attention.py; bytes are equal.)"""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins a multi-host job (jaxinfer/distributed.py): the three
    addressing fields all given, or `detect_distributed` (JAX finds them), or neither (one
    process, nothing initialized). The CLI derives one flag per field, as for EngineConfig."""

    coordinator_address: str | None = _setting(
        None, "multi-host: host:port of process 0's coordinator, the same on every process")
    num_processes: int | None = _setting(None, "multi-host: processes in the job, one per "
                                         "host")
    process_id: int | None = _setting(None, "multi-host: this process's index, 0 to "
                                      "num_processes - 1; process 0 writes the outputs")
    detect_distributed: bool = _setting(
        False, "multi-host, addresses found by JAX: Cloud TPU VM slices (GCE, GKE), Slurm, "
        "Open MPI")
    initialization_timeout_s: int = _setting(
        300, "multi-host: seconds to wait for every process to join before failing")
    heartbeat_timeout_s: int = _setting(
        100, "multi-host: seconds without a heartbeat after which a process counts as dead "
        "and the job stops with an error")

    def __post_init__(self) -> None:
        given = [name for name in ("coordinator_address", "num_processes", "process_id")
                 if getattr(self, name) is not None]
        if given and len(given) < 3:
            raise ValueError(f"{given[0]}={getattr(self, given[0])!r}: give all of "
                             "coordinator_address, num_processes and process_id, or none")
        if given and self.detect_distributed:
            raise ValueError(f"{self.detect_distributed=}: give it or coordinator_address, "
                             "num_processes and process_id, not both")
        for name in ("num_processes", "initialization_timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive int")
        if given and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"{self.process_id=} must be in [0, {self.num_processes=})")
        host, _, port = (self.coordinator_address or "h:1").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{self.coordinator_address=} must be host:port")

    @property
    def enabled(self) -> bool:
        """Whether this process joins a multi-host job."""
        return self.detect_distributed or self.coordinator_address is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How `python -m jaxinfer serve` listens and protects itself (jaxinfer/server/). The
    CLI derives one flag per field, as for EngineConfig."""

    host: str = _setting("127.0.0.1", "address to listen on; 0.0.0.0 exposes the server to "
                         "the network (set --api_key then)")
    port: int = _setting(8000, "TCP port; 0 picks a free one (logged)")
    api_key: str | None = _setting(None, "clients must send 'Authorization: Bearer KEY' to "
                                   "/v1/*; default: no key")
    served_model_name: str | None = _setting(None, "the model name clients give; default: "
                                             "--model as given ('demo' for the bundled one)")
    max_waiting_requests: int = _setting(
        256, "completions waiting for a slot (n counts each); over it requests get 503 with "
        "Retry-After")
    max_request_body_bytes: int = _setting(8 * 2**20, "larger request bodies get 413")
    shutdown_timeout: int = _setting(
        30, "seconds after SIGTERM to finish in-flight requests; then they are aborted with "
        "an error and the process exits 0")

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_request_body_bytes", "shutdown_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} must be in [0, 65536)")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset for no key)")
