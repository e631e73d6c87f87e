"""Command line: `python -m jaxinfer <command> --flags` (absl).

`main.py` holds the command table (`COMMANDS`), the help and the dispatcher, `run`
the entry point, re-exported here for `python -m jaxinfer` and the `jaxinfer` script;
`flags.py` every flag and the configs made from them (engine flags derived from
`EngineConfig`'s fields, so they cannot drift from it); `model_commands.py` the
commands that load weights (generate, batch, serve, eval_ppl, convert);
`plan_commands.py` those that load none (plan, audit, aot). This package is the only
place FLAGS are read and logging configured.
"""

from jaxinfer.cli.main import run

__all__ = ["run"]
