"""The command table (`COMMANDS`: each command's function, summary, flags and defaults),
the help and the dispatcher; `run` is the entry point. A command line may be spelt as
vLLM's (argv.py), with the model as a plain argument. Errors a user can fix print one
line and exit 2 (usage) or 1. See docs/cli.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import sys
import textwrap
import typing
from collections.abc import Callable

from absl import app, flags

from jaxinfer.cli import argv as argv_lib
from jaxinfer.cli.flags import (
    DISTRIBUTED_FLAGS,
    ENGINE_FLAGS,
    FLAGS,
    RAY_FLAGS,
    SAMPLING_FLAGS,
    SERVER_FLAGS,
    from_flags,
)
from jaxinfer.cli.model_commands import (
    EVAL_PPL_DEFAULTS,
    GENERATE_DEFAULTS,
    batch,
    convert,
    eval_ppl,
    generate,
    serve,
)
from jaxinfer.cli.plan_commands import AOT_DEFAULTS, PLAN_DEFAULTS, aot, audit, plan
from jaxinfer.config import DistributedConfig

HELP_ARGS = frozenset({"--help", "-help", "-h", "--helpshort", "-?"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """A command: what runs, its one-line summary, the flags it reads."""

    run: Callable[[], None]
    summary: str
    flags: tuple[str, ...]
    defaults: dict[str, object] = dataclasses.field(default_factory=dict)  # over the flags


_HUB_FLAGS = ("revision", "download_dir")
_PLAN_FLAGS = (*_HUB_FLAGS, "dtype", "kv_cache_dtype", "max_model_len", "max_num_seqs", "page_size",
               "kv_cache_memory_bytes", "gpu_memory_utilization", "quantization",
               "enable_expert_parallel", "enable_lora", "max_loras", "max_lora_rank")
COMMANDS = {
    "generate": Command(run=generate, summary="complete one prompt and print prompt + "
                        "completion (default model: the bundled demo)",
                        flags=("model", "prompt", "max_tokens", *SAMPLING_FLAGS, "metrics",
                               *ENGINE_FLAGS, "enforce_eager", *DISTRIBUTED_FLAGS),
                        defaults=GENERATE_DEFAULTS),
    "batch": Command(run=batch, summary="run a JSONL file of requests, appending JSONL "
                     "results (resumable; --ray: over Ray Data replicas)",
                     flags=("model", "input", "output", "format", "retry_errors", "ray",
                            *RAY_FLAGS, "lora_modules", *ENGINE_FLAGS, "enforce_eager",
                            *DISTRIBUTED_FLAGS)),
    "serve": Command(run=serve, summary="OpenAI-compatible HTTP server (/v1/completions, "
                     "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, "
                     "/health, /ping, /version, /metrics, /docs)",
                     flags=("model", *SERVER_FLAGS, *ENGINE_FLAGS, "enforce_eager",
                            *DISTRIBUTED_FLAGS)),
    "convert": Command(run=convert, summary="copy an HF checkpoint directory to an orbax one "
                       "(--quantization: quantized weights)",
                       flags=("model", *_HUB_FLAGS, "output", "dtype", "quantization",
                              "calibration_data")),
    "plan": Command(run=plan, summary="print a model's memory plan per device, decode "
                    "roofline and cost on a device, and the best PP x TP x DP layout of "
                    "its chips; loads no weights",
                    flags=("model", "device", "tensor_parallel_size", "data_parallel_size",
                           "pipeline_parallel_size", "pipeline_microbatches", "memory_gb",
                           "bandwidth_gb_per_s", "price_per_hour", *_PLAN_FLAGS,
                           "speculative_config", "enable_prefix_caching",
                           "kv_offloading_size", "kv_offloading_backend",
                           "disable_hybrid_kv_cache_manager", "format"),
                    defaults=PLAN_DEFAULTS),
    "audit": Command(run=audit, summary="prompt overlap of a JSONL file: the prefill a "
                     "prefix cache would save; loads no weights",
                     flags=("model", *_HUB_FLAGS, "input", "page_size", "format")),
    "aot": Command(run=aot, summary="compile the step for a TPU slice with libtpu's "
                   "compiler (no TPU needed)",
                   flags=("model", "device", "tensor_parallel_size", "data_parallel_size",
                          "pipeline_parallel_size", "pipeline_microbatches", "buckets",
                          "max_num_batched_tokens", *_PLAN_FLAGS, "format"),
                   defaults=AOT_DEFAULTS),
    "eval_ppl": Command(run=eval_ppl, summary="perplexity of text files through prompt "
                        "logprobs; prints one JSON object",
                        flags=("model", "input", "window", "max_tokens_per_file",
                               *ENGINE_FLAGS, "enforce_eager"),
                        defaults=EVAL_PPL_DEFAULTS),
}


def commands_help() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return ("usage: python -m jaxinfer <command> [MODEL] [--flag=value ...]\n\ncommands:\n"
            + "\n".join(lines)
            + "\n\n`python -m jaxinfer <command> --help` lists a command's flags.\n")


def command_help(name: str) -> str:
    command = COMMANDS[name]
    lines = [f"usage: python -m jaxinfer {name} [MODEL] [--flag=value ...]", "",
             command.summary, "", "flags (--max-model-len 4096 is --max_model_len=4096):"]
    for flag_name in command.flags:
        flag = FLAGS[flag_name]
        choices = getattr(flag.parser, "enum_values", None)
        kind = "|".join(choices) if choices else flag.flag_type()
        value = command.defaults.get(flag_name, flag.default)
        default = "unset" if value is None else json.dumps(value)
        text = re.sub(r"^<[^>]*>: ", "", flag.help)  # absl prefixes enum help with choices
        text = re.sub(r";\s*repeat this option to specify a list of values$", "",
                      text)  # absl's note on a list flag, whose own help says so
        lines.append(f"  --{flag_name} ({kind}; default {default})")
        lines += textwrap.wrap(text, width=88, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def _join_job() -> None:
    """Join the multi-host job the distributed flags name, if any (distributed.py)."""
    from jaxinfer import distributed

    distributed.initialize(from_flags(DistributedConfig, **{name: FLAGS[name].value
                                                            for name in DISTRIBUTED_FLAGS}))


def _fail(message: str, code: int) -> typing.NoReturn:
    sys.stderr.write(f"jaxinfer: error: {' '.join(str(message).splitlines())}\n")
    sys.exit(code)


def _parse_flags(reading: argv_lib.Reading) -> list[str]:
    """absl's parse of `reading`; a value it cannot take exits 2, naming the unknown
    flags too."""
    try:
        return FLAGS(reading.argv)
    except (flags.Error, ValueError) as e:  # ValueError: --noflag=value
        message = re.sub(r"invalid literal for int\(\) with base 10: (.*)",
                         r"\1 is not an integer", str(e))
        message = re.sub(r"could not convert string to float: (.*)", r"\1 is not a number",
                         message)
        name = (reading.positionals or [None])[0]
        unknown = argv_lib.unknown_flags(reading, name, COMMANDS[name].flags) \
            if name in COMMANDS else [f"{flag} is not a flag" for flag in reading.unknown]
        _fail("; ".join([message, *unknown]) + " (see --help)", 2)


def parse(argv: list[str]) -> list[str]:
    """Parse a command line into FLAGS, vLLM's spellings too (argv.py), the model given
    as a plain argument into --model: [program, command]. A usage error (an unknown
    command or flag, a flag of another command, a value absl cannot parse) prints one
    line and exits 2."""
    reading = argv_lib.read(argv)
    args = _parse_flags(reading)[1:]
    if not 1 <= len(args) <= 2 or args[0] not in COMMANDS or set(args[1:]) & set(COMMANDS):
        _fail(_unknown_command(args), 2)
    name = args[0]
    problems = (argv_lib.unknown_flags(reading, name, COMMANDS[name].flags)
                + _foreign_flags(name, reading))
    if problems:
        _fail(f"{name}: {'; '.join(problems)}; see python -m jaxinfer {name} --help", 2)
    if len(args) == 2:
        _take_model(name, args[1])
    return [argv[0], name]


def _unknown_command(args: list[str]) -> str:
    """Why `args` (the plain arguments after `python -m jaxinfer`) name no command and
    at most a model."""
    commands = ", ".join(COMMANDS)
    if not args:
        return f"give one command of {commands} (python -m jaxinfer --help)"
    if args[0] not in COMMANDS:
        close = difflib.get_close_matches(args[0], COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{args[0]!r} is not a command{hint}; the commands are {commands}"
    if any(arg in COMMANDS for arg in args[1:]):
        return f"one command at a time: {' '.join(args)!r} (flags start with --)"
    return (f"{args[0]} takes one plain argument, the model, not {' '.join(args[1:])!r} "
            "(flags start with --)")


def _foreign_flags(name: str, reading: argv_lib.Reading) -> list[str]:
    """A flag given that only other commands read is an error, not silently ignored."""
    own, problems = set(COMMANDS[name].flags), []
    for flag in dict.fromkeys(f for command in COMMANDS.values() for f in command.flags):
        if FLAGS[flag].present and flag not in own:
            readers = [n for n, c in COMMANDS.items() if flag in c.flags]
            problems.append(f"{reading.spelled(flag)} is not a flag of {name} (it is one of "
                            f"{', '.join(readers)})")
    return problems


def _take_model(name: str, model: str) -> None:
    """The model given as a plain argument (`serve MODEL`, vLLM's form) as --model; both
    given must name the same model."""
    if FLAGS["model"].present and os.path.normpath(FLAGS.model) != os.path.normpath(model):
        _fail(f"{name}: two models given: {model!r} (the plain argument) and "
              f"--model={FLAGS.model!r}; give one", 2)
    FLAGS.model = model


def main(argv: list[str]) -> None:
    name = argv[1]
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        # batch --ray runs no engine here (the replicas do) and refuses multi-host flags
        if "coordinator_address" in COMMANDS[name].flags and not FLAGS.ray:
            _join_job()  # before anything starts a JAX backend
        COMMANDS[name].run()
    except app.UsageError as e:
        _fail(f"{name}: {e}", 2)
    except (ValueError, OSError) as e:
        logging.debug("%s failed", name, exc_info=True)
        _fail(f"{name}: {e}", 1)


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if HELP_ARGS & set(argv[1:]):
        command = next((arg for arg in argv[1:] if arg in COMMANDS), None)
        sys.stdout.write(command_help(command) if command else commands_help())
        sys.exit(0)
    app.run(main, argv=argv, flags_parser=parse)
