"""Command line: `python -m jaxinfer <command> --flags` (absl).

`main.py` holds the command table (`COMMANDS`), the help and the dispatcher, `run`
the entry point, re-exported here for `python -m jaxinfer` and the `jaxinfer` script;
`flags.py` every flag and the configs made from them (engine flags derived from
`EngineConfig`'s fields, so they cannot drift from it); `model_commands.py` the
commands that load weights (generate, batch, serve, eval_ppl, convert);
`plan_commands.py` those that load none (plan, audit, aot). This package is the only
place FLAGS are read and logging configured.

Departure from ARCHITECTURE.md (which has one cli.py): a package, split by what the
modules hold, once the module passed the 400-line cap. Its import-linter contracts
name `jaxinfer.cli` and so cover every module here.
"""

from jaxinfer.cli.main import run

__all__ = ["run"]
