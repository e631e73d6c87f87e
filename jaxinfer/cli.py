"""Command line: `python -m jaxinfer <command> --flags`.

`python -m jaxinfer --help` lists the commands (`COMMANDS`: generate, batch, serve, convert,
plan, audit, aot, eval_ppl), `python -m jaxinfer <command> --help` that command's flags with
their defaults. Engine flags are derived from `EngineConfig`'s fields (name,
default, type, choices and help text), so they cannot drift from it. Sampling flags
default to unset: the checkpoint's generation_config.json defaults apply and a flag
given overrides only its field. Errors a user can fix (a bad flag value, a missing
model directory, a prompt too long) print one line to stderr and exit non-zero (2:
usage, 1: the rest); `--verbosity=1` logs their traceback. The only module that
reads FLAGS and configures logging.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable

from absl import app, flags

from jaxinfer import accelerators
from jaxinfer.config import DEFAULT_MODEL, DistributedConfig, EngineConfig, ServerConfig
from jaxinfer.engine.request import SamplingParams

FLAGS = flags.FLAGS
DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):"
HELP_ARGS = frozenset({"--help", "-help", "-h", "--helpshort", "-?"})

flags.DEFINE_string("model", None, "model directory (HF or orbax); plan and aot also take a "
                    "preset name (configs/*.toml); default: the bundled demo model")
flags.DEFINE_string("prompt", DEFAULT_PROMPT, "prompt text")
flags.DEFINE_integer("max_tokens", 64, "tokens to generate")
flags.DEFINE_float("temperature", None, "0 = greedy; default: the checkpoint's")
flags.DEFINE_float("top_p", None, "top-p (nucleus) sampling; default: the checkpoint's")
flags.DEFINE_integer("top_k", None, "top-k sampling, 0 = off; default: the checkpoint's")
flags.DEFINE_float("repetition_penalty", None, "1 = off; default: the checkpoint's")
flags.DEFINE_string("input", None, "JSONL file of requests (batch) or prompts (audit); "
                    "eval_ppl: text files, comma-separated paths or globs")
flags.DEFINE_integer("window", None, "eval_ppl: tokens per scored window, overlapping by one "
                     "(jaxinfer/evaluate.py); default: max_model_len - 1")
flags.DEFINE_integer("max_tokens_per_file", None, "eval_ppl: score only the first tokens of "
                     "each file; default: all")
flags.DEFINE_string("output", None, "JSONL results (batch); orbax directory (convert)")
flags.DEFINE_boolean("metrics", False, "print the engine metrics as JSON to stderr")
flags.DEFINE_float("memory_gb", None, "memory per device for weights + KV cache, in GB; "
                  "default with --device: 90% of what one device lets a program use")
flags.DEFINE_float("bandwidth_gb_per_s", None, "memory bandwidth per device for the decode "
                   "roofline; default: the --device preset's, else no roofline")
flags.DEFINE_string("device", None, "accelerator preset (jaxinfer/accelerators.py): a TPU "
                    "type (v5e-1, v6e-8, v5p-8...; aot takes only these) or a GCP GPU "
                    "machine (h100-8 = a3-highgpu-8g, a100-40gb-8, a100-80gb-8, l4-1...)")
flags.DEFINE_float("price_per_hour", None, "price per hour of the whole --device preset "
                   "(without --device: of tensor_parallel_size devices), for plan's cost per "
                   "million output tokens; default: the preset's list price if it carries "
                   "one, else no cost")
flags.DEFINE_enum("buckets", "all", ["all", "ends"],
                  "every bucket, or the smallest, a mixed one and the largest")
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty")


def define_config_flags(config_class: type) -> tuple[str, ...]:
    """One flag per field of a config dataclass (EngineConfig, DistributedConfig), from its
    type, default, choices and help."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kinds = set(typing.get_args(hints[field.name])) - {types.NoneType} or {
            hints[field.name]}
        help_text, choices = field.metadata["help"], field.metadata["choices"]
        if choices:
            flags.DEFINE_enum(field.name, field.default, list(choices), help_text)
        elif kinds == {bool}:
            flags.DEFINE_boolean(field.name, field.default, help_text)
        elif kinds == {int}:
            flags.DEFINE_integer(field.name, field.default, help_text)
        elif kinds == {str}:
            flags.DEFINE_string(field.name, field.default, help_text)
        else:
            raise TypeError(f"{config_class.__name__}.{field.name}: no flag type for {kinds}")
    return tuple(field.name for field in dataclasses.fields(config_class))


ENGINE_FLAGS = define_config_flags(EngineConfig)
DISTRIBUTED_FLAGS = define_config_flags(DistributedConfig)
SERVER_FLAGS = define_config_flags(ServerConfig)
flags.DEFINE_alias("kv_dtype", "kv_cache_dtype")


def engine_config(**defaults: object) -> EngineConfig:
    """EngineConfig from the engine flags; `defaults` replace flags the user did not give."""
    settings = {name: FLAGS[name].value for name in ENGINE_FLAGS}
    settings |= {k: v for k, v in defaults.items() if not FLAGS[k].present}
    return EngineConfig(**settings)


def make_llm(*, warm_up: bool = True, **defaults: object) -> object:
    """An LLM from the engine flags (see `engine_config`)."""
    from jaxinfer import LLM

    settings = dataclasses.asdict(engine_config(**defaults))
    kwargs = {} if FLAGS.model is None else {"model": FLAGS.model}
    return LLM(**kwargs, warm_up=warm_up, **settings)


def sampling_params(defaults: SamplingParams) -> SamplingParams:
    """`defaults` (the checkpoint's) with --max_tokens and each sampling flag given."""
    given = {name: FLAGS[name].value for name in SAMPLING_FLAGS if FLAGS[name].value is not None}
    return dataclasses.replace(defaults, max_tokens=FLAGS.max_tokens, **given)


def generate() -> None:
    from jaxinfer import distributed

    # The prompt is checked before warm-up: a bad one fails now, not after compiling.
    llm = make_llm(**COMMANDS["generate"].defaults, warm_up=False)
    llm.engine.prompt_token_ids(FLAGS.prompt)
    params = sampling_params(llm.engine.default_params)
    distributed.check_same("the prompt and sampling parameters", repr((FLAGS.prompt, params)))
    llm.engine.warm_up()
    (out,) = llm.generate(FLAGS.prompt, params)
    if not distributed.is_primary():  # multi-host: only process 0 prints
        return
    sys.stdout.write(FLAGS.prompt + out.text + "\n")
    logging.info("%d prompt tokens, %d generated, finish_reason=%s, %s",
                 len(out.prompt_token_ids), len(out.token_ids), out.finish_reason, params)
    if FLAGS.metrics:
        sys.stderr.write(json.dumps(llm.metrics()) + "\n")


def batch() -> None:
    from jaxinfer import batch as batch_lib
    from jaxinfer import distributed

    if not FLAGS.input or not FLAGS.output:
        raise app.UsageError("batch needs --input=IN.jsonl and --output=OUT.jsonl")
    summary = batch_lib.run(make_llm(), FLAGS.input, FLAGS.output)
    if distributed.is_primary():
        sys.stderr.write(json.dumps(summary, indent=1) + "\n")


def convert() -> None:
    from jaxinfer import checkpoint

    if not FLAGS.model or not FLAGS.output:
        raise app.UsageError("convert needs --model=HF_DIR and --output=ORBAX_DIR")
    checkpoint.convert_hf_to_orbax(FLAGS.model, FLAGS.output, FLAGS.dtype, FLAGS.quantization,
                                   FLAGS.calibration_data)
    sys.stdout.write(f"wrote {FLAGS.output}\n")


def _model_config() -> object:
    """The ModelConfig of --model: a model directory or a preset."""
    import pathlib

    from jaxinfer import checkpoint
    from jaxinfer.config import load_preset

    model = pathlib.Path(FLAGS.model or DEFAULT_MODEL)
    return checkpoint.load_config(model) if model.is_dir() else load_preset(str(model))


def _with_checkpoint_quantization(settings: EngineConfig) -> EngineConfig:
    """`settings` in the mode of a --model directory written quantized (orbax convert
    --quantization, or a compressed-tensors FP8 checkpoint), as loading serves it."""
    import pathlib

    from jaxinfer import checkpoint

    model = pathlib.Path(FLAGS.model or DEFAULT_MODEL)
    if not model.is_dir():
        return settings
    return dataclasses.replace(
        settings, quantization=checkpoint.served_quantization(model, settings.quantization))


def _quantized_head() -> bool:
    """Whether a quantized --model serves a quantized LM head (checkpoint.quantized_head;
    a preset: yes)."""
    import pathlib

    from jaxinfer import checkpoint

    model = pathlib.Path(FLAGS.model or DEFAULT_MODEL)
    return checkpoint.quantized_head(model) if model.is_dir() else True


def _plan_budget(settings: EngineConfig, acc: accelerators.Accelerator | None
                 ) -> dict[str, int]:
    """The per-device budget: --memory_gb, else --kv_cache_memory_bytes, else the engine's
    share of one device of --device."""
    from jaxinfer import planner

    if FLAGS.memory_gb is not None:
        return {"memory_bytes": int(FLAGS.memory_gb * 1e9)}
    if settings.kv_cache_memory_bytes is not None:
        return {"kv_cache_bytes": settings.kv_cache_memory_bytes}
    if acc is not None:
        usable = acc.chip.usable_hbm_bytes
        return {"memory_bytes": int(usable * planner.DEVICE_MEMORY_FRACTION)}
    raise app.UsageError("plan needs --memory_gb=GB, --kv_cache_memory_bytes=BYTES or "
                         "--device=NAME")


def _plan_tensor_parallel_size(cfg: object, acc: accelerators.Accelerator | None) -> int:
    """--tensor_parallel_size, else every device of --device, else 1; ValueError unless
    the model's heads split over it."""
    from jaxinfer import planner

    if FLAGS["tensor_parallel_size"].present:
        planner.check_tensor_parallel(cfg, FLAGS.tensor_parallel_size)
        return FLAGS.tensor_parallel_size
    tp = acc.chips if acc else 1
    try:
        planner.check_tensor_parallel(cfg, tp)
    except ValueError as e:
        raise ValueError(f"{e} (by default every device of --device={FLAGS.device}; give "
                         "--tensor_parallel_size)") from None
    return tp


def plan() -> None:
    from jaxinfer import planner

    settings, cfg = _with_checkpoint_quantization(engine_config()), _model_config()
    acc = accelerators.find_preset(FLAGS.device) if FLAGS.device else None
    tp = _plan_tensor_parallel_size(cfg, acc)
    bandwidth = FLAGS.bandwidth_gb_per_s
    if bandwidth is not None and bandwidth <= 0:
        raise app.UsageError(f"--bandwidth_gb_per_s={bandwidth} must be > 0")
    if bandwidth is None and acc is not None:
        bandwidth = acc.chip.hbm_bytes_per_s / 1e9
    price = FLAGS.price_per_hour if FLAGS.price_per_hour is not None else (
        acc.list_price_per_hour if acc else None)
    result = planner.plan(cfg, dtype=settings.dtype, kv_dtype=settings.kv_dtype,
                          quantization=settings.quantization,
                          quantized_head=_quantized_head(),
                          max_model_len=settings.max_model_len,
                          max_num_seqs=settings.max_num_seqs, page_size=settings.page_size,
                          bandwidth_gb_per_s=bandwidth, tensor_parallel_size=tp,
                          num_devices=acc.chips if acc else tp,
                          peak_flops_per_s=acc.chip.bf16_flops if acc else None,
                          **_plan_budget(settings, acc))
    report = {"device": accelerators.describe(acc) if acc else None,
              **result.summary(price_per_hour=price)}
    sys.stdout.write(json.dumps(report, indent=1) + "\n")


def audit() -> None:
    from jaxinfer import audit as audit_lib

    if not FLAGS.input:
        raise app.UsageError("audit needs --input=PROMPTS.jsonl")
    report = audit_lib.run(FLAGS.model or DEFAULT_MODEL, FLAGS.input,
                           page_size=FLAGS.page_size)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")


def aot() -> None:
    from jaxinfer import aot as aot_lib

    aot_lib.tpu_compile_environment()  # before anything starts a JAX backend
    cfg, engine = _model_config(), _with_checkpoint_quantization(engine_config())
    settings = aot_lib.Settings(
        dtype=engine.dtype, kv_dtype=engine.kv_dtype, max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=engine.max_model_len or cfg.max_position_embeddings,
        page_size=engine.page_size, kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        tensor_parallel_size=engine.tensor_parallel_size
        if FLAGS["tensor_parallel_size"].present else None,  # default: the slice's chips
        quantization=engine.quantization, quantized_head=_quantized_head())
    device = FLAGS.device or COMMANDS["aot"].defaults["device"]
    report = aot_lib.compile_report(cfg, device=device, settings=settings,
                                    buckets=FLAGS.buckets)
    sys.stdout.write(aot_lib.format_table(report) + "\n")
    sys.stdout.write(json.dumps(report, indent=1) + "\n")


def eval_ppl() -> None:
    from jaxinfer import evaluate

    if not FLAGS.input:
        raise app.UsageError("eval_ppl needs --input=FILE[,FILE...] (paths or globs)")
    files = evaluate.expand_inputs(FLAGS.input)  # bad inputs fail before warm-up
    llm = make_llm(**COMMANDS["eval_ppl"].defaults, warm_up=False)
    evaluate.resolve_window(llm, FLAGS.window)
    llm.engine.warm_up()
    report = evaluate.perplexity(llm, files, window=FLAGS.window,
                                 max_tokens_per_file=FLAGS.max_tokens_per_file)
    sys.stdout.write(json.dumps(report) + "\n")


def serve() -> None:
    from jaxinfer import server

    config = ServerConfig(**{name: FLAGS[name].value for name in SERVER_FLAGS})
    sock = server.bind(config.host, config.port)  # a taken port fails before warm-up
    llm = make_llm()
    name = config.served_model_name or FLAGS.model or DEFAULT_MODEL.name

    def ready(url: str) -> None:
        sys.stderr.write(f"jaxinfer: serving {name!r} at {url}/v1\n")
        sys.stderr.flush()

    server.serve(llm, config, sock, model_name=name, ready=ready)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """A command: what runs, its one-line summary, the flags it reads."""

    run: Callable[[], None]
    summary: str
    flags: tuple[str, ...]
    defaults: dict[str, object] = dataclasses.field(default_factory=dict)  # over the flags


_PLAN_FLAGS = ("dtype", "kv_cache_dtype", "max_model_len", "max_num_seqs", "page_size",
               "kv_cache_memory_bytes", "quantization")
COMMANDS = {
    "generate": Command(run=generate, summary="complete one prompt and print prompt + "
                        "completion (default model: the bundled demo)",
                        flags=("model", "prompt", "max_tokens", *SAMPLING_FLAGS, "metrics",
                               *ENGINE_FLAGS, *DISTRIBUTED_FLAGS),
                        defaults={"max_num_seqs": 1}),  # one prompt: fewer buckets
    "batch": Command(run=batch, summary="run a JSONL file of requests, appending JSONL "
                     "results (resumable)",
                     flags=("model", "input", "output", *ENGINE_FLAGS, *DISTRIBUTED_FLAGS)),
    "serve": Command(run=serve, summary="OpenAI-compatible HTTP server (/v1/completions, "
                     "/v1/chat/completions, /v1/models, /health, /metrics)",
                     flags=("model", *SERVER_FLAGS, *ENGINE_FLAGS)),
    "convert": Command(run=convert, summary="copy an HF checkpoint directory to an orbax one "
                       "(--quantization: quantized weights)",
                       flags=("model", "output", "dtype", "quantization",
                              "calibration_data")),
    "plan": Command(run=plan, summary="print a model's memory plan per device, decode "
                    "roofline and cost on a device; loads no weights",
                    flags=("model", "device", "tensor_parallel_size", "memory_gb",
                           "bandwidth_gb_per_s", "price_per_hour", *_PLAN_FLAGS)),
    "audit": Command(run=audit, summary="prompt overlap of a JSONL file: the prefill a "
                     "prefix cache would save; loads no weights",
                     flags=("model", "input", "page_size")),
    "aot": Command(run=aot, summary="compile the step for a TPU slice with libtpu's "
                   "compiler (no TPU needed)",
                   flags=("model", "device", "tensor_parallel_size", "buckets",
                          "max_num_batched_tokens", *_PLAN_FLAGS),
                   defaults={"device": "v5e-1"}),
    "eval_ppl": Command(run=eval_ppl, summary="perplexity of text files through prompt "
                        "logprobs; prints one JSON object",
                        flags=("model", "input", "window", "max_tokens_per_file",
                               *ENGINE_FLAGS),
                        defaults={"enable_prompt_logprobs": True}),
}


def commands_help() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return ("usage: python -m jaxinfer <command> [--flag=value ...]\n\ncommands:\n"
            + "\n".join(lines)
            + "\n\n`python -m jaxinfer <command> --help` lists a command's flags.\n")


def command_help(name: str) -> str:
    command = COMMANDS[name]
    lines = [f"usage: python -m jaxinfer {name} [--flag=value ...]", "", command.summary,
             "", "flags:"]
    for flag_name in command.flags:
        flag = FLAGS[flag_name]
        choices = getattr(flag.parser, "enum_values", None)
        kind = "|".join(choices) if choices else flag.flag_type()
        value = command.defaults.get(flag_name, flag.default)
        default = "unset" if value is None else json.dumps(value)
        text = re.sub(r"^<[^>]*>: ", "", flag.help)  # absl prefixes enum help with choices
        lines.append(f"  --{flag_name} ({kind}; default {default})")
        lines += textwrap.wrap(text, width=88, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def _join_job() -> None:
    """Join the multi-host job the distributed flags name, if any (distributed.py)."""
    from jaxinfer import distributed

    distributed.initialize(DistributedConfig(**{name: FLAGS[name].value
                                                for name in DISTRIBUTED_FLAGS}))


def _fail(message: str, code: int) -> typing.NoReturn:
    sys.stderr.write(f"jaxinfer: error: {' '.join(str(message).splitlines())}\n")
    sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except flags.Error as e:
        _fail(f"{e} (see --help)", 2)


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        _fail(f"give one command of {', '.join(COMMANDS)} (python -m jaxinfer --help)", 2)
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        if "coordinator_address" in COMMANDS[argv[1]].flags:
            _join_job()  # before anything starts a JAX backend
        COMMANDS[argv[1]].run()
    except app.UsageError as e:
        _fail(f"{argv[1]}: {e}", 2)
    except (ValueError, OSError) as e:
        logging.debug("%s failed", argv[1], exc_info=True)
        _fail(f"{argv[1]}: {e}", 1)


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if HELP_ARGS & set(argv[1:]):
        command = next((arg for arg in argv[1:] if arg in COMMANDS), None)
        sys.stdout.write(command_help(command) if command else commands_help())
        sys.exit(0)
    app.run(main, argv=argv, flags_parser=_parse_flags)
