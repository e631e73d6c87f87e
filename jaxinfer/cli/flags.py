"""Every flag the commands read, and the configs made from them: engine, distributed and
server flags derived from `EngineConfig`, `DistributedConfig` and `ServerConfig`;
sampling flags unset unless given. See docs/cli.md#engine-flags.
"""

from __future__ import annotations

import dataclasses
import types
import typing

from absl import app, flags

from jaxinfer.config import DistributedConfig, EngineConfig, ServerConfig
from jaxinfer.engine.request import SamplingParams

FLAGS = flags.FLAGS
DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):"

flags.DEFINE_string("model", None, "model directory (HF or orbax) or Hugging Face Hub id "
                    "(org/name, downloaded once: docs/models.md); plan and aot also take a "
                    "preset name (jaxinfer/config/presets/*.toml); also given as the plain "
                    "argument after the command (serve MODEL, as vLLM's); default: the "
                    "bundled demo model")
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
flags.DEFINE_boolean("retry_errors", True, "batch: run again the lines whose earlier run "
                     "ended in an error record (those records are dropped from the output "
                     "first); false: keep them and skip those lines")
flags.DEFINE_boolean("ray", False, "batch: run the requests on Ray Data, one engine per "
                     "replica (pip install 'jaxinfer[ray]'; docs/batch.md)")
flags.DEFINE_string("ray_address", None, "batch --ray: the Ray cluster to join (auto, "
                    "host:6379, ray://host:10001); default: start a local one")
flags.DEFINE_integer("num_replicas", 1, "batch --ray: engines, one Ray actor each, each on "
                     "tensor_parallel_size devices (one CPU without accelerators)")
flags.DEFINE_integer("ray_batch_size", None, "batch --ray: requests handed to a replica at "
                     "a time, run together; default: 4 * max_num_seqs")
flags.DEFINE_boolean("metrics", False, "print the engine metrics as JSON to stderr")
flags.DEFINE_boolean("enforce_eager", False, "vLLM's flag; here: no warm-up compile of "
                     "every bucket at start, so the model is ready sooner; each bucket "
                     "compiles when a step first needs it (that step waits for it) and "
                     "counts as a compilation after warm-up, so not with --strict_compile")
flags.DEFINE_float("memory_gb", None, "memory per device for weights + KV cache, in GB; "
                  "default with --device: 90% of what one device lets a program use")
flags.DEFINE_float("bandwidth_gb_per_s", None, "memory bandwidth per device for the decode "
                   "roofline; default: the --device preset's, else no roofline")
flags.DEFINE_string("device", None, "accelerator preset (jaxinfer/sizing/accelerators.py): a TPU "
                    "type (v5e-1, v6e-8, v5p-8...; aot takes only these) or a GCP GPU "
                    "machine (h100-8 = a3-highgpu-8g, a100-40gb-8, a100-80gb-8, l4-1...)")
flags.DEFINE_float("price_per_hour", None, "price per hour of the whole --device preset "
                   "(without --device: of tensor_parallel_size devices), for plan's cost per "
                   "million output tokens; default: the preset's list price if it carries "
                   "one, else no cost")
flags.DEFINE_enum("format", "table", ["table", "json"],
                  "how plan, audit, aot and batch print their report: aligned text, or JSON "
                  "for scripts")
flags.DEFINE_enum("buckets", "all", ["all", "ends", "smallest"],
                  "every bucket; ends: the smallest, a mixed one and the largest; "
                  "smallest: the smallest decode bucket")
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty")
RAY_FLAGS = ("ray_address", "num_replicas", "ray_batch_size")  # each needs --ray


def define_config_flags(config_class: type) -> tuple[str, ...]:
    """One flag per field of a config dataclass (EngineConfig, DistributedConfig), from its
    type, default, choices and help; a tuple field is a flag given once per value."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kinds = set(typing.get_args(hints[field.name])) - {types.NoneType} or {
            hints[field.name]}
        help_text, choices = field.metadata["help"], field.metadata["choices"]
        if typing.get_origin(hints[field.name]) is tuple:  # a list: the flag repeats
            flags.DEFINE_multi_string(field.name, list(field.default), help_text)
        elif choices:
            flags.DEFINE_enum(field.name, field.default, list(choices), help_text)
        elif kinds == {bool}:
            flags.DEFINE_boolean(field.name, field.default, help_text)
        elif kinds == {int}:
            flags.DEFINE_integer(field.name, field.default, help_text)
        elif kinds == {float}:
            flags.DEFINE_float(field.name, field.default, help_text)
        elif kinds == {str} or all(dataclasses.is_dataclass(k) for k in kinds):
            flags.DEFINE_string(field.name, field.default, help_text)  # a dataclass: JSON
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
    return from_flags(EngineConfig, **settings)


def from_flags(config_class: type, **values: object) -> object:
    """`config_class(**values)` from flag values: a value it refuses is a usage error
    (exit 2, like a flag absl cannot parse), naming the flag."""
    try:
        return config_class(**values)
    except (ValueError, TypeError) as e:
        message = str(e).removeprefix("self.")  # a config's f"{self.name=}"
        raise app.UsageError(f"--{message}" if message.split("=")[0] in values
                             else message) from None


def make_llm(*, warm_up: bool = True, **defaults: object) -> object:
    """An LLM from the engine flags (see `engine_config`); no warm-up with
    --enforce_eager."""
    from jaxinfer import LLM

    config = engine_config(**defaults)
    if FLAGS.enforce_eager and config.strict_compile:
        raise app.UsageError("--enforce_eager compiles each bucket when first used, which "
                             "--strict_compile refuses: give one of them")
    kwargs = {} if FLAGS.model is None else {"model": FLAGS.model}
    return LLM(**kwargs, warm_up=warm_up and not FLAGS.enforce_eager,
               **dataclasses.asdict(config))


def check_sampling_flags() -> None:
    """--max_tokens and each sampling flag given, checked by SamplingParams before the
    model loads: a value it refuses is a usage error naming the flag."""
    given = {name: FLAGS[name].value for name in SAMPLING_FLAGS if FLAGS[name].value is not None}
    from_flags(SamplingParams, max_tokens=FLAGS.max_tokens, **given)


def sampling_params(defaults: SamplingParams) -> SamplingParams:
    """`defaults` (the checkpoint's) with --max_tokens and each sampling flag given."""
    given = {name: FLAGS[name].value for name in SAMPLING_FLAGS if FLAGS[name].value is not None}
    return dataclasses.replace(defaults, max_tokens=FLAGS.max_tokens, **given)
