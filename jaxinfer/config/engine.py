"""How the engine runs: `EngineConfig` (batching, KV cache, kernels, quantization, tensor
parallelism) and `SpeculativeConfig`. Each EngineConfig field carries its help text and
allowed values (`setting`), from which the CLI derives its flags.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from jaxinfer.config import lora, offload, pipeline
from jaxinfer.config.dtypes import (  # noqa: F401 (the names engine.py long exported)
    DTYPE_CHOICES,
    DTYPES,
    check_dtype_choice,
    checkpoint_dtype,
    served_dtype,
)
from jaxinfer.config.model import ATTENTION_IMPLS
from jaxinfer.config.pooling import RUNNERS

# The demo checkpoint, package data (in a checkout, a link to checkpoints/demo).
DEFAULT_MODEL = pathlib.Path(__file__).resolve().parents[1] / "demo"
SCHEDULERS = ("continuous", "static")
KV_CACHE_DTYPES = ("auto", *DTYPES, "int8", "fp8")  # 8-bit: pallas/kv_quant.py
# jaxinfer/model/quantization.py; mxfp4: experts only, packed (MXFP4 checkpoints' own)
QUANTIZATION_MODES = ("int8", "w8a8", "fp8", "int4", "mxfp4")
# pre-quantized checkpoint formats --quantization may name (vLLM's names), served as int4:
# jaxinfer/checkpoint/prequantized_int4/
PREQUANTIZED_METHODS = ("awq", "gptq")


SPECULATIVE_METHODS = ("draft_model", "ngram", "eagle", "eagle3", "medusa")
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa")  # those that read `model`
# data-parallel request routing (SGLang's names): jaxinfer/engine/parallel/routing.py
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")
MAX_SPECULATIVE_TOKENS = 8
# generation_config.json key -> SamplingParams field: the keys vLLM's generation_config
# applies to requests that give no sampling parameters (and override_generation_config
# may set)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                       "max_new_tokens": "max_tokens"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): who proposes draft tokens and
    how many a step may verify per request (jaxinfer/engine/spec_decode/speculation.py)."""

    # "draft_model" (a small model with the target's tokenizer), "ngram", or heads on the
    # target's hidden states: "eagle" (EAGLE-1/2), "eagle3", "medusa" (config/heads.py)
    method: str
    num_speculative_tokens: int  # k: the most draft tokens a request verifies per step
    model: str | None = None  # the draft's or the heads' checkpoint directory
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched against earlier tokens
    prompt_lookup_max: int = 4  # ngram: longest suffix matched (the longest match wins)
    adaptive: bool = True  # choose per step whether (and how far) to speculate by cost
    # vLLM's: no speculation in a step of at least this many requests (None: no limit)
    disable_by_batch_size: int | None = None
    # vLLM's: the draft's tensor-parallel degree; here it must be the target's (the draft
    # is split over the same mesh). None: the target's.
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} must be one of "
                             f"{SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}]")
        if (self.method in MODEL_METHODS) != (self.model is not None):
            needs = ("needs a checkpoint directory" if self.method in MODEL_METHODS
                     else "takes none")
            raise ValueError(f"speculative_config model={self.model!r}: method="
                             f"{self.method!r} {needs}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)) or \
                not 1 <= low <= high:
            raise ValueError(f"speculative_config prompt_lookup_min={low!r} and "
                             f"prompt_lookup_max={high!r} must be ints with 1 <= min <= max")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive={self.adaptive!r} must be a bool")
        for key in ("disable_by_batch_size", "draft_tensor_parallel_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"speculative_config {key}={value!r} must be a positive int")
        if self.draft_tensor_parallel_size is not None and self.method != "draft_model":
            raise ValueError("speculative_config draft_tensor_parallel_size is for "
                             "method='draft_model'")

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
        if "method" not in value and "model" in value:  # vLLM infers it from the model
            value = value | {"method": infer_method(value["model"])}
            if value["method"] == "ngram":
                value.pop("model")
        missing = sorted(k for k in ("method", "num_speculative_tokens") if k not in value)
        if missing:
            raise ValueError(f"speculative_config lacks {missing}")
        return cls(**value)


def infer_method(model: object) -> str:
    """The speculative method of `model` when none is given, as vLLM infers it: "ngram"
    by name; else the heads a checkpoint's config.json describes (config/heads.py); else,
    for a config that looks like an ordinary Llama (SafeAILab's EAGLE checkpoints do),
    "eagle3" or "eagle" when the directory's name says so; else "draft_model". A Hub id
    (no directory yet) by its name alone: eagle3, eagle, medusa, else draft_model."""
    if model in ("ngram", "[ngram]"):
        return "ngram"
    path = pathlib.Path(str(model))
    name = path.resolve().name.lower()
    by_name = "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else None
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):  # a Hub id, or the loader names what is wrong
        if by_name is None and "medusa" in name:
            return "medusa"
        return by_name or "draft_model"
    from jaxinfer.config.heads import infer_method as head_method
    return head_method(hf) or by_name or "draft_model"


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field of EngineConfig or DistributedConfig: its help text and allowed values feed
    the CLI's flags."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine batches, pads and sizes its KV cache. The CLI derives one flag per
    field from here: name, default, type, `choices` and `help` (see `setting`)."""

    revision: str | None = setting(
        None, "a Hub model's branch, tag or commit (default: main); docs/models.md")
    tokenizer: str | None = setting(
        None, "the tokenizer's directory or Hub id; default: the model's")
    tokenizer_revision: str | None = setting(
        None, "a Hub tokenizer's branch, tag or commit (default: main)")
    download_dir: str | None = setting(
        None, "where Hub models are downloaded and looked for; default: $HF_HUB_CACHE "
        "(~/.cache/huggingface/hub)")
    chat_template: str | None = setting(
        None, "the chat template, replacing the checkpoint's (vLLM's): a file, or the "
        "Jinja text itself (text holding {{ or {%; on one line, its \\n and \\t are read "
        "as vLLM reads them); default: the checkpoint's")
    generation_config: str = setting(
        "auto", "the sampling defaults of requests that give none (vLLM's): auto, the "
        "checkpoint's generation_config.json; vllm, SamplingParams' own (none from the "
        "checkpoint); or a directory holding a generation_config.json")
    override_generation_config: str | None = setting(
        None, "a JSON object of generation_config.json values over generation_config's "
        "(vLLM's), e.g. {\"temperature\": 0.5}; keys: " + ", ".join(GENERATION_DEFAULTS))
    dtype: str = setting(
        "auto", "weights dtype; auto: the checkpoint's (config.json's dtype), but a float32 "
        "checkpoint in bfloat16 on TPU and GPU and a float16 one in bfloat16; float: "
        "float32 (docs/models.md#dtype)", DTYPE_CHOICES)
    kv_cache_dtype: str = setting("auto", "KV pages dtype; auto: the weights' dtype; "
                                   "int8, fp8 (float8_e4m3fn): 8-bit values with a float32 "
                                   "scale per token and KV head", KV_CACHE_DTYPES)
    max_num_seqs: int = setting(32, "requests in flight")
    max_num_batched_tokens: int = setting(512, "tokens per step (the top token bucket)")
    max_model_len: int | None = setting(None, "prompt + output; default: the model's maximum")
    page_size: int = setting(16, "tokens per KV page")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV cache size; default: sized from the device memory or the limits")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of each accelerator's memory (TPU or GPU; vLLM's name) for the "
        "weights plus the KV pool, unless kv_cache_memory_bytes is given. Not used on CPU, "
        "where the pool holds every slot at full length within a quarter of RAM")
    scheduler: str = setting("continuous", "batching policy; static: the benchmarks' "
                              "baseline (fill a batch, run it to completion)", SCHEDULERS)
    async_scheduling: bool = setting(
        True, "plan and send step t + 1 while step t runs on the device; decode tokens "
        "pass from step to step on the device and are read one step late (a request that "
        "stops may compute one extra position, discarded). Speculative decoding runs "
        "synchronous steps")
    strict_compile: bool = setting(False, "raise on any compilation after warm-up")
    batch_invariant: bool = setting(
        False, "matmuls and RoPE by fixed blocks of 16 rows, so a token's logits do not "
        "depend on the batch or step it ran in, and jaxinfer.training's "
        "sequence_logprobs(batch_invariant=True) equals the engine's logprobs bitwise on "
        "CPU (vLLM's VLLM_BATCH_INVARIANT); dense models, tensor_parallel_size=1; costs "
        "compute (docs/rl.md#batch-invariant-mode)")
    compilation_cache_dir: str | None = setting(
        None, "directory of JAX's persistent compilation cache, one per process (set by "
        "LLM and the CLI, not by Engine); default: $JAX_COMPILATION_CACHE_DIR, else "
        "~/.cache/jaxinfer/xla; empty: off")
    seed: int = setting(0, "draws the seeds of requests that give none")
    enable_prefix_caching: bool = setting(True, "reuse KV pages of shared prompt prefixes")
    kv_offloading_size: float | None = setting(
        None, "GiB of host memory (a replica's devices together; vLLM's name and unit) "
        "that keep the full KV pages evicted from the device pool; a prefix hit copies "
        "them back (docs/kv_cache.md#the-host-tier); None: off")
    kv_offloading_backend: str = setting(
        "native", "what keeps offloaded pages (vLLM's name): native, jaxinfer's host tier",
        ("native",))
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "models with both sliding-window and full-attention layers (Gemma 3, "
        "gpt-oss): keep every page in every layer, as for other models, instead of giving "
        "the sliding layers their own pages, freed as they slide out of the window "
        "(vLLM's name; docs/kv_cache.md)")
    runner: str = setting(
        "auto", "what the model serves (vLLM's name): generate (text), pooling (embeddings, "
        "scores: docs/pooling.md); auto: pooling for an encoder, a checkpoint without an "
        "LM head, or a sentence-transformers directory, else generate", RUNNERS)
    attention_impl: str = setting("auto", "attention kernel; auto: the backend's kernel, "
                                   "else the pure-jnp reference", ATTENTION_IMPLS)
    skip_tokenizer_init: bool = setting(
        False, "load no tokenizer: prompts must be token ids, outputs carry no text")
    quantization: str | None = setting(
        None, "quantize the linear weights at load (jaxinfer/model/quantization.py): int8 "
        "(weight-only), w8a8 (int8 weights and activations; the fast path on CPU), fp8 "
        "(float8_e4m3fn weight-only), int4 (group-wise, activation-aware scales: "
        "jaxinfer/checkpoint/awq.py), mxfp4 (the experts alone, 4-bit blocks as gpt-oss "
        "publishes them, its checkpoints' default); awq, gptq: an AWQ or GPTQ checkpoint's "
        "int4 as it is (also detected from its config.json); default: none, or the "
        "checkpoint's",
        QUANTIZATION_MODES + PREQUANTIZED_METHODS)
    calibration_data: str | None = setting(
        None, "int4: a JSONL file of {\"text\": ...} lines to choose the activation-aware "
        "scales on; default: windows of the bundled corpus's training files")
    enable_prompt_logprobs: bool = setting(
        False, "compile a scoring variant of every mixed bucket at warm-up, so requests may "
        "ask for prompt_logprobs (eval_ppl sets it)")
    tensor_parallel_size: int = setting(
        1, "devices the model is split over (tensor parallelism); must divide the query "
        "heads, and divide the KV heads or be a multiple of them")
    data_parallel_size: int = setting(
        1, "replicas of the model (data parallelism), each on its own tensor_parallel_size "
        "devices with its own scheduler and KV pool; requests go to the replica that has "
        "their prefix cached, else the least loaded (vLLM's --data-parallel-size)")
    load_balance_method: str = setting(
        "cache_aware", "with data_parallel_size > 1, which replica a request goes to: "
        "cache_aware (the one that has its leading pages, unless it is the busier by a "
        "batch; else the least loaded), round_robin, shortest_queue (SGLang's names)",
        LOAD_BALANCE_METHODS)
    pipeline_parallel_size: int = setting(
        1, "stages the layers are split into (pipeline parallelism), each on its own "
        "tensor_parallel_size devices, a step's tokens flowing through them in "
        "microbatches (vLLM's --pipeline-parallel-size; docs/parallelism.md)")
    pipeline_microbatches: int = setting(
        0, "with pipeline_parallel_size > 1: microbatches a step's tokens are split into "
        "so the stages work at once; 0: one per stage")
    enable_expert_parallel: bool = setting(
        False, "mixture-of-experts models: each of the tensor_parallel_size devices holds "
        "whole experts (it must divide their number) instead of a slice of every expert; "
        "attention stays tensor parallel")
    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT's format) on the base model, many in one batch "
        "(docs/lora.md)")
    max_loras: int = setting(1, "with enable_lora: adapters on the device at once (one "
                             "slot each; more wait on the host)")
    max_lora_rank: int = setting(16, "with enable_lora: the largest adapter rank served "
                                 "(every slot is this rank, smaller ones zero-padded)")
    max_cpu_loras: int | None = setting(
        None, "with enable_lora: adapters kept in host memory (least recently used "
        "dropped); default: max_loras")
    speculative_config: SpeculativeConfig | None = setting(
        None, "speculative decoding as JSON (vLLM's): {\"method\": \"ngram\", "
        "\"draft_model\", \"eagle\", \"eagle3\" or \"medusa\" (inferred from the "
        "model's config.json when absent), \"num_speculative_tokens\": k, \"model\": the "
        "draft's or heads' directory, "
        "\"prompt_lookup_min\"/\"prompt_lookup_max\": n-gram sizes, \"adaptive\": "
        "choose per step by cost (default true)}; default: off")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        check_dtype_choice(self.dtype)
        if self.dtype == "float":
            object.__setattr__(self, "dtype", "float32")
        for field in dataclasses.fields(self):
            choices, value = field.metadata["choices"], getattr(self, field.name)
            unset_allowed = value is None and field.default is None
            if choices and value not in choices and not unset_allowed:
                raise ValueError(f"{field.name}={getattr(self, field.name)!r} must be one "
                                 f"of {choices}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size",
                     "tensor_parallel_size", "data_parallel_size",
                     "pipeline_parallel_size"):
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
        lora.check_settings(self.enable_lora, self.max_loras, self.max_lora_rank,
                            self.max_cpu_loras)
        pipeline.check_settings(self)
        offload.check_settings(self)
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant=True runs each replica on one device; "
                             f"tensor_parallel_size={self.tensor_parallel_size} sums "
                             "matmuls across devices")
        if not (isinstance(self.gpu_memory_utilization, int | float)
                and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"{self.gpu_memory_utilization=} must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"{self.kv_cache_memory_bytes=} must be > 0 or None")
        for name in ("chat_template", "generation_config"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}={value!r} must be a non-empty string")
        object.__setattr__(self, "override_generation_config",
                           parse_generation_overrides(self.override_generation_config))

    @property
    def generation_overrides(self) -> dict[str, int | float]:
        """`override_generation_config` as a dict (generation_config.json's keys)."""
        return json.loads(self.override_generation_config or "{}")

    @property
    def lora_slots(self) -> lora.LoraSlots | None:
        """The adapter slots the step holds (model/lora.py); None without enable_lora."""
        if not self.enable_lora:
            return None
        dtype = self.dtype if self.dtype in lora.LORA_DTYPES else "float32"
        return lora.LoraSlots(self.max_loras, self.max_lora_rank, dtype)

    @property
    def kv_dtype(self) -> str:
        """The KV pages' dtype, "auto" resolved to the weights' dtype. (On CPU bfloat16
        pages are stored as their uint16 bits, see model/attention.py; bytes are equal.)"""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        if self.dtype == "auto":
            raise ValueError("kv_cache_dtype='auto' follows dtype, which is still 'auto': "
                             "resolve it first (config.served_dtype)")
        return self.dtype


def parse_generation_overrides(value: dict | str | None) -> str | None:
    """vLLM's override_generation_config, a dict or a JSON object of generation_config.json
    values, as canonical JSON (the config stays hashable); ValueError naming a key that is
    not one of GENERATION_DEFAULTS or a value that is not a number."""
    given = f"override_generation_config={value!r}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{given} is not valid JSON: {e}") from None
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{given} must be a JSON object")
    unknown = sorted(set(value) - set(GENERATION_DEFAULTS))
    if unknown:
        hint = " (generation_config.json's name for max_tokens is max_new_tokens)" if \
            "max_tokens" in unknown else ""
        raise ValueError(f"{given}: {unknown} set no sampling default; its keys are "
                         f"{list(GENERATION_DEFAULTS)}{hint}")
    for key, number in value.items():
        if not isinstance(number, int | float) or isinstance(number, bool):
            raise ValueError(f"{given}: {key}={number!r} is not a number")
    return json.dumps(value, sort_keys=True)
