"""Command line: `python -m jaxinfer <command> --flags` (absl); the only place FLAGS are
read and logging configured. main.py holds the command table and `run` (re-exported
here), flags.py every flag, model_commands.py and plan_commands.py the commands.
See docs/cli.md.
"""

from jaxinfer.cli.main import run

__all__ = ["run"]
