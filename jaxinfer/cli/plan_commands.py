"""The commands that load no weights: plan (memory plan, decode roofline, PP x TP x DP
layouts), audit (prompt overlap) and aot (compile the step for a TPU slice). Each reads
FLAGS and imports its library only when it runs. See docs/cli.md (#plan, #audit, #aot).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys
import typing

from absl import app

from jaxinfer.cli import report as report_lib
from jaxinfer.cli.flags import FLAGS, engine_config
from jaxinfer.config import DEFAULT_MODEL, EngineConfig
from jaxinfer.sizing import accelerators

# Over the flags, as --help shows them: the weights' dtype is the model's own (vLLM's
# auto) and the step splits over every chip of --device unless told otherwise.
PLAN_DEFAULTS = {"dtype": "auto: the checkpoint's, as the engine serves it on --device "
                          "(docs/models.md#dtype); bfloat16 for a preset",
                 "tensor_parallel_size": "every device of --device a stage has (with "
                 "--data_parallel_size: the rest of them), else 1",
                 "data_parallel_size": "the devices of --device left over by "
                 "--tensor_parallel_size and --pipeline_parallel_size, else 1"}
AOT_DEFAULTS = PLAN_DEFAULTS | {"device": "v5e-1",
                                "tensor_parallel_size": "the slice's chips if the model splits "
                                "(with --data_parallel_size: the rest of them)",
                                "data_parallel_size": "1"}


@functools.cache
def _model_path(config_only: bool = True) -> pathlib.Path:
    """--model as a path: a directory, a preset's name (no such directory), or a Hub id
    downloaded (only its config.json for plan and aot; checkpoint/hub.py)."""
    from jaxinfer.checkpoint import hub

    model = FLAGS.model or DEFAULT_MODEL
    if not hub.is_hub_id(model):
        return pathlib.Path(model)
    # an id the Hub does not have, or a download that fails, is a runtime error (exit 1)
    return hub.resolve(model, revision=FLAGS.revision, download_dir=FLAGS.download_dir,
                       config_only=config_only)


def _model_config() -> object:
    """The ModelConfig of --model (a model directory or a preset), checked for
    --enable_expert_parallel."""

    from jaxinfer import checkpoint
    from jaxinfer.config import ModelOptions, load_preset, runner

    model = _model_path()
    cfg = checkpoint.load_config(model) if model.is_dir() else load_preset(str(model))
    if model.is_dir():  # a pooling model's decoder has no LM head (docs/pooling.md)
        cfg = runner.served_head(cfg, runner.with_runner(model, engine_config()))
    # a model without experts is the model's answer, not a bad flag value: exit 1
    ModelOptions(expert_parallel=FLAGS.enable_expert_parallel).check(cfg)
    return cfg


def _device(find: typing.Callable[[str], accelerators.Accelerator],
            name: str) -> accelerators.Accelerator:
    """The preset --device names (`find`: plan's or aot's lookup); a name it does not
    know is a usage error."""
    try:
        return find(name)
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None


def _served_dtype(platform: str | None) -> str:
    """--dtype resolved as the engine resolves it on `platform` (config.served_dtype):
    "auto" is the checkpoint's own dtype; a preset's is bfloat16. No `platform` (no
    --device): this machine's backend, where the engine would run."""

    from jaxinfer.config import served_dtype

    if platform is None:
        import jax

        platform = "gpu" if jax.default_backend() in ("cuda", "rocm") else \
            jax.default_backend()
    config = _model_path() / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {"dtype": "bfloat16"}
    try:
        return served_dtype(FLAGS.dtype, hf, platform)
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None


def _with_checkpoint_quantization(settings: EngineConfig) -> EngineConfig:
    """`settings` in the mode of a --model directory written quantized (orbax convert
    --quantization, or a compressed-tensors FP8 checkpoint), as loading serves it."""

    from jaxinfer import checkpoint

    model = _model_path()  # a preset: its published checkpoint's (gpt-oss: mxfp4)
    return dataclasses.replace(
        settings, quantization=checkpoint.served_quantization(model, settings.quantization))


def _quantized_head() -> bool:
    """Whether a quantized --model serves a quantized LM head (checkpoint.quantized_head;
    a preset: yes)."""

    from jaxinfer import checkpoint

    model = _model_path()
    return checkpoint.quantized_head(model) if model.is_dir() else True


def _draft_config(settings: EngineConfig) -> object | None:
    """What --speculative_config adds to the plan: a draft model's ModelConfig, heads'
    (weight bytes, bytes per token) from their config.json, else None."""
    spec = settings.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    if spec.method != "draft_model":
        from jaxinfer.engine.spec_decode import loading as spec_loading

        return spec_loading.head_plan(spec.model, _model_config(), settings)
    from jaxinfer import checkpoint

    return checkpoint.load_config(spec.model)


def _plan_budget(settings: EngineConfig, acc: accelerators.Accelerator | None
                 ) -> dict[str, int]:
    """The per-device budget: --memory_gb, else --kv_cache_memory_bytes, else the engine's
    share of one device of --device."""

    if FLAGS.memory_gb is not None:
        return {"memory_bytes": int(FLAGS.memory_gb * 1e9)}
    if settings.kv_cache_memory_bytes is not None:
        return {"kv_cache_bytes": settings.kv_cache_memory_bytes}
    if acc is not None:
        usable = acc.chip.usable_hbm_bytes
        return {"memory_bytes": int(usable * settings.gpu_memory_utilization)}
    raise app.UsageError("plan needs --memory_gb=GB, --kv_cache_memory_bytes=BYTES or "
                         "--device=NAME")


def choose_layout(chips: int | None, device: str | None, tp: int | None, dp: int | None,
                  pp: int = 1) -> tuple[int, int]:
    """(tensor_parallel_size, data_parallel_size) for `pp` stages on `chips` devices (None:
    no --device): the sizes given (None: not given), the other filling the chips a stage
    has; neither: every device a stage has tensor parallel, else 1. ValueError unless they
    divide --device's chips or when they need more than it has."""
    stages = "" if pp == 1 else f" x --pipeline_parallel_size={pp}"
    if chips is not None and chips % pp:
        raise ValueError(f"--pipeline_parallel_size={pp} must divide the {chips} devices of "
                         f"--device={device}")
    per_stage = None if chips is None else chips // pp
    if dp is not None and tp is None:
        if per_stage is not None and per_stage % dp:
            over = "" if pp == 1 else f" over {pp} stages"
            raise ValueError(f"--data_parallel_size={dp} must divide the {chips} devices of "
                             f"--device={device}{over} (or give --tensor_parallel_size)")
        tp = per_stage // dp if per_stage is not None else 1
    else:
        tp = tp or per_stage or 1
        dp = dp or max(1, (per_stage or tp) // tp)
    if chips is not None and dp * pp * tp > chips:
        raise ValueError(f"--data_parallel_size={dp}{stages} x --tensor_parallel_size={tp} "
                         f"needs {dp * pp * tp} devices; --device={device} has {chips}")
    return tp, dp


def _recommended_flags(split: object) -> str:
    """The flags of a recommended layout, --pipeline_parallel_size only when it has stages."""
    stages = "" if split.pipeline_parallel_size == 1 else (
        f" --pipeline_parallel_size={split.pipeline_parallel_size}")
    return (f"--data_parallel_size={split.data_parallel_size}{stages} "
            f"--tensor_parallel_size={split.tensor_parallel_size}")


def _plan_layout(cfg: object, acc: accelerators.Accelerator | None,
                 recommended: object | None) -> tuple[int, int, int]:
    """(tensor_parallel_size, data_parallel_size, pipeline_parallel_size) to plan: the
    flags given, `choose_layout` the rest. ValueError unless the model's heads split over
    it (naming the recommended layout) or the replicas fit --device."""
    from jaxinfer.sizing import planner

    tp_given, dp_given = (FLAGS["tensor_parallel_size"].present,
                          FLAGS["data_parallel_size"].present)
    pp = FLAGS.pipeline_parallel_size
    tp, dp = choose_layout(acc.chips if acc else None, FLAGS.device,
                           FLAGS.tensor_parallel_size if tp_given else None,
                           FLAGS.data_parallel_size if dp_given else None, pp)
    try:
        planner.check_tensor_parallel(cfg, tp, FLAGS.enable_expert_parallel)
    except ValueError as e:
        if tp_given or dp_given:
            raise
        hint = "" if recommended is None else (
            f"; recommended here: {_recommended_flags(recommended)}")
        raise ValueError(f"{e} (by default every device of --device={FLAGS.device}; give "
                         f"--tensor_parallel_size){hint}") from None
    return tp, dp, pp


def _plan_kwargs(settings: EngineConfig, acc: accelerators.Accelerator | None
                 ) -> dict[str, object]:
    """planner.plan's arguments but the layout's: dtypes, lengths, budget, bandwidth, peak."""
    from jaxinfer.checkpoint import prequantized_int4

    bandwidth = FLAGS.bandwidth_gb_per_s
    if bandwidth is None and acc is not None:
        bandwidth = acc.chip.hbm_bytes_per_s / 1e9
    return dict(dtype=settings.dtype, kv_dtype=settings.kv_dtype,
                quantization=settings.quantization, quantized_head=_quantized_head(),
                prequantized_group=prequantized_int4.group_size(_model_path()),
                max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
                page_size=settings.page_size,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                hybrid_kv_cache=not settings.disable_hybrid_kv_cache_manager,
                bandwidth_gb_per_s=bandwidth, expert_parallel=FLAGS.enable_expert_parallel,
                peak_flops_per_s=acc.chip.bf16_flops if acc else None,
                draft=_draft_config(settings), lora=settings.lora_slots,
                **_plan_budget(settings, acc))


def _check_plan_flags() -> None:
    """plan's own numbers, refused before anything loads (exit 2)."""
    for name in ("memory_gb", "bandwidth_gb_per_s"):
        if FLAGS[name].value is not None and FLAGS[name].value <= 0:
            raise app.UsageError(f"--{name}={FLAGS[name].value} must be > 0")
    if FLAGS.price_per_hour is not None and FLAGS.price_per_hour < 0:
        raise app.UsageError(f"--price_per_hour={FLAGS.price_per_hour} must be >= 0")


def plan() -> None:
    from jaxinfer.sizing import layout, planner

    _check_plan_flags()
    acc = _device(accelerators.find_preset, FLAGS.device) if FLAGS.device else None
    dtype = _served_dtype(acc.chip.platform if acc else None)
    if _encoder_config() is not None:
        return _plan_encoder(dtype, acc)
    settings = _with_checkpoint_quantization(
        dataclasses.replace(engine_config(), dtype=dtype))
    cfg = _model_config()
    kwargs = _plan_kwargs(settings, acc)
    microbatches = settings.pipeline_microbatches

    def check_stages(pp: int) -> object:  # EngineConfig's own checks of pp stages
        return dataclasses.replace(settings, pipeline_parallel_size=pp)

    splits = [] if acc is None else layout.splits(
        cfg, acc, pipeline_microbatches=microbatches, check_stages=check_stages, **kwargs)
    tp, dp, pp = _plan_layout(cfg, acc, layout.recommend(splits))
    price = FLAGS.price_per_hour if FLAGS.price_per_hour is not None else (
        acc.list_price_per_hour if acc else None)
    try:
        result = planner.plan(cfg, tensor_parallel_size=tp, num_devices=dp * pp * tp,
                              pipeline_parallel_size=pp, pipeline_microbatches=microbatches,
                              **layout.stage_budget(kwargs, pp))
    except ValueError as e:
        best = layout.recommend(splits)
        if best is None:
            raise
        raise ValueError(f"{e} (recommended here: {_recommended_flags(best)})") from None
    report = {"model": str(FLAGS.model or DEFAULT_MODEL), "dtype": settings.dtype,
              "quantization": settings.quantization,
              "data_parallel_size": dp, **result.summary(price_per_hour=price),
              **_host_tier(result, settings, acc),
              "device": accelerators.describe(acc) if acc else None}
    if acc is not None:
        chosen = next((s for s in splits if (s.tensor_parallel_size, s.data_parallel_size,
                                             s.pipeline_parallel_size) == (tp, dp, pp)),
                      None) or layout.evaluate(cfg, acc, tp, dp, pp, microbatches, **kwargs)
        report["layout"] = layout.report(splits, chosen, acc, result.max_model_len)
    report_lib.write(report, sys.stdout, FLAGS.format)


def _host_tier(result: object, settings: EngineConfig,
               acc: accelerators.Accelerator | None) -> dict[str, object]:
    """The host tier --kv_offloading_size keeps (sizing/host_tier.py), if given."""
    if settings.kv_offloading_size is None:
        return {}
    from jaxinfer.sizing import host_tier

    return {"host_tier": host_tier.report(result, settings.kv_offloading_size,
                                          acc.chip if acc else None)}


def _encoder_config() -> object | None:
    """The EncoderConfig of a --model directory holding an encoder (BERT, XLM-R)."""
    from jaxinfer.config.encoder import EncoderConfig, is_encoder
    from jaxinfer.text.tokenizer import read_json

    model = _model_path()
    hf = read_json(model / "config.json") if model.is_dir() else {}
    return EncoderConfig.from_hf(hf) if is_encoder(hf) else None


def _plan_encoder(dtype: str, acc: accelerators.Accelerator | None) -> None:
    """An encoder's plan: weights and the largest packed step, no KV cache."""
    from jaxinfer.pooling.plan import encoder_plan

    settings = engine_config()
    if settings.kv_offloading_size is not None:  # EngineConfig refuses a pooling runner
        try:
            dataclasses.replace(settings, runner="pooling")
        except ValueError as e:
            raise app.UsageError(f"--{e}") from None
    memory = int(FLAGS.memory_gb * 1e9) if FLAGS.memory_gb is not None else (
        int(acc.chip.usable_hbm_bytes * settings.gpu_memory_utilization) if acc else None)
    report = {"model": str(FLAGS.model), **encoder_plan(
        _encoder_config(), dtype=dtype, max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len, memory_bytes=memory),
        "device": accelerators.describe(acc) if acc else None}
    report_lib.write(report, sys.stdout, FLAGS.format)


def _aot_encoder(device: str) -> None:
    """An encoder's packed steps compiled for one chip of --device (JSON report)."""
    from jaxinfer import aot as aot_lib
    from jaxinfer.aot_rows import bucket_row
    from jaxinfer.pooling.compile import compile_encoder

    acc = accelerators.get(device)
    settings = engine_config()
    report = {"device": acc.name, "model": str(FLAGS.model), **compile_encoder(
        _encoder_config(), aot_lib.target_devices(acc), dtype=_served_dtype("tpu"),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len, buckets=FLAGS.buckets,
        row=lambda compiled: bucket_row(compiled, acc))}
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    if not report["fits"]:
        sys.exit(1)


def audit() -> None:
    from jaxinfer.cli import audit as audit_lib

    if not FLAGS.input:
        raise app.UsageError("audit needs --input=PROMPTS.jsonl")
    if FLAGS.page_size < 1:
        raise app.UsageError(f"--page_size={FLAGS.page_size} must be a positive int")
    report = audit_lib.run(_model_path(config_only=False), FLAGS.input,
                           page_size=FLAGS.page_size)
    report_lib.write(report, sys.stdout, FLAGS.format)


def aot() -> None:
    from jaxinfer import aot as aot_lib
    from jaxinfer.cli import aot_table

    device = FLAGS.device or AOT_DEFAULTS["device"]
    _device(accelerators.get, device)  # a TPU slice's name
    aot_lib.require_tpu_compiler()  # else one line on how to install it (exit 1)
    aot_lib.tpu_compile_environment()  # before anything starts a JAX backend
    if _encoder_config() is not None:
        return _aot_encoder(device)
    cfg = _model_config()
    engine = _with_checkpoint_quantization(
        dataclasses.replace(engine_config(), dtype=_served_dtype("tpu")))
    settings = aot_lib.Settings(
        dtype=engine.dtype, kv_dtype=engine.kv_dtype, max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=engine.max_model_len or cfg.max_position_embeddings,
        page_size=engine.page_size, kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        tensor_parallel_size=engine.tensor_parallel_size
        if FLAGS["tensor_parallel_size"].present else None,  # default: the slice's chips
        data_parallel_size=engine.data_parallel_size
        if FLAGS["data_parallel_size"].present else None,  # default: one replica
        quantization=engine.quantization, quantized_head=_quantized_head(),
        expert_parallel=FLAGS.enable_expert_parallel, lora=engine.lora_slots,
        pipeline_parallel_size=engine.pipeline_parallel_size,  # TP default: chips / stages
        pipeline_microbatches=engine.pipeline_microbatches)
    report = aot_lib.compile_report(
        cfg, device=device, settings=settings, buckets=FLAGS.buckets,
        progress=lambda event: print(aot_table.progress_line(event), file=sys.stderr,
                                     flush=True))
    if FLAGS.format == "json":
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        sys.stdout.write(aot_table.format_table(report) + "\n")
    if aot_table.exit_code(report):  # the table says what failed (docs/cli.md#exit-codes)
        sys.exit(aot_table.exit_code(report))

