"""A checkpoint directory -> what an engine serves (`load`): device params (AWQ-calibrated
for int4), a KV pool sized by the planner, the tokenizer, the checkpoint's sampling
defaults, the runner, and with `speculative_config` the speculation
(spec_decode/loading.py). See docs/architecture.md (#1-two-worlds-and-one-bridge,
#3-dependency-direction-the-layers-contract) and docs/cli.md#engine-flags (sizing).
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import logging
import os
import pathlib

import jax

from jaxinfer import checkpoint, distributed
from jaxinfer.checkpoint import awq, prequantized_int4
from jaxinfer.config import (
    EngineConfig,
    ModelConfig,
    ModelOptions,
    checkpoint_dtype,
    offload,
    served_dtype,
)
from jaxinfer.config import runner as runner_choice
from jaxinfer.config.engine import GENERATION_DEFAULTS
from jaxinfer.engine import runner as runner_lib
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.metrics.summary import FlopCount
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.spec_decode import loading as spec_loading
from jaxinfer.engine.spec_decode.speculation import Speculation
from jaxinfer.lora import peft
from jaxinfer.model import quantization, sharding
from jaxinfer.pallas import AttentionSettings
from jaxinfer.sizing import planner
from jaxinfer.text.tokenizer import Tokenizer, eos_token_ids_from_configs, read_json

log = logging.getLogger(__name__)
CPU_KV_FRACTION = 0.25  # of physical memory, when sizing the CPU page pool by default
# What tells chat_template's text from a file name (vLLM's test adds braces alone)
TEMPLATE_MARKS = ("{{", "{%", "\n")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """Everything `load` read and built for one engine."""

    model_dir: pathlib.Path
    model_config: ModelConfig  # as the checkpoint says
    tokenizer: Tokenizer | None  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    default_params: SamplingParams  # SamplingParams() with generation_config.json's values
    max_model_len: int
    memory_plan: planner.MemoryPlan
    flops: FlopCount  # model FLOPs per token and the mesh's peak, for MFU
    runner: runner_lib.Runner
    speculation: Speculation | None = None


def load(model_dir: str | os.PathLike, config: EngineConfig, *, replica: int = 0,
         params_from: dict | None = None) -> LoadedModel:
    """Read the checkpoint at `model_dir` and build its runner as `config` says, on the
    devices of data-parallel replica `replica`. `params_from`: another replica's device
    params (already quantized), copied device to device instead of reading the weights
    again (a draft model is read again)."""
    root = pathlib.Path(model_dir)
    model_config = runner_choice.served_head(checkpoint.load_config(root), config)
    ep = config.enable_expert_parallel
    check_options(model_config, config, root)
    tokenizer = load_tokenizer(pathlib.Path(config.tokenizer or root),
                               skip=config.skip_tokenizer_init,
                               chat_template=config.chat_template)
    eos_token_ids = (tokenizer.eos_token_ids if tokenizer is not None
                     else eos_token_ids_from_configs(root))
    defaults = default_sampling_params(root, config.generation_config,
                                       config.generation_overrides)
    config = with_checkpoint_quantization(root, config)
    max_len = max_model_len(model_config, config)
    mesh = runner_lib.make_mesh(model_config, config.tensor_parallel_size,
                                config.data_parallel_size, replica, ep,
                                config.pipeline_parallel_size)
    parts = spec_loading.prepare(root, model_config, config, max_len)
    options = engine_options(config, parts.feature_layers)
    served = sharding.served_config(model_config, config.tensor_parallel_size)
    group = prequantized_int4.group_size(root)  # an AWQ or GPTQ checkpoint's int4 groups
    memory_plan = plan_memory(served, config, max_len, checkpoint.quantized_head(root),
                              draft=parts.plan_draft(served, config), prequantized_group=group)
    if config.quantization is not None:  # raises if int4 groups would straddle devices
        planner.weight_bytes(served, config.dtype, config.tensor_parallel_size,
                             config.quantization, expert_parallel=ep, prequantized_group=group)
    group_pages = tuple(group.num_pages for group in memory_plan.page_groups)
    check_same_engine(served, config, max_len, group_pages)
    params = params_from or checkpoint.load_params(root, model_config, config.dtype, mesh,
                                                   expert_parallel=ep,
                                                   quantization_mode=config.quantization)
    params = _quantized(params, served, root, config, mesh, options)
    spec = config.speculative_config
    buckets = step_buckets(config)
    runner = runner_lib.Runner(
        served, params, mesh=mesh, num_pages=group_pages, page_size=config.page_size,
        group_windows=tuple(group.window for group in memory_plan.page_groups),
        max_model_len=max_len, kv_dtype=config.kv_dtype, eos_token_ids=eos_token_ids,
        buckets=buckets, attention=AttentionSettings(impl=config.attention_impl),
        enable_prompt_logprobs=config.enable_prompt_logprobs,
        uses_draft_probs=parts.proposes_with_model, options=options,
        pooling=config.runner == "pooling")
    runner.adapters = adapter_slots(runner, model_config)
    if config.kv_offloading_size is not None:
        offload.check_page_groups(config.kv_offloading_size, len(group_pages))
        runner.enable_host_tier(config.kv_offloading_size)
    speculation = spec and spec_loading.make_speculation(
        config, parts, runner, vocab_size=served.vocab_size, mesh=mesh,
        num_pages=memory_plan.num_pages, max_len=max_len, buckets=buckets,
        eos_token_ids=eos_token_ids)
    return LoadedModel(model_dir=root, model_config=model_config, tokenizer=tokenizer,
                       eos_token_ids=eos_token_ids, default_params=defaults,
                       max_model_len=max_len, memory_plan=memory_plan, runner=runner,
                       flops=flop_count(model_config, config), speculation=speculation)


def step_buckets(config: EngineConfig) -> BucketSet:
    """The padding ladders the runner compiles (engine/core/buckets.py)."""
    spec = config.speculative_config
    return BucketSet(max_num_batched_tokens=config.max_num_batched_tokens,
                     max_num_seqs=config.max_num_seqs,
                     min_tokens=runner_lib.min_step_tokens(config.dtype, config.quantization),
                     verify_positions=spec.num_speculative_tokens + 1 if spec else 0)


def engine_options(config: EngineConfig, feature_layers: tuple[int, ...] = ()
                   ) -> ModelOptions:
    """The options `config` runs its model with, keeping `feature_layers` for
    speculative heads."""
    return ModelOptions(expert_parallel=config.enable_expert_parallel,
                        feature_layers=feature_layers, batch_invariant=config.batch_invariant,
                        lora=config.lora_slots, pipeline_stages=config.pipeline_parallel_size,
                        pipeline_microbatches=config.pipeline_microbatches)


def check_options(model_config: ModelConfig, config: EngineConfig,
                  root: pathlib.Path) -> None:
    """ValueError unless the engine's options suit the model (ModelOptions.check), and
    LoRA adapters go to a generating model."""
    engine_options(config).check(model_config)
    if config.enable_lora and config.runner == "pooling":
        raise ValueError("enable_lora=True serves adapters on a generating model; "
                         f"{root} is served as a pooling model")


def adapter_slots(runner: runner_lib.Runner, model_config: ModelConfig
                  ) -> runner_lib.DeviceAdapters | None:
    """The runner's LoRA slots, reading PEFT adapters for `model_config` (the
    checkpoint's); None without enable_lora."""
    slots = runner.options.lora
    if slots is None:
        return None
    return runner_lib.DeviceAdapters(runner, model_config, functools.partial(
        peft.read, cfg=model_config, max_rank=slots.max_rank))


def _quantized(params: dict, served: ModelConfig, root: pathlib.Path, config: EngineConfig,
               mesh: object, options: ModelOptions) -> dict:
    """Float `params` quantized at load to `config.quantization` (int4 with its
    activation-aware scales); params the checkpoint already holds quantized as they are."""
    if config.quantization is None or quantization.mode_of(params) is not None:
        return params
    if config.quantization == "int4":  # activation-aware scales before rounding
        params = awq.calibrate_checkpoint(params, served, root, config.calibration_data)
    return runner_lib.quantize_at_load(params, served, mesh, config.quantization, options)


def check_data_parallel(config: EngineConfig) -> None:
    """Raise ValueError unless data-parallel replicas can run here: one process (a
    multi-host job runs one replica over every process's devices), and
    data_parallel_size x tensor_parallel_size devices present."""
    if jax.process_count() > 1:
        raise ValueError(f"data_parallel_size={config.data_parallel_size} with several "
                         "processes (a multi-host job): not supported; run one replica "
                         "over all processes (data_parallel_size=1), or one server or Ray "
                         "replica per host")
    sharding.layout_mesh(config.data_parallel_size, config.tensor_parallel_size,
                         pipeline_parallel_size=config.pipeline_parallel_size)


def check_same_engine(served: ModelConfig, config: EngineConfig, max_len: int,
                      num_pages: tuple[int, ...]) -> None:
    """Multi-host: raise ValueError unless every process serves the same model with the
    same settings and page pool (sized per host, from its own memory), as all must run
    the same schedule (distributed.py). The compilation cache directory may differ."""
    spec = config.speculative_config
    if jax.process_count() > 1 and spec is not None and spec.adaptive:
        raise ValueError("speculative_config adaptive=true picks k from each process's own "
                         "step times, which differ between the processes of a multi-host "
                         "job and would split their schedules: set \"adaptive\": false")
    settings = dataclasses.replace(config, compilation_cache_dir=None)
    distributed.check_same(f"the model, engine settings or KV page pool (here {num_pages} "
                           "pages, sized from this host's memory unless "
                           "kv_cache_memory_bytes is given)",
                           repr((served, settings, max_len, num_pages)))


def with_served_dtype(model_dir: str | os.PathLike, config: EngineConfig) -> EngineConfig:
    """`config` with dtype "auto" resolved to the checkpoint's own on this backend
    (config.served_dtype; docs/models.md#dtype)."""
    if config.dtype != "auto":
        return config
    hf = read_json(pathlib.Path(model_dir) / "config.json")
    platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else \
        jax.default_backend()
    dtype = served_dtype(config.dtype, hf, platform)
    log.info("dtype auto: %s (saved in %s) served in %s", model_dir, checkpoint_dtype(hf),
             dtype)
    return dataclasses.replace(config, dtype=dtype)


def with_checkpoint_quantization(root: pathlib.Path, config: EngineConfig) -> EngineConfig:
    """`config` serving a checkpoint written quantized (convert --quantization, or a
    compressed-tensors FP8 checkpoint) in its mode; asking for another mode is an error."""
    mode = checkpoint.served_quantization(root, config.quantization)
    return config if mode == config.quantization else dataclasses.replace(
        config, quantization=mode)


def load_tokenizer(model_dir: pathlib.Path, *, skip: bool = False,
                   chat_template: str | None = None) -> Tokenizer | None:
    """The checkpoint's tokenizer, with `chat_template` (EngineConfig's: a file or the
    template's text, `read_chat_template`) instead of its own if given; None when `skip`.
    A directory without one is refused with the way out: token-id prompts need none."""
    if skip:
        return None
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{str(model_dir)!r} has no tokenizer.json; to serve token-id prompts without "
            "a tokenizer, pass skip_tokenizer_init=True (--skip_tokenizer_init)")
    tokenizer = Tokenizer.from_dir(model_dir)
    if chat_template is None:
        return tokenizer
    return tokenizer.with_chat_template(read_chat_template(chat_template))


def read_chat_template(value: str, *, unescape: bool = True) -> str:
    """A chat template given as vLLM's --chat-template is: a file's text, else `value`
    itself when it looks like a template (TEMPLATE_MARKS), else FileNotFoundError naming
    chat_template. A one-line template has its backslash escapes (\\n) read, as vLLM
    reads them, when `unescape`."""
    if os.path.isfile(value):  # False, not an error, for a long template's text
        try:
            return pathlib.Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template={value!r}: the file cannot be read: {e}") \
                from None
    if not any(mark in value for mark in TEMPLATE_MARKS):
        raise FileNotFoundError(
            f"chat_template={value!r} looks like a file name, but there is no such file "
            "(a template given as text holds {{ or {%)")
    if not unescape or "\n" in value:
        return value
    try:
        return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError:  # a backslash that starts no escape: as it is
        return value


def default_sampling_params(model_dir: pathlib.Path, generation_config: str = "auto",
                            overrides: dict | None = None) -> SamplingParams:
    """SamplingParams() with generation_config.json's values (temperature, top_p, top_k,
    min_p, repetition_penalty, max_new_tokens) where it has them, as vLLM does; `do_sample`
    is ignored, as vLLM does too. `generation_config` (vLLM's): "auto", the checkpoint's
    file; "vllm", none; else a directory holding one. `overrides` (vLLM's
    override_generation_config) go over those values."""
    path = None if generation_config == "vllm" else (
        model_dir if generation_config == "auto" else pathlib.Path(generation_config)
    ) / "generation_config.json"
    if path is not None and generation_config != "auto" and not path.is_file():
        raise FileNotFoundError(f"generation_config={generation_config!r}: no {path} (give "
                                "auto, vllm, or a directory holding a generation_config.json)")
    found = (read_json(path) if path else {}) | dict(overrides or {})
    values = {field: found[key] for key, field in GENERATION_DEFAULTS.items()
              if found.get(key) is not None}
    try:
        params = SamplingParams(**values)
    except ValueError as e:
        source = " with override_generation_config" if overrides else ""
        raise ValueError(f"{path or 'generation_config=vllm'}{source}: {e}") from None
    if values:
        log.info("sampling defaults from %s%s: %s", path or "override_generation_config",
                 " and override_generation_config" if path and overrides else "", values)
    return params


def max_model_len(model_config: ModelConfig, config: EngineConfig) -> int:
    """`config.max_model_len`, or the model's maximum; never more than the model's."""
    limit = model_config.max_position_embeddings
    wanted = config.max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return wanted


def plan_memory(model_config: ModelConfig, config: EngineConfig, max_len: int,
                quantized_head: bool = True,
                draft: ModelConfig | tuple[int, int] | None = None,
                prequantized_group: int | None = None) -> planner.MemoryPlan:
    """The page pool's plan for `model_config` as served (KV heads copied under tensor
    parallelism): `kv_cache_memory_bytes` (all devices together) if given; else
    `gpu_memory_utilization` of the mesh's accelerator memory (weights included); else, on
    CPU, every slot at full length within CPU_KV_FRACTION of RAM. The bandwidth is
    probed once per process. `prequantized_group`: an AWQ or GPTQ checkpoint's int4
    groups (planner.weight_bytes)."""
    common = dict(dtype=config.dtype, kv_dtype=config.kv_dtype, max_model_len=max_len,
                  quantization=config.quantization, quantized_head=quantized_head, draft=draft,
                  max_num_seqs=config.max_num_seqs, page_size=config.page_size,
                  max_num_batched_tokens=config.max_num_batched_tokens,
                  hybrid_kv_cache=not config.disable_hybrid_kv_cache_manager,
                  expert_parallel=config.enable_expert_parallel,
                  prequantized_group=prequantized_group, lora=config.lora_slots,
                  pipeline_parallel_size=config.pipeline_parallel_size,
                  pipeline_microbatches=config.pipeline_microbatches,
                  bandwidth_gb_per_s=round(runner_lib.memory_bandwidth(), 1))
    if config.kv_cache_memory_bytes is not None:
        return planner.plan(model_config, kv_cache_bytes=config.kv_cache_memory_bytes,
                            **common)
    device_limit = runner_lib.device_memory_limit()
    if device_limit:  # every device of the mesh holds 1/n of the weights and of each page
        total = device_limit * config.tensor_parallel_size * config.pipeline_parallel_size
        return planner.plan(model_config,
                            memory_bytes=int(total * config.gpu_memory_utilization),
                            **common)
    if config.gpu_memory_utilization != EngineConfig().gpu_memory_utilization:
        log.warning("gpu_memory_utilization=%s is not used on CPU: the KV pool holds every "
                    "slot at full length within a share of RAM (kv_cache_memory_bytes sets "
                    "it)", config.gpu_memory_utilization)
    beside = draft[1] if isinstance(draft, tuple) else (
        draft and planner.kv_bytes_per_token(draft, config.kv_dtype))
    page_bytes = config.page_size * (
        planner.kv_bytes_per_token(model_config, config.kv_dtype) + (beside or 0))
    pages_per_seq = -(-max_len // config.page_size)
    wanted = (config.max_num_seqs * pages_per_seq + 1) * page_bytes
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return planner.plan(model_config, kv_cache_bytes=min(wanted, int(physical * CPU_KV_FRACTION)),
                        **common)


def flop_count(model_config: ModelConfig, config: EngineConfig) -> FlopCount:
    """The model's FLOPs per token (planner.decode_flops of the whole model, the LM head
    apart, each layer's window) and the mesh's peak: `tensor_parallel_size` devices of
    `runner_lib.peak_flops` (int8's with w8a8, else bf16's; measured once per process on
    a device that is no known chip), and a known chip's published bandwidth."""
    cfg = model_config
    matmul, attention = planner.decode_flops(cfg)
    head = 2 * cfg.hidden_size * cfg.vocab_size
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    peak, source = runner_lib.peak_flops("int8" if config.quantization == "w8a8"
                                         else config.dtype)
    devices, chip = config.tensor_parallel_size, runner_lib.device_chip()
    return FlopCount(matmul_per_token=matmul - head, head_per_sample=head,
                     attention_per_position=attention // cfg.num_layers,
                     windows=tuple((w, windows.count(w)) for w in dict.fromkeys(windows)),
                     peak_flops_per_s=peak * devices, peak_source=source, devices=devices,
                     chip_bytes_per_s=chip and chip.hbm_bytes_per_s)
