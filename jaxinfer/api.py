"""The public Python API: `LLM(model=..., **engine settings)`, `generate`,
`generate_stream`, `chat`. `LLM` is a face over the engine; it also sets JAX's
compilation cache and takes vLLM's keywords (config/vllm_keywords.py). See
docs/sampling.md#the-python-api.
"""

from __future__ import annotations

import itertools
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from jaxinfer.checkpoint import hub
from jaxinfer.config import DEFAULT_MODEL, EngineConfig, vllm_keywords
from jaxinfer.config import runner as runner_choice
from jaxinfer.engine import loading, runner
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.parallel.data_parallel import DataParallelEngine, make_engine
from jaxinfer.engine.request import RequestOutput, SamplingParams
from jaxinfer.lora import LoRARequest
from jaxinfer.pooling.calls import PoolingCalls
from jaxinfer.pooling.engine import PoolingEngine
from jaxinfer.text.tokenizer import Tokenizer, TooLong

Prompt = str | Sequence[int]
Conversation = Sequence[Mapping[str, object]]  # chat messages: {"role": ..., "content": ...}


class LLM(PoolingCalls):
    """A model served by the engine; keyword arguments are EngineConfig fields
    (`skip_tokenizer_init=True` serves token-id prompts from a checkpoint without a
    tokenizer: outputs carry token ids and empty text) and vLLM's keywords, each honoured,
    accepted where it changes nothing, or refused with the reason
    (docs/sampling.md#vllms-llm-keywords). `enforce_eager=True` (vLLM's) is
    `warm_up=False`: each bucket compiles when a step first needs it. A pooling model
    (`runner="pooling"`, or found so by "auto": docs/pooling.md) serves `embed`,
    `classify` and `score` instead of `generate`."""

    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, *, warm_up: bool = True,
                 **engine_settings: object) -> None:
        settings, eager = vllm_keywords.engine_settings(engine_settings)
        config = EngineConfig(**settings)
        if eager and config.strict_compile:
            raise ValueError("enforce_eager=True compiles each bucket when first used, which "
                             "strict_compile=True refuses: give one of them")
        if pathlib.Path(model) == DEFAULT_MODEL and not DEFAULT_MODEL.is_dir():
            raise FileNotFoundError(
                f"no model was given, and the default (the demo checkpoint, {DEFAULT_MODEL})"
                " is not there. Give a model directory: LLM(model=DIR), or --model=DIR")
        model, config = hub.resolve_all(model, config)  # Hub ids -> local directories
        runner.use_compilation_cache(config.compilation_cache_dir)
        config = runner_choice.with_runner(model, config)
        if config.runner == "pooling":
            self.engine = make_pooling_engine(model, config, warm_up=warm_up and not eager)
        else:
            self.engine = make_engine(model, config, warm_up=warm_up and not eager)
        self.tokenizer = self.engine.tokenizer
        self.config = getattr(self.engine, "model_config", None)
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> Engine | DataParallelEngine:
        """The engine (vLLM's name for it; `engine` is the same object)."""
        return self.engine

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (vLLM's accessor): `encode`, `decode`,
        `apply_chat_template`, `convert_ids_to_tokens`; docs/serving.md#tokenization
        says where it differs from transformers'."""
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given. No
        `sampling_params`: the checkpoint's defaults (`engine.default_params`).
        `priority`: one int per prompt, lower runs first (as in vLLM). `use_tqdm`: a
        progress bar of finished prompts on stderr (vLLM's). `lora_request`: the LoRA
        adapter of every prompt, or one per prompt (None: the base model; vLLM's;
        docs/lora.md)."""
        self._generating("generate")
        ids = self._add_all(prompts, sampling_params, priority, lora_request)
        pending = set(ids)  # a step reports the prompts it changed: no scan of all of them
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        bar.update()
        return [self.engine.release(i) for i in ids]

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                        ) -> Iterator[RequestOutput]:
        """Yield a prompt's RequestOutput each time a step adds to it (see deltas)."""
        self._generating("generate_stream")
        ids = self._add_all(prompts, sampling_params, lora_request=lora_request)
        try:
            while any(not self.engine.output(i).finished for i in ids):
                yield from (out for out in self.engine.step() if out.request_id in ids)
        finally:
            for i in ids:
                self.engine.abort(i)
                self.engine.release(i)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             tools: Sequence[Mapping[str, object]] | None = None,
             continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, object] | None = None,
             chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or
        several, through the chat template (the checkpoint's, or LLM's `chat_template`):
        the server's path for /v1/chat/completions. `tools`: function definitions in
        OpenAI's shape (`{"type": "function", "function": {"name", "description",
        "parameters"}}`), which the template shows the model (vLLM's argument);
        `continue_final_message`, `chat_template_kwargs` (template variables such as
        Qwen3's `enable_thinking`) and `chat_template` (this call's template, its text or
        a file) as vLLM's. One finished RequestOutput per conversation, in order."""
        self._generating("chat")
        chat = {"continue_final_message": continue_final_message,
                "template_kwargs": dict(chat_template_kwargs or {})}
        tokenizer = self.tokenizer
        if chat_template is not None and tokenizer is not None:
            tokenizer = tokenizer.with_chat_template(
                loading.read_chat_template(chat_template, unescape=False))
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            messages = [messages]
        prompts = []
        for index, conversation in enumerate(messages):
            try:
                prompts.append(self._chat_prompt(tokenizer, [dict(m) for m in conversation],
                                                 tools, add_generation_prompt, chat))
            except (ValueError, TypeError) as e:
                raise ValueError(f"conversation {index}: {e}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _chat_prompt(self, tokenizer: Tokenizer | None, messages: list[dict],
                     tools: Sequence[Mapping] | None, add_generation_prompt: bool,
                     chat: dict) -> list[int]:
        if tokenizer is None or (tools is None and tokenizer is self.tokenizer):
            return self.engine.prompt_token_ids(messages=messages,
                                                add_generation_prompt=add_generation_prompt,
                                                **chat)
        try:  # rendered here (tools, this call's template), then checked as token ids
            ids = tokenizer.prompt_ids(None, messages,
                                       tools=None if tools is None else [dict(t) for t in tools],
                                       add_generation_prompt=add_generation_prompt,
                                       max_tokens=self.max_model_len - 1, **chat)
        except TooLong as e:
            raise ValueError(f"{e}; max_model_len {self.max_model_len} leaves no room to "
                             "generate") from None
        return self.engine.prompt_token_ids(ids)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: free the KV cache and move the weights to host memory
        (level 1) or drop them (level 2: new weights come back with update_weights).
        No request may be unfinished; compiled programs are kept
        (docs/rl.md#sleeping-and-waking)."""
        self._generating("sleep")
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back the memory `sleep` freed: `tags` "weights", "kv_cache" (None:
        both, as vLLM's); the engine serves again once both are back."""
        self._generating("wake_up")
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def device_memory_bytes(self) -> int:
        """Bytes of live jax arrays on the engine's devices (JAX's own count)."""
        return self.engine.device_memory_bytes()

    def update_weights(self, weights: object, policy: str = "abort") -> dict:
        """New weights without recompiling: a params pytree (whole or part), a mapping
        of HF tensor names to numpy or jax arrays, or a checkpoint directory. Requests
        in flight: "abort", "wait" or "keep"; the prefix cache is reset. Returns bytes
        sent from host and what was dropped (docs/rl.md#updating-weights)."""
        return self._single_engine("update_weights").update_weights(weights, policy)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> int:
        """vLLM's: requests in flight aborted ("abort"), finished ("wait") or kept
        ("keep"), then no step runs until resume_generation; returns how many aborted."""
        return self._single_engine("pause_generation").pause_generation(mode, clear_cache)

    def resume_generation(self) -> None:
        self._single_engine("resume_generation").resume_generation()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page (vLLM's); returns how many."""
        return self._single_engine("reset_prefix_cache").reset_prefix_cache()

    def _generating(self, what: str) -> None:
        if isinstance(self.engine, PoolingEngine):
            raise ValueError(f"{what} needs a generative model: this is a pooling model "
                             "(runner='pooling'); it serves embed(), classify(), score() "
                             "and metrics()")

    def _single_engine(self, what: str) -> Engine:
        self._generating(what)
        if isinstance(self.engine, DataParallelEngine):
            raise NotImplementedError(f"{what} with data_parallel_size > 1: not supported "
                                      "yet; use one replica (tensor_parallel_size spans "
                                      "devices)")
        return self.engine

    def metrics(self) -> dict[str, float | int]:
        """Throughput, batching, padding, KV pages, preemptions, compiles, roofline."""
        return self.engine.metrics.summary()

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[str]:
        if getattr(self.engine, "paused", False):  # its steps would never run
            raise RuntimeError("generation is paused: call resume_generation() first")
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list),
                                 self.engine.default_params)
        priority = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        adapters = _as_lora_list(lora_request, len(prompt_list))
        prepared = []
        for index, (prompt, sp, lora) in enumerate(zip(prompt_list, params, adapters,
                                                       strict=True)):
            try:
                prepared.append(self.engine.prepare(prompt, sp, lora_request=lora))
            except ValueError as e:
                raise ValueError(f"prompt {index}: {e}") from None
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        for request_id, request, rank in zip(ids, prepared, priority, strict=True):
            self.engine.add_prepared(request_id, request, priority=rank)
        return ids


def make_pooling_engine(model: str | os.PathLike, config: EngineConfig, *,
                        warm_up: bool) -> PoolingEngine:
    if config.data_parallel_size > 1 or config.tensor_parallel_size > 1:
        raise ValueError("a pooling model runs on one device: data_parallel_size and "
                         "tensor_parallel_size must be 1")
    if config.speculative_config is not None or config.enable_prompt_logprobs:
        raise ValueError("a pooling model samples nothing: no speculative_config or "
                         "enable_prompt_logprobs")
    if config.quantization is not None or config.batch_invariant:
        raise ValueError(f"quantization={config.quantization!r}, batch_invariant="
                         f"{config.batch_invariant}: a pooling model runs in its float "
                         "dtype (float32, bfloat16), as computed")
    return PoolingEngine(model, config, warm_up=warm_up)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int | np.integer) for t in prompts):
        return [prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, str | list | tuple | np.ndarray):
            raise TypeError(f"prompt {i} is a {type(p).__name__}; expected str or token ids")
    return prompts


def _as_lora_list(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                  count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    adapters = list(lora_request)
    if len(adapters) != count:
        raise ValueError(f"got {len(adapters)} lora_request entries for {count} prompts")
    return adapters


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                    count: int, default: SamplingParams) -> list[SamplingParams]:
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] is a {type(p).__name__}, "
                            "not SamplingParams")
    return params
