"""The command table (`COMMANDS`: each command's function, summary, flags and defaults),
the help and the dispatcher; `run` is the entry point. Errors a user can fix print one
line and exit 2 (usage) or 1. See docs/cli.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import re
import sys
import textwrap
import typing
from collections.abc import Callable

from absl import app, flags

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
               "enable_expert_parallel")
COMMANDS = {
    "generate": Command(run=generate, summary="complete one prompt and print prompt + "
                        "completion (default model: the bundled demo)",
                        flags=("model", "prompt", "max_tokens", *SAMPLING_FLAGS, "metrics",
                               *ENGINE_FLAGS, *DISTRIBUTED_FLAGS),
                        defaults=GENERATE_DEFAULTS),
    "batch": Command(run=batch, summary="run a JSONL file of requests, appending JSONL "
                     "results (resumable; --ray: over Ray Data replicas)",
                     flags=("model", "input", "output", "format", "retry_errors", "ray",
                            *RAY_FLAGS, *ENGINE_FLAGS, *DISTRIBUTED_FLAGS)),
    "serve": Command(run=serve, summary="OpenAI-compatible HTTP server (/v1/completions, "
                     "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                     "/ping, /version, /metrics, /docs)",
                     flags=("model", *SERVER_FLAGS, *ENGINE_FLAGS, *DISTRIBUTED_FLAGS)),
    "convert": Command(run=convert, summary="copy an HF checkpoint directory to an orbax one "
                       "(--quantization: quantized weights)",
                       flags=("model", *_HUB_FLAGS, "output", "dtype", "quantization",
                              "calibration_data")),
    "plan": Command(run=plan, summary="print a model's memory plan per device, decode "
                    "roofline and cost on a device, and the best DP x TP layout of its "
                    "chips; loads no weights",
                    flags=("model", "device", "tensor_parallel_size", "data_parallel_size",
                           "memory_gb",
                           "bandwidth_gb_per_s", "price_per_hour", *_PLAN_FLAGS,
                           "speculative_config", "format"),
                    defaults=PLAN_DEFAULTS),
    "audit": Command(run=audit, summary="prompt overlap of a JSONL file: the prefill a "
                     "prefix cache would save; loads no weights",
                     flags=("model", *_HUB_FLAGS, "input", "page_size", "format")),
    "aot": Command(run=aot, summary="compile the step for a TPU slice with libtpu's "
                   "compiler (no TPU needed)",
                   flags=("model", "device", "tensor_parallel_size", "data_parallel_size",
                          "buckets",
                          "max_num_batched_tokens", *_PLAN_FLAGS, "format"),
                   defaults=AOT_DEFAULTS),
    "eval_ppl": Command(run=eval_ppl, summary="perplexity of text files through prompt "
                        "logprobs; prints one JSON object",
                        flags=("model", "input", "window", "max_tokens_per_file",
                               *ENGINE_FLAGS),
                        defaults=EVAL_PPL_DEFAULTS),
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

    distributed.initialize(from_flags(DistributedConfig, **{name: FLAGS[name].value
                                                            for name in DISTRIBUTED_FLAGS}))


def _fail(message: str, code: int) -> typing.NoReturn:
    sys.stderr.write(f"jaxinfer: error: {' '.join(str(message).splitlines())}\n")
    sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except flags.Error as e:
        message = re.sub(r"invalid literal for int\(\) with base 10: (.*)",
                         r"\1 is not an integer", str(e))
        message = re.sub(r"could not convert string to float: (.*)", r"\1 is not a number",
                         message)
        _fail(f"{message} (see --help)", 2)


def _unknown_command(args: list[str]) -> str:
    """Why `args` (what follows `python -m jaxinfer`) names no command."""
    commands = ", ".join(COMMANDS)
    if not args:
        return f"give one command of {commands} (python -m jaxinfer --help)"
    if args[0] not in COMMANDS:
        close = difflib.get_close_matches(args[0], COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{args[0]!r} is not a command{hint}; the commands are {commands}"
    return f"one command at a time: {' '.join(args)!r} (flags start with --)"


def _refuse_foreign_flags(name: str) -> None:
    """A flag given that only other commands read is an error, not silently ignored."""
    own = set(COMMANDS[name].flags)
    for flag in dict.fromkeys(f for command in COMMANDS.values() for f in command.flags):
        if FLAGS[flag].present and flag not in own:
            readers = [n for n, c in COMMANDS.items() if flag in c.flags]
            raise app.UsageError(f"--{flag} is not a flag of {name} (it is one of "
                                 f"{', '.join(readers)}); see python -m jaxinfer {name} --help")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        _fail(_unknown_command(argv[1:]), 2)
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        _refuse_foreign_flags(argv[1])
        # batch --ray runs no engine here (the replicas do) and refuses multi-host flags
        if "coordinator_address" in COMMANDS[argv[1]].flags and not FLAGS.ray:
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
