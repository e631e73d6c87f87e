"""A command line in vLLM's spellings read as absl reads jaxinfer's: flag names with
dashes or underscores, argparse's `--no-flag`, vLLM's `-tp`, `-pp`, `-dp` and `-q`, several
values after a list flag (`--lora-modules a=A b=B`). Values are never touched. Unknown
flags are taken out and kept, so that the command names them all in one line. See
docs/cli.md#vllm-command-lines.
"""

from __future__ import annotations

import dataclasses

from absl import flags
from absl.flags import _helpers  # absl's own suggestions for a misspelt flag

# vLLM's one-dash short names of flags jaxinfer has (vLLM's EngineArgs)
SHORT_NAMES = {"tp": "tensor_parallel_size", "dp": "data_parallel_size",
               "pp": "pipeline_parallel_size", "q": "quantization"}
# vLLM flags jaxinfer has none of, each with what to do instead (where a close name
# would mislead, that it has no such setting)
VLLM_ONLY = {
    "block_size": "did you mean --page-size? vLLM's KV cache block is jaxinfer's page",
    "trust_remote_code": "jaxinfer runs no code from a checkpoint; leave it out",
    "tokenizer_mode": "jaxinfer has no such setting",
    "disable_log_requests": "jaxinfer has no such setting",
}
_BOOLEAN_WORDS = ("true", "false")


@dataclasses.dataclass
class Reading:
    """argv as absl should parse it, and what it could not take."""

    argv: list[str]
    positionals: list[str] = dataclasses.field(default_factory=list)  # the command, model
    unknown: list[str] = dataclasses.field(default_factory=list)  # as spelled, in order
    spellings: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> as given
    stray_values: list[str] = dataclasses.field(default_factory=list)  # "--flag value"

    def spelled(self, name: str) -> str:
        """The flag `name` as the command line wrote it (--max-model-len), else --name."""
        return self.spellings.get(name, f"--{name}")


def flag_name(arg: str) -> str:
    """The flag name of `arg` (--max-model-len=4096: max_model_len), no dashes."""
    return arg.lstrip("-").split("=", 1)[0].replace("-", "_")


def _known(name: str, short: bool, flag_values: flags.FlagValues) -> tuple[str, str] | None:
    """(the name absl knows `name` by, the flag's own name) or None for an unknown flag.
    `no_x` and `nox` negate the boolean flag x (absl takes only `nox`)."""
    if short and name in SHORT_NAMES:
        name = SHORT_NAMES[name]
    if name in flag_values:
        return name, flag_values[name].name
    base = name.removeprefix("no").removeprefix("_")
    if name.startswith("no") and base in flag_values and flag_values[base].boolean:
        return f"no{base}", flag_values[base].name
    return None


def read(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> Reading:
    """`argv` with every flag name in absl's spelling, and the unknown flags taken out
    (with the word after one, when it does not start with -: its value, as argparse
    would take it)."""
    reading = Reading(argv=list(argv[:1]))
    args, index = argv[1:], 0
    while index < len(args):
        arg, following = args[index], args[index + 1] if index + 1 < len(args) else None
        index += 1
        if arg == "--":
            reading.argv += args[index - 1:]
            reading.positionals += args[index:]
            break
        if not arg.startswith("-") or arg.strip("-") == "":
            reading.argv.append(arg)
            reading.positionals.append(arg)
            continue
        name, equals, value = arg.lstrip("-").partition("=")
        known = _known(name.replace("-", "_"), not arg.startswith("--"), flag_values)
        takes_next = not equals and following is not None
        if known is None:
            reading.unknown.append(arg.split("=", 1)[0])
            index += takes_next and not following.startswith("-")
            continue
        absl_name, own_name = known
        reading.spellings[own_name] = arg[:len(arg) - len(arg.lstrip("-"))] + name
        reading.argv.append(f"--{absl_name}{equals}{value}")
        if takes_next and not flag_values[own_name].boolean:
            reading.argv.append(following)  # the flag's value, as it is
            index += 1
        if isinstance(flag_values[own_name], flags.MultiFlag):  # argparse's nargs="+"
            while index < len(args) and _another_value(args[index]):
                reading.argv.append(f"--{absl_name}={args[index]}")
                index += 1
        elif takes_next and following.lower() in _BOOLEAN_WORDS:
            reading.stray_values.append(f"{arg} {following}")
            index += 1
    return reading


def _another_value(arg: str) -> bool:
    """Whether `arg`, after a list flag's value, is one more value (`--lora-modules a=A
    b=B`, vLLM's): a name=path or a JSON object, never a flag or the model."""
    return not arg.startswith("-") and ("=" in arg or arg.lstrip().startswith("{"))


def unknown_flags(reading: Reading, command: str, own: tuple[str, ...]) -> list[str]:
    """Why each unknown flag and stray value of `reading` is refused, naming the close
    flags of `command` (whose flags are `own`) in the spelling the command line used."""
    problems = []
    for spelled in reading.unknown:
        name = flag_name(spelled)
        close = _helpers.get_flag_suggestions(name, list(own))
        dashed = "-" in spelled.lstrip("-")
        hint = VLLM_ONLY.get(name) or ("did you mean " + ", ".join(
            "--" + (flag.replace("_", "-") if dashed else flag) for flag in close) + "?"
            if close else "jaxinfer has no such setting")
        problems.append(f"{spelled} is not a flag of {command} ({hint})")
    for stray in reading.stray_values:
        flag, word = stray.split()
        problems.append(f"{flag} takes no value: give {flag}={word}")
    return problems
