"""vLLM's `LLM(...)` keywords (its `LLM.__init__` and `EngineArgs`) as jaxinfer's LLM takes
them: EngineConfig fields of the same name and meaning are honoured, `enforce_eager` skips
the warm-up, and each other vLLM name is accepted where it changes nothing here or refused
with the reason (`VLLM_KEYWORDS`). See docs/sampling.md#vllms-llm-keywords.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import NamedTuple

from jaxinfer.config.engine import EngineConfig

log = logging.getLogger(__name__)
ANY = "any value"  # a keyword that changes nothing here, whatever its value
# vLLM's None for "the default" where EngineConfig's default is a value
NONE_IS_DEFAULT = ("seed", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")


class Keyword(NamedTuple):
    """A vLLM keyword EngineConfig has no field for: the values that change nothing here
    (accepted; ANY: all), and why it has no effect, or why other values are refused."""

    accepted: tuple | str
    reason: str


_TEXT_ONLY = "jaxinfer serves text models: no image, audio or video inputs"
_NO_CODE = "jaxinfer runs no code from a checkpoint or the caller in its steps"
_CONFIG_AS_IS = "the checkpoint's config.json is read as it is: edit a copy of it"
_TASK = ("vLLM's older name: runner='pooling' serves embedding, classification and scoring "
         "models (docs/pooling.md)")
_CONVERT = ("runner='pooling' pools a causal LM's last hidden state; no other conversion "
            "(docs/pooling.md#choosing-the-runner)")
_POOLER = ("the pooling is the checkpoint's (sentence-transformers' files); PoolingParams "
           "sets normalize and dimensions per request (docs/pooling.md)")
_ONE_PROCESS = ("one process drives a host's devices; a multi-host job joins through "
                "jaxinfer.distributed (docs/parallelism.md)")
_XLA = "XLA compiles every step's bucket; there are no CUDA graphs or torch.compile to set"

VLLM_KEYWORDS: dict[str, Keyword] = {
    # accepted, with no effect here
    "served_model_name": Keyword(ANY, "names the model in the server's answers; LLM "
                                 "answers no HTTP requests (serve --served_model_name does)"),
    "disable_log_stats": Keyword(ANY, "LLM logs no periodic statistics; llm.metrics() "
                                 "reports them when asked"),
    "enable_log_requests": Keyword(ANY, "LLM logs no line per request"),
    "disable_log_requests": Keyword(ANY, "LLM logs no line per request"),
    "swap_space": Keyword(ANY, "a preempted request gives its KV pages back and recomputes "
                          "them when it resumes (vLLM V1's way too): nothing is swapped"),
    "disable_custom_all_reduce": Keyword(ANY, "XLA chooses the collectives"),
    "disable_async_output_proc": Keyword(ANY, "vLLM V0's; async_scheduling is the setting "
                                         "here"),
    "max_seq_len_to_capture": Keyword(ANY, _XLA),
    "compilation_config": Keyword(ANY, _XLA),
    "cuda_graph_sizes": Keyword(ANY, _XLA),
    "cudagraph_capture_sizes": Keyword(ANY, _XLA),
    "max_cudagraph_capture_size": Keyword(ANY, _XLA),
    "disable_cascade_attn": Keyword(ANY, "there is no cascade attention kernel here"),
    "calculate_kv_scales": Keyword(ANY, "an int8 or fp8 KV cache always has a scale per "
                                   "token and KV head, computed as each is written"),
    "prefix_caching_hash_algo": Keyword(ANY, "the prefix cache keys pages by blake2b digests "
                                        "and checks every hit token by token"),
    "scheduling_policy": Keyword(("fcfs", "priority"), "the scheduler orders requests by "
                                 "priority, then arrival: without priorities, first come "
                                 "first served"),
    "max_parallel_loading_workers": Keyword(ANY, "jaxinfer's loader has no worker pool"),
    "safetensors_load_strategy": Keyword(ANY, "jaxinfer's loader has no such choice"),
    "ignore_patterns": Keyword(ANY, "jaxinfer's loader picks the weight files itself"),
    "model_loader_extra_config": Keyword((None, {}), "the loader takes no options"),
    "enable_chunked_prefill": Keyword((None, True), "a long prompt is always split into "
                                      "chunks of up to max_num_batched_tokens"),
    "max_num_partial_prefills": Keyword((1,), "the scheduler has no partial-prefill limits"),
    "max_long_partial_prefills": Keyword((1,), "the scheduler has no partial-prefill limits"),
    "long_prefill_token_threshold": Keyword((0,), "the scheduler has no partial-prefill "
                                            "limits"),
    "max_logprobs": Keyword((20,), "logprobs are limited to the top 20 (vLLM's default), "
                            "fixed"),
    "logprobs_mode": Keyword(("raw_logprobs",), "logprobs are the raw model's (vLLM's "
                             "default mode)"),
    "device": Keyword(("auto",), "JAX picks the backend; set JAX_PLATFORMS to choose it"),
    "hf_token": Keyword((None, True), "the Hub downloads take the token in $HF_TOKEN (else "
                        "huggingface-cli login's): set it there"),
    # refused unless at vLLM's default, which is what jaxinfer does
    "trust_remote_code": Keyword((False,), "jaxinfer runs no code from a checkpoint: its "
                                 "model families are built in"),
    "tokenizer_mode": Keyword(("auto",), "jaxinfer reads the fast tokenizer's "
                              "tokenizer.json alone (auto's choice)"),
    "task": Keyword((None, "auto", "generate"), _TASK),
    "convert": Keyword(("auto", "none"), _CONVERT),
    "pooler_config": Keyword((None,), _POOLER),
    "override_pooler_config": Keyword((None,), _POOLER),
    "block_size": Keyword((None,), "page_size is jaxinfer's name for vLLM's KV cache block"),
    "num_gpu_blocks_override": Keyword((None,), "kv_cache_memory_bytes sizes the KV pool"),
    "cpu_offload_gb": Keyword((0,), "the weights stay in device memory: a larger model needs "
                              "more devices (tensor_parallel_size) or quantization"),
    "decode_context_parallel_size": Keyword((1,), "no context parallelism: "
                                            "tensor_parallel_size splits the KV heads"),
    "distributed_executor_backend": Keyword((None, "mp", "uni"), _ONE_PROCESS),
    "data_parallel_size_local": Keyword((None,), _ONE_PROCESS),
    "data_parallel_rank": Keyword((None,), _ONE_PROCESS),
    "data_parallel_start_rank": Keyword((None,), _ONE_PROCESS),
    "data_parallel_address": Keyword((None,), _ONE_PROCESS),
    "data_parallel_rpc_port": Keyword((None,), _ONE_PROCESS),
    "enable_eplb": Keyword((False,), "experts stay where they are placed at load"),
    "disable_sliding_window": Keyword((False,), "sliding-window layers attend within their "
                                      "window, as the model was trained"),
    "load_format": Keyword(("auto", "safetensors"), "jaxinfer reads safetensors (HF) and "
                           "orbax checkpoints, told apart by the directory's files"),
    "config_format": Keyword(("auto", "hf"), "jaxinfer reads HF's config.json"),
    "hf_config_path": Keyword((None,), _CONFIG_AS_IS),
    "hf_overrides": Keyword((None, {}), _CONFIG_AS_IS),
    "rope_scaling": Keyword((None, {}), _CONFIG_AS_IS),
    "rope_theta": Keyword((None,), _CONFIG_AS_IS),
    "code_revision": Keyword((None,), _NO_CODE),
    "logits_processors": Keyword((None, []), _NO_CODE + ": logit_bias, the penalties and "
                                 "structured outputs shape the logits"),
    "logits_processor_pattern": Keyword((None,), _NO_CODE),
    "worker_cls": Keyword(("auto",), "there are no worker processes"),
    "worker_extension_cls": Keyword(("",), "there are no worker processes"),
    "scheduler_cls": Keyword((None, "vllm.core.scheduler.Scheduler",
                              "vllm.v1.core.sched.scheduler.Scheduler"),
                             "scheduler ('continuous' or 'static') chooses the policy"),
    "structured_outputs_config": Keyword((None, {}), "structured outputs have their own "
                                         "grammar engine here, with nothing to choose"),
    "guided_decoding_backend": Keyword((None, "auto"), "structured outputs have their own "
                                       "grammar engine here, with nothing to choose"),
    "reasoning_parser": Keyword((None, ""), "LLM returns the text as generated; the "
                                "server's --reasoning_parser splits reasoning off"),
    "enable_prompt_adapter": Keyword((False,), "no prompt adapters"),
    "enable_sleep_mode": Keyword((False,), "the engine holds its device memory until it "
                                 "is deleted"),
    "model_impl": Keyword(("auto",), "the model runs jaxinfer's JAX implementation of its "
                          "family"),
    "kv_transfer_config": Keyword((None,), "no KV transfer between instances "
                                  "(disaggregated prefill)"),
    "kv_events_config": Keyword((None,), "the KV cache publishes no events"),
    "kv_sharing_fast_prefill": Keyword((False,), "no KV sharing across layers"),
    "enable_prompt_embeds": Keyword((False,), "prompts are text or token ids"),
    "otlp_traces_endpoint": Keyword((None,), "no OpenTelemetry tracing"),
    "collect_detailed_traces": Keyword((None,), "no OpenTelemetry tracing"),
    "allowed_local_media_path": Keyword(("",), _TEXT_ONLY),
    "allowed_media_domains": Keyword((None,), _TEXT_ONLY),
    "limit_mm_per_prompt": Keyword((None, {}), _TEXT_ONLY),
    "mm_processor_kwargs": Keyword((None, {}), _TEXT_ONLY),
    "media_io_kwargs": Keyword((None, {}), _TEXT_ONLY),
    "enable_mm_embeds": Keyword((False,), _TEXT_ONLY),
}
WARM_UP_KEYWORD = "enforce_eager"  # vLLM's; here: no warm-up (docs/cli.md)


def engine_settings(keywords: dict[str, object]) -> tuple[dict[str, object], bool]:
    """The EngineConfig settings among LLM's `keywords` and whether `enforce_eager` asks
    for no warm-up. A vLLM keyword of VLLM_KEYWORDS at a value it accepts is dropped (its
    effect logged when it has none); at another value, ValueError with the reason. An
    unknown keyword: TypeError naming the close EngineConfig fields."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    settings, eager = {}, False
    for name, value in keywords.items():
        if name == WARM_UP_KEYWORD:
            eager = bool(value)
        elif name in fields:
            if not (value is None and name in NONE_IS_DEFAULT):
                settings[name] = value
        elif name in VLLM_KEYWORDS:
            accepted, reason = VLLM_KEYWORDS[name]
            if accepted is not ANY and not any(_same(value, a) for a in accepted):
                shown = " or ".join(repr(a) for a in accepted)
                raise ValueError(f"LLM({name}={value!r}) is not served: {reason} (vLLM's "
                                 f"keyword; jaxinfer takes {shown})")
            if accepted is ANY:
                log.info("LLM(%s=%r): no effect here: %s", name, value, reason)
        else:
            raise TypeError(unknown_keyword(name, sorted(fields | {WARM_UP_KEYWORD})))
    return settings, eager


def unknown_keyword(name: str, known: list[str]) -> str:
    """The message for an LLM keyword that is neither a setting nor vLLM's."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = ("did you mean " + " or ".join(repr(c) for c in close) + "?" if close else
            "it is no EngineConfig field, nor a vLLM keyword jaxinfer knows "
            "(docs/sampling.md#vllms-llm-keywords)")
    return f"LLM got an unexpected keyword {name!r}; {hint}"


def _same(value: object, accepted: object) -> bool:
    """`value` equals `accepted`, a bool never equal to an int (True is no 1 here)."""
    return isinstance(value, bool) == isinstance(accepted, bool) and value == accepted
